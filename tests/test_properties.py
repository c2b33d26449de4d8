"""Property-based checks of the public API on the CPU path (FusedMLP and evaluate_fused_mlp with device='cpu').

Every input either works, giving what a NumPy float64 forward of the same weights gives, or raises the
FusedMLPError subclass for what is wrong (also a ValueError or TypeError), with a message that names the argument.
No other exception may escape: no raw TypeError from NumPy, no SystemError, no crash.

Hypothesis runs derandomized (a fixed seed per test) and without its example database, so every run tries the same
examples and writes nothing. Array values come from a NumPy generator seeded by Hypothesis: random, never zeros.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedmlp import (
    ArgumentError,
    DTypeError,
    ExpressionError,
    FusedMLP,
    FusedMLPError,
    LimitError,
    ShapeError,
    evaluate_fused_mlp,
)
from fusedmlp import _core

MAX_LAYERS = _core.MAX_LAYERS
MAX_FUSED_WIDTH = _core.MAX_FUSED_WIDTH
FUNCTIONS = set(_core.expr_functions())


def examples(n):
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ------------------------------------------------------------------------------------------------ the oracle

_erf = np.vectorize(math.erf, otypes=[np.float64])

# Activations written out in NumPy (PyTorch's definitions), independent of the core's evaluator.
NUMPY_ACTIVATIONS = {
    "none": lambda h: h,
    "identity": lambda h: h,
    "relu": lambda h: np.where(h < 0, 0.0, h),
    "tanh": np.tanh,
    "sigmoid": lambda h: 0.5 * (1.0 + np.tanh(0.5 * h)),
    "silu": lambda h: h * 0.5 * (1.0 + np.tanh(0.5 * h)),
    "gelu": lambda h: 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0))),
    "softsign": lambda h: h / (1.0 + np.abs(h)),
    "leaky_relu": lambda h: np.where(h > 0, h, 0.01 * h),
    "elu": lambda h: np.where(h > 0, h, np.expm1(np.minimum(h, 0.0))),
    "hardtanh(x, -0.5, 0.5)": lambda h: np.clip(h, -0.5, 0.5),
    "x * x - 0.5": lambda h: h * h - 0.5,
    "2 * x + sin(x)": lambda h: 2.0 * h + np.sin(h),
}
ACTIVATIONS = sorted(NUMPY_ACTIVATIONS)


def numpy_forward(x, weights, biases, acts):
    """Float64 forward of the arrays as given, converted to float32 as the library converts weights and inputs, with
    float32 storage between layers (the CPU path's documented semantics). Returns (output, magnitude): the largest
    |value| seen in any layer, from which the comparison's absolute tolerance is set."""
    h = np.asarray(x).astype(np.float32).astype(np.float64)
    peak = float(np.max(np.abs(h), initial=1.0))
    with np.errstate(all="ignore"):
        for w, b, act in zip(weights, biases, acts):
            w = np.asarray(w).astype(np.float32).astype(np.float64)
            h = h @ w.T
            if b is not None:
                h = h + np.asarray(b).astype(np.float32).astype(np.float64)
            peak = max(peak, float(np.max(np.abs(h), initial=0.0)) * w.shape[1])
            h = NUMPY_ACTIVATIONS[act](h).astype(np.float32).astype(np.float64)
            peak = max(peak, float(np.max(np.abs(h), initial=0.0)))
    return h, peak


def assert_matches(y, x, weights, biases, acts):
    ref, peak = numpy_forward(np.atleast_2d(x), weights, biases, acts)
    x_dtype = np.asarray(x).dtype
    assert y.dtype == x_dtype.newbyteorder("=")
    ref = ref.reshape(y.shape)
    # float32 storage: 6e-8 per rounding, amplified at most by the widest sum of |terms| (peak); float16 outputs
    # round once more by 2**-11
    rtol, atol = (1e-3, 1e-3 * peak) if y.dtype == np.float16 else (1e-5, 1e-6 * peak)
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------------ building blocks

WEIGHT_DTYPES = [np.float32, np.float64, np.float16, np.longdouble, np.int8, np.int32, np.int64, np.uint8]
LAYOUTS = ["c", "fortran", "reversed", "strided", "list", "tuple-rows", "readonly", "big-endian"]


def random_values(rng, shape, dtype, bound):
    if np.dtype(dtype).kind in "iu":
        low = 0 if np.dtype(dtype).kind == "u" else -1
        return rng.integers(low, 2, shape).astype(dtype)
    return rng.uniform(-bound, bound, shape).astype(dtype)


def lay_out(arr, layout):
    """The same values in another memory layout or container."""
    if layout == "fortran":
        return np.asfortranarray(arr)
    if layout == "reversed" and arr.ndim:  # a view with negative strides
        flipped = np.ascontiguousarray(arr[(slice(None, None, -1),) * arr.ndim])
        return flipped[(slice(None, None, -1),) * arr.ndim]
    if layout == "strided":  # every other element of a larger array
        big = np.empty(tuple(2 * n + 1 for n in arr.shape), dtype=arr.dtype)
        view = big[(slice(1, None, 2),) * arr.ndim]
        view[...] = arr
        return view
    if layout == "list":
        return arr.tolist() if arr.dtype != np.longdouble else arr
    if layout == "tuple-rows":
        return tuple(arr) if arr.ndim else arr
    if layout == "readonly":
        out = arr.copy()
        out.flags.writeable = False
        return out
    if layout == "big-endian":
        return arr.astype(arr.dtype.newbyteorder(">"))
    return arr


@st.composite
def networks(draw, max_width=10, max_layers=4, widths=None):
    """A valid network: dict(weights, biases, activation, output_activation, acts), acts being one name per layer."""
    if widths is None:
        depth = draw(st.integers(1, max_layers))
        widths = draw(st.lists(st.integers(1, max_width), min_size=depth + 1, max_size=depth + 1))
    depth = len(widths) - 1
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    weights, biases = [], []
    for i, o in zip(widths[:-1], widths[1:]):
        bound = 1.0 / math.sqrt(i)  # nn.Linear's initialisation keeps every layer's values near 1
        weights.append(lay_out(random_values(rng, (o, i), draw(st.sampled_from(WEIGHT_DTYPES)), bound),
                               draw(st.sampled_from(LAYOUTS))))
        has_bias = draw(st.booleans())
        biases.append(lay_out(random_values(rng, (o,), draw(st.sampled_from(WEIGHT_DTYPES)), bound),
                              draw(st.sampled_from(LAYOUTS))) if has_bias else None)
    style = draw(st.sampled_from(["one", "hidden-list", "every-list"]))
    if style == "one":
        hidden, out = draw(st.sampled_from(ACTIVATIONS)), draw(st.none() | st.sampled_from(ACTIVATIONS))
        activation, acts = hidden, [hidden] * (depth - 1) + [out or "none"]
    elif style == "hidden-list":
        activation = draw(st.lists(st.sampled_from(ACTIVATIONS), min_size=depth - 1, max_size=depth - 1))
        out = draw(st.none() | st.sampled_from(ACTIVATIONS))
        acts = activation + [out or "none"]
    else:
        activation = draw(st.lists(st.sampled_from(ACTIVATIONS), min_size=depth, max_size=depth))
        out, acts = None, list(activation)
    if draw(st.booleans()) and isinstance(activation, list):
        activation = tuple(activation)
    no_biases = all(b is None for b in biases) and draw(st.booleans())
    return dict(weights=weights if draw(st.booleans()) else tuple(weights), biases=None if no_biases else biases,
                activation=activation, output_activation=out, acts=acts, widths=widths, rng=rng)


def inputs(draw, net, rows=None):
    rng = net["rng"]
    n_in = net["widths"][0]
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16]))
    if draw(st.integers(0, 5)) == 0:
        return random_values(rng, (n_in,), dtype, 2.0)  # one row, 1-D
    rows = draw(st.integers(0, 9)) if rows is None else rows
    x = random_values(rng, (rows, n_in), dtype, 2.0)
    layout = draw(st.sampled_from(["c", "fortran", "reversed", "strided", "list", "readonly", "big-endian"]))
    if layout == "list" and (rows == 0 or dtype != np.float64):
        layout = "c"  # a list of Python floats is float64; an empty list has no feature count
    return lay_out(x, layout)


