"""Low-bit inference (issue 26), no GPU needed: int8 and float8 (e4m3) models, their scales, calibration, the CPU
path's emulation of the kernels' quantisation, saving, errors, and (with NVRTC) the 8-bit kernels' rendering and
ahead-of-time compiles for sm_80 / sm_89 / sm_90a.

The emulation is checked against an independent NumPy one written here from the rules in csrc/fm.h (fm_quant8):
int8 clamps to [-127, 127] and rounds to nearest even; e4m3 rounds to nearest even with 3 mantissa bits, subnormals
in steps of 2^-9, saturating at 448.
"""

import re
import warnings

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from fusedmlp.errors import ArgumentError, DTypeError, LimitError, ShapeError
from conftest import graph_weights, rel_l2, torch_init
from test_gpu import random_graph as gpu_graph

LOWBIT = fusedmlp.LOWBIT_PRECISIONS
QMAX = {"int8": 127.0, "float8": 448.0}
TINY = float(np.finfo(np.float32).tiny)


# ------------------------------------------------------------------------------------------------ NumPy emulation


def e4m3_round(v):
    """Nearest e4m3 value of each float (ties to even), saturating to +-448; NaN stays NaN."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    r = np.round(a / step) * step  # numpy rounds half to even
    r = np.where(a >= 448.0, 448.0, r)
    return np.where(np.isnan(v), np.nan, np.copysign(r, v))


def int8_round(v):
    return np.round(np.clip(np.asarray(v, dtype=np.float64), -127, 127))


def code_round(v, dtype):
    return int8_round(v) if dtype == "int8" else e4m3_round(v)


def fake_quant(v, scale, dtype):
    """v stored with `scale` and read back: the product with the float32 inverse is a float32 one."""
    inv = np.float32(1) / np.float32(scale)
    return code_round(np.asarray(v, dtype=np.float32) * inv, dtype) * np.float64(np.float32(scale))


def weight_scales(w, dtype):
    amax = np.max(np.abs(w.astype(np.float64)), axis=1)
    s = (amax / QMAX[dtype]).astype(np.float32)
    return np.where(amax == 0, np.float32(1), np.maximum(s, np.float32(TINY)))


def emulate(x, ws, bs, mlp, dtype, act_scales):
    """The 8-bit network in float64: x and every value between layers as code * scale, weights as code * w_scale."""
    def act(text, y):
        return _core.eval_expr(text, np.ascontiguousarray(y.ravel())).reshape(y.shape)

    wq = []
    for w in ws:
        s = weight_scales(w, dtype)
        codes = code_round((w.astype(np.float64) / s[:, None].astype(np.float64)).astype(np.float32), dtype)
        wq.append((codes * s[:, None].astype(np.float64)).astype(np.float32).astype(np.float64))
    x0 = fake_quant(x, act_scales[0], dtype)
    values, h = {-1: x0}, x0
    last = len(ws) - 1
    for l, (w, b, text) in enumerate(zip(wq, bs, mlp.activations)):
        cat = mlp._concat[l]
        inp = h if not cat else np.concatenate([h, x0] if cat == 1 else [x0, h], 1)
        y = act(text, inp @ w.T + (0 if b is None else b.astype(np.float64)))
        res = mlp._residual[l]
        if res is not None:
            r = values[res[2]]
            y = act(res[1], y + r if res[0] == 1 else y * r)
        y = y.astype(np.float32).astype(np.float64)
        h = values[l] = y if l == last else fake_quant(y, act_scales[l + 1], dtype)
    return h


def float_reference(x, ws, bs, mlp):
    return mlp._net.forward_cpu(np.asarray(x, dtype=np.float32), quantised=False).astype(np.float64)


def random_graph(rng):
    """test_gpu's random graph with at most six layers and no mish (the draws the README's accuracy table was made
    from): residuals from the layer's input, earlier layers and x, concats."""
    return gpu_graph(rng, max_depth=6, hidden_acts=("relu", "gelu", "tanh", "silu", "sigmoid", "none"))


def calibrated(rng, dtype, widths=(8, 64, 64, 4), rows=256, **kwargs):
    ws, bs = torch_init(rng, list(widths))
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", dtype=dtype, device="cpu", **kwargs)
    x = rng.standard_normal((rows, widths[0])).astype(np.float32)
    return mlp.calibrate(x), ws, bs, x


# ------------------------------------------------------------------------------------------------ the codes


def test_e4m3_codes_round_to_nearest_even_and_saturate_as_the_emulation_says():
    values = np.concatenate([np.linspace(-500, 500, 20001), np.geomspace(1e-4, 460, 5001),
                             -np.geomspace(1e-4, 460, 5001), [0.0, 2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875,
                                                              464.0, 480.0, 1e30, np.inf, -np.inf]]).astype(np.float32)
    got = np.array([_core.Network.quant8_value(float(v), "float8") for v in values])
    want = e4m3_round(values)
    assert np.array_equal(got, want), values[np.flatnonzero(got != want)[:5]]
    # 2^-10 is halfway between 0 and the smallest subnormal 2^-9: even (0); 3 * 2^-10 halfway to 2^-8: even (2^-8);
    # 1.0625 halfway between 1 and 1.125: even (1); 1.1875 between 1.125 and 1.25: even (1.25).
    assert [_core.Network.quant8_value(v, "float8") for v in (2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875)] == \
        [0.0, 2.0 ** -8, 1.0, 1.25]
    assert _core.Network.quant8_value(1e30, "float8") == 448.0
    assert _core.Network.quant8_value(-np.inf, "float8") == -448.0
    assert np.isnan(_core.Network.quant8_value(np.nan, "float8"))


def test_int8_codes_round_half_to_even_and_clamp_to_127():
    values = np.concatenate([np.arange(-140, 140, 0.25), [0.5, 1.5, 2.5, -0.5, -2.5, 1e9, -1e9]]).astype(np.float32)
    got = np.array([_core.Network.quant8_value(float(v), "int8") for v in values])
    assert np.array_equal(got, int8_round(values))
    assert _core.Network.quant8_value(-200.0, "int8") == -127.0  # symmetric: -128 is never produced


