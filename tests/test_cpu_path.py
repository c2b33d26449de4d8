"""The CPU path (device='cpu') against an independent NumPy float64 forward. No GPU needed.

The oracle writes every built-in activation out in NumPy by hand, following PyTorch's definitions; it never calls
the core's own evaluator (_core.eval_expr), so a wrong formula in the C function table cannot pass by agreeing with
itself. The CPU path keeps float32 between layers (csrc/ref.c); the oracle does the same where it says so, and the
tolerances below are set from that.
"""

import math

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from conftest import graph_weights, rel_l2, torch_init

# Relative L2 error allowed between the CPU path and a float64 forward: float32 storage between layers rounds by
# 2**-24 (6e-8) per layer, so measured errors are ~1e-7.
TOL = 1e-5

# ------------------------------------------------------------------------------------------------ NumPy oracle

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _relu6(x):
    return np.minimum(np.maximum(x, 0.0), 6.0)  # minimum/maximum propagate NaN, as torch's relu6 does


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x, beta=1.0, threshold=20.0):
    # torch.nn.functional.softplus: linear where beta * x > threshold
    return np.where(x * beta > threshold, x, np.log1p(np.exp(x * beta)) / beta)


# name -> NumPy function of (x, *arguments), with torch.nn.functional's defaults for the optional arguments.
NUMPY = {
    "abs": np.abs,
    "sqrt": np.sqrt,
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log2": np.log2,
    "log10": np.log10,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "erf": _erf,
    "floor": np.floor,
    "ceil": np.ceil,
    "min": np.minimum,
    "max": np.maximum,
    "pow": np.power,
    "none": lambda x: x,
    "identity": lambda x: x,
    "relu": lambda x: np.where(x < 0, 0.0, x),
    "leaky_relu": lambda x, slope=0.01: np.where(x > 0, x, x * slope),
    "elu": lambda x, alpha=1.0: np.where(x > 0, x, alpha * np.expm1(x)),
    "selu": lambda x: SELU_SCALE * np.where(x > 0, x, SELU_ALPHA * np.expm1(x)),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x * _sigmoid(x),
    "sigmoid": _sigmoid,
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "square": np.square,
    "hardtanh": lambda x, lo=-1.0, hi=1.0: np.clip(x, lo, hi),
    "hardsigmoid": lambda x: _relu6(x + 3.0) / 6.0,
    "hardswish": lambda x: x * _relu6(x + 3.0) / 6.0,
    "softsign": lambda x: x / (1.0 + np.abs(x)),
    # comparisons give 1 or 0 (0 for NaN), where(c, a, b) a where c != 0: as ONNX's Greater / ... / Where
    "gt": lambda x, y: (x > y).astype(np.float64),
    "ge": lambda x, y: (x >= y).astype(np.float64),
    "lt": lambda x, y: (x < y).astype(np.float64),
    "le": lambda x, y: (x <= y).astype(np.float64),
    "eq": lambda x, y: (x == y).astype(np.float64),
    "where": lambda c, a, b: np.where(c != 0, a, b),
}

N = NUMPY
# User expressions: the text the library parses, and the same function written in NumPy.
EXPRESSIONS = {
    "x * tanh(softplus(x))": lambda x: x * np.tanh(_softplus(x)),
    "sin(30*x)": lambda x: np.sin(30.0 * x),
    "max(x, 0.1*x)": lambda x: np.maximum(x, 0.1 * x),
    "leaky_relu(x, 0.2)": lambda x: N["leaky_relu"](x, 0.2),
    "softplus(x, 2, 10)": lambda x: _softplus(x, 2.0, 10.0),
    "elu(x, 0.5)": lambda x: N["elu"](x, 0.5),
    "hardtanh(x, -2, 2)": lambda x: np.clip(x, -2.0, 2.0),
    "min(x, 0.5)": lambda x: np.minimum(x, 0.5),
    "pow(x, 3)": lambda x: x**3,
    "pow(x, 2.5)": lambda x: np.power(x, 2.5),
    "x^-2 + 1": lambda x: x**-2.0 + 1.0,
    "2*cos(x) - 1": lambda x: 2.0 * np.cos(x) - 1.0,
    "x / (1 + abs(x)) - pi + e": lambda x: x / (1.0 + np.abs(x)) - math.pi + math.e,
    "-x^2": lambda x: -(x**2),
    "1e-3 * exp(x) + .5": lambda x: 1e-3 * np.exp(x) + 0.5,
    # the comparisons and where in the forms ONNX exporters write them (torch's Softplus threshold, Hardshrink), each
    # a function of x that keeps x's NaN (a comparison alone gives 0 for it)
    "x * gt(x, 0.5)": lambda x: x * N["gt"](x, 0.5),
    "x * ge(x, 0.5)": lambda x: x * N["ge"](x, 0.5),
    "x * lt(x, -0.5)": lambda x: x * N["lt"](x, -0.5),
    "x + le(x, 0)": lambda x: x + N["le"](x, 0.0),
    "x + eq(x, 0)": lambda x: x + N["eq"](x, 0.0),
    "where(gt(x * 2, 10), x, softplus(x * 2) / 2)": lambda x: np.where(2 * x > 10, x, _softplus(2 * x) / 2),
    "where(le(abs(x), 0.3), 0, x)": lambda x: np.where(np.abs(x) <= 0.3, 0.0, x),
}

