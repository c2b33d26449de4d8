"""GPU tests: the fused kernel against a float64 reference. Marked `gpu`; skipped without a device.

Every launch poisons its output first (NaN bytes), so an element the kernel failed to write cannot pass.
"""

import concurrent.futures
import os
import re
import time
import types

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from conftest import graph_weights, reference, rel_l2, rendered_repeats, torch_init

pytestmark = pytest.mark.gpu

# Tolerance for fp16 activations with fp32 accumulation (the bound): relative L2 error vs float64.
FP16_TOL = 2e-3

BUILTINS = ["relu", "leaky_relu", "leaky_relu(x, 0.2)", "elu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh",
            "softplus", "sin", "square", "none", "mish", "selu", "hardswish", "softsign", "exp"]
# Well-conditioned user expressions (slope of order 1): fp16 storage's relative error 2^-11 stays of that order.
# High-frequency ones such as sin(30*x) amplify it by their slope; they get their own test below.
EXPRESSIONS = ["x * tanh(softplus(x))", "0.5*x + 0.25*sin(x)", "max(x, -0.5)", "x / (1 + abs(x))",
               "min(max(x, -1), 1)", "x * sigmoid(1.702 * x)", "tanh(x)^2 - 0.5", "log1p(x*x)", "2*cos(x) - 1"]

BATCHES = [1, 127, 129, 4096, 65537, 1000003]


def random_width(rng):
    r = rng.random()
    if r < 0.35:
        return int(rng.choice([16, 32, 48, 64, 96, 128, 256]))
    if r < 0.5:
        return int(rng.integers(1, 9))
    return int(rng.integers(1, 257))


def random_case(rng, index):
    depth = int(rng.integers(1, 9))
    widths = [random_width(rng) for _ in range(depth + 1)]
    bias = [bool(rng.random() < 0.6) for _ in range(depth)]
    pool = BUILTINS + EXPRESSIONS
    acts = [str(rng.choice(pool)) for _ in range(depth - 1)] + [str(rng.choice(["none", "none", "sigmoid", "tanh"]))]
    # Large batches for small networks only, so the float64 reference stays quick; every case sees odd sizes.
    flops = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    choices = [b for b in BATCHES if b * flops < 4e9] or [1]
    batch = int(choices[index % len(choices)])
    dtype = np.float16 if index % 3 == 0 else np.float32
    return widths, bias, acts, batch, dtype


def check_case(rng, widths, bias, acts, batch, dtype, mlp=None):
    ws, bs = torch_init(rng, widths, bias)
    x = rng.standard_normal((batch, widths[0])).astype(dtype)
    if mlp is None:
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cuda")
    kernel = mlp._kernel("float16" if dtype == np.float16 else "float32")
    y = kernel.run(np.ascontiguousarray(x), poison=True)
    assert y.shape == (batch, widths[-1]) and y.dtype == dtype
    # The reference sees exactly what the kernel saw: x as given (fp16 inputs are exact in float64).
    ref, peak = reference(x, ws, bs, mlp.activations)
    if peak > 6e4:  # the reference leaves fp16's range (exp of exp...): overflow to inf/NaN is the right answer
        return None, peak
    assert not np.isnan(y).any(), "unwritten (poisoned) or NaN outputs"
    return rel_l2(y, ref), peak


def test_tcnn64_matches_float64(rng):
    ws, _ = torch_init(rng, [32, 64, 64, 64, 64, 16], bias=False)
    mlp = fusedmlp.FusedMLP(ws, None, activation="relu", device="cuda")
    for batch, dtype in [(1, np.float32), (127, np.float16), (129, np.float32), (65537, np.float16)]:
        x = rng.standard_normal((batch, 32)).astype(dtype)
        y = mlp._kernel(np.dtype(dtype).name).run(x, poison=True)
        ref, _ = reference(x, ws, [None] * 5, ["relu"] * 4 + ["none"])
        assert not np.isnan(y).any()
        assert rel_l2(y, ref) <= FP16_TOL, (batch, dtype)


def test_public_call_matches_cpu_path(rng):
    ws, bs = torch_init(rng, [3, 64, 128, 96, 64, 32, 16, 4], bias=True)
    x = rng.standard_normal((1000, 3)).astype(np.float32)
    gpu = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation="silu", device="cuda", check=True)
    cpu = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation="silu", device="cpu")
    assert gpu.dtype == np.float32 and gpu.shape == (1000, 4)
    assert rel_l2(gpu, cpu.astype(np.float64)) <= FP16_TOL


def test_three_hundred_random_architectures():
    rng = np.random.default_rng(20261122)
    cases = [random_case(rng, i) for i in range(int(os.environ.get("FUSEDMLP_GPU_CASES", "320")))]
    # Build (compile) in parallel: NVRTC releases the GIL, and the device has many cores.
    mlps = []
    for widths, bias, acts, batch, dtype in cases:
        ws, bs = torch_init(np.random.default_rng(len(mlps)), widths, bias)
        mlps.append(fusedmlp.FusedMLP(ws, bs, activation=acts, device="cuda"))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(lambda m_c: m_c[0]._kernel("float16" if m_c[1][4] == np.float16 else "float32"),
                      zip(mlps, cases)))
    print(f"\nbuilt {len(mlps)} kernels in {time.perf_counter() - start:.1f} s")
    failures, checked, skipped = [], 0, 0
    for i, ((widths, bias, acts, batch, dtype), mlp) in enumerate(zip(cases, mlps)):
        err, peak = check_case(np.random.default_rng(i), widths, bias, acts, batch, dtype, mlp)
        if err is None:  # the reference left fp16's range: not a meaningful fp16 comparison
            skipped += 1
            continue
        checked += 1
        if not err <= FP16_TOL:
            failures.append((i, widths, acts, batch, np.dtype(dtype).name, err))
    print(f"checked {checked} architectures, {skipped} skipped (outside fp16 range), {len(failures)} failures")
    assert checked >= 300
    assert not failures, failures[:10]