def test_the_kernels_int8_arithmetic_without_conversions_is_cvt_rni_and_exact():
    """fm_common.cuh / fused_mlp.cu, replayed in float32: after the clamp, adding 1.5 * 2^23 rounds to nearest even
    and leaves the code in the low byte (as cvt.rni + masking did); a code c, as c ^ 0x80 in that constant's low byte,
    minus (1.5 * 2^23 + 128) is c (as I2F did); an s32 sum s started at the constant's bits reads as the float
    1.5 * 2^23 + s for |s| <= 127^2 * 256 (fm_acc_magic), minus the constant is s (as I2FP did)."""
    magic = np.float32(12582912.0)
    rng = np.random.default_rng(3)
    halves = (np.arange(-300, 301) + 0.5).astype(np.float32)
    v = np.concatenate([rng.uniform(-300, 300, 1_000_000).astype(np.float32), halves,
                        np.nextafter(halves, np.float32(np.inf)), np.nextafter(halves, np.float32(-np.inf)),
                        np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45], np.float32)])
    t = np.fmin(np.fmax(v, np.float32(-127)), np.float32(127))
    assert np.array_equal((t + magic).view(np.uint32) & 0xFF, int8_round(v).astype(np.int32) & 0xFF)
    codes = np.arange(256, dtype=np.uint32)
    value = (np.uint32(0x4B400000) | (codes ^ 0x80)).view(np.float32) - np.float32(12582912.0 + 128.0)
    assert np.array_equal(value, codes.astype(np.uint8).view(np.int8).astype(np.float32))
    s = np.arange(-127 * 127 * 256, 127 * 127 * 256 + 1, 997, dtype=np.int64)
    s = np.concatenate([s, [-127 * 127 * 256, 127 * 127 * 256, -1, 0, 1]])
    assert np.array_equal((s + 0x4B400000).astype(np.uint32).view(np.float32) - magic, s.astype(np.float32))
    assert 127 * 127 * 256 < 2**22 <= 127 * 127 * 288  # K <= 256 (no concat) takes the constant, wider K the I2FP


# ------------------------------------------------------------------------------------------------ scales


@pytest.mark.parametrize("dtype", LOWBIT)
def test_weight_scales_are_per_output_channel_amax_over_the_largest_code(rng, dtype):
    ws, bs = torch_init(rng, [20, 48, 5])
    ws[0][3] = 0.0  # an all-zero (pruned) channel: scale 1, codes 0, never a division by zero
    ws[1][2] = 1e-40  # float32 denormals: the scale is held at float32's smallest normal
    mlp = fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu")
    got = mlp.weight_scales
    for w, s in zip(ws, got):
        assert s.dtype == np.float32 and s.shape == (w.shape[0],)
        assert np.array_equal(s, weight_scales(w, dtype))
    assert got[0][3] == 1.0 and got[1][2] == np.float32(TINY)
    assert mlp.act_scales is None


@pytest.mark.parametrize("dtype", LOWBIT)
def test_calibrate_scales_each_layer_input_by_its_amax_on_the_sample(rng, dtype):
    mlp, ws, bs, x = calibrated(rng, dtype)
    h0 = np.maximum(x @ ws[0].T.astype(np.float64) + bs[0], 0)
    h1 = np.maximum(h0.astype(np.float32) @ ws[1].T.astype(np.float64) + bs[1], 0)
    want = [np.abs(x).max(), np.abs(h0.astype(np.float32)).max(), np.abs(h1.astype(np.float32)).max()]
    want = np.array(want, dtype=np.float64) / QMAX[dtype]
    np.testing.assert_allclose(mlp.act_scales, want, rtol=1e-6)
    assert mlp.act_scales.dtype == np.float32
    assert 0 < mlp.calibration_error <= fusedmlp.CHECK_TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_concat_layer_shares_the_network_inputs_scale(rng, dtype):
    ws, bs = graph_weights(rng, [6, 40, 40, 3], {2: "after"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat={2: "after"}, dtype=dtype, device="cpu")
    x = rng.standard_normal((300, 6)).astype(np.float32) * 9  # x's range larger than layer 1's output
    amax = mlp._net.amax(x)
    mlp.calibrate(x)
    s = mlp.act_scales
    assert s[0] == s[2] == np.float32(max(amax[0], amax[2]) / QMAX[dtype])
    assert s[1] == np.float32(amax[1] / QMAX[dtype])


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_layer_dead_on_the_sample_gets_a_unit_range_and_a_warning_naming_it(rng, dtype):
    ws, bs = torch_init(rng, [4, 16, 16, 2])
    bs[0][:] = -100.0  # relu(W x - 100) is zero for every sample row
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", dtype=dtype, device="cpu")
    with pytest.warns(RuntimeWarning, match="layer 0's output is zero on every row"):
        mlp.calibrate(rng.standard_normal((64, 4)).astype(np.float32))
    assert mlp.act_scales[1] == np.float32(1.0 / QMAX[dtype])
    assert np.all(np.isfinite(mlp(rng.standard_normal((9, 4)).astype(np.float32))))


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_sample_with_inf_or_nan_is_refused_naming_the_element(rng, dtype):
    mlp = fusedmlp.FusedMLP(*torch_init(rng, [5, 16, 2]), dtype=dtype, device="cpu")
    x = rng.standard_normal((10, 5)).astype(np.float32)
    x[7, 3] = np.inf
    with pytest.raises(ArgumentError, match=r"x_sample\[7, 3\] is inf"):
        mlp.calibrate(x)
    x[7, 3] = np.nan
    with pytest.raises(ArgumentError, match=r"x_sample\[7, 3\] is nan"):
        mlp.calibrate(x)
    assert mlp.act_scales is None  # a refused calibration leaves the model as it was


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_layer_that_overflows_on_the_sample_is_named(rng, dtype):
    ws, bs = torch_init(rng, [3, 8, 2])
    mlp = fusedmlp.FusedMLP(ws, bs, activation="exp(x) * 1e30", dtype=dtype, device="cpu")
    x = np.abs(rng.standard_normal((16, 3))).astype(np.float32) * 100
    with pytest.raises(ArgumentError, match="layer 0's output is infinite on x_sample"):
        mlp.calibrate(x)


def test_a_scale_whose_dequantisation_factor_leaves_float32_is_named(rng):
    ws, bs = torch_init(rng, [3, 8, 2])
    ws[0] *= 1e30
    mlp = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu")
    with pytest.raises(ArgumentError, match=r"layer 0, channel \d+: act_scale .* overflows float32"):
        mlp._set_act_scales([1e15, 1.0])
    with pytest.raises(ArgumentError, match=r"act_scale\[1\] is 0"):
        mlp._set_act_scales([1.0, 0.0])


def test_calibrate_warns_where_the_calibrated_error_exceeds_the_dtypes_bound(rng):
    # y = (x + 1000) - 1000: the hidden values' one scale (1000 / 127) has no code for x's small differences
    ws = [np.array([[1.0], [0.0]], np.float32), np.array([[1.0, -1.0]], np.float32)]
    bs = [np.array([1000.0, 1000.0], np.float32), None]
    mlp = fusedmlp.FusedMLP(ws, bs, activation="none", dtype="int8", device="cpu")
    with pytest.warns(RuntimeWarning, match="over the 0.1 that check=True accepts for int8"):
        mlp.calibrate(rng.uniform(-1, 1, (200, 1)).astype(np.float32))
    assert mlp.calibration_error > fusedmlp.CHECK_TOLERANCES["int8"]


# ------------------------------------------------------------------------------------------------ the CPU path


@pytest.mark.parametrize("dtype", LOWBIT)
def test_cpu_path_computes_the_numpy_emulation_on_random_graphs(dtype):
    rng = np.random.default_rng(26)
    for i in range(30):
        ws, bs, acts, residual, concat = random_graph(rng)
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=dtype, device="cpu")
        mlp.calibrate(rng.standard_normal((128, ws[0].shape[1])).astype(np.float32))
        x = rng.standard_normal((77, ws[0].shape[1])).astype(np.float32)
        want = emulate(x, ws, bs, mlp, dtype, mlp.act_scales)
        got = mlp(x)
        # the same roundings; float64 sums in another order can only flip a code where a value sits on a rounding
        # boundary to within 1e-16, which these draws do not hit
        assert rel_l2(got, want) <= 1e-6, (i, [w.shape for w in ws], acts, residual, concat)