# Functions whose domain is not every real: inside a network they get an argument in their domain, and away from
# the ends of it (acos(tanh(x)) near x = 10 turns tanh's last-bit rounding into a 1e-7 relative difference).
DOMAIN_GUARDED = {
    "sqrt": "sqrt(abs(x) + 0.5)",
    "log": "log(abs(x) + 0.5)",
    "log2": "log2(abs(x) + 0.5)",
    "log10": "log10(abs(x) + 0.5)",
    "log1p": "log1p(abs(x))",
    "asin": "asin(0.9 * tanh(x))",
    "acos": "acos(0.9 * tanh(x))",
}
GUARDED_NUMPY = {
    "sqrt(abs(x) + 0.5)": lambda x: np.sqrt(np.abs(x) + 0.5),
    "log(abs(x) + 0.5)": lambda x: np.log(np.abs(x) + 0.5),
    "log2(abs(x) + 0.5)": lambda x: np.log2(np.abs(x) + 0.5),
    "log10(abs(x) + 0.5)": lambda x: np.log10(np.abs(x) + 0.5),
    "log1p(abs(x))": lambda x: np.log1p(np.abs(x)),
    "asin(0.9 * tanh(x))": lambda x: np.arcsin(0.9 * np.tanh(x)),
    "acos(0.9 * tanh(x))": lambda x: np.arccos(0.9 * np.tanh(x)),
}
TWO_ARGUMENT = {"min": "min(x, 0.5)", "max": "max(x, 0.1*x)", "pow": "pow(x, 3)", "gt": "x * gt(x, 0.5)",
                "ge": "x * ge(x, 0.5)", "lt": "x * lt(x, -0.5)", "le": "x + le(x, 0)", "eq": "x + eq(x, 0)",
                "where": "where(gt(x * 2, 10), x, softplus(x * 2) / 2)"}


def numpy_activation(text):
    """The NumPy function for an activation text of this file (a bare built-in name or a listed expression)."""
    for table in (EXPRESSIONS, GUARDED_NUMPY):
        if text in table:
            return table[text]
    return NUMPY[text]


def network_pool():
    """Activation texts for random networks: every built-in (domain-guarded where needed) and the expressions.

    sin(30*x) is left out: chained, its slope of 30 turns a one-ulp difference in float32 storage into a visible
    one; it has its own test below.
    """
    pool = []
    for name in _core.expr_functions():
        pool.append(DOMAIN_GUARDED.get(name) or TWO_ARGUMENT.get(name) or name)
    pool += [t for t in EXPRESSIONS if t not in ("sin(30*x)", "pow(x, 2.5)", "x^-2 + 1")]
    return pool


def numpy_forward(x, weights, biases, activations, float32_storage=True):
    """Float64 forward in NumPy: h @ W.T + b, then the activation; optionally float32 storage between layers.

    Returns the output and the largest |value| any layer produced.
    """
    h = np.asarray(x, dtype=np.float64)
    peak = 0.0
    with np.errstate(all="ignore"):
        for w, b, act in zip(weights, biases, activations):
            h = h @ np.asarray(w, dtype=np.float64).T
            if b is not None:
                h = h + np.asarray(b, dtype=np.float64)
            h = numpy_activation(act)(h)
            if float32_storage:
                h = h.astype(np.float32).astype(np.float64)
            if h.size:
                peak = max(peak, float(np.max(np.abs(h))))
    return h, peak