def build(net, **kwargs):
    return FusedMLP(net["weights"], net["biases"], net["activation"], net["output_activation"], device="cpu",
                    **kwargs)


def raises(error, field, call, *args, **kwargs):
    """Asserts that call raises exactly the error class (no other exception), naming field in its message."""
    with pytest.raises(FusedMLPError) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, error), f"{type(info.value).__name__} instead of {error.__name__}: {info.value}"
    assert isinstance(info.value, (ValueError, TypeError))
    assert field in str(info.value), f"{field!r} not named in: {info.value}"
    return info.value


def per_layer_biases(net):
    return net["biases"] if net["biases"] is not None else [None] * len(net["weights"])


# ------------------------------------------------------------------------------------------------ valid inputs


@examples(700)
@given(data=st.data())
def test_valid_networks_and_inputs_match_a_numpy_float64_forward(data):
    net = data.draw(networks())
    x = inputs(data.draw, net)
    if data.draw(st.booleans()):
        y = build(net)(x)
    else:
        y = evaluate_fused_mlp(x, net["weights"], net["biases"], net["activation"], net["output_activation"],
                               device="cpu")
    n_out = net["widths"][-1]
    assert y.shape == ((n_out,) if np.ndim(x) == 1 else (len(x), n_out))
    assert_matches(y, x, net["weights"], per_layer_biases(net), net["acts"])