@pytest.mark.parametrize("dtype", LOWBIT)
def test_random_graphs_stay_within_the_check_bound_on_fresh_inputs(dtype):
    """The quantisation error against the float network (relative L2) on inputs the calibration did not see: what
    the README's table reports and what check=True accepts."""
    rng = np.random.default_rng(2026)
    errors = []
    for i in range(60):
        ws, bs, acts, residual, concat = random_graph(rng)
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=dtype, device="cpu")
        mlp.calibrate(rng.standard_normal((512, ws[0].shape[1])).astype(np.float32))
        x = rng.standard_normal((1000, ws[0].shape[1])).astype(np.float32)
        errors.append(rel_l2(mlp(x), float_reference(x, ws, bs, mlp)))
    print(f"\n{dtype}: median {np.median(errors):.2e}, max {max(errors):.2e}")
    assert max(errors) <= fusedmlp.CHECK_TOLERANCES[dtype]
    assert np.median(errors) <= fusedmlp.CHECK_TOLERANCES[dtype] / 2


def test_int8_is_closer_than_float8_and_both_further_than_float16_on_a_relu_mlp(rng):
    ws, bs = torch_init(rng, [32, 128, 128, 128, 16])
    x = rng.standard_normal((2000, 32)).astype(np.float32)
    errs = {}
    for dtype in LOWBIT:
        mlp = fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu").calibrate(x[:500])
        errs[dtype] = rel_l2(mlp(x[500:]), float_reference(x[500:], ws, bs, mlp))
    # int8 keeps 1/127 of the range everywhere; e4m3 3 mantissa bits (a relative step of 1/16 to 1/8)
    assert 1e-3 < errs["int8"] < errs["float8"] < 0.1, errs


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_low_bit_call_before_calibrate_says_what_to_call(rng, dtype):
    mlp = fusedmlp.FusedMLP(*torch_init(rng, [4, 16, 2]), dtype=dtype, device="cpu")
    with pytest.raises(ArgumentError, match=rf"dtype='{dtype}' needs an activation scale per layer") as e:
        mlp(rng.standard_normal((3, 4)).astype(np.float32))
    assert "mlp.calibrate(x_sample)" in str(e.value)
    with pytest.raises(ArgumentError, match="calibrate"):
        mlp.compile("sm_90")


@pytest.mark.parametrize("dtype", LOWBIT)
def test_evaluate_fused_mlp_calibrates_on_its_own_batch(rng, dtype):
    ws, bs = torch_init(rng, [6, 32, 3])
    x = rng.standard_normal((50, 6)).astype(np.float32)
    y = fusedmlp.evaluate_fused_mlp(x, ws, bs, dtype=dtype, device="cpu")
    want = fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu").calibrate(x)(x)
    assert np.array_equal(y, want)


def test_calibrate_on_a_16_bit_model_is_refused(rng):
    mlp = fusedmlp.FusedMLP(*torch_init(rng, [4, 16, 2]), device="cpu")
    with pytest.raises(ArgumentError, match="dtype='int8' or 'float8' models; this one computes in float16"):
        mlp.calibrate(np.ones((2, 4), np.float32))


def test_dtype_names_and_bad_samples(rng):
    ws, bs = torch_init(rng, [4, 8, 2])
    names = (("fp8", "float8"), ("e4m3", "float8"), ("torch.float8_e4m3fn", "float8"), ("torch.int8", "int8"))
    for name, want in names:
        assert fusedmlp.FusedMLP(ws, bs, dtype=name, device="cpu")._precision == want
    with pytest.raises(DTypeError, match="int8, float8"):
        fusedmlp.FusedMLP(ws, bs, dtype="int4", device="cpu")
    mlp = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu")
    with pytest.raises(ShapeError, match=r"calibration takes \(rows >= 1, 4\)"):
        mlp.calibrate(np.ones((3, 5), np.float32))
    with pytest.raises(DTypeError, match="x_sample has dtype"):
        mlp.calibrate(np.array([["a"] * 4]))
    one_row = rng.standard_normal(4).astype(np.float32) + 3
    assert mlp.calibrate(one_row) is mlp and mlp.act_scales[0] == np.float32(np.abs(one_row).max() / 127)


@pytest.mark.parametrize("dtype", LOWBIT)
def test_check_true_compares_against_the_float_network(rng, dtype, monkeypatch):
    mlp, ws, bs, x = calibrated(rng, dtype)
    y = mlp(x)
    mlp._verify(x, y)  # the CPU path's own result passes its dtype's bound
    with pytest.raises(fusedmlp.FusedMLPError, match=f"dtype={dtype}"):
        mlp._verify(x, y * 1.5)


# ------------------------------------------------------------------------------------------------ saving, torch


@pytest.mark.parametrize("dtype", LOWBIT)
def test_scales_survive_save_and_from_npz(rng, dtype, tmp_path):
    ws, bs, acts, residual, concat = random_graph(np.random.default_rng(3))
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=dtype, device="cpu")
    mlp.calibrate(rng.standard_normal((64, ws[0].shape[1])).astype(np.float32))
    back = fusedmlp.FusedMLP.from_npz(mlp.save(tmp_path / "m"), device="cpu")
    assert back._precision == dtype
    assert np.array_equal(back.act_scales, mlp.act_scales)
    assert all(np.array_equal(a, b) for a, b in zip(back.weight_scales, mlp.weight_scales))
    x = rng.standard_normal((33, ws[0].shape[1])).astype(np.float32)
    assert np.array_equal(back(x), mlp(x))
    uncalibrated = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=dtype,
                                     device="cpu")
    again = fusedmlp.FusedMLP.from_npz(uncalibrated.save(tmp_path / "u"), device="cpu")
    assert again.act_scales is None