def random_width(rng):
    r = rng.random()
    if r < 0.2:
        return int(rng.integers(1, 5))
    if r < 0.4:
        return int(rng.choice([16, 32, 64, 128, 256]))
    return int(rng.integers(1, 257))


# ------------------------------------------------------------------------------------------------ random networks


def test_every_builtin_has_a_numpy_definition():
    # A function added to the C table without an oracle here would go untested.
    assert sorted(NUMPY) == sorted(_core.expr_functions())
    assert set(network_pool()) >= {DOMAIN_GUARDED.get(n) or TWO_ARGUMENT.get(n) or n for n in NUMPY}


def test_random_architectures_match_numpy_float64():
    rng = np.random.default_rng(20261122)
    pool = network_pool()
    used, checked, redrawn = set(), 0, 0
    failures = []
    while checked < 120:
        depth = int(rng.integers(1, 9))
        widths = [random_width(rng) for _ in range(depth + 1)]
        bias = [bool(rng.random() < 0.6) for _ in range(depth)]
        acts = [str(rng.choice(pool)) for _ in range(depth)]
        batch = int(rng.choice([1, 3, 64, 67, 131]))
        ws, bs = torch_init(rng, widths, bias)
        x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        ref, peak = numpy_forward(x, ws, bs, acts)
        if not np.all(np.isfinite(ref)) or peak > 1e6:  # exp of exp of...: an overflow, not a comparison
            redrawn += 1
            continue
        y = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cpu")(x)
        assert y.shape == (batch, widths[-1]) and y.dtype == np.float32
        err = rel_l2(y, ref)
        if not err <= TOL:
            failures.append((widths, acts, bias, batch, err))
        used.update(acts)
        checked += 1
    assert not failures, failures[:5]
    assert redrawn < checked  # the pool is mostly well-behaved; a flood of redraws would hide a bug
    assert len(used) >= 0.8 * len(pool), sorted(set(pool) - used)


def test_float32_storage_is_the_only_rounding():
    # Against a float64 forward with no float32 rounding at all: only the per-layer storage rounding remains.
    rng = np.random.default_rng(7)
    for acts in (["relu"] * 5, ["tanh", "gelu", "silu", "mish", "none"], ["softplus(x, 2, 10)"] * 4 + ["sigmoid"]):
        ws, bs = torch_init(rng, [9, 64, 200, 37, 128, 5], True)
        x = rng.standard_normal((150, 9)).astype(np.float32)
        y = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cpu")(x)
        ref, _ = numpy_forward(x, ws, bs, acts, float32_storage=False)
        err = rel_l2(y, ref)
        assert 0 < err <= TOL, (acts, err)


def test_each_function_alone_matches_numpy_including_nan(rng):
    # One layer whose only activation is the function itself, on raw pre-activations: sqrt and log see negative
    # inputs too, and NaN must land where NumPy puts it.
    ws, bs = torch_init(rng, [6, 40], True)
    x = (3.0 * rng.standard_normal((50, 6))).astype(np.float32)
    pre = x.astype(np.float64) @ ws[0].astype(np.float64).T + bs[0]
    texts = [n for n in _core.expr_functions() if n not in TWO_ARGUMENT] + list(EXPRESSIONS)
    for text in texts:
        y = fusedmlp.FusedMLP(ws, bs, activation=[text], device="cpu")(x)
        with np.errstate(all="ignore"):
            expect = numpy_activation(text)(pre).astype(np.float32)
        np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6 * max(1.0, float(np.nanmax(np.abs(
            np.where(np.isinf(expect), 0, expect))))), equal_nan=True, err_msg=text)
        assert np.array_equal(np.isnan(y), np.isnan(expect)), text


def test_high_frequency_sine_layer(rng):
    # sin(30*x) once, after a well-conditioned layer: within the tolerance of its slope.
    widths = [2, 256, 256, 3]
    ws, bs = torch_init(rng, widths, True)
    acts = ["sin(30*x)", "tanh", "none"]
    x = rng.uniform(-1, 1, (300, 2)).astype(np.float32)
    y = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cpu")(x)
    ref, _ = numpy_forward(x, ws, bs, acts)
    assert rel_l2(y, ref) <= TOL
    ref64, _ = numpy_forward(x, ws, bs, acts, float32_storage=False)
    assert rel_l2(y, ref64) <= 30 * TOL