@examples(60)
@given(data=st.data())
def test_networks_wider_than_the_kernel_run_on_the_cpu_and_render_as_segments(data):
    """A layer wider than one fused kernel holds: the CPU path computes it, the fused plan refuses it naming the width,
    and the network renders as segments with that layer a GEMM."""
    wide = data.draw(st.integers(MAX_FUSED_WIDTH + 1, 3 * MAX_FUSED_WIDTH))
    widths = data.draw(st.lists(st.integers(1, 8), min_size=2, max_size=3))
    at = data.draw(st.integers(0, len(widths) - 1))
    widths[at] = wide
    net = data.draw(networks(widths=widths))
    mlp = build(net)
    x = inputs(data.draw, net, rows=3)
    assert_matches(mlp(x), x, net["weights"], per_layer_biases(net), net["acts"])
    raises(LimitError, f"has {wide} ", lambda: mlp._net.plan(90))
    assert "GEMM" in mlp.source
    gemms = {int(line.split(":")[0].split()[-1]) for line in mlp.segments if ": gemm" in line}
    assert {at - 1, at} & set(range(len(widths) - 1)) <= gemms  # the layers reading or writing the wide value


# ------------------------------------------------------------------------------------------------ wrong shapes


@examples(400)
@given(data=st.data())
def test_arrays_of_the_wrong_rank_are_shape_errors_naming_them(data):
    net = data.draw(networks())
    weights, biases = list(net["weights"]), list(per_layer_biases(net))
    k = data.draw(st.integers(0, len(weights) - 1))
    target = data.draw(st.sampled_from(["weights", "biases"]))
    rank = data.draw(st.sampled_from([0, 1, 3, 4] if target == "weights" else [0, 2, 3]))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    bad = random_values(net["rng"], shape, np.float32, 1.0)
    bad = data.draw(st.sampled_from([bad, bad.tolist(), lay_out(bad, "reversed")]))
    (weights if target == "weights" else biases)[k] = bad
    raises(ShapeError, f"{target}[{k}]", FusedMLP, weights, biases, net["activation"], net["output_activation"],
           device="cpu")


@examples(400)
@given(data=st.data())
def test_chains_that_do_not_connect_are_shape_errors_naming_the_layer(data):
    net = data.draw(networks(max_layers=5).filter(lambda n: len(n["widths"]) >= 3))
    weights = list(net["weights"])
    k = data.draw(st.integers(1, len(weights) - 1))
    n_in = data.draw(st.integers(1, 12).filter(lambda n: n != net["widths"][k]))
    weights[k] = random_values(net["rng"], (net["widths"][k + 1], n_in), np.float32, 1.0)
    error = raises(ShapeError, f"weights[{k}] has shape", FusedMLP, weights, net["biases"], net["activation"],
                   net["output_activation"], device="cpu")
    assert f"weights[{k - 1}]" in str(error) and error.hint.startswith("weights use nn.Linear.weight's layout")


@examples(300)
@given(data=st.data())
def test_biases_of_the_wrong_length_are_shape_errors_naming_them(data):
    net = data.draw(networks())
    biases = list(per_layer_biases(net))
    k = data.draw(st.integers(0, len(biases) - 1))
    n_out = net["widths"][k + 1]
    length = data.draw(st.integers(0, 12).filter(lambda n: n != n_out))
    biases[k] = lay_out(random_values(net["rng"], (length,), np.float32, 1.0), data.draw(st.sampled_from(LAYOUTS)))
    raises(ShapeError, f"biases[{k}] has {length} elements", FusedMLP, net["weights"], biases, net["activation"],
           net["output_activation"], device="cpu")