def test_siren_sin30_error_is_bounded_by_its_slope(rng):
    # sin(30 z) turns fp16's relative rounding of z (2^-11) into an absolute error ~30 * |z| * 2^-11 per layer: the
    # documented fp16 bound for such activations scales with the slope, here 30x the plain bound.
    widths = [2, 256, 256, 256, 3]
    ws, bs = torch_init(rng, widths, True)
    acts = ["sin(30*x)"] + ["sin(x)"] * 2 + ["none"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cuda")
    assert mlp.source.count("float act(float x, int) { return fm_sin_d(") == 2  # the hidden layers: their inputs are sines
    x = rng.uniform(-1, 1, (65537, 2)).astype(np.float32)
    y = mlp._kernel("float32").run(x, poison=True)
    ref, _ = reference(x, ws, bs, mlp.activations)
    assert not np.isnan(y).any()
    assert rel_l2(y, ref) <= 30 * FP16_TOL


def test_widths_past_one_fused_kernel_run_as_segments(rng):
    """A layer wider than the fused kernels take (257 > 256) was a LimitError; since issue 29 the network is cut
    into segments (a GEMM layer here) and gives the float64 answer through the same call."""
    ws, _ = torch_init(rng, [8, 257, 4], False)
    mlp = fusedmlp.FusedMLP(ws, None, device="cuda")
    x = rng.standard_normal((4099, 8)).astype(np.float32)
    y = mlp(x)
    ref, _ = reference(x, ws, [None, None], mlp.activations)
    assert mlp.segments is not None
    assert rel_l2(y, ref) <= FP16_TOL


def test_zero_rows_and_one_dimensional_input(rng):
    ws, bs = torch_init(rng, [5, 7, 3], True)
    mlp = fusedmlp.FusedMLP(ws, bs, device="cuda")
    assert mlp(np.zeros((0, 5), np.float32)).shape == (0, 3)
    x = rng.standard_normal(5).astype(np.float32)
    y = mlp(x)
    ref, _ = reference(x[None], ws, bs, mlp.activations)
    assert y.shape == (3,) and rel_l2(y[None], ref) <= FP16_TOL


def test_cache_hit_in_a_new_object_compiles_nothing(rng, tmp_path):
    ws, bs = torch_init(rng, [16, 48, 48, 2], True)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    first = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cuda", cache_dir=tmp_path)
    t0 = time.perf_counter()
    y1 = first(x)
    cold = time.perf_counter() - t0
    second = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cuda", cache_dir=tmp_path)
    t0 = time.perf_counter()
    y2 = second(x)
    warm = time.perf_counter() - t0
    print(f"\nfirst call {cold * 1e3:.1f} ms (render + NVRTC + load), cache hit {warm * 1e3:.2f} ms")
    assert first.cache_path == second.cache_path and os.path.exists(second.cache_path)
    assert os.path.exists(second.cache_path[: -len(".cubin")] + ".cu")
    np.testing.assert_array_equal(y1, y2)


def test_threads_share_one_model(rng):
    ws, bs = torch_init(rng, [12, 64, 64, 5], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", device="cuda")
    xs = [rng.standard_normal((int(rng.integers(1, 5000)), 12)).astype(np.float32) for _ in range(32)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ys = list(pool.map(mlp, xs))
    for x, y in zip(xs, ys):
        ref, _ = reference(x, ws, bs, mlp.activations)
        assert rel_l2(y, ref) <= FP16_TOL


def test_cuda_error_names_the_driver_error(rng):
    gpu = _core.Gpu(0)
    ws, _ = torch_init(rng, [4, 4], False)
    plan = _core.Network(ws, [None], ["none"]).plan(gpu.info["arch"])
    with pytest.raises(fusedmlp.CudaError) as info:
        plan.load(gpu, b"\x7fELF not a cubin", "fusedmlp_forward")
    assert info.value.name.startswith("CUDA_ERROR_")


# (the comparisons and where at thresholds float16 holds exactly: x itself is a float16 value, so they are exact)
@pytest.mark.parametrize("act", BUILTINS + EXPRESSIONS + ["sin(30*x)", "cos", "erf", "softplus(x, 2, 10)", "elu(x, 0.5)",
                                 "x * gt(x, 0.5) + ge(x, 1) - lt(x, -1) * le(x, -2) + eq(x, 0)",
                                 "where(gt(x * 2, 10), x, softplus(x * 2) / 2)"])
def test_activation_accuracy_in_float32(act):
    # A 1 -> 1 layer with weight 1 and float32 output computes act(fp16(x)) and stores it unrounded, so this sees the
    # device helper's own error: it must stay far below fp16's 4.9e-4 (the fast exp/reciprocal paths give ~1e-6).
    x = np.concatenate([np.linspace(-30, 30, 20001), np.geomspace(1e-6, 30, 4000), -np.geomspace(1e-6, 30, 4000)])
    x = x.astype(np.float16).astype(np.float32)[:, None]
    mlp = fusedmlp.FusedMLP([np.ones((1, 1), np.float32)], None, activation=[act], device="cuda")
    y = mlp._kernel("float32").run(x, poison=True)[:, 0].astype(np.float64)
    ref = _core.eval_expr(mlp.activations[0], x[:, 0].astype(np.float64))
    finite = np.isfinite(ref) & (np.abs(ref) < 3e38)
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    # Relative 2e-5 plus absolute 1e-5: near zeros reached by cancellation (gelu at -4, 2*cos(x) - 1 near pi/3) and for
    # arguments float32 itself rounds (30*x) the float32 formula has absolute, not relative, error, as in PyTorch.
    excess = np.abs(y[finite] - ref[finite]) - (2e-5 * np.abs(ref[finite]) + 1e-5)
    assert excess.max() <= 0, (act, float(x[finite][np.argmax(excess)][0]), float(excess.max()))


def test_tune_keeps_the_fastest_candidate_and_later_processes_reuse_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_AUTOTUNE", "1")
    rng = np.random.default_rng(7)
    ws, bs = torch_init(rng, [2, 50, 50, 50, 50, 1], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cuda", cache_dir=tmp_path)
    results = fusedmlp.tune(mlp, batch_sizes=[1000, 300_000], io_dtype="float32")
    info = fusedmlp._api._gpu(0).info
    for rows, record in results.items():
        ms = record["ms"]
        chosen = fusedmlp._tune.label(record["options"])
        assert ms[chosen] == min(ms.values()) and all(v > 0 for v in ms.values()), (rows, record)
        if info["arch"] == 90:  # a network the warpgroup kernel takes: its warpgroup counts, less those dominated
            assert all(name.startswith("wg") for name in ms), ms
            assert len(ms) >= 2 or (rows <= 4 * info["sm_count"] * 16 and list(ms) == ["wg4"]), (rows, ms)
        else:
            assert len(ms) >= 2, (rows, ms)
    print(f"\ntuned pinn-like 2-50x4-1: {results}")
    x = rng.standard_normal((300_000, 2)).astype(np.float32)
    ref, _ = reference(x, ws, bs, mlp.activations)
    assert rel_l2(mlp(x), ref) <= FP16_TOL
    # A new object (as in a new process) reads the stored choice: timing again would be a bug.
    monkeypatch.setattr(fusedmlp._tune, "tune_bucket", lambda *a, **k: pytest.fail("re-tuned a stored bucket"))
    again = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cuda", cache_dir=tmp_path)
    assert rel_l2(again(x), ref) <= FP16_TOL


def test_resnet_mlp_with_four_residual_gelu_blocks(rng):
    # issue 5's ResNet-MLP: 64-128, four blocks x + gelu(Linear128(x)), -64, against float64
    widths = [64, 128, 128, 128, 128, 128, 64]
    ws, bs = torch_init(rng, widths, True)
    residual = {1: "add", 2: "add", 3: "add", 4: "add"}
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual=residual, device="cuda")
    for batch, dtype in [(1, np.float32), (129, np.float16), (65537, np.float32)]:
        x = rng.standard_normal((batch, 64)).astype(dtype)
        y = mlp._kernel(np.dtype(dtype).name).run(x, poison=True)
        ref = graph_reference(x, ws, bs, mlp)
        assert not np.isnan(y).any() and rel_l2(y, ref) <= FP16_TOL, (batch, dtype)


def graph_reference(x, ws, bs, mlp, rms=None):
    """float64 forward of mlp's graph (activations, residual sources, input concats) with exact activations; appends
    each layer's output RMS to `rms` when given."""
    from fusedmlp import _core as core

    def act(text, y):
        return core.eval_expr(text, np.ascontiguousarray(y.ravel())).reshape(y.shape)

    x0 = np.asarray(x, dtype=np.float64)
    values, h = {-1: x0}, x0
    for l, (w, b, text) in enumerate(zip(ws, bs, mlp.activations)):
        cat = mlp._concat[l]
        inp = h if not cat else np.concatenate([h, x0] if cat == 1 else [x0, h], 1)
        y = act(text, inp @ w.astype(np.float64).T + (0 if b is None else b))
        res = mlp._residual[l]
        if res is not None:
            r = values[res[2]]
            y = act(res[1], y + r if res[0] == 1 else y * r)
        h = values[l] = y
        if rms is not None:
            rms.append(float(np.sqrt(np.mean(h * h))) if h.size else 0.0)
    return h


def test_random_residual_architectures():
    rng = np.random.default_rng(5)
    failures, checked, skipped = [], 0, 0
    for i in range(60):
        depth = int(rng.integers(2, 7))
        width = int(rng.choice([3, 16, 40, 64, 96, 128, 200, 256]))
        widths = [int(rng.integers(1, 60))] + [width] * depth + [int(rng.integers(1, 30))]
        acts = [str(rng.choice(["relu", "gelu", "tanh", "silu", "none"])) for _ in range(depth)] + ["none"]
        # hidden layers 1..depth-1 map width -> width; the last one (depth) takes a residual only when its output
        # width happens to equal its input width, which then exercises the two-buffer staged case
        residual = {l: (str(rng.choice(["add", "add", "mul"])), str(rng.choice(["none", "relu", "tanh"])))
                    for l in range(1, depth) if rng.random() < 0.7}
        if i % 4 == 0:
            widths[-1] = width
            residual[depth] = "add"
        ws, bs = torch_init(rng, widths, bool(i % 2))
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, device="cuda")
        dtype = np.float16 if i % 3 == 0 else np.float32
        x = rng.standard_normal((int(rng.choice([1, 127, 129, 5000])), widths[0])).astype(dtype)
        y = mlp._kernel(np.dtype(dtype).name).run(x, poison=True)
        rms = []
        ref = graph_reference(x, ws, bs, mlp, rms)
        # Outside fp16's range either way: past 6e4 it overflows; chained 'mul' residuals can shrink a layer's
        # activations to RMS ~1e-6 (seen: draw 20), below fp16's smallest normal 6.1e-5, where few bits remain.
        if np.max(np.abs(ref)) > 6e4 or min(rms) < 1e-3:
            skipped += 1
            continue
        checked += 1
        err = rel_l2(y, ref)
        if np.isnan(y).any() or not err <= FP16_TOL:
            failures.append((i, widths, acts, residual, err))
    print(f"\nresidual architectures: {checked} checked, {skipped} outside fp16's range, {len(failures)} failures")
    assert checked >= 45 and not failures, failures[:5]


# ------------------------------------------------------------------------------------------------ graphs, precisions

#: Relative L2 bound per compute dtype (fusedmlp.CHECK_TOLERANCES): bf16 keeps 8 mantissa bits to fp16's 10 (and
#: tf32's), so its rounding error per layer is 8x larger.
PREC_TOL = fusedmlp.CHECK_TOLERANCES


def to_bf16_bits(a):
    """float32 -> bfloat16 bits, round to nearest even (what the kernel reads for bfloat16 I/O)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def run_io(mlp, x32, io):
    """Runs mlp's kernel with io-typed input and output; returns (the input as the kernel saw it, output float64)."""
    return run_io_kernel(mlp._kernel(io), x32, io)


def run_io_kernel(kernel, x32, io):
    """run_io with a given kernel (built for io in and out); the input comes back as float32 (exact), which both the
    float64 references and the CPU forward (float32 only) take."""
    if io == "bfloat16":
        bits = to_bf16_bits(x32)
        y = kernel.run(bits, poison=True)
        return from_bf16_bits(bits), from_bf16_bits(y).astype(np.float64)
    x = x32.astype(io)
    return x.astype(np.float32), kernel.run(x, poison=True).astype(np.float64)


HIDDEN_ACTS = ("relu", "gelu", "tanh", "silu", "sigmoid", "none", "x * tanh(softplus(x))")


def random_graph(rng, max_depth=7, hidden_acts=HIDDEN_ACTS):
    """(ws, bs, acts, residual, concat) of a random graph: 1..max_depth layers up to 256 wide, input concats, residuals
    from the layer's input, earlier layers and x."""
    depth = int(rng.integers(1, max_depth + 1))
    common = int(rng.choice([3, 16, 32, 48, 64, 100, 128, 200, 256]))
    widths = [common if rng.random() < 0.4 else int(rng.integers(1, 64))]
    widths += [common if rng.random() < 0.75 else int(rng.integers(1, 257)) for _ in range(depth)]
    concat = {l: str(rng.choice(["after", "before"])) for l in range(1, depth) if rng.random() < 0.3}
    acts = [str(rng.choice(hidden_acts)) for _ in range(depth - 1)] + [str(rng.choice(["none", "tanh"]))]
    residual = {}
    for l in range(depth):
        sources = [v for v in range(-1, l) if widths[v + 1] == widths[l + 1]]
        if sources and rng.random() < 0.6:
            src = int(rng.choice(sources))
            residual[l] = (str(rng.choice(["add", "add", "mul"])), str(rng.choice(["none", "relu", "tanh"])),
                           "input" if src < 0 else src)
    ws, bs = graph_weights(rng, widths, concat, 1.7)
    return ws, bs, acts, residual, concat


def random_graph_case(rng):
    """random_graph's network and a batch size."""
    return (*random_graph(rng), int(rng.choice([1, 127, 129, 2049, 4099])))


def test_random_graphs_in_every_precision():
    """>= 200 random graphs (residuals from the layer's input, earlier layers and the network input; input concats
    before and after), each in float16, bfloat16 and tf32 with float32, float16 and bfloat16 I/O, vs float64."""
    rng = np.random.default_rng(20261123)
    n = int(os.environ.get("FUSEDMLP_GPU_GRAPHS", "240"))
    cases = [random_graph_case(rng) for _ in range(n)]
    runs = []  # (case index, compute dtype, io dtype, model)
    for i, (ws, bs, acts, residual, concat, batch) in enumerate(cases):
        for j, prec in enumerate(fusedmlp.PRECISIONS):
            io = ("float32", "float16", "bfloat16")[(i + j) % 3]
            runs.append((i, prec, io, fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat,
                                                        dtype=prec, device="cuda")))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(lambda r: r[3]._kernel(r[2]), runs))
    print(f"\nbuilt {len(runs)} graph kernels in {time.perf_counter() - start:.1f} s")
    errors = {p: [] for p in fusedmlp.PRECISIONS}
    failures, skipped = [], 0
    for i, prec, io, mlp in runs:
        ws, bs, acts, residual, concat, batch = cases[i]
        x32 = np.random.default_rng(i).standard_normal((batch, ws[0].shape[1])).astype(np.float32)
        x, y = run_io(mlp, x32, io)
        rms = []
        ref = graph_reference(x, ws, bs, mlp, rms)
        # fp16 storage (compute or I/O) leaves its range past 6e4, and loses bits below RMS 1e-3 (chained 'mul'
        # residuals); bf16 and tf32 keep float32's range.
        if (prec == "float16" or io == "float16") and (np.max(np.abs(ref)) > 6e4 or min(rms) < 1e-3):
            skipped += 1
            continue
        err = rel_l2(y, ref)
        tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
        errors[prec].append(err)
        if np.isnan(y).any() or not err <= tol:
            failures.append((i, prec, io, [w.shape for w in ws], acts, residual, concat, batch, err))
    for prec, errs in errors.items():
        e = np.array(errs)
        print(f"{prec}: {len(e)} graphs, relative L2 median {np.median(e):.2e}, p99 {np.quantile(e, 0.99):.2e}, "
              f"max {e.max():.2e}")
    print(f"{skipped} float16 runs outside float16's range, {len(failures)} failures")
    assert all(len(e) >= 200 for p, e in errors.items() if p != "float16") and len(errors["float16"]) >= 180
    assert not failures, failures[:5]