def test_wide_layers_run_on_the_cpu(rng):
    # The 256-feature limit is the fused kernel's; the CPU path takes any width.
    widths = [8, 600, 300, 4]
    ws, bs = torch_init(rng, widths, True)
    x = rng.standard_normal((70, 8)).astype(np.float32)
    y = fusedmlp.FusedMLP(ws, bs, activation="gelu", device="cpu")(x)
    ref, _ = numpy_forward(x, ws, bs, ["gelu", "gelu", "none"])
    assert y.shape == (70, 4)
    assert rel_l2(y, ref) <= TOL


# ------------------------------------------------------------------------------------------------ torch


TORCH_MODULES = [
    ("ReLU", (), "relu"),
    ("LeakyReLU", (0.2,), "leaky_relu(x, 0.2)"),
    ("ELU", (0.5,), "elu(x, 0.5)"),
    ("GELU", (), "gelu"),
    ("GELU", ("tanh",), "gelu_tanh"),
    ("SiLU", (), "silu"),
    ("Sigmoid", (), "sigmoid"),
    ("Tanh", (), "tanh"),
    ("Softplus", (2, 10), "softplus(x, 2, 10)"),
    ("Mish", (), "mish"),
    ("Hardtanh", (), "hardtanh"),
    ("Hardsigmoid", (), "hardsigmoid"),
    ("Hardswish", (), "hardswish"),
    ("Softsign", (), "softsign"),
    ("SELU", (), "selu"),
]


@pytest.mark.parametrize("module, args, text", TORCH_MODULES, ids=[f"{m}{a}" for m, a, _ in TORCH_MODULES])
def test_matches_torch_modules_in_float64(module, args, text, rng):
    torch = pytest.importorskip("torch")
    widths = [7, 48, 33, 64, 5]
    ws, bs = torch_init(rng, widths, [True, False, True, True])
    layers = []
    for w, b in zip(ws, bs):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.astype(np.float64)))
            if b is not None:
                linear.bias.copy_(torch.from_numpy(b.astype(np.float64)))
        layers += [linear, getattr(torch.nn, module)(*args)]
    model = torch.nn.Sequential(*layers)  # the activation follows every layer, the output one included
    # Spread wide enough to reach every branch: Softplus's threshold, Hardtanh's and Hardswish's corners.
    x = (4.0 * rng.standard_normal((257, 7))).astype(np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.astype(np.float64))).numpy()
    mlp = fusedmlp.FusedMLP(ws, bs, activation=text, output_activation=text, device="cpu")
    y = mlp(x)
    assert y.shape == ref.shape
    assert rel_l2(y, ref) <= TOL, module
    # The same model through its torch tensors: FusedMLP accepts them as weights.
    from_torch = fusedmlp.FusedMLP([l.weight for l in model if hasattr(l, "weight")],
                                   [l.bias for l in model if hasattr(l, "weight")], activation=text,
                                   output_activation=text, device="cpu")
    np.testing.assert_array_equal(from_torch(x), y)


# ------------------------------------------------------------------------------------------------ x layouts


@pytest.fixture
def small(rng):
    widths = [6, 40, 24, 3]
    ws, bs = torch_init(rng, widths, True)
    acts = ["silu", "tanh", "none"]
    return fusedmlp.FusedMLP(ws, bs, activation=acts[:2], device="cpu"), ws, bs, acts


@pytest.mark.parametrize("dtype, tol", [(np.float32, TOL), (np.float64, TOL), (np.float16, 2e-3)])
def test_output_dtype_follows_input(small, rng, dtype, tol):
    mlp, ws, bs, acts = small
    x = rng.standard_normal((45, 6)).astype(dtype)
    y = mlp(x)
    assert y.dtype == dtype and y.shape == (45, 3)
    # x is read as float32 (exact for float16, rounded for float64); the float32 result is then cast to x's dtype.
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(y, mlp(x32).astype(dtype))
    ref, _ = numpy_forward(x32, ws, bs, acts)
    assert rel_l2(y, ref) <= tol


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_layouts_and_views_give_the_contiguous_result(small, rng, dtype):
    mlp, ws, bs, acts = small
    base = rng.standard_normal((40, 6)).astype(dtype)
    views = {
        "fortran": np.asfortranarray(base),
        "every other row": base[::2],
        "reversed columns": base[:, ::-1],
        "reversed rows and columns": base[::-1, ::-1],
        "transposed": np.ascontiguousarray(base.T).T,
        "column slice of a wider array": np.concatenate([base, base], axis=1)[:, 3:9],
    }
    for name, view in views.items():
        kept = view.copy()
        y = mlp(view)
        contiguous = np.ascontiguousarray(view)
        np.testing.assert_array_equal(y, mlp(contiguous), err_msg=name)
        ref, _ = numpy_forward(contiguous.astype(np.float32), ws, bs, acts)
        assert y.dtype == dtype and rel_l2(y, ref) <= (2e-3 if dtype == np.float16 else TOL), name
        np.testing.assert_array_equal(view, kept, err_msg=name)  # x is never written


