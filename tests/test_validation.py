"""Bad input raises the documented class (fusedmlp.errors) with a message naming the field, the value and the rule.

No GPU needed: construction validates everything on the CPU path, and compile() plans for a named architecture
without a device.
"""

import os
import re

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from fusedmlp.errors import (ArgumentError, DTypeError, ExpressionError, FusedMLPError, LimitError, ShapeError)
from conftest import graph_weights, rel_l2, torch_init


@pytest.fixture
def net(rng):
    ws, bs = torch_init(rng, [3, 4, 5], True)
    return ws, bs


def make(weights, biases=None, activation="relu", output_activation=None, **kwargs):
    return fusedmlp.FusedMLP(weights, biases, activation, output_activation, device="cpu", **kwargs)


# ------------------------------------------------------------------------------------------------ the classes


def test_error_classes_derive_from_the_builtin_a_user_expects():
    for cls in (ArgumentError, ShapeError, ExpressionError, LimitError):
        assert issubclass(cls, ValueError) and issubclass(cls, FusedMLPError)
    assert issubclass(DTypeError, TypeError) and issubclass(DTypeError, FusedMLPError)
    for cls in (fusedmlp.LibraryNotFoundError, fusedmlp.CompileError, fusedmlp.CudaError, fusedmlp.TemplateError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, FusedMLPError)


def test_a_caller_catching_value_error_sees_fusedmlp_errors(net):
    ws, bs = net
    with pytest.raises(ValueError, match="weights is empty"):
        make([])
    with pytest.raises(TypeError, match="has dtype complex128"):
        make([np.ones((2, 2), complex)])


# ------------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("weights", [np.ones((4, 3), np.float32), {"net.0.weight": np.ones((4, 3))}, "weights", 3],
                         ids=["ndarray", "dict", "str", "int"])
def test_weights_must_be_a_list(weights):
    with pytest.raises(ArgumentError, match=r"weights must be a list of \(out_features, in_features\) arrays"):
        make(weights)


def test_empty_weights():
    with pytest.raises(ArgumentError, match="weights is empty; a network needs at least one layer"):
        make([])


def test_ragged_weights_are_a_shape_error():
    with pytest.raises(ShapeError, match=r"weights\[0\] could not be read as an array: .*inhomogeneous"):
        make([[[1.0, 2.0], [3.0]]])


@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), ()])
def test_weights_must_be_two_dimensional(rng, shape):
    w = rng.standard_normal(shape).astype(np.float32)
    with pytest.raises(ShapeError, match=re.escape(f"weights[0] has shape {shape}; it must have 2 dimensions "
                                                   "(out_features, in_features)")):
        make([w])


@pytest.mark.parametrize("array, dtype", [
    (np.array([[1.0, None]], dtype=object), "object"),
    (np.array([["a", "b"]]), "<U1"),
    (np.ones((2, 2), np.complex64), "complex64"),
    (np.ones((2, 2), bool), "bool"),
], ids=["object", "str", "complex", "bool"])
def test_weights_must_be_real_numbers(rng, array, dtype):
    ws, _ = torch_init(rng, [2, 2, 2], False)
    with pytest.raises(DTypeError, match=rf"weights\[1\] has dtype {dtype}; weights and biases must be real numbers"):
        make([ws[0], array])