def test_from_torch_calibrates_when_given_a_sample(rng):
    torch = pytest.importorskip("torch")
    from fusedmlp.torch import from_torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
    x = torch.randn(200, 12)
    mlp = from_torch(module, dtype="int8", device="cpu", calibrate=x)
    assert mlp.act_scales is not None and mlp.act_scales[0] == np.float32(x.abs().max().item() / 127)
    with torch.no_grad():
        want = module(x).double().numpy()
    assert rel_l2(mlp(x.numpy()), want) <= fusedmlp.CHECK_TOLERANCES["int8"]
    assert from_torch(module, dtype="int8", device="cpu").act_scales is None


# ------------------------------------------------------------------------------------------------ plans, errors


@pytest.mark.parametrize("dtype,arch", [("int8", 75), ("float8", 80), ("float8", 86)])
def test_an_arch_without_the_instructions_is_a_limit_error_naming_dtype_and_sm(rng, dtype, arch):
    mlp, *_ = calibrated(rng, dtype)
    need = 80 if dtype == "int8" else 89
    with pytest.raises(LimitError, match=rf"dtype='{dtype}' needs Tensor Cores of sm_{need} or newer; the target is "
                                         rf"sm_{arch}"):
        mlp._net.plan(arch, precision=dtype)


@pytest.mark.parametrize("dtype", LOWBIT)
def test_low_bit_plans_pad_to_32_and_pick_their_kernel(rng, dtype):
    """Both run mma.sync below sm_90 and, where their form fits, wgmma on sm_90 (H100: float8 2.6-5.2x faster than its
    mma.sync, which Hopper emulates with float16 HMMAs; int8 1.3-1.6x)."""
    mlp, *_ = calibrated(rng, dtype, widths=(7, 40, 33, 5))
    for arch in (80, 89, 90):
        if arch < (89 if dtype == "float8" else 80):
            continue
        info = mlp._net.plan(arch, precision=dtype).info
        assert info["precision"] == dtype and info["wgmma"] == (arch == 90)
    assert mlp._net.plan(90, precision=dtype, wgmma=0).info["wgmma"] == 0
    assert mlp.segments is None  # one fused kernel where one takes the whole network


# ------------------------------------------------------------------------------------------- wider: 8-bit GEMMs

#: (widths, concat, residual, norm) of 8-bit networks no fused kernel takes: a wide chain, a concat of x before a wide
#: layer (NeRF/SDF's skip) with a residual from x, odd widths whose codes are not whole 16-byte rows.
WIDE_NETWORKS = [
    ([64, 512, 512, 512, 64], None, {2: "add"}, None),
    ([19, 300, 300, 4], {2: "before"}, {1: ("add", "relu", 0)}, None),
    ([33, 1024, 77, 1], {2: "after"}, None, None),
]


def wide_model(n, dtype, device="cpu", cache_dir=None):
    widths, concat, residual, norm = WIDE_NETWORKS[n]
    rng = np.random.default_rng(40 + n)
    ws, bs = graph_weights(rng, widths, concat or {}, 1.0)
    acts = ["relu", "gelu", "tanh", "silu"][: len(widths) - 2] + ["none"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, concat=concat, residual=residual, norm=norm, dtype=dtype,
                            device=device, cache_dir=cache_dir)
    return mlp.calibrate(rng.standard_normal((256, widths[0])).astype(np.float32))


@pytest.mark.parametrize("dtype", LOWBIT)
def test_a_wide_low_bit_network_runs_every_layer_as_an_8bit_gemm_chained_by_codes(dtype):
    from fusedmlp import _segments

    for n in range(len(WIDE_NETWORKS)):
        mlp = wide_model(n, dtype)
        widths = WIDE_NETWORKS[n][0]
        cut = mlp._segments_for(90, 232448, 132, 233472, "float16", "float32")
        assert [(s.first, s.kind) for s in cut] == [(l, "gemm") for l in range(len(widths) - 1)]
        assert any("features; a fused kernel holds" in s.reason for s in cut)
        for l, plan in enumerate(_segments.plans(mlp, 90, "float16", "float32")):
            info = plan.info
            assert info["gemm"] == 1 and info["precision"] == dtype and info["wgmma"] == 1
            assert info["in_dtype"] == ("float16" if l == 0 or (WIDE_NETWORKS[n][1] or {}).get(l) == "before"
                                        else "codes")
            assert info["out_dtype"] == ("float32" if l == len(widths) - 2 else "codes")
        # below sm_90: the mma.sync form, the same dtypes
        arch = 89 if dtype == "float8" else 80
        assert all(p.info["wgmma"] == 0 for p in _segments.plans(mlp, arch, "float32", "float32"))


@pytest.mark.parametrize("dtype", LOWBIT)
def test_an_8bit_gemm_renders_its_scales_and_k32_warpgroup_mma(dtype):
    mlp = wide_model(0, dtype)
    plan = mlp._gemm_plan(2, 90, 232448, 132, 233472, "codes", None, "codes", "codes")  # its residual reads layer 1's
    source = fusedmlp._api._source_of(plan)
    ty, acc = ("e4m3", "f32") if dtype == "float8" else ("s8", "s32")
    assert f"wgmma.mma_async.sync.aligned.m64n256k32.{acc}.{ty}.{ty}" in source
    s = np.asarray(mlp.act_scales, dtype=np.float32)
    qin, qout, rscale = np.float32(1) / s[2], np.float32(1) / s[3], s[2]
    assert (f"QIN = {c_hex(np.float32(qin))}f, QOUT = {c_hex(np.float32(qout))}f, RSCALE = {c_hex(rscale)}f"
            in source), re.findall(r"QIN = .*", source)
    assert "#define FM_IN_TYPE 3" in source and "#define FM_OUT_TYPE 3" in source and "#define FM_RES_TYPE 3" in source
    last = mlp._gemm_plan(3, 90, 232448, 132, 233472, "codes", None, None, "float16")
    assert "QOUT = 0x0p+0f" in fusedmlp._api._source_of(last)