def test_unaligned_float32_input(small, rng):
    # A float32 view at an odd address (a packed buffer, a memory-mapped record) is copied, not refused.
    mlp, ws, bs, acts = small
    x = rng.standard_normal((21, 6)).astype(np.float32)
    raw = np.empty(x.nbytes + 1, np.uint8)
    view = raw[1:].view(np.float32).reshape(x.shape)
    view[...] = x
    assert not view.flags.aligned
    np.testing.assert_array_equal(mlp(view), mlp(x))


def test_one_row_zero_rows_and_lists(small, rng):
    mlp, ws, bs, acts = small
    x = rng.standard_normal((5, 6)).astype(np.float32)
    batch = mlp(x)
    one = mlp(x[2])
    assert one.shape == (3,) and one.dtype == np.float32
    np.testing.assert_array_equal(one, batch[2])
    single = mlp(x[2:3])
    assert single.shape == (1, 3)
    np.testing.assert_array_equal(single[0], batch[2])
    for dtype in (np.float32, np.float16, np.float64):
        empty = mlp(np.empty((0, 6), dtype))
        assert empty.shape == (0, 3) and empty.dtype == dtype
    listed = mlp(x.astype(np.float64).tolist())  # a nested list is float64
    assert listed.dtype == np.float64
    np.testing.assert_array_equal(listed, batch.astype(np.float64))


def test_evaluate_fused_mlp_is_the_one_shot_form(small, rng):
    mlp, ws, bs, acts = small
    x = rng.standard_normal((33, 6)).astype(np.float32)
    y = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation=acts[:2], device="cpu")
    np.testing.assert_array_equal(y, mlp(x))


def test_weights_are_copied_at_construction(rng):
    ws, bs = torch_init(rng, [4, 16, 2], True)
    x = rng.standard_normal((9, 4)).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", device="cpu")
    before = mlp(x)
    ws[0] *= 3.0
    bs[1] += 1.0
    np.testing.assert_array_equal(mlp(x), before)


# ------------------------------------------------------------------------------------------------ eval_expr


def probe_points(rng):
    return np.concatenate([3.0 * rng.standard_normal(300), rng.uniform(-1, 1, 100),
                           [50.0, -50.0, 1e4, -1e4, 20.5, -20.5, 7.25, -7.25]])


def expression_texts():
    return [n for n in _core.expr_functions() if n not in TWO_ARGUMENT] + list(TWO_ARGUMENT.values()) \
        + list(EXPRESSIONS) + list(GUARDED_NUMPY)


@pytest.mark.parametrize("text", expression_texts())
def test_eval_expr_matches_numpy(text, rng):
    x = probe_points(rng)
    y = _core.eval_expr(text, x)
    with np.errstate(all="ignore"):
        expect = numpy_activation(text)(x)
    assert y.dtype == np.float64 and y.shape == x.shape
    np.testing.assert_allclose(y, expect, rtol=1e-10, atol=1e-12, equal_nan=True)
    assert np.array_equal(np.isnan(y), np.isnan(expect))
    assert np.array_equal(np.isinf(y), np.isinf(expect))


@pytest.mark.parametrize("text", expression_texts())
def test_eval_expr_propagates_nan(text, rng):
    x = rng.standard_normal(64)
    holes = rng.choice(64, 9, replace=False)
    x[holes] = np.nan
    y = _core.eval_expr(text, x)
    assert np.all(np.isnan(y[holes])), text
    with np.errstate(all="ignore"):
        expect = numpy_activation(text)(x)
    np.testing.assert_allclose(y, expect, rtol=1e-10, atol=1e-12, equal_nan=True)