@examples(250)
@given(data=st.data())
def test_zero_size_dimensions_are_shape_errors_naming_the_first_empty_array(data):
    depth = data.draw(st.integers(1, 4))
    widths = data.draw(st.lists(st.integers(1, 6), min_size=depth + 1, max_size=depth + 1))
    j = data.draw(st.integers(0, depth))
    widths[j] = 0
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    weights = [random_values(rng, (o, i), np.float32, 1.0) for i, o in zip(widths[:-1], widths[1:])]
    first = j - 1 if j > 0 else 0  # the layer whose output (or, for j = 0, input) is empty
    raises(ShapeError, f"weights[{first}] has shape", FusedMLP, weights, None, "relu", device="cpu")


@examples(300)
@given(data=st.data())
def test_inputs_of_the_wrong_shape_are_shape_errors_naming_x(data):
    net = data.draw(networks(max_layers=2))
    n_in = net["widths"][0]
    shape = data.draw(st.one_of(
        st.tuples(st.integers(0, 5), st.integers(0, 12).filter(lambda n: n != n_in)),  # wrong feature count
        st.tuples(st.integers(0, 12).filter(lambda n: n != n_in)),  # one row of the wrong length
        # rank 3 and up with a wrong feature count (leading dimensions are rows, as nn.Linear takes them)
        st.lists(st.integers(1, 3), min_size=2, max_size=4).flatmap(
            lambda lead: st.integers(0, 12).filter(lambda n: n != n_in).map(lambda n: (*lead, n))),
        st.just(()),  # a scalar
    ))
    x = random_values(net["rng"], shape, data.draw(st.sampled_from([np.float32, np.float64, np.float16])), 1.0)
    x = data.draw(st.sampled_from([x, lay_out(x, "reversed")]))
    raises(ShapeError, "x has shape", build(net), x)