def test_integer_weights_are_accepted_as_numbers(rng):
    w = rng.integers(-3, 4, (4, 3))
    x = rng.standard_normal((6, 3)).astype(np.float32)
    y = make([w], activation=[], output_activation="none")(x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_name_the_index(net, bad):
    ws, bs = net
    w = ws[1].copy()
    w[2, 3] = bad
    with pytest.raises(ArgumentError, match=rf"weights\[1\] holds a non-finite value {bad} at index \(2, 3\)"):
        make([ws[0], w], bs)


def test_a_finite_weight_beyond_float32_is_non_finite_after_conversion(net):
    ws, bs = net
    w = ws[0].astype(np.float64)
    w[1, 2] = 1e39
    with pytest.raises(ArgumentError, match=r"weights\[0\] holds a non-finite value inf at index \(1, 2\) \(after "
                                            r"conversion to float32\)"):
        make([w, ws[1]], bs)


def test_non_finite_bias_names_the_index(net):
    ws, bs = net
    b = bs[1].copy()
    b[4] = np.nan
    with pytest.raises(ArgumentError, match=r"biases\[1\] holds a non-finite value nan at index \(4,\)"):
        make(ws, [bs[0], b])


def test_chain_mismatch_names_both_layers_and_shapes(rng):
    ws, _ = torch_init(rng, [3, 4, 5], False)
    bad = rng.standard_normal((7, 6)).astype(np.float32)
    with pytest.raises(ShapeError, match=re.escape("weights[2] has shape (7, 6) but weights[1] has shape (5, 4): "
                                                   "layer 2 takes 6 input features while layer 1 produces 5")):
        make(ws + [bad])


def test_empty_dimension(rng):
    with pytest.raises(ShapeError, match=re.escape("weights[0] has shape (0, 3); every dimension must be >= 1")):
        make([np.ones((0, 3), np.float32)])


# ------------------------------------------------------------------------------------------------ biases


def test_bias_of_the_wrong_length(net, rng):
    ws, bs = net
    with pytest.raises(ShapeError, match=re.escape("biases[1] has 3 elements; layer 1 has 5 outputs "
                                                   "(weights[1].shape[0])")):
        make(ws, [bs[0], rng.standard_normal(3).astype(np.float32)])


def test_bias_must_be_one_dimensional(net, rng):
    ws, bs = net
    with pytest.raises(ShapeError, match=re.escape("biases[0] has shape (1, 4); it must have 1 dimension")):
        make(ws, [rng.standard_normal((1, 4)), bs[1]])


@pytest.mark.parametrize("biases", [[None], [None, None, None], np.ones(4), "bias"],
                         ids=["short", "long", "ndarray", "str"])
def test_biases_list_of_the_wrong_length(net, biases):
    ws, _ = net
    with pytest.raises(ArgumentError, match=r"biases must be None or a list of 2 entries \(an array or None per "
                                            r"layer\)"):
        make(ws, biases)


def test_bias_of_strings(net):
    ws, bs = net
    with pytest.raises(DTypeError, match=r"biases\[0\] has dtype <U3"):
        make(ws, ["abc", bs[1]])


# ------------------------------------------------------------------------------------------------ activations


def test_unknown_activation_points_at_it(net):
    ws, bs = net
    with pytest.raises(ExpressionError, match=r"activation of layer 0: unknown name 'relux' at column 1; known "
                                              r"functions: abs, .*, softsign") as info:
        make(ws, bs, "relux")
    assert info.value.column == 1 and info.value.expression == "relux"
    assert str(info.value).splitlines()[1:] == ["    relux", "    ^"]


def test_unknown_name_later_in_an_expression(net):
    ws, bs = net
    with pytest.raises(ExpressionError, match=r"activation of layer 1: unknown name 'Tanh' at column 5") as info:
        make(ws, bs, "relu", "x * Tanh(x)")
    assert info.value.column == 5
    lines = str(info.value).splitlines()
    assert lines[0].endswith("(names are case-sensitive: did you mean 'tanh'?)")
    assert lines[1:] == ["    x * Tanh(x)", "        ^"]
    assert info.value.hint == "names are case-sensitive: did you mean 'tanh'?"


@pytest.mark.parametrize("text, message, column", [
    ("relu(x", r"expected '\)' to close '\(' at column 5, found end of expression at column 7", 7),
    ("(x + 1", r"expected '\)' to close '\(' at column 1", 7),
    ("x)", r"unexpected '\)' at column 2: it closes no '\('", 2),
    ('x); asm("trap"); (', r"unexpected '\)' at column 2: it closes no '\('", 2),
    ("#include <x>", r"unexpected character '#' at column 1", 1),
    ("x; y", r"unexpected character ';' at column 2", 2),
    ("2x", r"malformed number '2x' at column 1", 1),
    ("0x1f * x", r"malformed number '0x1f' at column 1", 1),
    ("1e40 * x", r"number '1e40' at column 1 is beyond float32 range", 1),
    ("", r"empty expression", 1),
    ("   ", r"empty expression", 1),
    ("tanh(x, 1)", r"'tanh' takes 1 argument, got 2 \(at column 1\)", 1),
    ("softplus(x, 1, 2, 3)", r"'softplus' takes 1 to 3 arguments, got 4", 1),
    ("hardtanh(x, 2, -2)", r"'hardtanh' at column 1 has min 2 greater than max -2", 1),
    ("x(2)", r"'x' at column 1 is not a function", 1),
    ("x * relu", r"function 'relu' at column 5 needs its arguments", 5),
    ("max", r"function 'max' at column 1 needs its arguments", 1),
    ("x +", r"expected a number, x, a function call or '\(' at column 4, found end of expression", 4),
    ("x ** 2", r"expected a number, x, a function call or '\(' at column 4, found '\*'", 4),
    ("x\u00e9", r"unexpected byte 0xC3 at column 2", 2),
])
def test_bad_expressions_say_what_and_where(net, text, message, column):
    ws, bs = net
    with pytest.raises(ExpressionError, match="activation of layer 0: " + message) as info:
        make(ws, bs, text)
    assert info.value.column == column
    assert info.value.expression == text
    lines = str(info.value).splitlines()
    assert lines[-2:] == ["    " + text, " " * (4 + column - 1) + "^"]  # the caret line ends the message


def test_embedded_nul_is_an_error_not_a_truncation(net):
    # The C core reads text up to the first NUL: "x\0..." must not quietly become "x".
    ws, bs = net
    with pytest.raises(ExpressionError, match="activation holds a NUL character at column 2") as info:
        make(ws, bs, "x\0; asm(\"trap\")")
    assert info.value.column == 2
    with pytest.raises(ExpressionError, match=r"output_activation holds a NUL character at column 5"):
        make(ws, bs, "relu", "tanh\0")
    with pytest.raises(ExpressionError, match=r"activation\[0\] holds a NUL character at column 1"):
        make(ws, bs, ["\0relu"], "none")


def test_very_long_expression(net):
    ws, bs = net
    text = "x" + " + x" * 1100
    with pytest.raises(ExpressionError, match="expression is longer than 4096 characters"):
        make(ws, bs, text)


@pytest.mark.parametrize("text, message", [
    ("(" * 200 + "x" + ")" * 200, "expression nests more than 130 levels deep"),
    ("-" * 100 + "x", "expression nests more than 64 operations deep"),
    ("x" + "+x" * 100, "expression nests more than 64 operations deep"),
    ("tanh(" * 70 + "x" + ")" * 70, "expression nests more than 64"),
])
def test_deeply_nested_expression(net, text, message):
    ws, bs = net
    with pytest.raises(ExpressionError, match=message):
        make(ws, bs, text)


def test_nesting_just_inside_the_limit_works(net, rng):
    ws, bs = net
    text = "tanh(" * 30 + "x" + ")" * 30
    mlp = make(ws, bs, text)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    assert np.all(np.isfinite(mlp(x)))


@pytest.mark.parametrize("kwargs, field", [
    (dict(activation=3), "activation=3"),
    (dict(activation=None), "activation=None"),
    (dict(activation=b"relu"), "activation=b'relu'"),
    (dict(activation="relu", output_activation=1.5), "output_activation=1.5"),
    (dict(activation=["relu", "tanh", "gelu"]), None),  # a list of the wrong length is a count error
    (dict(activation=[np.str_("relu"), 0]), "activation[1]=0"),
], ids=["int", "None", "bytes", "output", "list-count", "list-entry"])
def test_activation_must_be_text(net, kwargs, field):
    ws, bs = net
    if field is None:
        with pytest.raises(ArgumentError, match="activation has 3 entries; the network has 2 layers"):
            make(ws, bs, **kwargs)
        return
    with pytest.raises(ArgumentError, match=re.escape(field) + " must be a string: a built-in name such as 'relu'"):
        make(ws, bs, **kwargs)


# ------------------------------------------------------------------------------------------------ x


def test_x_with_the_wrong_feature_count(net, rng):
    mlp = make(*net)
    with pytest.raises(ShapeError, match=re.escape("x has shape (4, 5); the network takes (batch, 3) (or (3,) for "
                                                   "one row, or (..., 3) with more leading dimensions)")):
        mlp(rng.standard_normal((4, 5)).astype(np.float32))
    with pytest.raises(ShapeError, match=re.escape("x has shape (2,); the network takes (batch, 3)")):
        mlp(rng.standard_normal(2).astype(np.float32))


@pytest.mark.parametrize("shape", [(), (2, 4, 5), (2, 0)])
def test_x_of_the_wrong_rank_or_width(net, rng, shape):
    mlp = make(*net)
    with pytest.raises(ShapeError, match=re.escape(f"x has shape {shape}; the network takes (batch, 3)")):
        mlp(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("shape", [(2, 4, 3), (1, 1, 3), (3, 0, 3), (2, 1, 5, 3)])
def test_x_with_leading_dimensions_keeps_them_as_nn_linear_does(net, rng, shape):
    """(..., in) in, (..., out) out, each row the 2-D call's (float32 and float16, out= too): a NeRF batch of
    (rays, samples, features) needs no reshape."""
    mlp = make(*net)
    for dtype in (np.float32, np.float16):
        x = rng.standard_normal(shape).astype(dtype)
        y = mlp(x)
        flat = mlp(x.reshape(-1, 3))
        assert y.shape == shape[:-1] + (flat.shape[1],) and y.dtype == dtype
        np.testing.assert_array_equal(y.reshape(flat.shape), flat)
        out = np.full_like(y, np.nan)
        assert mlp(x, out=out) is out
        np.testing.assert_array_equal(out, y)
        with pytest.raises(ShapeError, match="out has shape"):
            mlp(x, out=np.empty(flat.shape, dtype))


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64, object, np.int64, np.uint8, bool, "<U3"])
def test_x_of_a_dtype_that_is_not_float(net, rng, dtype):
    mlp = make(*net)
    x = np.asarray(rng.standard_normal((4, 3))).astype(dtype)
    with pytest.raises(DTypeError, match=re.escape(f"x has dtype {np.dtype(dtype)}; it must be float32, float16, "
                                                   "bfloat16 (ml_dtypes) or float64")):
        mlp(x)