def test_eval_expr_saturates_like_torch_at_large_magnitudes():
    x = np.array([-1e4, -50.0, 50.0, 1e4])
    cases = {
        "sigmoid": [0.0, 1.9287498479639178e-22, 1.0, 1.0],
        "tanh": [-1.0, -1.0, 1.0, 1.0],
        "relu": [0.0, 0.0, 50.0, 1e4],
        "softplus": [0.0, 1.9287498479639178e-22, 50.0, 1e4],
        "silu": [-0.0, -50.0 * 1.9287498479639178e-22, 50.0, 1e4],
        "gelu": [-0.0, -0.0, 50.0, 1e4],
        "hardswish": [-0.0, -0.0, 50.0, 1e4],
        "softsign": [-1e4 / 10001, -50 / 51, 50 / 51, 1e4 / 10001],
        "elu": [-1.0, -1.0, 50.0, 1e4],
    }
    for text, expect in cases.items():
        np.testing.assert_allclose(_core.eval_expr(text, x), expect, rtol=1e-12, atol=0, err_msg=text)
    assert np.all(np.isposinf(_core.eval_expr("exp", np.array([1e4, 800.0]))))
    assert list(_core.eval_expr("mish", x)) == pytest.approx([0.0, -50.0 * 1.9287498479639178e-22, 50.0, 1e4],
                                                              rel=1e-12, abs=1e-300)


# ------------------------------------------------------------------------------------------------ from_npz


def test_from_npz_orders_layers_naturally(tmp_path, rng):
    # Prefixes net.0, net.2, ..., net.10: a string sort would put net.10 second and break the chain.
    widths = [3, 9, 7, 11, 6, 8, 4]
    bias = [True, True, True, False, True, True]
    ws, bs = torch_init(rng, widths, bias)
    state = {}
    for i, (w, b) in enumerate(zip(ws, bs)):
        state[f"net.{2 * i}.weight"] = w
        if b is not None:
            state[f"net.{2 * i}.bias"] = b
    state["net.4.running_mean"] = rng.standard_normal(7).astype(np.float32)  # not a layer: 1-D, no .weight
    path = tmp_path / "model.npz"
    np.savez(path, **dict(sorted(state.items())))  # stored in string order: 0, 10, 2, 4, 6, 8
    assert list(np.load(path).files)[:3] == ["net.0.bias", "net.0.weight", "net.10.bias"]
    mlp = fusedmlp.FusedMLP.from_npz(path, activation="tanh", output_activation="sigmoid", device="cpu")
    assert mlp.widths == tuple(widths)
    acts = ["tanh"] * 5 + ["sigmoid"]
    x = rng.standard_normal((50, 3)).astype(np.float32)
    y = mlp(x)
    ref, _ = numpy_forward(x, ws, bs, acts)
    assert rel_l2(y, ref) <= TOL
    np.testing.assert_array_equal(y, fusedmlp.FusedMLP(ws, bs, "tanh", "sigmoid", device="cpu")(x))


def test_from_npz_without_layers_is_a_shape_error(tmp_path, rng):
    path = tmp_path / "empty.npz"
    np.savez(path, scale=rng.standard_normal(3), **{"net.0.bias": rng.standard_normal(4)})
    with pytest.raises(fusedmlp.ShapeError, match=r"no '<name>\.weight' 2-D arrays \(keys: \['net\.0\.bias', 'scale'\]"):
        fusedmlp.FusedMLP.from_npz(path, device="cpu")


# ------------------------------------------------------------------------------------------------ activations


def test_hidden_list_plus_output_activation(rng):
    ws, bs = torch_init(rng, [5, 30, 20, 10, 2], True)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["relu", "elu(x, 0.5)", "softsign"], output_activation="sigmoid",
                            device="cpu")
    assert mlp.activations == ("relu(x)", "elu(x, 0.5)", "softsign(x)", "sigmoid(x)")
    ref, _ = numpy_forward(x, ws, bs, ["relu", "elu(x, 0.5)", "softsign", "sigmoid"])
    assert rel_l2(mlp(x), ref) <= TOL