@examples(100)
@given(rows=st.integers(0, 5), n_in=st.integers(1, 6), n_out=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_zero_rows_give_an_empty_result_and_one_by_one_works(rows, n_in, n_out, seed):
    rng = np.random.default_rng(seed)
    w = [rng.uniform(-1, 1, (n_out, n_in)).astype(np.float32), rng.uniform(-1, 1, (1, n_out)).astype(np.float32)]
    mlp = FusedMLP(w, None, "tanh", device="cpu")
    x = rng.uniform(-1, 1, (rows, n_in)).astype(np.float32)
    y = mlp(x)
    assert y.shape == (rows, 1) and y.dtype == np.float32
    assert_matches(y, x, w, [None, None], ["tanh", "none"])


# ------------------------------------------------------------------------------------------------ wrong types


def bad_dtype_arrays(shape):
    """Arrays (or nested lists) of the given shape whose elements are not real numbers."""
    size = int(np.prod(shape))
    return st.sampled_from([
        lambda: np.full(shape, 0.5, dtype=object),
        lambda: np.full(shape, "0.5"),
        lambda: np.full(shape, b"0.5"),
        lambda: np.full(shape, 0.5 + 1j, dtype=np.complex64),
        lambda: np.full(shape, 1 - 2j),
        lambda: np.ones(shape, dtype=bool),
        lambda: np.zeros(shape, dtype="datetime64[s]"),
        lambda: np.zeros(shape, dtype="timedelta64[ms]"),
        lambda: np.zeros(shape, dtype="V4"),
        lambda: np.zeros(shape, dtype=[("a", "f4")]),
        lambda: np.full(shape, 0.5 + 0.5j).tolist() if size else np.full(shape, 0.5 + 0.5j),
        lambda: np.full(shape, "x").tolist() if size else np.full(shape, "x"),
        lambda: np.full(shape, None) if size else np.full(shape, None, dtype=object),
        lambda: np.full(shape, {}, dtype=object),
    ]).map(lambda make: make())


@examples(500)
@given(data=st.data())
def test_arrays_of_non_numbers_are_dtype_errors_naming_them(data):
    net = data.draw(networks(max_layers=3))
    weights, biases = list(net["weights"]), list(per_layer_biases(net))
    k = data.draw(st.integers(0, len(weights) - 1))
    target = data.draw(st.sampled_from(["weights", "biases", "x"]))
    if target == "x":
        n_in = net["widths"][0]
        x = data.draw(bad_dtype_arrays(data.draw(st.sampled_from([(3, n_in), (n_in,), (0, n_in)]))))
        raises(DTypeError, "x ", build(net), x)
        return
    shape = (net["widths"][k + 1], net["widths"][k]) if target == "weights" else (net["widths"][k + 1],)
    (weights if target == "weights" else biases)[k] = data.draw(bad_dtype_arrays(shape))
    raises(DTypeError, f"{target}[{k}]", FusedMLP, weights, biases, net["activation"], net["output_activation"],
           device="cpu")


@examples(150)
@given(data=st.data())
def test_integer_and_bool_inputs_are_dtype_errors(data):
    net = data.draw(networks(max_layers=2))
    dtype = data.draw(st.sampled_from([np.int8, np.int32, np.int64, np.uint16, np.bool_, np.longdouble,
                                       np.complex128]))
    x = np.ones((2, net["widths"][0]), dtype=dtype)
    x = data.draw(st.sampled_from([x, x.tolist()]))
    raises(DTypeError, f"x has dtype {np.asarray(x).dtype}", build(net), x)


@examples(400)
@given(data=st.data())
def test_non_finite_weights_and_biases_are_argument_errors_naming_the_index(data):
    net = data.draw(networks())
    weights, biases = list(net["weights"]), list(per_layer_biases(net))
    k = data.draw(st.integers(0, len(weights) - 1))
    target = data.draw(st.sampled_from(["weights", "biases"]))
    shape = (net["widths"][k + 1], net["widths"][k]) if target == "weights" else (net["widths"][k + 1],)
    dtype = data.draw(st.sampled_from([np.float16, np.float32, np.float64, np.longdouble]))
    arr = random_values(net["rng"], shape, dtype, 1.0)
    index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf] + ([1e39, -3.5e38, 1e300] if dtype != np.float16
                                                                   and dtype != np.float32 else [])))
    with np.errstate(over="ignore"):
        arr[index] = value
    layout = data.draw(st.sampled_from(["c", "fortran", "reversed", "strided", "list"]))
    (weights if target == "weights" else biases)[k] = lay_out(arr, layout)
    error = raises(ArgumentError, f"{target}[{k}] holds a non-finite value", FusedMLP, weights, biases,
                   net["activation"], net["output_activation"], device="cpu")
    assert f"at index {index}" in str(error)


# ------------------------------------------------------------------------------------------------ wrong counts


@examples(300)
@given(data=st.data())
def test_lists_of_the_wrong_length_are_argument_errors_naming_them(data):
    net = data.draw(networks())
    depth = len(net["weights"])
    target = data.draw(st.sampled_from(["biases", "activation", "activation+output"]))
    if target == "biases":
        n = data.draw(st.integers(0, depth + 3).filter(lambda n: n != depth))
        biases = [None] * n
        raises(ArgumentError, f"biases must be None or a list of {depth} entries", FusedMLP, net["weights"], biases,
               device="cpu")
    elif target == "activation":
        n = data.draw(st.integers(0, depth + 3).filter(lambda n: n not in (depth - 1, depth)))
        raises(ArgumentError, f"activation has {n} entries; the network has {depth} layers", FusedMLP,
               net["weights"], net["biases"], ["relu"] * n, device="cpu")
    else:  # one activation per layer and an output activation too
        raises(ArgumentError, f"activation has {depth} entries", FusedMLP, net["weights"], net["biases"],
               ["relu"] * depth, "tanh", device="cpu")


@examples(40)
@given(depth=st.integers(MAX_LAYERS + 1, MAX_LAYERS + 40), seed=st.integers(0, 2**32 - 1))
def test_too_many_layers_is_a_limit_error(depth, seed):
    rng = np.random.default_rng(seed)
    weights = [rng.uniform(0.5, 1.5, (1, 1)).astype(np.float32) for _ in range(depth)]
    raises(LimitError, f"weights has {depth} layers; at most {MAX_LAYERS}", FusedMLP, weights, device="cpu")