def test_codes_are_an_8bit_gemms_dtype_only(rng):
    mlp, *_ = calibrated(rng, "int8", widths=(8, 300, 4))
    with pytest.raises(ValueError, match="layer 1 is the network's last: its result is y"):
        mlp._gemm_plan(1, 90, 232448, 132, 233472, "codes", None, None, "codes")
    with pytest.raises(ValueError, match="codes are a GEMM segment's"):
        mlp._net.plan(90, 232448, 132, "codes", "float32", precision="int8")
    ws, bs = torch_init(rng, [8, 300, 4])
    half = fusedmlp.FusedMLP(ws, bs, device="cpu")
    with pytest.raises(ValueError, match=r"3 \(its codes\)"):
        half._gemm_plan(1, 90, 232448, 132, 233472, "codes", None, None, "float32")
    with pytest.raises(ValueError, match="dtype 'int4' is not one of float32, float16, bfloat16"):
        mlp._gemm_plan(1, 90, 232448, 132, 233472, "int4", None, None, "float32")


def test_a_norm_in_a_wide_low_bit_network_plans_its_row_pass_with_float16_z_only(rng):
    """(It was a LimitError.) The row pass of an 8-bit network's norm layer reads z in float16, as the emulation
    rounds it; a last layer's result is y, never codes."""
    ws, bs = torch_init(rng, [8, 300, 64, 4])
    mlp = fusedmlp.FusedMLP(ws, bs, dtype="int8", norm={1: "layernorm", 2: "softmax"}, device="cpu")
    mlp.calibrate(rng.standard_normal((64, 8)).astype(np.float32))
    target = (90, 232448, 132, 233472)
    assert mlp._norm_plan(1, *target, "float16", None, "codes").info["norm_pass"] == 1
    with pytest.raises(ValueError, match="an 8-bit network's 1"):
        mlp._norm_plan(1, *target, "float32", None, "codes")
    with pytest.raises(ValueError, match="layer 2 is the network's last: its result is y"):
        mlp._norm_plan(2, *target, "float16", None, "codes")
    assert len(mlp.compile("sm_90")) == 5  # three GEMMs, two row passes


# ------------------------------------------------------------------------------------------- kernels, ahead of time


def nvrtc_or_skip():
    try:
        fusedmlp._api._nvrtc_info()
    except fusedmlp.errors.LibraryNotFoundError as e:
        pytest.skip(f"NVRTC is not installed: {e.message}")


def cubin_sm(path):
    """The SM version in a cache entry's CUBIN (ELF e_flags bits 8..15, as test_compile_matrix reads it)."""
    import pathlib
    import struct

    from fusedmlp._cache import MAGIC

    data = pathlib.Path(path).read_bytes()
    magic, _version, header_length = struct.unpack_from("<8sII", data)
    cubin = data[16 + header_length:]
    assert magic == MAGIC and cubin[:4] == b"\x7fELF"
    return (struct.unpack_from("<I", cubin, 48)[0] >> 8) & 0xFF


def c_hex(v):
    """A float as C's printf("%a") writes it (Python's float.hex keeps trailing zeros: 0x1.8000000000000p+1)."""
    return re.sub(r"\.?0+p", "p", float(v).hex())