NERF_WIDTHS = [63] + [256] * 8 + [4]


@pytest.mark.parametrize("prec", fusedmlp.PRECISIONS)
def test_nerf_mlp_in_every_precision(rng, prec):
    """The 8 x 256 NeRF trunk with the 63-wide encoded input concatenated before layer 5 (torch.cat([x, h]))."""
    ws, bs = [], []
    for l in range(9):
        fan_in = NERF_WIDTHS[l] + (63 if l == 5 else 0)
        bound = 1 / np.sqrt(fan_in)
        ws.append(rng.uniform(-bound, bound, (NERF_WIDTHS[l + 1], fan_in)).astype(np.float32))
        bs.append(rng.uniform(-bound, bound, NERF_WIDTHS[l + 1]).astype(np.float32))
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat={5: "before"}, dtype=prec, device="cuda")
    for batch, io in [(1, "float32"), (1000, "float16"), (65537, "float32"), (4097, "bfloat16")]:
        x, y = run_io(mlp, rng.standard_normal((batch, 63)).astype(np.float32), io)
        ref = graph_reference(x, ws, bs, mlp)
        tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
        assert not np.isnan(y).any() and rel_l2(y, ref) <= tol, (batch, io, rel_l2(y, ref))


@pytest.mark.parametrize("prec", fusedmlp.PRECISIONS)
def test_resnet_mlp_in_every_precision(rng, prec):
    widths = [64, 128, 128, 128, 128, 128, 64]
    ws, bs = torch_init(rng, widths, True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual={1: "add", 2: "add", 3: "add", 4: "add"}, dtype=prec,
                            device="cuda")
    for batch, io in [(129, "float32"), (65537, "bfloat16"), (3000, "float16")]:
        x, y = run_io(mlp, rng.standard_normal((batch, 64)).astype(np.float32), io)
        ref = graph_reference(x, ws, bs, mlp)
        tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
        assert not np.isnan(y).any() and rel_l2(y, ref) <= tol, (batch, io, rel_l2(y, ref))


def test_tf32_keeps_float32_range_where_float16_overflows(rng):
    """Activations past 65504 are inf in fp16 storage; tf32 stores float32 and gets them right."""
    ws = [rng.standard_normal((32, 8)).astype(np.float32) * 300, rng.standard_normal((4, 32)).astype(np.float32)]
    x = rng.standard_normal((500, 8)).astype(np.float32) * 100
    tf32 = fusedmlp.FusedMLP(ws, None, activation="none", dtype="tf32", device="cuda")
    ref = graph_reference(x, ws, [None, None], tf32)
    assert np.abs(ref).max() > 1e5
    assert rel_l2(tf32._kernel("float32").run(x, poison=True), ref) <= PREC_TOL["tf32"]
    fp16 = fusedmlp.FusedMLP(ws, None, activation="none", device="cuda")
    assert not np.isfinite(fp16._kernel("float32").run(x, poison=True)).all()


@pytest.mark.parametrize("prec", fusedmlp.PRECISIONS)
def test_pinn_tanh_network_with_fast_tanh_stays_within_the_bound(rng, prec):
    """pinn50's shape: hidden tanh layers stored in 16 bits use tanh.approx; the network error stays the dtype's."""
    ws, bs = torch_init(rng, [2, 50, 50, 50, 50, 50, 1], True)
    mlp = fusedmlp.FusedMLP(ws, bs, "tanh", dtype=prec, device="cuda")
    for batch, io in [(1000, "float32"), (70001, "float16"), (3000, "bfloat16")]:
        x, y = run_io(mlp, rng.standard_normal((batch, 2)).astype(np.float32), io)
        ref = graph_reference(x, ws, bs, mlp)
        tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
        assert not np.isnan(y).any() and rel_l2(y, ref) <= tol, (batch, io, rel_l2(y, ref))


@pytest.mark.parametrize("act", ["tanh", "sigmoid", "silu", "gelu"])
def test_fast_activations_stay_within_16_bit_rounding(act):
    """A hidden layer stored in fp16 uses the one-MUFU forms; an identity layer after it copies the stored values out
    in float32, so this sees act(x) as stored: within 1.25x fp16's rounding of values of order one (2^-11 relative,
    and 2^-11 absolute below magnitude 1, where sigmoid/silu/gelu take their tails). Measured on an H100: tanh 0.41x
    that rounding bound, sigmoid 0.40x, silu 0.78x, gelu 0.80x (its 3e-5 fit error on top of a full rounding)."""
    x = np.concatenate([np.linspace(-12, 12, 48001), np.geomspace(1e-4, 12, 2000), -np.geomspace(1e-4, 12, 2000)])
    x = x.astype(np.float16).astype(np.float32)[:, None]
    mlp = fusedmlp.FusedMLP([np.ones((1, 1), np.float32), np.ones((1, 1), np.float32)], None, activation=[act, "none"],
                            device="cuda")
    y = mlp._kernel("float32").run(x, poison=True)[:, 0].astype(np.float64)
    assert "    FM_FAST_HELPERS" in mlp.source
    ref = _core.eval_expr(mlp.activations[0], x[:, 0].astype(np.float64))
    err = np.abs(y - ref)
    bound = 1.25 * 2.0 ** -11 * np.maximum(np.abs(ref), 1.0)
    print(f"\n{act}: max abs error {err.max():.2e} at x = {x[np.argmax(err), 0]:.3f}; max error / bound "
          f"{(err / bound).max():.2f}")
    assert (err <= bound).all(), (act, float(x[np.argmax(err / bound), 0]), float((err / bound).max()))


@pytest.mark.parametrize("act", ["tanh", "sigmoid", "silu", "gelu"])
def test_fast_activations_of_float32_pre_activations(act):
    """As above, with the pre-activations a kernel really sees: float32 sums, not float16 values (here w * x, the
    product of two float16 values, exact in float32). The one-MUFU forms take the float32 argument as it is, so the
    stored result stays within 1.25 float16 roundings of act at the exact pre-activation (a float16 MUFU, which
    rounds the argument first, reached 1.1x: bench/results/h100/act16_probe.txt)."""
    x = np.concatenate([np.linspace(-12, 12, 60001), np.geomspace(1e-4, 12, 3000), -np.geomspace(1e-4, 12, 3000)])
    x = x.astype(np.float16).astype(np.float32)[:, None]
    w = np.float32(np.float16(0.3))
    mlp = fusedmlp.FusedMLP([np.full((1, 1), w, np.float32), np.ones((1, 1), np.float32)], None,
                            activation=[act, "none"], device="cuda")
    y = mlp._kernel("float32").run(x, poison=True)[:, 0].astype(np.float64)
    assert "    FM_FAST_HELPERS" in mlp.source
    z = np.float64(w) * x[:, 0].astype(np.float64)
    ref = _core.eval_expr(act, z)
    err = np.abs(y - ref)
    bound = 1.25 * 2.0 ** -11 * np.maximum(np.abs(ref), 1.0)
    print(f"\n{act}: max error / bound {(err / bound).max():.2f} at z = {z[np.argmax(err / bound)]:.4f}")
    assert (err <= bound).all(), (act, float(z[np.argmax(err / bound)]), float((err / bound).max()))


def kernel_error(kernel, mlp, ws, bs, x32, prec, io):
    """(relative L2 error of a loaded kernel on x32 against float64, its tolerance), or None where the reference
    leaves what float16 holds (values past 6e4, or a layer's RMS under 1e-3); NaN in the output is an infinite
    error."""
    x, y = run_io_kernel(kernel, x32, io)
    rms = []
    ref = graph_reference(x, ws, bs, mlp, rms)
    if (prec == "float16" or io == "float16") and (np.max(np.abs(ref)) > 6e4 or min(rms) < 1e-3):
        return None
    err = np.inf if np.isnan(y).any() else rel_l2(y, ref)
    return err, max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)


def call_error(mlp, ws, bs, x32, prec):
    """kernel_error for a call of the model on float32 x32 (its default plan: one kernel, or segments)."""
    y = np.asarray(mlp(x32), np.float64)
    rms = []
    ref = graph_reference(x32, ws, bs, mlp, rms)
    if prec == "float16" and (np.max(np.abs(ref)) > 6e4 or min(rms) < 1e-3):
        return None
    return (np.inf if np.isnan(y).any() else rel_l2(y, ref)), PREC_TOL[prec]


def tally(result, failures, case):
    """One kernel_error result into a test's tally: 0 where the reference left what float16 holds (None), else 1,
    with case + (error,) appended to failures where the error is past the tolerance."""
    if result is None:
        return 0
    err, tol = result
    if not err <= tol:
        failures.append(case + (err,))
    return 1