@examples(60)
@given(depth=st.integers(MAX_LAYERS - 3, MAX_LAYERS), seed=st.integers(0, 2**32 - 1))
def test_the_deepest_network_allowed_works(depth, seed):
    rng = np.random.default_rng(seed)
    weights = [rng.uniform(0.5, 1.5, (2, 2)).astype(np.float32) / 2 for _ in range(depth)]
    x = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
    y = FusedMLP(weights, None, "tanh", device="cpu")(x)
    assert_matches(y, x, weights, [None] * depth, ["tanh"] * (depth - 1) + ["none"])


# ------------------------------------------------------------------------------------------------ activations

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(
    lambda name: name not in FUNCTIONS and name not in ("x", "pi", "e"))


@examples(400)
@given(data=st.data(), name=identifiers)
def test_unknown_activation_names_are_expression_errors_pointing_at_them(data, name):
    net = data.draw(networks())
    depth = len(net["weights"])
    prefix = data.draw(st.sampled_from(["", "x * ", "tanh(x) + ", "  "]))
    text = prefix + name + data.draw(st.sampled_from(["", "(x)", " "]))
    where = data.draw(st.sampled_from(["activation", "output_activation", "list"]))
    kwargs = dict(activation=net["activation"], output_activation=net["output_activation"])
    if where == "activation":
        kwargs = dict(activation=text, output_activation=None)
    elif where == "output_activation":
        kwargs = dict(activation="relu", output_activation=text)
    else:
        kwargs = dict(activation=["relu"] * (depth - 1) + [text], output_activation=None)
    error = raises(ExpressionError, "unknown name", FusedMLP, net["weights"], net["biases"], device="cpu", **kwargs)
    assert "activation" in str(error)
    assert error.expression == text and error.column == len(prefix) + 1
    assert str(error).splitlines()[-1] == " " * (4 + len(prefix)) + "^"


@examples(300)
@given(data=st.data(), junk=st.one_of(st.integers(), st.floats(), st.binary(max_size=8), st.none(),
                                      st.lists(st.integers(), max_size=3).map(np.array), st.just(object())))
def test_activations_that_are_not_text_are_argument_errors(data, junk):
    net = data.draw(networks(max_layers=3))
    depth = len(net["weights"])
    where = data.draw(st.sampled_from(["activation", "output_activation", "list"]))
    if where == "activation":
        kwargs, field = dict(activation=junk), "activation="
    elif where == "output_activation":
        kwargs, field = dict(output_activation=junk), "output_activation="
    else:
        i = data.draw(st.integers(0, depth - 1))
        acts = ["tanh"] * depth
        acts[i] = junk
        kwargs, field = dict(activation=acts), f"activation[{i}]="
    if junk is None and where == "output_activation":
        return  # output_activation=None means "none"
    raises(ArgumentError, field, FusedMLP, net["weights"], net["biases"], device="cpu", **kwargs)


# ------------------------------------------------------------------------------------------------ keyword values


def _valid_device(value):
    return isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda|cuda:\d{1,9}", value, flags=re.ASCII) is not None


junk_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(), st.text(max_size=12),
    st.binary(max_size=8), st.lists(st.sampled_from(["cpu", "cuda", 0, 1.5]), max_size=3),
    st.lists(st.sampled_from(["cpu", "cuda", "auto"]), min_size=1, max_size=3).map(np.array),
    st.lists(st.integers(0, 1), min_size=2, max_size=3).map(np.array), st.just(object()),
    st.sampled_from(["CPU", " cpu", "cuda:", "cuda:-1", "cuda:1.0", "cuda:99999999999999999999", "cuda:\u0663",
                     "gpu", "cuda:0 ", "mps", "cpu\0"]),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@examples(400)
@given(data=st.data(), value=junk_values)
def test_bad_keyword_values_are_argument_errors_naming_the_keyword(data, value):
    net = data.draw(networks(max_layers=2))
    keyword = data.draw(st.sampled_from(["device", "check", "cache_dir"]))
    if keyword == "device" and _valid_device(value):
        return
    if keyword == "check" and isinstance(value, (bool, np.bool_)):
        return
    if keyword == "cache_dir" and (value is None or isinstance(value, (str, bytes)) and value and "\0" not in (
            value if isinstance(value, str) else value.decode("latin-1"))):
        return  # a folder path: accepted (nothing is written until a compile)
    kwargs = {"device": "cpu", keyword: value}
    raises(ArgumentError, f"{keyword}=", FusedMLP, net["weights"], net["biases"], net["activation"],
           net["output_activation"], **kwargs)
    if keyword != "cache_dir":
        x = np.ones((1, net["widths"][0]), np.float32)
        raises(ArgumentError, f"{keyword}=", evaluate_fused_mlp, x, net["weights"], net["biases"], **kwargs)