# ------------------------------------------------------------------------------------------------ device


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "CPU", "cuda:0:1", "", 3, None, 1.0])
def test_bad_device(net, device):
    ws, bs = net
    with pytest.raises(ArgumentError, match=re.escape(f"device={device!r} is not one of 'auto', 'cpu', 'cuda' or "
                                                      "'cuda:N'")):
        fusedmlp.FusedMLP(ws, bs, device=device)


def test_evaluate_fused_mlp_validates_the_same_way(net, rng):
    ws, bs = net
    x = rng.standard_normal((4, 3)).astype(np.float32)
    with pytest.raises(ArgumentError, match="device='gpu' is not one of"):
        fusedmlp.evaluate_fused_mlp(x, ws, bs, device="gpu")
    with pytest.raises(ShapeError, match=re.escape("x has shape (4, 3); the network takes (batch, 4)")):
        fusedmlp.evaluate_fused_mlp(x, [ws[1]], [bs[1]], device="cpu")


# ------------------------------------------------------------------------------------------------ limits


@pytest.mark.parametrize("widths, layer, count, side, arch", [
    ([8, 257, 4], 0, 257, "output", 80),
    ([300, 16, 4], 0, 300, "input", 80),
    ([4, 64, 64, 1000], 2, 1000, "output", 90),
    ([4, 64, 64, 600], 2, 600, "output", 90),
])
def test_width_over_the_limit_is_segmented_at_compile(rng, tmp_path, widths, layer, count, side, arch):
    """One fused kernel holds 256 features a layer, 512 on sm_90a (the streamed warpgroup kernel); past that its
    plan says so, naming the layer, and the network is cut into segments, the wide layer a GEMM, and compiles."""
    ws, bs = torch_init(rng, widths, True)
    mlp = make(ws, bs, "tanh", cache_dir=tmp_path)
    most = 512 if arch == 90 else 256
    with pytest.raises(LimitError, match=rf"layer {layer} has {count} {side} features; the fused kernels hold at "
                                         rf"most {most} features per layer"):
        mlp._net.plan(arch, 232448 if arch == 90 else 166912)
    paths = mlp.compile(f"sm_{arch}")
    assert isinstance(paths, tuple) and len(paths) >= 2 and all(os.path.isfile(p) for p in paths)
    if arch == 90:  # (a model on the CPU describes its sm_90 cut)
        assert any(line.startswith(f"layer {layer}: gemm") for line in mlp.segments)
    # The CPU path itself takes the wide network.
    x = rng.standard_normal((10, widths[0])).astype(np.float32)
    y = mlp(x)
    assert y.shape == (10, widths[-1]) and np.all(np.isfinite(y))
    h = x.astype(np.float64)
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w.astype(np.float64).T + b
        h = np.tanh(h) if i < len(ws) - 1 else h
    assert rel_l2(y, h) <= 1e-5