def test_one_activation_per_layer_without_output_activation(rng):
    ws, bs = torch_init(rng, [5, 30, 20, 2], False)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    acts = ["hardtanh(x, -2, 2)", "x * tanh(softplus(x))", "leaky_relu(x, 0.2)"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cpu")
    assert mlp.activations == ("hardtanh(x, (-2), 2)", "(x * tanh(softplus(x, 1, 20)))", "leaky_relu(x, 0.2)")
    ref, _ = numpy_forward(x, ws, bs, acts)
    assert rel_l2(mlp(x), ref) <= TOL


def test_one_name_means_every_hidden_layer_and_a_linear_output(rng):
    ws, bs = torch_init(rng, [5, 30, 20, 2], True)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu_tanh", device="cpu")
    assert mlp.activations == ("gelu_tanh(x)", "gelu_tanh(x)", "none(x)")
    ref, _ = numpy_forward(x, ws, bs, ["gelu_tanh", "gelu_tanh", "none"])
    assert rel_l2(mlp(x), ref) <= TOL
    with_output_act, _ = numpy_forward(x, ws, bs, ["gelu_tanh"] * 3)
    assert rel_l2(mlp(x), with_output_act) > 1e-3  # the output layer is linear: no activation follows it


@pytest.mark.parametrize("count", [1, 4])
def test_activation_list_of_the_wrong_length_names_the_counts(rng, count):
    ws, bs = torch_init(rng, [5, 30, 20, 2], True)
    with pytest.raises(fusedmlp.ArgumentError, match=rf"activation has {count} entries; the network has 3 layers, "
                                                     r"so give 2 \(hidden layers, plus output_activation\) or 3"):
        fusedmlp.FusedMLP(ws, bs, activation=["relu"] * count, device="cpu")


def test_full_list_with_an_output_activation_too_is_refused(rng):
    ws, bs = torch_init(rng, [5, 30, 20, 2], True)
    with pytest.raises(fusedmlp.ArgumentError, match="activation has 3 entries; the network has 3 layers"):
        fusedmlp.FusedMLP(ws, bs, activation=["relu"] * 3, output_activation="tanh", device="cpu")


# ------------------------------------------------------------------------------------------------ out=


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_out_receives_the_returned_result(small, rng, dtype):
    mlp = small[0]
    x = rng.standard_normal((45, 6)).astype(dtype)
    expected = mlp(x)
    layouts = {
        "C order": np.full((45, 3), np.nan, dtype),  # poisoned: a call that writes nothing cannot pass
        "Fortran order": np.asfortranarray(np.full((45, 3), np.nan, dtype)),
        "column slice of a wider array": np.full((45, 8), np.nan, dtype)[:, 2:5],
        "every other row of a taller array": np.full((90, 3), np.nan, dtype)[::2],
    }
    for name, out in layouts.items():
        assert mlp(x, out=out) is out, name
        np.testing.assert_array_equal(out, expected, err_msg=name)
    wide = np.full((45, 8), np.nan, dtype)
    mlp(x, out=wide[:, 2:5])
    assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 5:]).all()  # only out's own elements are written