@examples(150)
@given(data=st.data(), arch=st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=10),
                                      st.sampled_from(["sm_99999999999999999999", "sm_", "compute_", "sm_9x",
                                                       "sm_\u0669\u0660", "9.", "sm_74", "sm_-80"])))
def test_bad_arch_values_are_argument_errors_before_any_compile(data, arch):
    # a target the plan accepts would compile with NVRTC: not what this test is about
    if isinstance(arch, str):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d{1,3})a?", arch.strip(), flags=re.ASCII)
        if m and int(m.group(1) + m.group(2)) >= 75:
            return
    if isinstance(arch, int) and not isinstance(arch, bool) and 75 <= arch < 10000:
        return
    mlp = FusedMLP([np.full((2, 3), 0.25, np.float32)], device="cpu")
    raises(ArgumentError, "arch", mlp.compile, arch)


@examples(100)
@given(dtype=st.one_of(st.sampled_from(["float64", "int8", "foo", "f4,f4", object, "complex64", "bfloat", "",
                                        "float", "O", (np.float32, -1)]), st.integers(), st.text(max_size=6)))
def test_bad_compile_dtypes_are_dtype_errors(dtype):
    mlp = FusedMLP([np.full((2, 3), 0.25, np.float32)], device="cpu")
    try:
        name = np.dtype(dtype).name
    except Exception:
        name = None
    if name in ("float32", "float16") or dtype == "bfloat16":
        return
    raises(DTypeError, "io_dtype=", mlp.compile, "sm_80", dtype)


# ------------------------------------------------------------------------------------------------ anything at all

anything = st.deferred(lambda: st.one_of(
    junk_values,
    st.lists(st.floats(-2, 2), min_size=1, max_size=4),
    st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=3), min_size=1,
             max_size=3),
    st.lists(st.lists(st.one_of(st.floats(-2, 2), st.integers(-3, 3), st.text(max_size=2), st.none()),
                      max_size=3), max_size=3),
    st.tuples(st.integers(1, 4), st.integers(1, 4), st.sampled_from(["f4", "f8", "f2", "i4", "u1", "?", "c8", "O",
                                                                     "U2", "M8[s]"]))
    .map(lambda t: np.ones(t[:2], dtype=t[2])),
    st.sampled_from(ACTIVATIONS + ["x ^ 2", "max(x, 0", "relu(", "x); asm(\"trap\"); (", "#include <x>", ""]),
))


@examples(900)
@given(data=st.data())
def test_anything_either_works_correctly_or_raises_a_fusedmlp_error(data):
    """Arguments drawn from a pool of valid values and junk: the only exceptions allowed are FusedMLPErrors."""
    net = data.draw(networks(max_layers=3))
    args = dict(weights=net["weights"], biases=net["biases"], activation=net["activation"],
                output_activation=net["output_activation"])
    for name in data.draw(st.sets(st.sampled_from(sorted(args) + ["weights[i]", "biases[i]", "x"]), max_size=3)):
        if name == "weights[i]":
            args["weights"] = list(args["weights"]) if isinstance(args["weights"], (list, tuple)) else args["weights"]
            if isinstance(args["weights"], list) and args["weights"]:
                args["weights"][data.draw(st.integers(0, len(args["weights"]) - 1))] = data.draw(anything)
        elif name == "biases[i]":
            if isinstance(args["biases"], list) and args["biases"]:
                args["biases"] = list(args["biases"])
                args["biases"][data.draw(st.integers(0, len(args["biases"]) - 1))] = data.draw(anything)
        elif name != "x":
            args[name] = data.draw(anything)
    x = data.draw(anything) if data.draw(st.booleans()) else inputs(data.draw, net)
    try:
        y = FusedMLP(**args, device="cpu")(x)
    except FusedMLPError as e:
        assert isinstance(e, (ValueError, TypeError))
        return
    # it worked: the arguments were valid after all, and the result must be right
    mlp = FusedMLP(**args, device="cpu")
    depth = len(mlp.widths) - 1
    biases = args["biases"] if args["biases"] is not None else [None] * depth
    ref = _reference_with_core_activations(x, args["weights"], biases, mlp.activations)
    tol = 2e-3 if y.dtype == np.float16 else 1e-4
    if y.dtype == np.float16:  # the output dtype's own range: past 65504 the right float16 answer is inf
        with np.errstate(over="ignore"):
            ref = ref.astype(np.float16).astype(np.float64)
    finite = np.abs(ref[np.isfinite(ref)])
    np.testing.assert_allclose(np.atleast_2d(y).astype(np.float64), ref, rtol=tol,
                               atol=tol * (1 + finite.max(initial=0)), equal_nan=True)