def test_wgmma_kernel_on_random_chains_in_every_warpgroup_count():
    """The sm_90a warpgroup kernel (where the GPU has it), forced at 1-4 warpgroups per CTA, on random chains with
    own-input residuals, float16 and bfloat16, all I/O dtypes, odd batches, vs float64; the mma.sync kernel of the
    same model must agree with the same reference."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"wgmma needs sm_90; this GPU is sm_{info['arch']}")
    rng = np.random.default_rng(20261124)
    failures, checked, wgmma_runs = [], 0, 0
    for i in range(48):
        depth = int(rng.integers(1, 7))
        widths = [random_width(rng) for _ in range(depth + 1)]
        residual = {l: (str(rng.choice(["add", "mul"])), str(rng.choice(["none", "relu"])))
                    for l in range(depth) if widths[l] == widths[l + 1] and rng.random() < 0.5}
        acts = [str(rng.choice(BUILTINS + EXPRESSIONS)) for _ in range(depth - 1)] + ["none"]
        prec = ("float16", "bfloat16")[i % 2]
        io = ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, {}, 1.0)
        batch = int(rng.choice([1, 63, 65, 1000, 4099, 70001]))
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, dtype=prec, device="cuda")
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        warps = 4 * (1 + i % 4)
        for wgmma in (1, 0):
            options = {"wgmma": wgmma, "warps": warps} if wgmma else {"wgmma": 0}
            try:
                kernel, plan, _, _ = mlp._build(io, io, **options)
            except fusedmlp.LimitError:  # that many warpgroups' stages do not fit: fewer may
                try:
                    kernel, plan, _, _ = mlp._build(io, io, wgmma=wgmma)
                except fusedmlp.LimitError:  # the weights overflow shared memory, or a hidden layer the registers
                    assert wgmma == 1
                    continue
            wgmma_runs += wgmma
            assert plan.info["wgmma"] == wgmma
            checked += tally(kernel_error(kernel, mlp, ws, bs, x32, prec, io), failures,
                             (i, wgmma, plan.info["warps"], widths, acts, residual, prec, io, batch))
    print(f"\nwgmma vs mma.sync: {checked} runs checked ({wgmma_runs} built with wgmma), {len(failures)} failures")
    assert checked >= 60 and wgmma_runs >= 30
    assert not failures, failures[:5]


def test_wgmma_kernel_on_random_chains_with_residuals_from_further_back():
    """Residuals that read a value from two or more layers back, or the network input (SimBa's blocks h + W2 f(W1 h),
    ResNet-like MLPs), in the sm_90a warpgroup kernel: the value kept in registers from its layer on (fm_network's
    ka). Random chains of one width (a last layer of another; a third with x joining a layer, NeRF's concat, whose
    fragments the streamed form keeps beside), forced onto the register-A form with resident weights and onto the
    streamed one, float16 and bfloat16, all I/O dtypes, odd batches, vs float64; the mma.sync kernel of the same model
    against the same reference. A graph that would keep two values at once is the planner's
    LimitError (skipped here, counted)."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"wgmma needs sm_90; this GPU is sm_{info['arch']}")
    rng = np.random.default_rng(20261127)
    failures, checked, wgmma_runs, refused = [], 0, 0, 0
    for i in range(40):
        depth = int(rng.integers(3, 8))
        width = int(rng.choice([16, 32, 64, 96, 128, 256]))
        widths = [width if rng.random() < 0.4 else int(rng.integers(1, 64))] + [width] * (depth - 1)
        widths.append(width if rng.random() < 0.5 else int(rng.integers(1, 40)))
        residual, start = {}, 0  # blocks of 2 or 3 layers, each adding its input (x for a first block)
        while start + 1 < depth:
            end = min(start + int(rng.integers(1, 3)), depth - 1)
            if widths[start] == width and widths[end + 1] == width and rng.random() < 0.8:
                residual[end] = (str(rng.choice(["add", "add", "mul"])), str(rng.choice(["none", "relu"])),
                                 "input" if start == 0 else start - 1)
            elif widths[end] == widths[end + 1] and rng.random() < 0.5:
                residual[end] = "add"  # the own input
            start = end + 1
        concat = {}  # x joining a layer without a residual: x's fragments kept beside (the streamed form only)
        free = [l for l in range(1, depth) if l not in residual]
        if free and i % 3 == 0:
            concat[int(rng.choice(free))] = str(rng.choice(["after", "before"]))
        acts = [str(rng.choice(["relu", "gelu", "silu", "tanh", "none"])) for _ in range(depth - 1)] + ["none"]
        prec = ("float16", "bfloat16")[i % 2]
        io = ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        batch = int(rng.choice([1, 63, 65, 1000, 4099, 70001]))
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=prec, device="cuda")
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        for options in ({"wgmma": 1, "warps": 8}, {"wgmma": 1, "resident": 0, "warps": 8}, {"wgmma": 0}):
            try:
                kernel, plan, _, _ = mlp._build(io, io, **options)
            except fusedmlp.LimitError:
                refused += 1
                continue
            wgmma_runs += plan.info["wgmma"]
            checked += tally(kernel_error(kernel, mlp, ws, bs, x32, prec, io), failures,
                             (i, options, widths, acts, residual, concat, prec, io, batch))
    print(f"\nresiduals from further back: {checked} runs checked ({wgmma_runs} wgmma), {refused} plans refused, "
          f"{len(failures)} failures")
    assert checked >= 80 and wgmma_runs >= 50
    assert not failures, failures[:5]


# Networks with stretches of layers that have the same code (render.c's REPEAT), which the warpgroup kernel runs as
# one loop over their weights and biases: (widths, activation, output activation, bias, residual, prec, io, options).
LOOP_CASES = [
    ([32] + [64] * 6 + [16], "relu", "none", False, {}, "float16", "float16", {}),  # layers 1-5
    ([48] * 6, "relu", "relu", True, {}, "float16", "float16", {}),  # from layer 0 up to the last
    ([64] + [128] * 5 + [64], "gelu", "none", True, {l: "add" for l in range(1, 5)}, "bfloat16", "float32", {}),
    ([16, 96, 96, 96, 80, 80, 80, 8], "silu", "none", True,
     {1: ("mul", "relu"), 2: ("mul", "relu"), 4: "add", 5: "add"}, "float16", "bfloat16", {}),  # two stretches
    ([3] + [128] * 4 + [1], "tanh", "sigmoid", True, {}, "float16", "float32", {"n_chunk": 64}),  # in column groups
    ([2] + [50] * 5 + [1], "tanh", "none", True, {}, "bfloat16", "float16", {}),  # padded columns (50 of 56)
]


def test_wgmma_layer_loops_match_float64():
    """The warpgroup kernel's loops over layers with the same code: each pass must read its own layer's weights and
    bias (every layer has its own random ones), carry the activations and the residual operand to the next pass,
    and stop before the last layer; at 1, 2 and 4 warpgroups per CTA, odd batches, vs float64."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"wgmma needs sm_90; this GPU is sm_{info['arch']}")
    rng = np.random.default_rng(20261122)
    failures, checked, built = [], 0, set()
    for i, (widths, act, out_act, bias, residual, prec, io, options) in enumerate(LOOP_CASES):
        ws, bs = torch_init(rng, widths, bias)
        ws = [2 * w for w in ws]  # so that the activations of deep relu and tanh stacks do not fade out
        mlp = fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, residual=residual, dtype=prec,
                                device="cuda")
        for warps in (4, 8, 16):
            try:
                kernel, plan, source, _ = mlp._build(io, io, wgmma=1, warps=warps, **options)
            except fusedmlp.LimitError:  # that many warpgroups do not fit this network
                continue
            built.add(i)
            repeats = rendered_repeats(source)
            assert plan.info["wgmma"] == 1 and max(repeats) >= 2, (widths, repeats)
            for batch in (70001, 129):
                x32 = np.random.default_rng(batch + i).standard_normal((batch, widths[0])).astype(np.float32)
                checked += tally(kernel_error(kernel, mlp, ws, bs, x32, prec, io), failures,
                                 (i, widths, act, residual, prec, io, warps, batch))
    print(f"\nwgmma layer loops: {checked} runs checked, {len(failures)} failures")
    assert built == set(range(len(LOOP_CASES))) and checked >= 20
    assert not failures, failures[:5]


# K-pipelined layers (plan.c's pipe, fused_mlp_sm90.cu's fm_pnetwork): chains without residuals whose hidden
# activations are not relu or the identity, and three equal 128-wide tanh layers (one more and the kernel would loop
# over them: then plan.c pipelines none).
PIPE_ACTS = ["tanh", "silu", "sigmoid", "sin", "gelu", "mish", "x * tanh(softplus(x))", "relu", "none"]


def pipe_cases():
    rng = np.random.default_rng(20261123)
    for i in range(20):
        depth = int(rng.integers(2, 7))
        widths = [int(rng.integers(1, 40))] + [int(rng.choice([16, 50, 64, 96, 100, 128, 160]))
                                               for _ in range(depth - 1)] + [int(rng.integers(1, 40))]
        acts = [str(rng.choice(PIPE_ACTS)) for _ in range(depth - 1)] + [str(rng.choice(["none", "sigmoid"]))]
        yield i, widths, acts, [bool(rng.random() < 0.6) for _ in range(depth)], rng
    yield 20, [2] + [128] * 3 + [3], ["tanh"] * 3 + ["none"], [True] * 4, rng


def test_wgmma_k_pipelined_layers_keep_the_bits_of_the_unpipelined_kernel():
    """A K-pipelined layer (its epilogue 16 columns at a time, each followed by the next layer's k step over them)
    computes the same sums in the same order as the unpipelined kernel: the outputs must be the same bits, at 1 and 2
    warpgroups per CTA, all I/O dtypes, float16 and bfloat16, odd batches; and within the tolerance of float64. An
    automatic plan with pipelined layers must build a kernel without spills (_api rebuilds it unpipelined where ptxas
    spilled), and where it did, the sin layers' 32-byte call frame must not have counted as spills."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"wgmma needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked, piped, same, rebuilt = [], 0, 0, 0, 0
    for i, widths, acts, bias, rng in pipe_cases():
        prec, io = ("float16", "bfloat16")[i % 2], ("float16", "float32", "bfloat16")[i % 3]
        ws, bs = torch_init(rng, widths, bias)
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, dtype=prec, device="cuda")
        batch = int(rng.choice([1, 65, 1000, 4099, 70001]))
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        for warps in (4, 8):
            try:
                on, plan, source, _ = mlp._build(io, io, wgmma=1, warps=warps, kpipe=1)
            except fusedmlp.LimitError:  # no layer to pipeline (relu and none only), or too many warps
                continue
            off, plan_off, _, _ = mlp._build(io, io, wgmma=1, warps=warps, kpipe=-1)
            assert plan.info["kpipe"] == 1 and plan_off.info["kpipe"] == 0 and "PIPE = true" in source
            piped += 1
            _, y_on = run_io_kernel(on, x32, io)
            _, y_off = run_io_kernel(off, x32, io)
            same += np.array_equal(y_on, y_off, equal_nan=True)
            if not np.array_equal(y_on, y_off, equal_nan=True):
                failures.append((i, widths, acts, prec, io, warps, batch, "bits differ"))
            checked += tally(kernel_error(on, mlp, ws, bs, x32, prec, io), failures,
                             (i, widths, acts, prec, io, warps, batch))
            auto, plan_auto, _, _ = mlp._build(io, io, wgmma=1, warps=warps)
            assert not plan_auto.info["kpipe"] or not fusedmlp._api.spilled(auto, plan_auto), (widths, acts, warps)
            rebuilt += plan.info["kpipe"] and not plan_auto.info["kpipe"]
    # a sine's far-argument call frame (32 bytes of local memory) is not a spill: this one stays pipelined
    ws, bs = torch_init(np.random.default_rng(5), [2, 64, 64, 64, 3], [True] * 4)
    sine = fusedmlp.FusedMLP(ws, bs, activation="sin", device="cuda")
    kernel, plan, _, _ = sine._build("float16", "float16", wgmma=1, warps=16)
    assert kernel.info["local_bytes"] > 0 and plan.info["kpipe"] == 1, (kernel.info, plan.info)
    print(f"\nK-pipelined layers: {piped} kernels, {same} bit for bit, {checked} checked vs float64, "
          f"{len(failures)} failures; {rebuilt} automatic plans rebuilt without (spills)")
    assert piped >= 20 and checked >= 10
    assert not failures, failures[:5]


def split_chain_cases():
    """The random chains of the column-group test (bench/results/h100/wgmma_split_diag.txt), one namespace each:
    i, widths, acts, residual, prec, io, ws, bs, batch, n_chunk, mlp (on the GPU) and x32 (its input)."""
    rng = np.random.default_rng(20261122)
    for i in range(24):
        depth = int(rng.integers(2, 5))
        widths = [int(rng.choice([3, 32, 64, 96, 128, 192]))] + [int(rng.choice([64, 96, 128, 192]))
                                                                   for _ in range(depth - 1)] + [int(rng.integers(1, 40))]
        residual = {l: "add" for l in range(depth) if widths[l] == widths[l + 1] and rng.random() < 0.5}
        acts = [str(rng.choice(["relu", "tanh", "silu", "gelu", "none"])) for _ in range(depth - 1)] + ["none"]
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, {}, 1.0)
        batch = int(rng.choice([65, 1000, 4099]))
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, dtype=prec, device="cuda")
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        yield types.SimpleNamespace(i=i, widths=widths, acts=acts, residual=residual, prec=prec, io=io, ws=ws, bs=bs,
                                    batch=batch, n_chunk=(32, 64)[i % 2], mlp=mlp, x32=x32)