@pytest.mark.parametrize("dtype,archs", [("int8", (80, 90)), ("float8", (89, 90))])
def test_wide_8bit_norm_layers_and_softmax_heads_are_a_gemm_and_a_row_pass(dtype, archs, tmp_path):
    """An 8-bit network's norm layers and softmax head over 256 features (a LimitError before): each layer's GEMM
    writes z in float16 (of the weights as given: no centring), its row pass reads z and the residual operand (codes,
    or x) and writes the next layer's codes with its scale (QOUT) or y; the chain compiles for each arch; the CPU
    path (the emulation, z rounded to float16 too) stays near the float network, and a network no wider than 256
    (one fused kernel, z in float32) does not round z."""
    from fusedmlp import _segments

    rng = np.random.default_rng(77)
    widths = [48, 512, 512, 300, 1000]
    ws, bs = graph_weights(rng, widths, {}, 1.0)
    norm = {0: "layernorm", 1: ("rmsnorm", rng.uniform(0.5, 1.5, 512).astype(np.float32)), 2: "layernorm",
            3: "softmax"}
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["silu", "gelu", "relu", "none"], residual={1: "add"}, norm=norm,
                            dtype=dtype, device="cpu", cache_dir=tmp_path)
    mlp.calibrate(rng.standard_normal((512, 48)).astype(np.float32))
    plans = _segments.plans(mlp, 90, "float16", "float32")
    kinds = [("norm" if p.info["norm_pass"] else "gemm", p.info["in_dtype"], p.info["out_dtype"]) for p in plans]
    assert kinds == [("gemm", "float16", "float16"), ("norm", "float16", "codes"),
                     ("gemm", "codes", "float16"), ("norm", "float16", "codes"),
                     ("gemm", "codes", "float16"), ("norm", "float16", "codes"),
                     ("gemm", "codes", "float16"), ("norm", "float16", "float32")], kinds
    scales = np.asarray(mlp.act_scales, dtype=np.float32)
    source = fusedmlp._api._source_of(plans[3])  # layer 1's row pass: its residual is layer 0's codes
    assert "#define FM_IN_TYPE 1" in source and "#define FM_OUT_TYPE 3" in source and "#define FM_RES_TYPE 3" in source
    assert (f"QOUT = {c_hex(np.float32(1) / scales[2])}f, RSCALE = {c_hex(scales[1])}f" in source), \
        re.findall(r"QIN = .*", source)
    assert "QOUT = 0x0p+0f" in fusedmlp._api._source_of(plans[-1])  # the softmax head writes y
    # the norm layers' GEMMs multiply the weights as given (their codes are the emulation's), not centred ones, with
    # the model's scales
    prenorm = mlp._prenorm_net().quant
    assert prenorm[1] == mlp._net.quant[1]
    assert all(np.array_equal(a, b) for a, b in zip(prenorm[2], mlp.weight_scales))
    for a, arch in enumerate(archs):
        paths = mlp.compile(f"sm_{arch}", ("float32", "bfloat16")[a])
        assert len(paths) == 8 and {cubin_sm(p) for p in paths} == {arch}
    x = rng.standard_normal((64, 48)).astype(np.float32)
    emu = mlp._net.forward_cpu(x).astype(np.float64)
    ref = mlp._net.forward_cpu(x, quantised=False).astype(np.float64)
    assert rel_l2(emu, ref) <= fusedmlp.CHECK_TOLERANCES[dtype]
    # z near 1000 (float16's steps there are 0.5, about half the rows' spread): an rmsnorm over it in the cut
    # network's emulation takes a handful of values a row, in one fused kernel's (256 wide, z in float32) nearly
    # every one; a layernorm's GEMM takes its bias less the bias's mean (the norm is blind to it), so its z is near 0
    distinct = {}
    for width, kind in ((512, "rmsnorm"), (256, "rmsnorm"), (512, "layernorm")):
        w1 = (rng.standard_normal((width, 48)) / 7).astype(np.float32)
        one = fusedmlp.FusedMLP([w1], [np.full(width, 1000, np.float32) + rng.uniform(-1, 1, width).astype(np.float32)],
                                activation="none", norm={0: kind}, dtype=dtype, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (rmsnorm's rounded z: over int8's check bound on the sample)
            one.calibrate(x)
        distinct[width, kind] = min(len(np.unique(row)) for row in one(x[:8]))
    assert (distinct[512, "rmsnorm"] <= 24 and distinct[256, "rmsnorm"] >= 240 and distinct[512, "layernorm"] >= 480), \
        distinct


MMA = {"int8": "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
       "float8": "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"}

#: (widths, concat, residual, norm): a chain, odd widths, a graph with a concat, residuals from the layer's input, an
#: earlier layer and x, and a layernorm, and a network whose 8-bit weights (200 KB) stream on sm_80/86/89.
AOT_NETWORKS = [
    ([8, 64, 64, 4], None, None, None),
    ([7, 100, 33, 250, 9], None, None, None),
    ([20, 96, 96, 96, 40, 20], {3: "after"}, {1: "add", 2: ("add", "none", 0), 4: ("mul", "tanh", "input")},
     {4: "layernorm"}),
    ([2, 256, 256, 256, 3], {2: "before"}, None, {1: "rmsnorm"}),
]


def aot_model(n, dtype, cache_dir=None):
    widths, concat, residual, norm = AOT_NETWORKS[n]
    rng = np.random.default_rng(n)
    ws, bs = graph_weights(rng, widths, concat or {}, 1.0)
    acts = ["gelu", "relu", "silu", "tanh", "sigmoid"][: len(widths) - 2] + ["none"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, concat=concat, residual=residual, norm=norm, dtype=dtype,
                            device="cpu", cache_dir=cache_dir)
    return mlp.calibrate(rng.standard_normal((256, widths[0])).astype(np.float32))


@pytest.mark.parametrize("dtype,archs", [("int8", (80, 90)), ("float8", (89, 90))])
def test_wide_low_bit_networks_compile_their_gemms_for_every_arch(dtype, archs, tmp_path):
    nvrtc_or_skip()
    for n in range(len(WIDE_NETWORKS)):
        mlp = wide_model(n, dtype, cache_dir=tmp_path)
        for a, arch in enumerate(archs):
            paths = mlp.compile(f"sm_{arch}", ("float32", "float16", "bfloat16")[(n + a) % 3])
            assert isinstance(paths, tuple) and len(paths) == len(WIDE_NETWORKS[n][0]) - 1
            assert {cubin_sm(p) for p in paths} == {arch}


@pytest.mark.parametrize("dtype,archs", [("int8", (80, 86, 89, 90)), ("float8", (89, 90))])
def test_every_low_bit_network_compiles_for_every_arch_and_io_dtype(dtype, archs, tmp_path):
    nvrtc_or_skip()
    for n in range(len(AOT_NETWORKS)):
        mlp = aot_model(n, dtype, tmp_path)
        for a, arch in enumerate(archs):
            io = ("float32", "float16", "bfloat16")[(n + a) % 3]
            path = mlp.compile(f"sm_{arch}", io)
            label = f"{AOT_NETWORKS[n][0]} {dtype} sm_{arch} {io}"
            assert cubin_sm(path) == arch, label
            source = mlp.source
            assert f"#define FM_PREC {3 if dtype == 'int8' else 4}" in source, label
            if arch == 90 and f"{dtype} wgmma" in source:  # the 8-bit wgmma forms, where they fit
                assert (".e4m3.e4m3" if dtype == "float8" else ".s32.s8.s8") in source, label
                assert "wgmma.mma_async" in source, label
            else:  # the plan line: mma.sync below sm_90 and where wgmma does not fit
                assert MMA[dtype] in source and f"{dtype} mma.sync" in source, label
            # the scales are in the source, so in the cache key: layer 0's input scale as its exact float32 inverse
            assert f"QIN = {c_hex(np.float32(1) / mlp.act_scales[0])}f" in source, label
    plan = aot_model(3, dtype)._net.plan(89 if dtype == "float8" else 80, 0, 0, "float32", "float32", precision=dtype)
    assert plan.info["resident"] == 0  # 200 KB of codes do not fit 99 / 163 KB: the streamed form was compiled


@pytest.mark.parametrize("dtype", LOWBIT)
@pytest.mark.parametrize("options", [{"resident": 0}, {"m_tiles": 1}, {"m_tiles": 2, "n_chunk": 32},
                                     {"warps": 1, "n_chunk": 16}, {"warps": 8, "m_tiles": 1, "n_chunk": 64}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_forced_mma_sync_forms_compile_for_sm_89_and_sm_90a(dtype, options, tmp_path):
    """The tile shapes the GPU tests force (tests/test_lowbit_gpu.py), for Ada and, as the arch-specific target the
    wgmma kernels use, sm_90a."""
    nvrtc_or_skip()
    mlp = aot_model(2, dtype)
    cache = fusedmlp._cache.KernelCache(tmp_path)
    for arch, arch_a in ((89, False), (90, True)):
        plan, source = mlp._render(arch, 0, 0, "float16", "float32", **options)
        assert plan.info["wgmma"] == 0 and plan.info["precision"] == dtype
        entry = fusedmlp._api.compile_cubin(source, arch, cache, arch_a)
        assert cubin_sm(entry.path) == arch


def test_different_scales_are_different_kernels_and_equal_ones_one_entry(tmp_path):
    nvrtc_or_skip()
    rng = np.random.default_rng(9)
    ws, bs = torch_init(rng, [8, 64, 4])
    x = rng.standard_normal((300, 8)).astype(np.float32)
    a = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu", cache_dir=tmp_path).calibrate(x)
    b = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu", cache_dir=tmp_path).calibrate(x * 2)
    c = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu", cache_dir=tmp_path).calibrate(x)
    pa, pb, pc = (m.compile("sm_89") for m in (a, b, c))
    assert pa != pb and pa == pc
    before = a.source
    a.calibrate(x * 3)  # a recalibrated model renders (and so keys) a new kernel
    assert a.source != before and a.compile("sm_89") not in (pa, pb)


#: Networks the float8 wgmma form takes (the register-A kernel's rules: no concat, residuals from the layer's own
#: input); widths padded to 32. (widths, norm, residual)
WGMMA_NETWORKS = [([8, 64, 64, 4], None, None), ([7, 100, 33, 250, 9], None, None),
                  ([32, 128, 128, 128, 16], {1: "layernorm"}, None), ([3, 96, 96, 1], None, None),
                  ([2, 50, 50, 50, 50, 1], None, {2: "add", 3: ("mul", "tanh")}),
                  ([64, 128, 128, 128, 128, 64], None, {1: "add", 2: "add", 3: ("add", "relu")}),
                  ([16, 48, 48, 48], None, {2: "add"}),  # the last layer's residual (fm_epi_tile)
                  # relu and identity hidden layers (fm_plan.q_fold: scales folded, relu in the cvt), padded widths,
                  # and 256-wide hidden layers (float8's fragments leave room for them in registers; float16's not)
                  ([24, 80, 80, 40, 10], None, None, ["relu", "none", "relu", "none"]),
                  ([3, 256, 256, 256, 5], None, None, ["relu", "relu", "sin", "none"])]


def wgmma_model(n, device="cpu", dtype="float8"):
    widths, norm, residual = WGMMA_NETWORKS[n][:3]
    rng = np.random.default_rng(100 + n)
    ws, bs = torch_init(rng, widths)
    acts = WGMMA_NETWORKS[n][3] if len(WGMMA_NETWORKS[n]) > 3 else \
        ["gelu", "tanh", "silu", "relu"][: len(widths) - 2] + ["none"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, norm=norm, residual=residual, dtype=dtype, device=device)
    return mlp.calibrate(rng.standard_normal((256, widths[0])).astype(np.float32))


@pytest.mark.parametrize("dtype, form", [("float8", r"f32\.e4m3\.e4m3"), ("int8", r"s32\.s8\.s8")])
def test_the_8bit_wgmma_forms_compile_for_sm_90a_without_spills(tmp_path, dtype, form):
    """The register-A wgmma forms for 8 bits (m64nNk32.f32.e4m3.e4m3, m64nNk32.s32.s8.s8; K-major B), every I/O
    dtype; ptxas's report (-v) says no spills and no serialised wgmma (C7519)."""
    nvrtc_or_skip()
    cache = fusedmlp._cache.KernelCache(tmp_path)
    for n in range(len(WGMMA_NETWORKS)):
        mlp = wgmma_model(n, dtype=dtype)
        for io in ("float32", "float16", "bfloat16"):
            plan, source = mlp._render(90, 0, 0, io, io, wgmma=1)
            assert plan.info["wgmma"] == 1 and plan.info["cluster"] == 0 and plan.info["kpipe"] == 0
            assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\." + form, source)
            assert cubin_sm(fusedmlp._api.compile_cubin(source, 90, cache, True).path) == 90
        _, log = _core.nvrtc_compile(source, "fused_mlp.cu", 90, True, ("--ptxas-options=-v",))
        if dtype == "int8" and n == len(WGMMA_NETWORKS) - 1:
            # 256 wide with an unbounded sine: int8's epilogue spills here (NVRTC 13: 280 bytes, the wgmma serialised,
            # C7512), and the form still ran 1.93x faster than mma.sync, same bits (H100, 2^20 rows:
            # bench/results/h100-int8-fast/int8_sin_form.txt), so the planner takes it. Above that, a regression.
            assert max(map(int, re.findall(r"(\d+) bytes spill stores", log))) <= 320, log
            continue
        assert set(re.findall(r"(\d+) bytes spill stores", log)) == {"0"}, log  # (a sine: fm_sin_far too)
        assert "C7519" not in log and "C7510" not in log, log


#: Networks of the 8-bit streamed warpgroup form (fused_mlp_sm90.cu with FM_STREAM: each layer one column group read
#: from several slots, its codes packed as in the resident form): (widths, concat, residual, norm, activations, plan
#: options). deep256's shape, whose 8-bit weights (288 KB) are past one CTA's shared memory, so the default plan; a
#: NeRF-like input concat on each side (x's part of the concat layer's weights in column order, the previous
#: layer's permuted: fm_plan_w_index); residuals from a layer's own input, a layernorm and padded widths, streamed
#: where they would fit resident (resident=0).
STREAM_NETWORKS = [([64, 256, 256, 256, 256, 256, 64], None, None, None, ["relu", "gelu", "relu", "silu", "relu", "none"],
                    {}),
                   ([40, 192, 192, 192, 192, 8], {3: "before"}, None, None, ["relu"] * 4 + ["none"], {}),
                   ([24, 96, 96, 96, 6], {2: "after"}, None, None, ["tanh", "relu", "gelu", "none"],
                    {"wgmma": 1, "resident": 0}),
                   ([32, 128, 128, 128, 16], None, {1: "add", 2: ("add", "relu")}, None, ["gelu", "silu", "none",
                                                                                        "none"], {"wgmma": 1, "resident": 0}),
                   ([7, 100, 33, 250, 9], None, None, {1: "layernorm"}, ["gelu", "tanh", "silu", "none"],
                    {"wgmma": 1, "resident": 0})]


def stream_model(n, device="cpu", dtype="float8"):
    widths, concat, residual, norm, acts, _ = STREAM_NETWORKS[n]
    rng = np.random.default_rng(200 + n)
    ws, bs = graph_weights(rng, widths, concat or {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, concat=concat, residual=residual, norm=norm, dtype=dtype,
                            device=device)
    return mlp.calibrate(rng.standard_normal((256, widths[0])).astype(np.float32))


@pytest.mark.parametrize("dtype, form", [("float8", r"f32\.e4m3\.e4m3"), ("int8", r"s32\.s8\.s8")])
def test_the_8bit_streamed_wgmma_form_plans_and_compiles_for_sm_90a_without_spills(tmp_path, dtype, form):
    """Networks whose 8-bit weights do not stay on chip take the streamed warpgroup form by default (no longer the
    mma.sync kernel's per-tile stream, which Hopper runs as float16 HMMAs for float8), each layer one group of its
    whole row; x's part of an input concat is not permuted, the previous layer's is. Compiled for sm_90a: no spills,
    no serialised wgmma. A network wider than 256 is no 8-bit streamed form (its GEMM chain: _segments)."""
    nvrtc_or_skip()
    cache = fusedmlp._cache.KernelCache(tmp_path)
    for n, (widths, concat, _, _, _, options) in enumerate(STREAM_NETWORKS):
        mlp = stream_model(n, dtype=dtype)
        plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472, **options)
        assert plan.info["wgmma"] == 1 and plan.info["stream_slots"] >= 2 and plan.info["precision"] == dtype, n
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\." + form, source)
        assert cubin_sm(fusedmlp._api.compile_cubin(source, 90, cache, True).path) == 90
        _, log = _core.nvrtc_compile(source, "fused_mlp.cu", 90, True, ("--ptxas-options=-v",))
        assert set(re.findall(r"(\d+) bytes spill stores", log)) == {"0"}, (n, log)
        assert "C7519" not in log and "C7510" not in log, log
    wide = fusedmlp.FusedMLP([np.ones((300, 8), np.float32), np.ones((2, 300), np.float32)], None, dtype=dtype,
                             device="cpu")
    wide.calibrate(np.ones((4, 8), np.float32))
    with pytest.raises(LimitError, match="8-bit form takes layers up to 256 wide"):
        wide._net.plan(90, precision=dtype, wgmma=1, resident=0)


def test_the_float8_wgmma_form_is_the_default_where_it_fits_and_refuses_what_it_has_not(rng):
    mlp = wgmma_model(0)
    assert mlp._net.plan(90, precision="float8").info["wgmma"] == 1  # the default on sm_90 (H100: 1.6-2.6x mma.sync)
    assert mlp._net.plan(90, precision="float8", wgmma=0).info["wgmma"] == 0
    with pytest.raises(LimitError, match="runs each layer whole: n_chunk=32"):
        mlp._net.plan(90, precision="float8", wgmma=1, n_chunk=32)
    with pytest.raises(LimitError, match="cluster kernel has no 8-bit form"):
        mlp._net.plan(90, precision="float8", cluster=2)
    ws, bs = torch_init(rng, [8, 64, 64, 64])
    res = fusedmlp.FusedMLP(ws, bs, residual={2: ("add", "none", 0)}, dtype="float8", device="cpu")
    res.calibrate(rng.standard_normal((64, 8)).astype(np.float32))
    with pytest.raises(LimitError, match="residuals from a layer's own input only"):
        res._net.plan(90, precision="float8", wgmma=1)
    assert res._net.plan(90, precision="float8").info["wgmma"] == 0  # not asked for: mma.sync takes it



def ptx_k32_a_fragment(lane, s, q):
    """The (row, column) of each byte of register q of an m16n8k32 / wgmma k32 8-bit A fragment, k step s, for lane
    (the PTX ISA's layout: a lane (g, t) holds row g + 8 (q % 2), columns 32 s + 16 (q // 2) + 4 t .. + 3)."""
    g, t = lane >> 2, lane & 3
    return [(g + 8 * (q % 2), 32 * s + 16 * (q // 2) + 4 * t + b) for b in range(4)]


def k32_packing(n):
    """fm_epi_codes (fused_mlp_sm90.cu) replayed on element labels over one warp's 32 lanes, with the kernel's index
    expressions: lane (g, t) holds the accumulators of columns 8 j + 2 t, + 1 of rows g, g + 8 and packs register q of
    k step s from its own pairs of tiles 4 s + 2 (q // 2) and + 1. Returns {column: the k position the PTX k32 A
    layout gives that byte}, checking on the way that each byte's row is the layout's and that every column lands on
    one position, the same in every lane."""
    where = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for s in range(n // 32):
            for q in range(4):
                j0, hh = 4 * s + 2 * (q >> 1), q & 1
                packed = [(g + 8 * hh, 8 * j + 2 * t + e) for j in (j0, j0 + 1) for e in (0, 1)]
                for (row, col), (prow, k) in zip(packed, ptx_k32_a_fragment(lane, s, q)):
                    assert row == prow, (lane, s, q)
                    assert where.setdefault(col, k) == k, (lane, col)
    assert sorted(where) == list(range(n)) and sorted(where.values()) == list(range(n))
    return where


def test_the_wgmma_k32_packing_and_residual_reads_index_algebra():
    """The float8 register-A kernel's packing (k32_packing): within each 32 columns a permutation, not the identity,
    which the next layer's weights take (fm_plan.k_perm). The residual read of such an input (fm_res_codes, KPERM)
    takes the lane's own register 2 ((j % 4) // 2) + hh of fragment j // 4, half j % 2, and finds the pair at the
    lane's accumulator positions; layer 0's (x in column order) shuffles from lane 2 (j % 2) + t // 2 of the quad,
    half t % 2. (The algebra against the PTX layout as written above, not the hardware: the GPU tests run it.)"""
    n = 96
    where = k32_packing(n)
    assert any(where[c] != c for c in range(n)) and all(where[c] // 32 == c // 32 for c in range(n))
    column_at = {k: c for c, k in where.items()}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(n // 8):
            for hh in range(2):
                want = [(g + 8 * hh, 8 * j + 2 * t), (g + 8 * hh, 8 * j + 2 * t + 1)]
                reg = ptx_k32_a_fragment(lane, j // 4, 2 * ((j % 4) // 2) + hh)[2 * (j % 2): 2 * (j % 2) + 2]
                assert [(row, column_at[k]) for row, k in reg] == want, (lane, j, hh)
                src = (lane & ~3) | (2 * (j % 2) + (t >> 1))
                reg = ptx_k32_a_fragment(src, j // 4, 2 * ((j % 4) // 2) + hh)[2 * (t & 1): 2 * (t & 1) + 2]
                assert reg == want, (lane, j, hh)


def test_float8_wgmma_weights_after_the_first_layer_take_the_packed_k_order():
    """The host side of the packing: a float8 register-A plan whose layers 0 and 1 have the same weights stores layer
    1's input k where the kernel's packing puts column k (k32_packing), layer 0's in column order (its input is x);
    the core-matrix layout (8 rows x 16 bytes, K-major) decoded here as fm_plan_w_index writes it."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 64)).astype(np.float32) * 0.1
    mlp = fusedmlp.FusedMLP([w, w.copy(), rng.standard_normal((16, 64)).astype(np.float32)], None, "relu",
                            dtype="float8", device="cpu")
    mlp.calibrate(rng.standard_normal((256, 64)).astype(np.float32))
    plan = mlp._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, precision=mlp._precision)
    assert plan.info["wgmma"] == 1
    blob = np.frombuffer(plan.packed_weights(), np.uint8)

    def decoded(offset, n_pad, k_pad):
        n, k = np.meshgrid(np.arange(n_pad), np.arange(k_pad), indexing="ij")
        return blob[offset + ((n // 8) * (k_pad // 16) + k // 16) * 128 + (n % 8) * 16 + k % 16]

    first, second = decoded(0, 64, 64), decoded(64 * 64, 64, 64)
    where = k32_packing(64)
    assert np.count_nonzero(first) > 3000
    assert np.array_equal(second[:, [where[c] for c in range(64)]], first)