def _reference_with_core_activations(x, weights, biases, activations):
    # Activations here may be any expression the grammar accepts, so the core's float64 evaluator applies them (it is
    # checked against hand-written NumPy in test_cpu_path.py); the linear algebra is NumPy's.
    h = np.atleast_2d(np.asarray(x)).astype(np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        for w, b, act in zip(weights, biases, activations):
            h = h @ np.asarray(w).astype(np.float32).astype(np.float64).T
            if b is not None:
                h = h + np.asarray(b).astype(np.float32).astype(np.float64)
            h = _core.eval_expr(act, np.ascontiguousarray(h.ravel())).reshape(h.shape)
            h = h.astype(np.float32).astype(np.float64)
    return h


# ------------------------------------------------------------------------------------------------ regressions

class _HalfTensor:
    """Looks like a torch tensor (detach, cpu) but cannot become an array."""

    def detach(self):
        return self

    def cpu(self):
        return self


W2 = [np.full((4, 3), 0.25, np.float32), np.full((2, 4), -0.5, np.float32)]


@pytest.mark.parametrize("error, field, call", [
    # each of these once let a NumPy or CPython exception escape instead of a FusedMLPError
    (ArgumentError, "device=", lambda: FusedMLP(W2, device=np.array(["cpu", "cuda"]))),  # ValueError: truth value
    (ArgumentError, "device=", lambda: FusedMLP(W2, device="cuda:99999999999999999999")),  # OverflowError on use
    (ArgumentError, "check=", lambda: FusedMLP(W2, device="cpu", check=np.array([1, 0]))),  # ValueError
    (ArgumentError, "cache_dir=", lambda: FusedMLP(W2, device="cpu", cache_dir=5)),  # TypeError from pathlib
    (ArgumentError, "cache_dir=", lambda: FusedMLP(W2, device="cpu", cache_dir="/tmp/a\0b")),  # ValueError on put
    (ArgumentError, "cache_dir=", lambda: FusedMLP(W2, device="cpu", cache_dir="")),  # was the current folder
    (ExpressionError, "activation", lambda: FusedMLP(W2, activation="x\udc80", device="cpu")),  # UnicodeEncodeError
    (ShapeError, "x could not be read", lambda: FusedMLP(W2, device="cpu")([[1, 2, 3], [1, 2]])),  # ValueError
    (ArgumentError, "arch=", lambda: FusedMLP(W2, device="cpu").compile("sm_99999999999999999999")),  # OverflowError
    (ArgumentError, "arch=", lambda: FusedMLP(W2, device="cpu").compile(10**30)),  # OverflowError
    (DTypeError, "io_dtype=", lambda: FusedMLP(W2, device="cpu").compile("sm_80", io_dtype="foo")),  # TypeError
    (DTypeError, "weights[0] could not be read", lambda: FusedMLP([_HalfTensor()], device="cpu")),  # AttributeError
    (ExpressionError, "activation (unused", lambda: FusedMLP(W2[:1], activation="reluu", device="cpu")),  # ignored
])
def test_inputs_that_once_escaped_as_foreign_exceptions(error, field, call):
    raises(error, field, call)


def test_long_non_ascii_expression_reports_a_column_in_characters():
    text = "\u00e9" * 2100  # 4200 UTF-8 bytes: past the 4096-byte limit at character 2049
    error = raises(ExpressionError, "longer than 4096", FusedMLP, W2, activation=text, device="cpu")
    assert error.column == 2049 and error.expression == text


def test_big_endian_inputs_are_read_by_value():
    x = np.random.default_rng(3).uniform(-1, 1, (5, 3))
    mlp = FusedMLP(W2, device="cpu")
    for dtype in (">f4", ">f8", ">f2"):
        y = mlp(x.astype(dtype))
        assert y.dtype == np.dtype(dtype).newbyteorder("=")
        np.testing.assert_array_equal(y, mlp(x.astype(np.dtype(dtype).newbyteorder("="))))