def test_wgmma_layers_split_into_column_groups():
    """The warpgroup kernel with each layer's columns forced into groups (n_chunk: 128 = 2 x 64, 192 = 3 x 64,
    96 = 64 + 32, ...), each group's MMA and epilogue after the previous group's in the source; vs float64 and,
    element for element, vs the same kernel unsplit (the same sums in the same order). Groups of layers without a
    bias in the accumulators came out wrong when the first k step ignored the accumulators (scale-d 0; 9 of these
    24 cases on the H100, bench/results/h100/wgmma_split_diag.txt)."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"wgmma needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked = [], 0
    for c in split_chain_cases():
        try:
            kernel, plan, source, _ = c.mlp._build(c.io, c.io, wgmma=1, warps=4, n_chunk=c.n_chunk)
        except fusedmlp.LimitError:
            continue
        for n, nc in re.findall(r"N = (\d+), NR = \d+, NC = (\d+);", source):
            n, nc = int(n), int(nc)
            assert nc == (c.n_chunk if n > c.n_chunk else n), (c.widths, n, nc)
        _, y_split = run_io_kernel(kernel, c.x32, c.io)
        _, y_whole = run_io_kernel(c.mlp._build(c.io, c.io, wgmma=1, warps=4)[0], c.x32, c.io)
        if not np.array_equal(y_split, y_whole, equal_nan=True):
            failures.append((c.i, c.n_chunk, c.widths, "differs from unsplit",
                             float(np.nanmax(np.abs(y_split - y_whole)))))
        checked += tally(kernel_error(kernel, c.mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures,
                         (c.i, c.n_chunk, c.widths, c.acts, c.residual, c.prec, c.io, c.batch))
    print(f"\nwgmma in column groups: {checked} runs checked, {len(failures)} failures")
    assert checked >= 15
    assert not failures, failures[:5]


def cluster_cases():
    """Random chains for the shared-memory-A (cluster) kernel: hidden layers 64-256 wide (so 224-256, which the
    register-A kernel cannot hold), a forced cluster size (1, 2 or 4 CTAs) and warpgroup count, every compute and
    I/O dtype, odd batches."""
    rng = np.random.default_rng(20261125)
    for i in range(30):
        depth = int(rng.integers(2, 6))
        widths = ([int(rng.choice([1, 2, 3, 17, 64]))] + [int(rng.choice([64, 100, 160, 200, 224, 250, 256]))
                                                          for _ in range(depth - 1)]
                  + [int(rng.choice([1, 3, 16, 40, 256]))])
        acts = [str(rng.choice(["sin", "relu", "tanh", "gelu", "silu", "none", "x * tanh(softplus(x))"]))
                for _ in range(depth - 1)] + [str(rng.choice(["none", "sigmoid"]))]
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, {}, 1.0)
        batch = int(rng.choice([1, 63, 65, 129, 1000, 4099, 70001]))
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        yield types.SimpleNamespace(i=i, widths=widths, acts=acts, prec=prec, io=io, ws=ws, bs=bs, batch=batch,
                                    cluster=(1, 2, 4)[i % 3], warps=(8, 4)[(i // 3) % 2], x32=x32)


def test_cluster_kernel_on_random_wide_chains():
    """The warpgroup kernel with activations in shared memory, each layer's columns split over a cluster of 1, 2 or
    4 CTAs that exchange them through distributed shared memory (siren256's form), vs float64; the default plan of
    each network (what a call gets) too."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"the cluster kernel needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked, sizes = [], 0, set()
    for c in cluster_cases():
        mlp = fusedmlp.FusedMLP(c.ws, c.bs, activation=c.acts, dtype=c.prec, device="cuda")
        forced = None
        for options in ({"cluster": c.cluster, "warps": c.warps}, {"cluster": c.cluster}):
            try:
                forced = mlp._build(c.io, c.io, **options)[:2]
                break
            except fusedmlp.LimitError:  # the weights' share or the buffers do not fit that shape
                continue
        builds = [b for b in (forced, mlp._build(c.io, c.io)[:2]) if b is not None]
        for kernel, plan in builds:
            cl, k = plan.info["cluster"], kernel.info  # the grid: clusters that can run at once (GPCs decide)
            assert cl < 2 or 1 <= k["max_clusters"] <= info["sm_count"] * k["blocks_per_sm"] // cl, (cl, k)
            if tally(kernel_error(kernel, mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures,
                     (c.i, cl, plan.info["warps"], c.widths, c.acts, c.prec, c.io, c.batch)):
                checked += 1
                sizes.add(cl)
    print(f"\ncluster kernel: {checked} runs checked, cluster sizes {sorted(sizes)}, {len(failures)} failures")
    assert checked >= 30 and {1, 2, 4} <= sizes
    assert not failures, failures[:5]


def stream_cases():
    """Random chains for the streamed register-A kernel: widths 1-256 (224-256 hidden layers included, which the
    resident register-A kernel cannot hold), own-input residuals, input concats (x before or after a hidden layer's
    input: NeRF's skip), a forced column group (16-256 columns: one slot's weights) and warpgroup count, float16 and
    bfloat16 compute, every I/O dtype, odd batches; long enough runs that a CTA's slots wrap around many times."""
    rng = np.random.default_rng(20261126)
    for i in range(36):
        depth = int(rng.integers(1, 7))
        widths = ([int(rng.choice([1, 2, 3, 17, 64, 200]))] + [int(rng.choice([16, 64, 100, 160, 224, 250, 256]))
                                                               for _ in range(depth - 1)]
                  + [int(rng.choice([1, 3, 16, 40, 256]))])
        acts = [str(rng.choice(["sin", "relu", "tanh", "gelu", "silu", "none"])) for _ in range(depth - 1)] + [
            str(rng.choice(["none", "sigmoid"]))]
        residual = {l: "add" for l in range(1, depth) if widths[l] == widths[l + 1] and rng.random() < 0.5}
        concat = {}
        if depth > 1 and rng.random() < 0.4:
            j = int(rng.integers(1, depth))
            concat[j] = str(rng.choice(["before", "after"]))
            residual.pop(j, None)
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        batch = int(rng.choice([1, 63, 129, 1000, 4099, 70001, 300001]))
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        yield types.SimpleNamespace(i=i, widths=widths, acts=acts, residual=residual, concat=concat, prec=prec, io=io,
                                    ws=ws, bs=bs, batch=batch, n_chunk=(64, 16, 128, 32, 256)[i % 5],
                                    warps=(8, 4, 12)[(i // 5) % 3], x32=x32)


def test_streamed_wgmma_kernel_on_random_chains():
    """The register-A warpgroup kernel with its weights streamed from global memory through shared-memory slots
    (wgmma=1, resident=0: a bulk copy per column group, refilled by the last warp done with it), vs float64."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"the streamed warpgroup kernel needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked, slots = [], 0, set()
    for c in stream_cases():
        mlp = fusedmlp.FusedMLP(c.ws, c.bs, activation=c.acts, residual=c.residual or None, concat=c.concat or None,
                                dtype=c.prec, device="cuda")
        built = None
        for options in ({"n_chunk": c.n_chunk, "warps": c.warps}, {"n_chunk": c.n_chunk}, {}):
            try:
                built = mlp._build(c.io, c.io, wgmma=1, resident=0, **options)[:2]
                break
            except fusedmlp.LimitError:  # that group width or warp count does not fit the registers or slots
                continue
        assert built is not None, (c.i, c.widths)
        kernel, plan = built
        assert plan.info["stream_slots"] >= 2 and not plan.info["resident"], plan.info
        if tally(kernel_error(kernel, mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures,
                 (c.i, plan.info["warps"], plan.info["stream_slots"], c.n_chunk, c.widths, c.acts, c.residual,
                  c.concat, c.prec, c.io, c.batch)):
            checked += 1
            slots.add(plan.info["stream_slots"])
    concats = sum(bool(c.concat) for c in stream_cases())
    print(f"\nstreamed wgmma kernel: {checked} runs checked ({concats} with a concat), slot counts {sorted(slots)}, "
          f"{len(failures)} failures")
    assert checked >= 25 and concats >= 8
    assert not failures, failures[:5]


def wide_stream_cases():
    """Random chains with layers wider than 256 (up to 512) for the streamed kernel's wide form: outputs through the
    warps' wide buffers, weights in K pieces. Narrow and wide layers mixed, own-input residuals (wide ones too), input
    concats, forced group widths (64, 128) and K pieces (16 to 256 columns, or the plan's), one or two warpgroups,
    float16 and bfloat16 compute, every I/O dtype, odd batches."""
    rng = np.random.default_rng(20261127)
    for i in range(24):
        depth = int(rng.integers(1, 6))
        hidden = [16, 64, 200, 256, 272, 300, 384, 448, 512]
        widths = ([int(rng.choice([1, 3, 17, 64, 259, 512]))] + [int(rng.choice(hidden)) for _ in range(depth - 1)]
                  + [int(rng.choice([1, 3, 16, 256, 300, 512]))])
        if max(widths) <= 256:
            widths[int(rng.integers(0, len(widths)))] = 512
        acts = [str(rng.choice(["sin", "relu", "tanh", "gelu", "silu", "none"])) for _ in range(depth - 1)] + [
            str(rng.choice(["none", "sigmoid"]))]
        residual = {l: "add" for l in range(1, depth) if widths[l] == widths[l + 1] and rng.random() < 0.5}
        concat = {}
        if depth > 1 and widths[0] <= 64 and rng.random() < 0.3:
            j = int(rng.integers(1, depth))
            concat[j] = str(rng.choice(["before", "after"]))
            residual.pop(j, None)
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        batch = int(rng.choice([1, 63, 129, 1000, 4099, 70001]))
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        yield types.SimpleNamespace(i=i, widths=widths, acts=acts, residual=residual, concat=concat, prec=prec, io=io,
                                    ws=ws, bs=bs, batch=batch, n_chunk=(128, 64)[i % 2],
                                    k_chunk=(0, 64, 128, 16, 256, 48)[i % 6], x32=x32)


def test_streamed_wgmma_kernel_on_random_wide_chains():
    """Layers wider than 256 in the streamed warpgroup kernel (sm_90a's fused form for them) vs float64: the forced
    shape, and the plan a call gets (the whole network where it fits, else segments, whose GEMMs and fused stretches
    each run). And K pieces do not change a bit: the same k steps run into the same accumulators in the same order,
    so a forced piece width gives the plan's results exactly."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"the streamed warpgroup kernel needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked, wide, pieces = [], 0, 0, 0
    for c in wide_stream_cases():
        mlp = fusedmlp.FusedMLP(c.ws, c.bs, activation=c.acts, residual=c.residual or None, concat=c.concat or None,
                                dtype=c.prec, device="cuda")
        forced = None
        for options in ({"n_chunk": c.n_chunk, "k_chunk": c.k_chunk}, {"n_chunk": 64}, {}):
            try:
                forced = mlp._build(c.io, c.io, wgmma=1, resident=0, **options)
                break
            except fusedmlp.LimitError:  # the registers (a wide concat) or shared memory do not fit that shape
                continue
        case = (c.i, c.n_chunk, c.k_chunk, c.widths, c.acts, c.residual, c.concat, c.prec, c.io, c.batch)
        if forced is not None:
            kernel, plan, source, _ = forced
            wide += "WIDE = true" in source
            pieces += bool(re.search(r"K = (\d+),.*\n.*KC = (?!\1;)", source))
            if tally(kernel_error(kernel, mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures, case + ("forced",)):
                checked += 1
            if c.k_chunk:  # the same network in whole-group slots where they fit, else the plan's pieces
                for options in ({"n_chunk": c.n_chunk, "k_chunk": 512}, {"n_chunk": c.n_chunk}):
                    try:
                        other = mlp._build(c.io, c.io, wgmma=1, resident=0, **options)[0]
                        break
                    except fusedmlp.LimitError:
                        other = None
                if other is not None:
                    _, y_a = run_io_kernel(kernel, c.x32, c.io)
                    _, y_b = run_io_kernel(other, c.x32, c.io)
                    if not np.array_equal(y_a, y_b, equal_nan=True):
                        failures.append(case + ("K pieces change the result",
                                                float(np.nanmax(np.abs(y_a.astype(np.float64) - y_b)))))
        checked += tally(call_error(mlp, c.ws, c.bs, c.x32, c.prec), failures, case + ("default plan",))
    print(f"\nstreamed wgmma kernel, wide chains: {checked} runs checked ({wide} with wide buffers, {pieces} in K "
          f"pieces), {len(failures)} failures")
    assert checked >= 30 and wide >= 10 and pieces >= 8
    assert not failures, failures[:5]


def wide_stream_models():
    """(case, its model on the GPU) for each of wide_stream_cases(); a skip on a GPU other than sm_90."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"the streamed warpgroup kernel needs sm_90; this GPU is sm_{info['arch']}")
    for c in wide_stream_cases():
        yield c, fusedmlp.FusedMLP(c.ws, c.bs, activation=c.acts, residual=c.residual or None,
                                   concat=c.concat or None, dtype=c.prec, device="cuda")


def same_bits_and_checked(base, kernel, mlp, c, case, failures):
    """A wide_stream_cases() case c: kernel against float64 (tally: 1 where checked) and bit for bit against base, the
    kernel it stands for, on the same rows; each miss appended to failures."""
    checked = tally(kernel_error(kernel, mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures, case)
    _, y_a = run_io_kernel(base, c.x32, c.io)
    _, y_b = run_io_kernel(kernel, c.x32, c.io)
    if not np.array_equal(y_a, y_b, equal_nan=True):
        failures.append(case + ("other bits", float(np.nanmax(np.abs(y_a.astype(np.float64) - y_b)))))
    return checked


def first_built_pair(mlp, io, attempts, base):
    """The first of attempts, (shape options, the variant's options), on which mlp's streamed warpgroup kernel builds
    both with base's options and with the variant's for io: (variant options, base build, variant build); None where
    every attempt raises a LimitError (registers, shared memory, or what the variant refuses)."""
    for shape, variant in attempts:
        try:
            return (variant, mlp._build(io, io, wgmma=1, resident=0, **base, **shape),
                    mlp._build(io, io, wgmma=1, resident=0, **variant, **shape))
        except fusedmlp.LimitError:
            continue
    return None


def test_wide_loop_gives_the_unrolled_kernels_bits_on_random_wide_chains():
    """wide_loop (the default; wide_loop=-1 unrolls): the streamed kernel's wide layers (and a last layer as wide) run
    their column groups as a run-time loop over one group's code (fm_wide_layer; residual and norm layers stay
    unrolled), the slot refills naming their weights from a constant-memory table. On wide_stream_cases(), vs float64,
    and bit for bit the unrolled kernel's results on the same shape: the same MMAs in the same order into the same
    accumulators, the same epilogue."""
    failures, checked, compared = [], 0, 0
    for c, mlp in wide_stream_models():
        # (a LimitError: the registers of a wide concat, or shared memory)
        looped_form = {"wide_loop": 1}
        built = first_built_pair(mlp, c.io, [({"n_chunk": c.n_chunk, "k_chunk": c.k_chunk}, looped_form),
                                             ({"n_chunk": 64}, looped_form), ({}, looped_form)], {"wide_loop": -1})
        if built is None:
            continue
        _, (unrolled, plan_u, _, _), (looped, plan, source, _) = built
        assert plan.info["wide_loop"] == 1 and "#define FM_WIDE_LOOP 1 " in source, plan.info
        assert {k: v for k, v in plan.info.items() if k != "wide_loop"} == {k: v for k, v in plan_u.info.items()
                                                                            if k != "wide_loop"}
        case = (c.i, c.n_chunk, c.k_chunk, c.widths, c.acts, c.residual, c.concat, c.prec, c.io, c.batch)
        checked += same_bits_and_checked(unrolled, looped, mlp, c, case + ("looped",), failures)
        compared += 1
    print(f"\nstreamed wgmma kernel, wide layers looped: {checked} runs checked, {compared} compared with the unrolled "
          f"kernel, {len(failures)} failures")
    assert checked >= 15 and compared >= 20
    assert not failures, failures[:5]


def test_input_buffers_in_the_wide_buffers_give_the_kernels_bits_on_random_wide_chains():
    """in_shared (auto where two warpgroups fit no other way: sdf512's stretches): each warp's input buffer in its
    wide buffer's bytes, its padding columns zeroed again for each tile, x landing there once the tile's y is stored
    (or, x converted on the way in, its raw landing buffer still filling under the tile). On wide_stream_cases(), one
    and two warpgroups, vs float64 and bit for bit the same shape with buffers of their own: the same MMAs on the
    same inputs. Cases with x landing verbatim and converted, and with padding columns, each among them."""
    failures, checked, compared, kinds = [], 0, 0, set()
    for c, mlp in wide_stream_models():
        shared, own = {"in_shared": 1}, {"in_shared": -1}
        built = first_built_pair(mlp, c.io, [({"n_chunk": c.n_chunk, "k_chunk": c.k_chunk, "warps": 4 + 4 * (c.i % 2)},
                                              shared), ({"n_chunk": 64, "warps": 4}, shared)], own)
        if built is None:
            continue
        _, (plain, plan_o, _, _), (in_wide, plan, source, _) = built
        assert plan.info["in_shared"] == 1 and plan_o.info["in_shared"] == 0, (plan.info, plan_o.info)
        assert "#define FM_IN_SHARED 1 " in source
        verbatim = c.io == c.prec and c.widths[0] % 8 == 0
        kinds |= {"x verbatim" if verbatim else "x converted", "padding columns" if c.widths[0] % 16 else "none"}
        case = (c.i, c.widths, c.acts, c.residual, c.concat, c.prec, c.io, c.batch, plan.info["warps"])
        checked += same_bits_and_checked(plain, in_wide, mlp, c, case + ("in_shared",), failures)
        compared += 1
    print(f"\nstreamed wgmma kernel, input buffers in the wide buffers: {checked} runs checked, {compared} compared "
          f"with buffers of their own ({sorted(kinds)}), {len(failures)} failures")
    assert checked >= 12 and compared >= 16 and len(kinds) == 4, (checked, compared, kinds)
    assert not failures, failures[:5]


@pytest.mark.parametrize("widths,acts,residual,prec", [
    ([512, 256, 1], ["relu", "none"], None, "float16"),  # rec1024's tail: x's rows 8-15 past the 256-wide buffer
    ([512, 300, 64], ["gelu", "sigmoid"], None, "bfloat16"),
    ([512, 272, 272, 16], ["silu", "tanh", "none"], {1: "add"}, "float16"),
])
def test_x_rows_past_the_wide_buffer_land_under_the_tiles_layers(widths, acts, residual, prec):
    """in_shared with x wider than the wide buffer and the stage (X_LATE in fused_mlp_sm90.cu): the next tile's x rows
    that share no byte with them are copied in as soon as the tile's own fragments are loaded, under its layers; only
    the others wait for y's store. Batches of many tiles per CTA (the early copy runs only where a CTA has a next
    tile), a last tile cut short (rows past x land as zeros in both parts): vs float64, and bit for bit the same shape
    with buffers of its own."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the streamed warpgroup kernel needs sm_90")
    rng = np.random.default_rng(sum(widths))
    ws, bs = graph_weights(rng, widths, {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, dtype=prec, device="cuda")
    failures, checked = [], 0
    for batch in (70001, 200003):
        x32 = np.random.default_rng(batch).standard_normal((batch, widths[0])).astype(np.float32)
        c = types.SimpleNamespace(ws=ws, bs=bs, x32=x32, prec=prec, io=prec)
        # (own buffers fit two warpgroups only with small K pieces, which change no bit)
        own = mlp._build(prec, prec, wgmma=1, resident=0, warps=8, in_shared=-1, k_chunk=64)
        shared = mlp._build(prec, prec, wgmma=1, resident=0, warps=8, in_shared=1)
        assert shared[1].info["in_shared"] == 1 and own[1].info["in_shared"] == 0
        checked += same_bits_and_checked(own[0], shared[0], mlp, c, (widths, batch), failures)
    assert checked == 2 and not failures, failures


@pytest.mark.parametrize("stacks, width, depth, io", [(2, 256, 3, "float16"), (4, 128, 2, "bfloat16"),
                                                     (2, 192, 2, "float32"), (3, 128, 2, "float16")])
def test_block_diagonal_layers_skip_their_zero_pieces_with_the_dense_kernels_bits(stacks, width, depth, io):
    """Parallel stacks read as one network (block-diagonal hidden layers, fm_spec_find_blocks): the streamed kernel's
    looped wide layers stream and multiply only each column group's own block of K pieces (fm_blocks). Against float64
    and bit for bit the same plan unrolled (wide_loop=-1, which multiplies the zero blocks: adding exact zeros changes
    no sum); 2 x 192 (groups of 128 straddle the blocks) and 3 stacks (384 wide: 3 groups of 128, 3 blocks) take
    what fits, the dense loop otherwise. Rows: a partial strip, a partial tile, many tiles per CTA."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the streamed warpgroup kernel needs sm_90")
    rng = np.random.default_rng(stacks * 1000 + width)
    n_in, n_out, wide = 23, 2, stacks * width
    ws, bs = [rng.uniform(-1, 1, (wide, n_in)).astype(np.float32) / np.sqrt(n_in)], []
    for _ in range(depth - 1):  # block-diagonal hidden layers
        w = np.zeros((wide, wide), np.float32)
        for s in range(stacks):
            w[s * width:(s + 1) * width, s * width:(s + 1) * width] = rng.uniform(-1, 1, (width, width)) / np.sqrt(width)
        ws.append(w)
    ws.append(rng.uniform(-1, 1, (n_out, wide)).astype(np.float32) / np.sqrt(wide))
    bs = [rng.uniform(-0.1, 0.1, w.shape[0]).astype(np.float32) for w in ws]
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", dtype="bfloat16" if io == "bfloat16" else "float16",
                            device="cuda")
    prec = "bfloat16" if io == "bfloat16" else "float16"
    looped, plan, source, _ = mlp._build(io, io, wgmma=1, resident=0)
    unrolled, _, source_u, _ = mlp._build(io, io, wgmma=1, resident=0, wide_loop=-1)
    assert f"BLOCKS = {stacks}; " in source or width % 128, source[:2000]
    failures, checked = [], 0
    for rows in (33, 4099, 70001):  # (33: a partial strip; one row's two outputs are too few for a relative L2)
        x32 = np.random.default_rng(rows).standard_normal((rows, n_in)).astype(np.float32)
        c = types.SimpleNamespace(ws=ws, bs=bs, x32=x32, prec=prec, io=io)
        checked += same_bits_and_checked(unrolled, looped, mlp, c, (stacks, width, rows), failures)
    assert checked >= 2 and not failures, failures


def test_split_wide_layers_give_the_unsplit_kernels_bits_on_random_wide_chains():
    """split=2, 4 or 8 (the tuner tries 2 and 4 below 32 rows per SM): clusters of that many CTAs run one row tile, each
    computing 1/n of every wide layer's column groups and storing them into all the cluster's wide buffers
    (fm_split_copy, the cluster barrier hand-over), narrow layers whole in each CTA, CTA 0 storing y. On
    wide_stream_cases() where a split plan exists (no residual or norm on a wide layer, whole groups per CTA), vs
    float64 and bit for bit the unsplit kernel's results on the same shape: each group's MMAs and epilogue are the same
    code on the same inputs."""
    failures, checked, compared = [], 0, 0
    for c, mlp in wide_stream_models():
        # (a LimitError: a residual or norm on a wide layer, groups per CTA, registers, memory)
        split, narrow = {"split": (2, 4, 8)[c.i % 3]}, {"n_chunk": 64, "warps": 4}
        built = first_built_pair(mlp, c.io, [({"n_chunk": c.n_chunk, "k_chunk": c.k_chunk, "warps": 4 + 4 * (c.i % 2)},
                                              split), (narrow, split), (narrow, {"split": 2})], {})
        if built is None:
            continue
        variant, (plain, plan_u, _, _), (split_k, plan, source, _) = built
        s = variant["split"]
        assert plan.info["split"] == s and f"#define FM_SPLIT {s} " in source, plan.info
        case = (c.i, s, c.widths, c.acts, c.residual, c.concat, c.prec, c.io, c.batch)
        checked += same_bits_and_checked(plain, split_k, mlp, c, case + ("split",), failures)
        compared += 1
    print(f"\nstreamed wgmma kernel, wide layers split over clusters: {checked} runs checked, {compared} compared "
          f"with the unsplit kernel, {len(failures)} failures")
    assert checked >= 6 and compared >= 8
    assert not failures, failures[:5]


@pytest.mark.parametrize("widths,act,residual,loop", [
    ([3, 256, 256, 256, 256, 5], "sin", None, (1, 3)),  # a SIREN's hidden layers (fm_sin_d): layers 1-3, one loop
    ([2, 128, 256, 256, 256, 3], "tanh", None, (2, 2)),  # layer 1 (128 -> 256) has code of its own
    ([16, 192, 192, 192, 192, 8], "gelu", "add", (1, 3)),  # residual blocks
    ([5, 224, 224, 224, 224, 224, 7], "relu", ("add", "relu"), (1, 4)),
])
def test_cluster_kernel_loops_over_hidden_layers_with_the_same_code(rng, widths, act, residual, loop):
    """A stretch of hidden layers with the same code (Layer<l>::REPEAT) is one loop over their weights and biases in
    the shared-memory-A kernel (fm_cl_network), its exchanges in the loop too; layer 0 and the last layer stay
    outside it. Clusters of 1, 2 and 4 CTAs, one and two warpgroups, fp16 and float32 I/O, odd batches, vs float64."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the cluster kernel needs sm_90")
    depth = len(widths) - 1
    ws = [rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-0.5, 0.5, o).astype(np.float32) for o in widths[1:]]
    res = {l: residual for l in range(1, depth - 1)} if residual else None
    mlp = fusedmlp.FusedMLP(ws, bs, activation=[act] * (depth - 1) + ["none"], residual=res, device="cuda")
    first, count = loop
    assert re.findall(r"REPEAT = (\d+);", mlp.source)[first] == str(count), mlp.source
    failures, checked = [], 0
    for batch, io in [(4099, "float16"), (129, "float32"), (70001, "float16")]:
        x32 = rng.uniform(-1, 1, (batch, widths[0])).astype(np.float32)
        for options in ({"cluster": 1}, {"cluster": 2}, {"cluster": 4, "warps": 4}, {"cluster": 2, "warps": 4}):
            try:
                kernel = mlp._build(io, io, **options)[0]
            except fusedmlp.LimitError:  # that cluster shape does not hold these weights
                continue
            checked += tally(kernel_error(kernel, mlp, ws, bs, x32, "float16", io), failures, (options, batch, io))
    assert checked >= 3 and not failures, (checked, failures)


@pytest.mark.parametrize("widths,residual", [
    ([3, 256, 256, 17], None),     # clusters of 4: 16 columns a CTA, CTA 1 stores one, CTAs 2 and 3 none
    ([17, 224, 224, 40], None),    # 40 % VEC == 0: the last real share stored in 16-byte pieces
    ([2, 256, 256, 100], None),    # 100: element by element
    ([64, 256, 256, 192], None),   # clusters of 4 ran it 1.9x mma.sync's time with the last layer whole in CTA 0
    ([2, 256, 256, 256], None),    # with 16-bit y no cluster plan held it before
    ([5, 256, 256, 256], {2: ("add", "tanh")}),  # a residual on the split last layer: its operand by column share
])
def test_cluster_kernel_splits_a_wide_last_layer(rng, widths, residual):
    """A last layer wider than 16 columns is split over the cluster like the hidden layers: each CTA computes its
    share of the columns from the whole exchanged input and stores those columns of y (a share past the real columns
    stores nothing). Clusters of 2 and 4, one and two warpgroups, 16-bit and float32 y, odd batches, vs float64, every
    column within the tolerance (a share stored at the wrong place, or not at all, fails its columns)."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the cluster kernel needs sm_90")
    depth = len(widths) - 1
    ws = [rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-0.5, 0.5, o).astype(np.float32) for o in widths[1:]]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["sin"] + ["gelu"] * (depth - 2) + ["sigmoid"], residual=residual,
                            device="cuda")
    failures, checked = [], 0
    for batch, io in [(4099, "float16"), (129, "float32"), (70001, "bfloat16"), (1, "float16")]:
        x32 = rng.uniform(-1, 1, (batch, widths[0])).astype(np.float32)
        for options in ({"cluster": 2}, {"cluster": 4}, {"cluster": 2, "warps": 4}, {"cluster": 4, "warps": 4}):
            try:
                kernel, plan, source = mlp._build(io, io, **options)[:3]
            except fusedmlp.LimitError:  # that cluster shape does not hold these weights
                continue
            n, nc = map(int, re.findall(r" N = (\d+), NR = \d+, NC = (\d+);", source)[-1])
            assert nc * plan.info["cluster"] == n, (options, n, nc)  # split: each CTA computes NC of the N columns
            x, y = run_io_kernel(kernel, x32, io)
            ref = graph_reference(x, ws, bs, mlp, [])
            tol = max(PREC_TOL["float16"], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
            scale = np.sqrt(np.mean(ref ** 2))
            col_err = np.sqrt(np.mean((y - ref) ** 2, axis=0)) / scale  # per column, against the whole output's RMS
            checked += 1
            if np.isnan(y).any() or not col_err.max() <= 2 * tol:
                failures.append((options, batch, io, int(np.argmax(col_err)), float(np.nanmax(col_err))))
    assert checked >= 8 and not failures, (checked, failures)


def cluster_residual_cases():
    """Random chains of equal-width layers (64-256, so also 224-256, which only the cluster kernel holds) with
    residual epilogues: on layer 0 (x as the operand), hidden layers and the last layer, each adding, multiplying
    or adding then an activation; a forced cluster size (1, 2 or 4 CTAs) and warpgroup count, every dtype."""
    rng = np.random.default_rng(20261123)
    for i in range(30):
        depth = int(rng.integers(2, 6))
        common = int(rng.choice([64, 160, 200, 224, 256]))
        widths = ([int(rng.choice([2, 17, common]))] + [common] * (depth - 1)
                  + [int(rng.choice([3, 16, common]))])
        specs = ["add", "add", "mul", ("add", "relu")]
        residual = {l: specs[int(rng.integers(0, 4))] for l in range(depth)
                    if widths[l] == widths[l + 1] and rng.random() < 0.7}
        acts = [str(rng.choice(["sin", "relu", "tanh", "gelu", "silu", "none"])) for _ in range(depth - 1)] + ["none"]
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        ws, bs = graph_weights(rng, widths, {}, 1.0)
        batch = int(rng.choice([1, 65, 129, 1000, 4099, 70001]))
        x32 = np.random.default_rng(i).standard_normal((batch, widths[0])).astype(np.float32)
        yield types.SimpleNamespace(i=i, widths=widths, acts=acts, residual=residual, prec=prec, io=io, ws=ws, bs=bs,
                                    batch=batch, cluster=(1, 2, 4)[i % 3], warps=(8, 4)[(i // 3) % 2], x32=x32)


def test_cluster_kernel_residual_epilogues_on_random_chains():
    """The cluster kernel's residual epilogues (the operand read from the columns of the A buffer that the layer's
    output then overwrites; layer 0's from x's fragments, this CTA's share picked by its rank) vs float64, forced
    cluster sizes and each network's default plan."""
    info = fusedmlp._api._gpu(0).info
    if info["arch"] != 90:
        pytest.skip(f"the cluster kernel needs sm_90; this GPU is sm_{info['arch']}")
    failures, checked, sizes, with_res = [], 0, set(), 0
    for c in cluster_residual_cases():
        mlp = fusedmlp.FusedMLP(c.ws, c.bs, activation=c.acts, residual=c.residual, dtype=c.prec, device="cuda")
        forced = None
        for options in ({"cluster": c.cluster, "warps": c.warps}, {"cluster": c.cluster}):
            try:
                forced = mlp._build(c.io, c.io, **options)[:3]
                break
            except fusedmlp.LimitError:  # the weights' share, the buffers or layer 0's fragments do not fit
                continue
        for kernel, plan, source in [b for b in (forced, mlp._build(c.io, c.io)[:3]) if b is not None]:
            cl = plan.info["cluster"]
            if tally(kernel_error(kernel, mlp, c.ws, c.bs, c.x32, c.prec, c.io), failures,
                     (c.i, cl, plan.info["warps"], c.widths, c.acts, c.residual, c.prec, c.io, c.batch)):
                checked += 1
                if cl:
                    sizes.add(cl)
                    with_res += bool(re.search(r"RES = [12],", source))
    print(f"\ncluster residuals: {checked} runs checked, {with_res} on clusters with residuals, sizes "
          f"{sorted(sizes)}, {len(failures)} failures")
    assert checked >= 30 and with_res >= 15 and {1, 2, 4} <= sizes
    assert not failures, failures[:5]


def kernel_forms():
    """Plan options forcing each kernel form this GPU has: mma.sync and, on sm_90, the register-A warpgroup kernel and
    the shared-memory-A one on clusters of 1, 2 and 4."""
    forms = [{"wgmma": 0}]
    if fusedmlp._api._gpu(0).info["arch"] == 90:
        forms += [{"wgmma": 1, "cluster": -1, "warps": 4}, {"cluster": 1}, {"cluster": 2}, {"cluster": 4}]
    return forms


def assert_every_kernel_form(mlp, x, ref, tol=FP16_TOL):
    """mlp's fp16 kernel on x (float16) within tol of ref in every form (kernel_forms)."""
    for options in kernel_forms():
        kernel, plan = mlp._build("float16", **options)[:2]
        y = kernel.run(x, poison=True)
        err = rel_l2(y, ref)
        assert not np.isnan(y).any() and err < tol, (options, plan.info["cluster"], err)


@pytest.mark.parametrize("residual", [{1: "add"}, None])
def test_sin_of_far_arguments_in_a_hidden_layer(rng, residual):
    """A hidden sin layer whose input is unbounded (here an identity layer's output) keeps the far check. On the
    cluster kernel, with a residual, it stores its columns over its residual operand, so it cannot store them a second
    time for far arguments: it redoes each 16-column group before its store; without one, the second store is the
    rotating one-group loop (fm_cl_store_again). Pre-activations up to 2^16, exact (a power-of-two diagonal, at most
    2^15 as float16 holds, times fp16 values in [-2, 2]), so the residual's sum stays of order one where float16 holds
    it."""
    width = 128
    w0 = np.ones((width, 1), np.float32)
    w1 = np.diag(2.0 ** rng.integers(-2, 16, width)).astype(np.float32)
    w2 = rng.standard_normal((8, width)).astype(np.float32) / 16
    mlp = fusedmlp.FusedMLP([w0, w1, w2], None, activation=["none", "sin", "none"], residual=residual,
                            device="cuda")
    assert mlp._net.preact_bounds()[1] == np.inf and "fm_sin_t(far, " in mlp.source
    x = (rng.integers(-2047, 2048, (4099, 1)) * 2.0 ** -10).astype(np.float16)
    ref = graph_reference(x, [w0, w1, w2], [None] * 3, mlp)
    assert_every_kernel_form(mlp, x, ref)


def test_siren_hidden_layers_bounded_by_their_weights_run_branch_free(rng):
    """A SIREN's hidden layers take a sine of sines: their pre-activations are bounded by the weights, so they render
    with fm_sin_d (arguments under 400: the hardware unit on x) and no far check (render.c); layer 0 keeps it (x may
    be anything). Every kernel form against float64, within the slope-scaled bound of test_siren_sin30_error_is_bounded_by_its_slope (sin(30 x) in the hidden
    layers too makes fp16's rounding chaotic: 0.29 relative error in every form, before this change as after); and
    NaN rows of x stay NaN rows (the branch-free sine of NaN is NaN), the others unchanged."""
    widths = [2, 128, 128, 128, 3]
    ws, bs = torch_init(rng, widths, True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["sin(30*x)", "sin", "sin", "none"], device="cuda")
    bounds = mlp._net.preact_bounds()
    assert bounds[1] < 400 and bounds[2] < 400, bounds
    assert mlp.source.count("float act(float x, int) { return fm_sin_d(") == 2 and "fm_sin_t(far, " in mlp.source
    x = rng.uniform(-1, 1, (4099, 2)).astype(np.float16)
    ref = graph_reference(x, ws, bs, mlp)
    assert_every_kernel_form(mlp, x, ref, 30 * FP16_TOL)
    y = mlp._kernel("float16").run(x, poison=True)
    x[::97] = np.nan
    y_nan = mlp._kernel("float16").run(x, poison=True)
    assert np.isnan(y_nan[::97]).all()
    keep = np.ones(len(x), bool)
    keep[::97] = False
    assert np.array_equal(y_nan[keep], y[keep])


def test_a_sine_after_a_clamp_runs_the_direct_form(rng):
    """hardtanh bounds its output, so the weights bound the next layer's pre-activations (fm_expr_range models the
    clamp): sin(3 z) there renders fm_sin_d, with no far check anywhere. Every kernel form against float64."""
    widths = [3, 128, 128, 4]
    ws, bs = torch_init(rng, widths, True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["hardtanh(x, -2, 2)", "sin(3*x)", "none"], device="cuda")
    assert 3 * mlp._net.preact_bounds()[1] < 400
    assert "float act(float x, int) { return fm_sin_d((3.0f * x)); }" in mlp.source and "fm_sin_t(far, " not in mlp.source
    x = (rng.standard_normal((4099, 3)) * 2).astype(np.float16)
    ref = graph_reference(x, ws, bs, mlp)
    assert_every_kernel_form(mlp, x, ref, 3 * FP16_TOL)


@pytest.mark.parametrize("act", ["sin", "cos"])
@pytest.mark.parametrize("form,limit", [("b", 980), ("d", 390)])
def test_branch_free_sine_of_a_bounded_hidden_layer_at_exact_arguments(act, form, limit):
    """fm_sin_b / fm_cos_b (arguments under 1000) and fm_sin_d / fm_cos_d (under 400) where the weights' bound puts
    them, at exact arguments up to the form's limit: layer 0 clamps x to [-1, 1] (so layer 1 is bounded by its
    weights) and x runs through every float16 value there; layer 1's column j has one integer weight c_j on it, so
    its pre-activation c_j x is exact in float32 (11 + 9 bits); a last identity layer copies the 16-bit results out in
    float32. 128 scales up to the limit: 3.9M arguments, dense near it where the error grows. Within 1.25x fp16's
    rounding of values of order one, as the branch-free forms of layer 0 (test below), in every form."""
    x = np.arange(0, 0x3c01, dtype=np.uint16).view(np.float16).astype(np.float32)  # every float16 in [0, 1]
    x = np.concatenate([x, -x[1:]])[:, None]
    c = np.round(np.linspace(1, limit, 128)).astype(np.float32)
    w1 = np.zeros((128, 128), np.float32)
    w1[:, 0] = c
    mlp = fusedmlp.FusedMLP([np.ones((128, 1), np.float32), w1, np.eye(128, dtype=np.float32)], None,
                            activation=["min(max(x, -1), 1)", act, "none"], device="cuda")
    assert f"float act(float x, int) {{ return fm_{act}_{form}(x); }}" in mlp.source, mlp._net.preact_bounds()
    ref = getattr(np, act)(c[None, :].astype(np.float64) * x.astype(np.float64))
    for options in kernel_forms():
        y = mlp._build("float32", **options)[0].run(x, poison=True).astype(np.float64)
        err = np.abs(y - ref)
        row, col = np.unravel_index(int(np.argmax(err)), err.shape)
        assert err[row, col] <= 1.25 * 2.0 ** -11, (act, options, float(c[col] * x[row, 0]), float(err[row, col]))


def test_branch_free_sin_stays_within_16_bit_rounding_below_its_far_bound():
    """The warpgroup kernels' branch-free sin and cos of layer 0 (the hardware unit on x; the far redo from |x| = 400)
    on every float16 value in [-1100, 1100]: a hidden layer of 128 copies of act(x) (a width every form takes), stored
    in float16, read back exactly in float32 by a last layer that picks column 0. Within 1.25x float16's rounding of
    values of order one (2^-11 absolute, as test_fast_activations_stay_within_16_bit_rounding), including the
    arguments just under 400 where the direct form is furthest off, and those past it (the far redo)."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the branch-free forms are the sm_90a kernels'")
    x = np.arange(0, 0x7c00, dtype=np.uint16).view(np.float16).astype(np.float32)
    x = x[x <= 1100]
    x = np.concatenate([x, -x])[:, None]
    w0 = np.ones((128, 1), np.float32)
    w1 = np.zeros((1, 128), np.float32)
    w1[0, 0] = 1.0
    for act in ("sin", "cos"):
        mlp = fusedmlp.FusedMLP([w0, w1], None, activation=[act, "none"], device="cuda")
        ref = getattr(np, act)(x[:, 0].astype(np.float64))
        for options in ({"wgmma": 1, "cluster": -1, "warps": 4}, {"cluster": 1}, {"cluster": 2}, {"cluster": 4}):
            kernel, _, source = mlp._build("float32", **options)[:3]
            assert f"fm_{act}_t(far, " in source, options
            y = kernel.run(x, poison=True)[:, 0].astype(np.float64)
            err = np.abs(y - ref)
            bound = 1.25 * 2.0 ** -11
            worst = int(np.argmax(err))
            print(f"\n{act} {options}: max abs error {err[worst]:.2e} at x = {x[worst, 0]:.1f} "
                  f"({err[worst] / bound:.2f} of the bound)")
            assert (err <= bound).all(), (act, options, float(x[worst, 0]), float(err[worst]))


def test_sin_of_far_arguments_in_every_kernel_form(rng):
    """sin of pre-activations up to about 2^30 (exact: one fp16 input times a power-of-two fp16 weight), where the
    warpgroup kernels' branch-free sin (reduction by 2 pi with a 24-bit quotient) is wrong: the epilogue must notice
    and redo those columns with the exact form. Every kernel form: mma.sync, register-A, shared-memory A on clusters
    of 1, 2 and 4 CTAs (near and far rows mixed over many tiles: where session 9's exchange deadlock showed)."""
    width = 128  # so each form takes it: clusters of 1 hold at most 208 columns per CTA
    w0 = (np.where(rng.random((width, 1)) < 0.5, -1.0, 1.0) * 2.0 ** rng.integers(-4, 16, (width, 1))).astype(np.float32)
    w1 = rng.standard_normal((8, width)).astype(np.float32) / 16
    mlp = fusedmlp.FusedMLP([w0, w1], None, activation="sin", device="cuda")
    x = (rng.choice([-1.0, 1.0], (4099, 1)) * rng.integers(1, 2048, (4099, 1)) * 2.0 ** rng.integers(0, 5, (4099, 1)))
    x = x.astype(np.float16)  # exact in fp16, so every pre-activation is exact in float32
    ref, _ = reference(x, [w0, w1], [None, None], mlp.activations)
    assert_every_kernel_form(mlp, x, ref)


@pytest.mark.parametrize("widths, concat", [([20, 64, 64, 3], None), ([259, 512, 512, 512, 1], {2: "before"})])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_numpy_out_takes_the_outputs_the_plain_call_returns(rng, widths, concat, dtype):
    """NumPy x with out=: the device's copy lands in out where out is C-contiguous in the kernel's output dtype (a
    fused kernel's run(out=), a segmented network's chain), else through a copy (float64, a strided out); either way
    out holds the plain call's bits, every element written (out poisoned first), leading dimensions kept; and
    MultiDeviceMLP's shares write their rows of out (three shares on one GPU)."""
    from fusedmlp.multi_gpu import MultiDeviceMLP

    ws, bs = graph_weights(rng, widths, concat or {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat=concat, device="cuda")
    np_dtype = pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = rng.standard_normal((3, 1031, widths[0])).astype(np_dtype)
    plain = mlp(x)
    for out in (np.full((3, 1031, widths[-1]), np.nan, dtype=np_dtype),
                np.full((3, 1031, 2 * widths[-1]), np.nan, dtype=np_dtype)[..., ::2]):  # contiguous, strided
        assert mlp(x, out=out) is out
        np.testing.assert_array_equal(out.astype(np.float64), plain.astype(np.float64))
    split = MultiDeviceMLP(ws, bs, activation="relu", concat=concat, devices=["cuda:0"] * 3, min_rows_per_device=64)
    x2 = x.reshape(-1, widths[0])
    out = np.full((len(x2), widths[-1]), np.nan, dtype=np_dtype)
    assert split(x2, out=out) is out
    np.testing.assert_array_equal(out.astype(np.float64), split.mlps[0](x2).astype(np.float64))
