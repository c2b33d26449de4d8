"""The weights' bound on each layer's pre-activations, the interval arithmetic over activation expressions it feeds,
and the render decision they make together: a layer whose sin/cos arguments stay under 400 for every input takes
fm_sin_d/fm_cos_d (the hardware unit on x), under 1000 the branch-free fm_sin_b/fm_cos_b, both with no far-argument
branch (render.c, fm_render_trig_bounded). No GPU needed."""

import math
import re

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from conftest import torch_init

# (expression, sin/cos argument inside it, or None): the argument's own text lets the test check the trig bound.
EXPRESSIONS = [
    ("sin", "x"), ("sin(30*x)", "30*x"), ("cos(x^2 - 1)", "x^2 - 1"), ("0.5*sin(2*x + 1) + x", "2*x + 1"),
    ("sin(tanh(x) * 7)", "tanh(x) * 7"), ("sin(exp(x))", "exp(x)"), ("sin(relu(x) - abs(x))", "relu(x) - abs(x)"),
    ("tanh", None), ("sigmoid(x) * 3 - 1", None), ("relu", None), ("silu", None), ("gelu", None), ("mish", None),
    ("x * x", None), ("x^3 - 2*x", None), ("1 / (2 + x)", None), ("min(x, 1) + max(x, -2)", None),
    ("floor(x) + ceil(x)", None), ("atan(x) + erf(x) + softsign(x)", None), ("hardsigmoid(x) - exp(x)", None),
    ("square(x - 1)", None),
    ("sin(leaky_relu(x, 0.2) * 3)", "leaky_relu(x, 0.2) * 3"), ("cos(elu(x))", "elu(x)"), ("elu(x, 0.5) + selu(x)", None),
    ("sin(softplus(x))", "softplus(x)"), ("softplus(x, 2, 3) - softplus(x, 0.5, 1)", None),
    ("hardtanh(x)", None), ("sin(hardtanh(x, -2, 0.5) * 40)", "hardtanh(x, -2, 0.5) * 40"),
    ("hardswish(x) + gelu_tanh(x)", None), ("sqrt(x) + log1p(x)", None), ("log(x) + log2(x) - log10(x)", None),
    ("expm1(x) + exp2(x)", None), ("sinh(x) - cosh(x)", None), ("asin(x) + acos(x) * 2", None),
]
INTERVALS = [(-1.0, 1.0), (-3.0, 2.5), (0.5, 4.0), (-20.0, -0.25), (-0.001, 0.002), (-700.0, 60.0)]


@pytest.mark.parametrize("text,arg", EXPRESSIONS)
@pytest.mark.parametrize("lo,hi", INTERVALS)
def test_expression_ranges_enclose_every_value_and_sine_argument(text, arg, lo, hi):
    x = np.concatenate([np.linspace(lo, hi, 20001), [lo, hi, 0.0 if lo <= 0 <= hi else lo]])
    r_lo, r_hi, trig = _core.expr_range(text, lo, hi)
    with np.errstate(all="ignore"):
        y = _core.eval_expr(text, x)
    y = y[~np.isnan(y)]
    slack = 1e-12 * max(1.0, np.abs(y).max(initial=0.0))
    assert (y >= r_lo - slack).all() and (y <= r_hi + slack).all(), (text, lo, hi, r_lo, r_hi, y.min(), y.max())
    if arg is None:
        assert trig == 0.0
    else:
        with np.errstate(all="ignore"):
            a = np.abs(_core.eval_expr(arg, x))
        assert (a[~np.isnan(a)] <= trig * (1 + 1e-12)).all(), (text, lo, hi, trig, a.max())


