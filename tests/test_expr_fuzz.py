"""Fuzzing the activation-expression parser (_core.parse_expr), and non-finite inputs through the CPU path.

Every text either raises ExpressionError with a column inside it (1 .. length + 1), or is accepted; an accepted text
holds only the grammar's characters, its canonical form parses back to itself and to the same CUDA text, that CUDA
text holds only characters no C or CUDA construct can be built from (no ; { } # " ' / * comment, no newline), and
the core's float64 evaluator gives the same values for the text and its canonical form. Accepted expressions that
come from the grammar are also evaluated by a float64 reference written here from the grammar's description.

Hypothesis runs derandomized and without its example database.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedmlp import ExpressionError, FusedMLP
from fusedmlp import _core

FUNCTIONS = _core.expr_functions()
MAX_LEN = 4096  # FM_EXPR_MAX_LEN in csrc/expr_internal.h

SAFE_CUDA = re.compile(r"[A-Za-z0-9_.+\-*/(), ]*")
GRAMMAR_CHARS = re.compile(r"[A-Za-z0-9_.+\-*/^(), \t]*")

# Inputs for the evaluators: ordinary values, and the edges where NaN and infinity patterns must agree.
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -3.0, 3.0, 6.0, 20.0, -20.0, 100.0, -100.0, 1e-300, 1e300, -1e300,
           np.inf, -np.inf, np.nan]
XS = np.concatenate([np.random.default_rng(11).normal(0.0, 3.0, 46), SPECIAL])


def examples(n):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def check(text):
    """Parses text with the core and checks every property above; returns the canonical text, or None if refused."""
    try:
        canonical, cuda = _core.parse_expr(text)
    except ExpressionError as e:
        assert 1 <= e.column <= len(text.encode("utf-8")) + 1, (text, e.column, e.message)
        assert e.message
        return None
    assert GRAMMAR_CHARS.fullmatch(text), f"accepted a character outside the grammar: {text!r}"
    assert SAFE_CUDA.fullmatch(cuda), f"unsafe CUDA text {cuda!r} from {text!r}"
    again, cuda_again = _core.parse_expr(canonical)  # every accepted tree's canonical text parses back
    assert again == canonical, (text, canonical, again)
    assert cuda_again == cuda
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(_core.eval_expr(text, XS.copy()), _core.eval_expr(canonical, XS.copy()))
    return canonical


# ------------------------------------------------------------------------------------------------ a float64 reference

_erf = np.vectorize(math.erf, otypes=[np.float64])
_SELU = 1.6732632423543772848170429916717 * 1.0507009873554804934193349852946


def _relu6(a):
    return np.where(a < 0, 0.0, np.where(a > 6, 6.0, a))


# name -> (fewest arguments, most, defaults of the 2nd and 3rd, function of the argument arrays); the formulas are
# torch.nn.functional's, written so that NaN and infinity come out as the C table's comment says (as in PyTorch).
REFERENCE = {
    "abs": (1, 1, (), np.abs), "sqrt": (1, 1, (), np.sqrt), "exp": (1, 1, (), np.exp), "exp2": (1, 1, (), np.exp2),
    "log": (1, 1, (), np.log), "log2": (1, 1, (), np.log2), "log10": (1, 1, (), np.log10),
    "log1p": (1, 1, (), np.log1p), "expm1": (1, 1, (), np.expm1), "sin": (1, 1, (), np.sin),
    "cos": (1, 1, (), np.cos), "tan": (1, 1, (), np.tan), "asin": (1, 1, (), np.arcsin),
    "acos": (1, 1, (), np.arccos), "atan": (1, 1, (), np.arctan), "sinh": (1, 1, (), np.sinh),
    "cosh": (1, 1, (), np.cosh), "tanh": (1, 1, (), np.tanh), "erf": (1, 1, (), _erf),
    "floor": (1, 1, (), np.floor), "ceil": (1, 1, (), np.ceil),
    "min": (2, 2, (), lambda a, b: np.where((a < b) | np.isnan(a), a, b)),  # NaN in either argument wins
    "max": (2, 2, (), lambda a, b: np.where((a > b) | np.isnan(a), a, b)),
    "none": (1, 1, (), lambda a: a), "identity": (1, 1, (), lambda a: a),
    "relu": (1, 1, (), lambda a: np.where(a < 0, 0.0, a)),
    "leaky_relu": (1, 2, (0.01,), lambda a, p: np.where(a > 0, a, a * p)),
    "elu": (1, 2, (1.0,), lambda a, p: np.where(a <= 0, np.expm1(a) * p, a)),
    "selu": (1, 1, (), lambda a: np.where(a <= 0, np.expm1(a) * _SELU, a * 1.0507009873554804934193349852946)),
    "gelu": (1, 1, (), lambda a: a * 0.5 * (1.0 + _erf(a * 0.7071067811865476))),
    "gelu_tanh": (1, 1, (), lambda a: 0.5 * a * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * (a * a * a))))),
    "silu": (1, 1, (), lambda a: a / (1.0 + np.exp(-a))),
    "sigmoid": (1, 1, (), lambda a: np.where(a >= 0, 1.0 / (1.0 + np.exp(-a)), np.exp(a) / (1.0 + np.exp(a)))),
    "softplus": (1, 3, (1.0, 20.0), lambda a, p, q: np.where(a * p > q, a, np.log1p(np.exp(a * p)) / p)),
    "mish": (1, 1, (), lambda a: a * np.tanh(np.log1p(np.exp(a)))),
    "square": (1, 1, (), lambda a: a * a),
    "hardtanh": (1, 3, (-1.0, 1.0), lambda a, p, q: np.where(a < p, p, np.where(a > q, q, a))),
    "hardsigmoid": (1, 1, (), lambda a: _relu6(a + 3.0) / 6.0),
    "hardswish": (1, 1, (), lambda a: a * _relu6(a + 3.0) / 6.0),
    "softsign": (1, 1, (), lambda a: a / (1.0 + np.abs(a))),
    "pow": (2, 2, (), None),  # parsed as a ^ b
    # comparisons: 1 or 0, 0 for NaN operands; where: a where c != 0 (NaN included), else b
    "gt": (2, 2, (), lambda a, b: (a > b).astype(np.float64)),
    "ge": (2, 2, (), lambda a, b: (a >= b).astype(np.float64)),
    "lt": (2, 2, (), lambda a, b: (a < b).astype(np.float64)),
    "le": (2, 2, (), lambda a, b: (a <= b).astype(np.float64)),
    "eq": (2, 2, (), lambda a, b: (a == b).astype(np.float64)),
    "where": (3, 3, (), lambda c, a, b: np.where(c != 0, a, b)),
}
_TOKEN = re.compile(r"[ \t]*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<punct>[-+*/^(),]))",
                    flags=re.ASCII)


class Reference:
    """Parses an accepted expression by the grammar (expr: term (+|- term)*; term: unary (*|/ unary)*;
    unary: (-|+) unary | power; power: atom (^ unary)?; atom: number | x | pi | e | name(args) | (expr); a text
    that is one function name alone means name(x)) and evaluates it on an array."""

    def __init__(self, text):
        self.tokens = []
        pos, text = 0, text.rstrip(" \t")
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            assert m is not None, f"the reference cannot read {text[pos:]!r}"
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0
        if len(self.tokens) == 1 and self.tokens[0][0] == "name" and self.tokens[0][1] in REFERENCE:
            name = self.tokens[0][1]
            self.tree = ("call", name, [("var",)] + [("num", d) for d in REFERENCE[name][2]])
        else:
            self.tree = self.expr()
            assert self.i == len(self.tokens), "trailing tokens"

    def peek(self, value):
        return self.i < len(self.tokens) and self.tokens[self.i][1] == value

    def take(self):
        self.i += 1
        return self.tokens[self.i - 1]

    def expr(self):
        node = self.term()
        while self.peek("+") or self.peek("-"):
            node = (self.take()[1], node, self.term())
        return node

    def term(self):
        node = self.unary()
        while self.peek("*") or self.peek("/"):
            node = (self.take()[1], node, self.unary())
        return node

    def unary(self):
        if self.peek("-"):
            self.take()
            inner = self.unary()
            return ("num", -inner[1]) if inner[0] == "num" else ("neg", inner)
        if self.peek("+"):
            self.take()
            return self.unary()
        base = self.atom()
        if self.peek("^"):
            self.take()
            return ("^", base, self.unary())
        return base

    def atom(self):
        kind, value = self.take()
        if kind == "num":
            return ("num", float(value))
        if value == "(":
            node = self.expr()
            assert self.take()[1] == ")"
            return node
        if value == "x":
            return ("var",)
        if value in ("pi", "e"):
            return ("const", math.pi if value == "pi" else math.e)
        assert self.take()[1] == "("
        args = [self.expr()]
        while self.peek(","):
            self.take()
            args.append(self.expr())
        assert self.take()[1] == ")"
        if value == "pow":
            return ("^", args[0], args[1])
        low, high, defaults, _ = REFERENCE[value]
        assert low <= len(args) <= high
        return ("call", value, args + [("num", d) for d in defaults[len(args) - 1:]])

    def __call__(self, x):
        with np.errstate(all="ignore"):
            return np.broadcast_to(self.eval(self.tree, x), x.shape).astype(np.float64)

    def eval(self, node, x):
        kind = node[0]
        if kind in ("num", "const"):
            return np.full(x.shape, node[1])
        if kind == "var":
            return x
        if kind == "neg":
            return -self.eval(node[1], x)
        if kind == "call":
            return REFERENCE[node[1]][3](*(self.eval(a, x) for a in node[2]))
        a = self.eval(node[1], x)
        if kind == "^" and node[2][0] == "num" and node[2][1] == math.floor(node[2][1]) and abs(node[2][1]) <= 16:
            k = int(node[2][1])  # small integer powers are products, so 0^-1 is inf and (-8)^3 is -512 exactly
            r = np.ones_like(a) if k == 0 else a
            for _ in range(abs(k) - 1):
                r = r * a
            return 1.0 / r if k < 0 else r
        b = self.eval(node[2], x)
        return {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "^": np.power}[kind](a, b)


def assert_close_to_reference(text):
    got = _core.eval_expr(text, XS.copy())
    want = Reference(text)(XS)
    same_nan = np.isnan(got) == np.isnan(want)
    assert same_nan.all(), (text, XS[~same_nan], got[~same_nan], want[~same_nan])
    finite = np.isfinite(want) & np.isfinite(got)
    assert (got[~finite & ~np.isnan(got)] == want[~finite & ~np.isnan(want)]).all(), (text, got, want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-9, atol=1e-300, err_msg=text)


# ------------------------------------------------------------------------------------------------ strategies

spaces = st.sampled_from(["", "", " ", "  ", "\t"])
numbers = st.one_of(
    st.integers(0, 10**6).map(str),
    st.floats(0, 1e6, allow_nan=False).map(repr),
    st.floats(0, 1e6, allow_nan=False).map(lambda v: f"{v:.3e}"),
    st.floats(0, 10, allow_nan=False).map(lambda v: f"{v:.4f}".lstrip("0") or "0"),
    st.sampled_from(["1.", ".5", "1e3", "2E-2", "1e+1", "0.000001", "3.4028234e38", "1e-45", "00", "007"]),
)


def _call(draw_args, name):
    low, high = REFERENCE[name][0], REFERENCE[name][1]
    return st.lists(draw_args, min_size=low, max_size=high).map(lambda args: f"{name}(" + ", ".join(args) + ")")


@st.composite
def grammar_expressions(draw, max_leaves=12):
    """Texts that follow the grammar, with varied spacing; rarely refused (only for its limits)."""
    def grow(budget):
        if budget <= 1 or draw(st.integers(0, 3)) == 0:
            return draw(st.one_of(st.sampled_from(["x", "x", "x", "pi", "e"]), numbers))
        choice = draw(st.integers(0, 5))
        s1, s2 = draw(spaces), draw(spaces)
        if choice == 0:
            return draw(st.sampled_from(["-", "+"])) + s1 + grow(budget - 1)
        if choice == 1:
            return "(" + s1 + grow(budget - 1) + s2 + ")"
        if choice in (2, 3):
            left = draw(st.integers(1, budget - 1))
            op = draw(st.sampled_from(["+", "-", "*", "/", "^"]))
            right = grow(budget - left)
            if op == "^" and draw(st.booleans()):
                right = draw(st.sampled_from(["2", "3", "-1", "-2", "0", "0.5", "16", "17", "(1+1)", "x"]))
            return grow(left) + s1 + op + s2 + right
        name = draw(st.sampled_from(sorted(REFERENCE)))
        low, high = REFERENCE[name][0], REFERENCE[name][1]
        count = draw(st.integers(low, high))
        args = [grow(max(1, budget // count - 1)) if i == 0 else draw(st.one_of(numbers, st.just("x")))
                for i in range(count)]
        if name == "hardtanh" and count == 3 and draw(st.booleans()):
            args[1:] = ["-2", "0.5"]
        return name + s1 + "(" + s2 + ", ".join(args) + ")"

    if draw(st.integers(0, 9)) == 0:
        return draw(spaces) + draw(st.sampled_from([n for n in sorted(REFERENCE) if REFERENCE[n][0] == 1])) + \
            draw(spaces)
    return draw(spaces) + grow(draw(st.integers(1, max_leaves))) + draw(spaces)


GRAMMAR_TOKENS = FUNCTIONS + ["x", "x", "x", "pi", "e", "X", "Relu", "foo", "_", "x1", "xx", "nan", "inf",
                              "0", "1", "2.5", ".5", "1.", "1e3", "1e-3", "1E+2", "1e", "0x1f", "1e40", "3.4028235e38",
                              "3.4028234e38", "1e-50", "1..2", "1.2.3", "2x", "1_0",
                              "+", "-", "*", "/", "^", "(", ")", ",", "**", "(", ")", "(x)", "x ^ -2"]
OUTSIDE_TOKENS = [";", "{", "}", "#", "\"", "'", "\\", "\n", "\r", "$", "@", "!", "<", ">", "=", "&", "|", "~",
                  "`", "[", "]", ":", "?", "%", ".", "\u00e9", "\u00a0", "\u2212", "\x7f", "\x01", "\x0b", "\x0c",
                  "\U0001f600", "asm", "__syncthreads", "#include", "#define", "volatile", "return", "/*", "*/", "//"]

token_soups = st.lists(
    st.tuples(st.one_of(st.sampled_from(GRAMMAR_TOKENS), st.sampled_from(OUTSIDE_TOKENS),
                        st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\0"), max_size=2)),
              spaces),
    max_size=30).map(lambda pairs: "".join(token + space for token, space in pairs))

C_FRAGMENTS = [
    'x); asm("trap"); (', 'x); asm volatile("exit;"); (x', '#include <cstdio>', '#define x 1', '/*', '*/',
    '// comment', 'x /* c */', 'x // c', '}; __global__ void k() {', '__syncthreads()', 'x;', 'x\n', 'x\\\n',
    '"x"', "'x'", 'x ? 1 : 0', 'x == 1', 'x && x', 'x[0]', 'x.y', 'x->y', '&x', '*&x', 'sizeof(x)', '(float)x',
    'x++', 'x += 1', 'x, x', 'relu(x), asm("trap")', 'max(x, 0 /* */)', '1f', '1.0f', '0x10', '1e', '1_000',
    'printf("%d", 1)', '__asm__("")', 'exp(x)) + ((x', 'x)', '(x', 'tanh(x)))', 'fm_relu(x)', 'expf(x)',
    'powf(x, 2)', 'fm_powi(x, 3)', 'std::exp(x)', 'x::y', 'x @ x', 'x % 2', '~x', '!x', 'x << 1', 'x | 1',
    '\tx\t', '\u00a0x', 'x\u2028', '\\u0078',
]


@st.composite
def fragment_expressions(draw):
    """A valid expression with C or CUDA text spliced into it."""
    base = draw(grammar_expressions(max_leaves=4))
    fragment = draw(st.sampled_from(C_FRAGMENTS))
    at = draw(st.integers(0, len(base)))
    where = draw(st.sampled_from(["splice", "prefix", "suffix", "alone", "call"]))
    if where == "splice":
        return base[:at] + fragment + base[at:]
    if where == "prefix":
        return fragment + draw(spaces) + base
    if where == "suffix":
        return base + draw(spaces) + fragment
    if where == "call":
        return f"{draw(st.sampled_from(FUNCTIONS))}({fragment})"
    return fragment


# ------------------------------------------------------------------------------------------------ the fuzz tests


@examples(700)
@given(text=grammar_expressions())
def test_grammar_expressions_are_accepted_consistently_and_evaluate_as_written(text):
    canonical = check(text)
    if canonical is None:  # refused only for one of the grammar's limits
        with pytest.raises(ExpressionError, match="nests more than|greater than max|beyond float32 range"):
            _core.parse_expr(text)
        return
    assert_close_to_reference(text)
    assert_close_to_reference(canonical)


@examples(700)
@given(text=token_soups)
def test_token_soups_are_refused_at_a_column_or_accepted_safely(text):
    canonical = check(text)
    if canonical is not None and len(text) < 200:
        assert_close_to_reference(text)


@examples(500)
@given(text=fragment_expressions())
def test_c_and_cuda_fragments_never_reach_the_cuda_text(text):
    canonical = check(text)
    if any(c in text for c in ';{}#"\'\n\\[]&|!<>=?:%@~`'):
        assert canonical is None, f"accepted {text!r}"


@st.composite
def long_or_deep(draw):
    n = draw(st.one_of(st.integers(1, 80), st.integers(MAX_LEN - 40, MAX_LEN + 40)))
    shape = draw(st.sampled_from(["spaces", "digits", "parens", "minus", "sum", "power", "calls", "balanced"]))
    if shape == "spaces":
        return " " * max(n - 1, 0) + "x"
    if shape == "digits":
        return "1" * n
    if shape == "parens":
        return "(" * n + "x" + ")" * n
    if shape == "minus":
        return "-" * n + "x"
    if shape == "sum":
        return "x" + " + x" * n
    if shape == "power":
        return "x" + "^x" * n
    if shape == "calls":
        return "sin(" * n + "x" + ")" * n

    def balanced(k):
        return "x * 0.5" if k <= 1 else "(" + balanced(k // 2) + ") + (" + balanced(k - k // 2) + ")"

    return balanced(min(n, 600))


@examples(300)
@given(text=long_or_deep())
def test_long_and_deeply_nested_expressions_are_refused_cleanly(text):
    canonical = check(text)
    if len(text) > MAX_LEN:
        assert canonical is None
        with pytest.raises(ExpressionError, match=f"longer than {MAX_LEN} characters") as info:
            _core.parse_expr(text)
        assert info.value.column == MAX_LEN + 1
    elif canonical is None:
        with pytest.raises(ExpressionError, match="nests more than|beyond float32 range"):
            _core.parse_expr(text)
    elif len(text) < 1000:
        assert_close_to_reference(text)


@examples(300)
@given(text=st.one_of(token_soups, st.text(max_size=20),
                      st.text(alphabet=st.characters(codec="utf-8"), min_size=2040, max_size=2100)))
def test_public_api_reports_columns_in_characters_for_any_text(text):
    """Through FusedMLP, text may hold NUL, lone surrogates and any Unicode: still ExpressionError, column in chars."""
    try:
        mlp = FusedMLP([np.full((1, 1), 0.5, np.float32)], None, output_activation=text, device="cpu")
    except ExpressionError as e:
        assert 1 <= e.column <= len(text) + 1, (text, e.column)
        assert e.expression is not None and "activation" in e.message
        return
    assert mlp.activations[0] == _core.parse_expr(text)[0]


@pytest.mark.parametrize("text", ["-" * 33 + "x", "x" + "^x" * 33, "2" + "^-x" * 20])
def test_canonical_text_of_a_deep_expression_parses_back(text):
    # Accepted (34 operations, within the 64 allowed); its fully parenthesised canonical text spends two syntax
    # levels per unary minus or power, which the parser's 130-level syntax limit (twice the tree limit) allows.
    canonical = _core.parse_expr(text)[0]
    assert _core.parse_expr(canonical)[0] == canonical


def test_the_length_limit_is_exact():
    assert check(" " * (MAX_LEN - 1) + "x") == "x"
    assert check(" " * MAX_LEN + "x") is None


# ------------------------------------------------------------------------------------------------ non-finite inputs

TORCH_NAMES = ["relu", "tanh", "sigmoid", "gelu", "silu", "elu", "softplus", "mish", "hardswish", "none"]


def _net(rng, widths=(4, 6, 5, 3)):
    ws = [rng.uniform(-0.5, 0.5, (o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-0.5, 0.5, o).astype(np.float32) for o in widths[1:]]
    return ws, bs


@pytest.mark.parametrize("activation", TORCH_NAMES)
def test_nan_in_x_gives_nan_in_that_row_only(activation):
    """What non-finite inputs do on the CPU path: the same as a float64 forward (PyTorch's, or NumPy's) of x.

    NaN in a row of x makes that row's outputs NaN (every built-in activation propagates NaN, as in PyTorch) and no
    other row changes. +-inf in a row gives, per output, what IEEE arithmetic gives: inf * w sums to +-inf, or to
    NaN when infinities of both signs meet; the activation then maps it (tanh(inf) = 1, relu(-inf) = 0,
    gelu(-inf) = NaN as -inf * 0), so a row may come out finite, infinite or NaN. Other rows are unaffected.
    """
    rng = np.random.default_rng(5)
    ws, bs = _net(rng)
    x = rng.uniform(-1, 1, (6, 4)).astype(np.float32)
    mlp = FusedMLP(ws, bs, activation, device="cpu")
    clean = mlp(x)
    dirty = x.copy()
    dirty[1, 2] = np.nan
    dirty[4, :] = np.nan
    y = mlp(dirty)
    assert np.isnan(y[[1, 4]]).all()
    others = [0, 2, 3, 5]
    np.testing.assert_array_equal(y[others], clean[others])


@pytest.mark.parametrize("activation", TORCH_NAMES)
def test_non_finite_x_matches_a_float64_pytorch_forward(activation):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    ws, bs = _net(rng)
    x = rng.uniform(-1, 1, (8, 4)).astype(np.float32)
    x[0, 0], x[1, 3], x[2, :2], x[3, 1], x[4, :] = np.inf, -np.inf, [np.inf, -np.inf], np.nan, [np.inf] * 4
    layers = []
    act = {"none": torch.nn.Identity(), "relu": torch.nn.ReLU(), "tanh": torch.nn.Tanh(), "sigmoid": torch.nn.Sigmoid(),
           "gelu": torch.nn.GELU(), "silu": torch.nn.SiLU(), "elu": torch.nn.ELU(), "softplus": torch.nn.Softplus(),
           "mish": torch.nn.Mish(), "hardswish": torch.nn.Hardswish()}[activation]
    for i, (w, b) in enumerate(zip(ws, bs)):
        linear = torch.nn.Linear(w.shape[1], w.shape[0]).double()
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.astype(np.float64)))
            linear.bias.copy_(torch.from_numpy(b.astype(np.float64)))
        layers += [linear] + ([act] if i < len(ws) - 1 else [])
    with torch.no_grad():
        want = torch.nn.Sequential(*layers)(torch.from_numpy(x.astype(np.float64))).numpy()
    got = FusedMLP(ws, bs, activation, device="cpu")(x).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got) * np.sign(got), np.isinf(want) * np.sign(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