@pytest.mark.parametrize("widths", [[8, 257, 4], [300, 16, 4], [4, 512, 512, 4]])
def test_width_up_to_512_is_one_streamed_kernel_on_sm_90(rng, tmp_path, widths):
    """On sm_90a a network with layers 257-512 wide is one kernel, the streamed warpgroup form (its wide layers'
    outputs through shared memory, their weights in K pieces), not segments."""
    ws, bs = torch_init(rng, widths, True)
    mlp = make(ws, bs, "tanh", cache_dir=tmp_path)
    plan = mlp._net.plan(90, 232448, 132, smem_per_sm=233472)
    assert plan.info["wgmma"] == 1 and plan.info["stream_slots"] >= 2 and not plan.info["resident"], plan.info
    path = mlp.compile("sm_90")
    assert isinstance(path, str) and os.path.isfile(path)
    assert mlp.segments is None or len(mlp.segments) <= 1, mlp.segments


def test_a_wide_layer_past_the_registers_is_named_and_cut_out(rng):
    """sdf512's concat layer (x's 259 features beside 512: 784 inputs) needs more registers than a thread has in the
    streamed kernel: the plan names the layer and its inputs, and the network is cut around it (a GEMM there)."""
    widths = [259] + [512] * 8 + [1]
    ws, bs = graph_weights(rng, widths, {4: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat={4: "before"}, device="cpu")
    with pytest.raises(LimitError, match=r"layer \d needs about \d+ registers per thread in the streamed warpgroup "
                                         r"kernel, over the 255 a thread has: .*x's fragments \(259 features\) kept for "
                                         r"layer 4's input concat"):
        mlp._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, wgmma=1, resident=0)
    assert [line.split(":")[0] for line in mlp.segments] == ["layers 0-3", "layer 4", "layers 5-8"]
    assert "outputs of 3 wide layers through shared memory" in mlp.segments[0]
    with pytest.raises(ValueError, match=r"k_chunk=-3: the streamed kernel's K inputs per slot fill"):
        mlp._net.plan(90, 232448, 132, wgmma=1, resident=0, k_chunk=-3)