def test_unmodelled_or_unbounded_parts_give_no_sine_bound():
    assert _core.expr_range("sin(1 / x)", -1, 1)[2] == math.inf  # the divisor's interval holds 0
    assert _core.expr_range("sin(tan(x))", -1, 1)[2] == math.inf  # not modelled: the whole line
    assert _core.expr_range("sin(leaky_relu(x, -0.5))", -1, 1)[2] == math.inf  # not monotone: the whole line
    assert _core.expr_range("sin(leaky_relu(x, x))", -1, 1)[2] == math.inf  # a slope that varies: the whole line
    assert _core.expr_range("sin(hardtanh(x * 5))", -math.inf, math.inf)[2] == 1.0  # bounded whatever x is
    assert _core.expr_range("sin", -math.inf, 3)[2] == math.inf
    assert _core.expr_range("sin(tanh(x))", -math.inf, math.inf)[2] == 1.0  # bounded whatever x is
    assert _core.expr_range("tanh", -math.inf, math.inf)[:2] == (-1.0, 1.0)


def test_preactivation_bounds_follow_the_weights_where_the_input_is_bounded():
    w0 = np.array([[1.0], [2.0]], np.float32)
    w1 = np.array([[1.0, -2.0], [3.0, 0.5]], np.float32)
    b1 = np.array([0.5, -1.0], np.float32)
    w2 = np.array([[4.0, -4.0]], np.float32)
    net = _core.Network([w0, w1, w2], [None, b1, None], ["tanh", "sin", "none"])
    bounds = net.preact_bounds()
    assert bounds[0] == math.inf  # x: anything
    assert bounds[1] == pytest.approx(max(1 + 2 + 0.5, 3 + 0.5 + 1) * 1.01)  # tanh's output in [-1, 1]
    assert bounds[2] == pytest.approx(8 * 1.01)  # sin's too
    assert _core.Network([w0, w1, w2], [None, b1, None], ["relu", "sin", "none"]).preact_bounds()[1] == math.inf
    clamped = _core.Network([w0, w1, w2], [None, b1, None], ["hardtanh(x, -2, 0.5)", "sin", "none"])
    assert clamped.preact_bounds()[1] == pytest.approx(max(1 * 2 + 2 * 2 + 0.5, 3 * 2 + 0.5 * 2 + 1) * 1.01)
    with_residual = _core.Network([w0, w1, w2], [None, b1, None], ["tanh", "sin", "none"],
                                  residuals=[None, (1, "none", 0), None])
    assert with_residual.preact_bounds()[2] == math.inf  # h = sin(.) + r: r is unbounded


def _act_lines(source):
    return re.findall(r"float act\(float x, int\) \{ return ([^;]*);", source)


def test_siren_hidden_layers_take_the_branch_free_sine_and_layer_0_keeps_the_far_check(rng):
    widths = [2, 256, 256, 256, 3]
    ws, bs = torch_init(rng, widths, True)
    acts = ["sin(30*x)"] * 3 + ["none"]
    # By the weights' size: 30 z under 400 (the hardware unit on x), under 1000 (one part of 2 pi), past 1000 (the
    # accurate form, and the far check in every layer).
    for scale, form, far in [(1, "fm_sin_d(", "false"), (2, "fm_sin_b(", "false"), (5, "fm_sin(", "true")]:
        mlp = fusedmlp.FusedMLP([ws[0]] + [w * scale for w in ws[1:]], bs, activation=acts, device="cpu")
        bound = 30 * mlp._net.preact_bounds()[1]
        assert {"fm_sin_d(": bound < 400, "fm_sin_b(": 400 < bound < 1000, "fm_sin(": 1000 < bound}[form], bound
        lines = _act_lines(mlp.source)
        assert lines[0].startswith("fm_sin(") and all(a.startswith(form) for a in lines[1:3]), (scale, lines)
        assert re.findall(r"FAR = (\w+)", mlp.source) == ["true", far, far, "false"], scale


def test_a_sine_stored_in_float32_keeps_the_accurate_form(rng):
    """The branch-free forms' error (up to 4e-5) suits 16-bit storage only: a last layer with sin and float32
    output keeps fm_sin."""
    ws, bs = torch_init(rng, [2, 32, 4], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="sin", output_activation="sin", device="cpu")
    assert _act_lines(mlp.source) == ["fm_sin(x)", "fm_sin(x)"]  # layer 0: x unbounded; layer 1: float32 result
    assert mlp._net.preact_bounds()[1] < 1000