def test_out_of_ml_dtypes_bfloat16(small, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    mlp = small[0]
    x = rng.standard_normal((9, 6)).astype(ml_dtypes.bfloat16)
    out = np.full((9, 3), np.nan, ml_dtypes.bfloat16)
    assert mlp(x, out=out) is out
    np.testing.assert_array_equal(out.astype(np.float32), mlp(x).astype(np.float32))
    with pytest.raises(fusedmlp.DTypeError, match=r"out has dtype float32; it must be bfloat16"):
        mlp(x, out=np.zeros((9, 3), np.float32))


def test_out_for_one_row_lists_and_empty_batches(small, rng):
    mlp = small[0]
    x = rng.standard_normal((5, 6)).astype(np.float32)
    one = np.full(3, np.nan, np.float32)  # x of shape (6,): out of shape (3,)
    assert mlp(x[2], out=one) is one
    np.testing.assert_array_equal(one, mlp(x)[2])
    listed = np.full((5, 3), np.nan)  # a nested list is read as float64: out is float64 too
    assert mlp(x.astype(np.float64).tolist(), out=listed) is listed
    np.testing.assert_array_equal(listed, mlp(x.astype(np.float64)))
    empty = np.empty((0, 3), np.float16)
    assert mlp(np.empty((0, 6), np.float16), out=empty) is empty
    with pytest.raises(fusedmlp.ShapeError, match=r"out has shape \(2, 3\).*must be \(0, 3\)"):
        mlp(np.empty((0, 6), np.float16), out=np.full((2, 3), 7, np.float16))


def _bad_numpy_outs(x):
    """(label, out, error, message regex) for float32 x of shape (5, 6) and a 6 -> 3 network."""
    read_only = np.zeros((5, 3), np.float32)
    read_only.setflags(write=False)
    return [
        ("a list", [[0.0] * 3] * 5, fusedmlp.ArgumentError, r"out is a list; for NumPy \(or list\) x it must be a "
         r"NumPy ndarray of shape \(5, 3\) and dtype float32"),
        ("wrong shape", np.zeros((5, 4), np.float32), fusedmlp.ShapeError,
         r"out has shape \(5, 4\); for x of shape \(5, 6\) it must be \(5, 3\)"),
        ("transposed shape", np.zeros((3, 5), np.float32), fusedmlp.ShapeError, r"out has shape \(3, 5\)"),
        ("float64 for float32 x", np.zeros((5, 3), np.float64), fusedmlp.DTypeError,
         r"out has dtype float64; it must be float32, the dtype this call returns \(x's dtype"),
        ("float16 for float32 x", np.zeros((5, 3), np.float16), fusedmlp.DTypeError, r"out has dtype float16"),
        ("read-only", read_only, fusedmlp.ArgumentError, r"out is read-only.*writable"),
        ("broadcast", np.broadcast_to(np.zeros(3, np.float32), (5, 3)), fusedmlp.ArgumentError, r"out is read-only"),
        ("elements sharing memory", np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), (5, 3), (4, 4)),
         fusedmlp.ArgumentError, r"out has strides \(4, 4\) .*elements share memory"),
        ("view of x", x[:, 1:4], fusedmlp.ArgumentError, r"out shares memory with x; out must not overlap x"),
    ]


@pytest.mark.parametrize("label", [case[0] for case in _bad_numpy_outs(np.zeros((5, 6), np.float32))])
def test_bad_out_names_out_the_value_and_the_rule(small, rng, label):
    mlp = small[0]
    x = rng.standard_normal((5, 6)).astype(np.float32)
    _, out, error, match = next(case for case in _bad_numpy_outs(x) if case[0] == label)
    before = x.copy()
    with pytest.raises(error, match=match):
        mlp(x, out=out)
    np.testing.assert_array_equal(x, before)  # nothing was written into x


def test_out_for_one_row_must_be_one_row(small, rng):
    mlp = small[0]
    x = rng.standard_normal(6).astype(np.float32)
    with pytest.raises(fusedmlp.ShapeError, match=r"out has shape \(1, 3\); for x of shape \(6,\) it must be \(3,\)"):
        mlp(x, out=np.zeros((1, 3), np.float32))


def test_the_cpu_path_splits_large_batches_over_threads_with_one_calls_bits(rng, monkeypatch):
    """Rows over FUSEDMLP_CPU_THREADS threads (else OMP_NUM_THREADS, else the CPUs the process may use), at least
    CPU_ROWS_PER_THREAD rows each: the same bits as one thread, residuals and concats included."""
    from fusedmlp import _api, _env

    ws, bs = graph_weights(rng, [5, 48, 48, 3], {1: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="tanh", concat={1: "before"}, residual={1: "add"}, device="cpu")
    x = rng.standard_normal((3 * _api.CPU_ROWS_PER_THREAD + 17, 5)).astype(np.float32)
    monkeypatch.setenv("FUSEDMLP_CPU_THREADS", "1")
    one = mlp(x)
    calls = []

    class Counting:  # the network, counting the rows of each forward_cpu call
        def __init__(self, net):
            self._net = net

        def __getattr__(self, name):
            return getattr(self._net, name)

        def forward_cpu(self, a):
            calls.append(len(a))
            return self._net.forward_cpu(a)

    monkeypatch.setattr(mlp, "_net", Counting(mlp._net))
    monkeypatch.setenv("FUSEDMLP_CPU_THREADS", "8")  # more than the rows allow: three parts
    np.testing.assert_array_equal(mlp(x), one)
    assert sorted(calls) == [4101, 4102, 4102] and sum(calls) == len(x)
    monkeypatch.delenv("FUSEDMLP_CPU_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _env.cpu_threads() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FUSEDMLP_CPU_THREADS", bad)
        with pytest.raises(ValueError, match=f"FUSEDMLP_CPU_THREADS={bad!r} is not a thread count"):
            _env.cpu_threads()