def test_the_streamed_plan_says_which_layers_are_wide(rng):
    ws, bs = torch_init(rng, [8, 300, 64], True)
    info = make(ws, bs, "tanh")._net.plan(90, 232448, 132, smem_per_sm=233472).info
    assert info["stream_slots"] >= 2 and info["wide_layers"] == (0,)
    assert info["k_chunk"][0] == 16 and 16 <= info["k_chunk"][1] < 304 and info["k_chunk"][1] % 16 == 0


def test_width_256_is_within_the_limit(rng):
    ws, bs = torch_init(rng, [256, 256, 256], True)
    assert make(ws, bs).compile("sm_90", "float16") is not None


def test_more_than_max_layers_is_a_limit_error(rng):
    limit = _core.MAX_LAYERS
    ws, bs = torch_init(rng, [4] * (limit + 2), True)
    with pytest.raises(LimitError, match=f"weights has {limit + 1} layers; at most {limit} fit one fused kernel"):
        make(ws, bs)
    deepest = make(ws[:limit], bs[:limit], "tanh")  # exactly the limit is fine
    assert len(deepest.widths) == limit + 1
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert deepest(x).shape == (3, 4)


@pytest.mark.parametrize("arch", ["sm_61", "sm_70", 52, "sm_91"])
def test_compile_for_an_unsupported_arch_lists_the_supported(net, arch):
    number = int(str(arch).replace("sm_", ""))
    with pytest.raises(ArgumentError, match=rf"arch sm_{number} is not supported; .*sm_75 or newer\): sm_75, sm_80, "
                                            r"sm_86, sm_87, sm_89, sm_90"):
        make(*net).compile(arch)


@pytest.mark.parametrize("arch", ["banana", "sm_", "sm_9x", "", None, 9.0, True])
def test_compile_for_something_that_is_not_an_arch(net, arch):
    with pytest.raises(ArgumentError, match=re.escape(f"arch={arch!r} is not an architecture; write it as 'sm_90' "
                                                      "(or 90)")):
        make(*net).compile(arch)


@pytest.mark.parametrize("dtype", ["float64", "int8", np.float64])
def test_compile_for_a_dtype_the_kernel_does_not_serve(net, dtype):
    with pytest.raises(DTypeError, match=rf"io_dtype=.*: a kernel reads and writes float32, float16 or bfloat16"):
        make(*net).compile("sm_90", dtype)


def test_nothing_is_written_for_a_rejected_model(tmp_path, net):
    ws, bs = net
    with pytest.raises(ExpressionError):
        fusedmlp.FusedMLP(ws, bs, 'x); asm("trap"); (', device="cpu", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
