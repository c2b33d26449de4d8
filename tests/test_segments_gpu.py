"""Segmented networks on the GPU against float64: layers wider than one fused kernel holds as GEMMs with their whole
epilogue, fused stretches between them, residuals and input concats read across the cuts, every compute dtype and
I/O dtype, poisoned outputs. Marked `gpu`; skipped without a device."""

import functools

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _segments
from conftest import graph_weights, rel_l2
from test_gpu import PREC_TOL, graph_reference, run_io, run_io_kernel

pytestmark = pytest.mark.gpu


def random_wide_case(rng):
    """A network of 1-6 layers mixing narrow (1-256) and wide (257-2048) widths, with residuals from any earlier value
    of the same width and input concats, so cuts fall between fused stretches and GEMMs in every combination."""
    depth = int(rng.integers(1, 7))
    pool = [3, 16, 64, 100, 256, 300, 512, 777, 1024, 2048]
    widths = [int(rng.choice([3, 63, 64, 259, 512]))] + [int(rng.choice(pool)) for _ in range(depth)]
    concat = {l: str(rng.choice(["after", "before"])) for l in range(1, depth) if rng.random() < 0.25}
    acts = [str(rng.choice(["relu", "gelu", "tanh", "silu", "sin", "none"])) for _ in range(depth - 1)]
    acts.append(str(rng.choice(["none", "tanh", "sigmoid"])))
    residual = {}
    for l in range(depth):
        sources = [v for v in range(-1, l) if widths[v + 1] == widths[l + 1]]
        if sources and rng.random() < 0.5:
            src = int(rng.choice(sources))
            residual[l] = (str(rng.choice(["add", "add", "mul"])), str(rng.choice(["none", "relu"])),
                           "input" if src < 0 else src)
    ws, bs = graph_weights(rng, widths, concat, 1.5)
    return ws, bs, acts, residual, concat


def check(mlp, ws, bs, prec, io, batch, seed):
    x32 = np.random.default_rng(seed).standard_normal((batch, ws[0].shape[1])).astype(np.float32)
    x, y = run_io(mlp, x32, io)
    ref = graph_reference(x, ws, bs, mlp)
    tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
    return rel_l2(y, ref), tol, np.isnan(y).any(), np.max(np.abs(ref))


def tally(mlp, ws, bs, prec, io, batch, seed, case, failures):
    """check() of one case: 0 where the reference leaves float16's range (inf is the right answer there), else 1, with
    the case, its error and the model's segments appended to failures where it is NaN or past the bound."""
    err, tol, nan, peak = check(mlp, ws, bs, prec, io, batch, seed)
    if (prec == "float16" or io == "float16") and peak > 6e4:
        return 0
    if nan or not err <= tol:
        failures.append(case + (batch, err, mlp.segments))
    return 1


@functools.lru_cache(maxsize=None)
def _wide_runs():
    """48 random networks with widths up to 2048, each in float16, bfloat16 and tf32 with rotating I/O dtypes and a
    random batch: (network index, case, precision, I/O dtype, batch), drawn in one sequence."""
    rng = np.random.default_rng(20261125)
    runs = []
    for i in range(48):
        case = random_wide_case(rng)
        for j, prec in enumerate(fusedmlp.PRECISIONS):
            runs.append((i, case, prec, ("float32", "float16", "bfloat16")[(i + j) % 3],
                         int(rng.choice([1, 127, 1000, 4099]))))
    return runs


@pytest.mark.parametrize("part", range(4))
def test_random_wide_graphs_in_every_precision(part):
    """_wide_runs' networks 12 part to 12 part + 11 (in four parts, each ~75 s on an H100, so that a device call's
    time limit takes them one by one): 36 runs a part, 28-33 of them segmented (144 and 117 in all)."""
    failures, checked, cut = [], 0, 0
    for i, (ws, bs, acts, residual, concat), prec, io, batch in _wide_runs():
        if i // 12 != part:
            continue
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=prec, device="cuda")
        cut += mlp.segments is not None
        checked += tally(mlp, ws, bs, prec, io, batch, i,
                         (i, prec, io, [w.shape for w in ws], acts, residual, concat), failures)
    print(f"\n{checked} runs checked, {cut} of them segmented, {len(failures)} failures")
    assert checked >= 30 and cut >= 22
    assert not failures, failures[:3]


def test_random_wide_graphs_reading_x_through_its_padded_copy():
    """16 random wide networks whose chain pads x (x of 259 or 63 features, float32 or 16-bit x; GEMMs reading it as
    a concat part or as their input, residuals from x read as it is), float16 and bfloat16, within float64's bound."""
    rng = np.random.default_rng(20261126)
    failures, padded = [], 0
    for i in range(300):
        ws, bs, acts, residual, concat = random_wide_case(rng)
        if ws[0].shape[1] < _segments.PAD_MIN_WIDTH:
            continue
        prec, io = str(rng.choice(["float16", "bfloat16"])), str(rng.choice(["float32", "float16", "bfloat16"]))
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=prec, device="cuda")
        chain = mlp._kernel(io)
        if not isinstance(chain, _segments.Chain) or _segments.X_PAD not in chain._slot_of:
            continue
        padded += tally(mlp, ws, bs, prec, io, int(rng.choice([1, 127, 1000, 4099])), i,
                        (i, prec, io, [w.shape for w in ws], acts, residual, concat), failures)
        if padded == 16:
            break
    print(f"\n{padded} padded chains checked, {len(failures)} failures")
    assert padded >= 12
    assert not failures, failures[:3]


NETWORKS = {
    "nerf": ([63] + [256] * 8 + [4], "relu", "none", {5: "before"}),
    "sdf512": ([259] + [512] * 8 + [1], "relu", "tanh", {4: "before"}),
    "rec1024": ([256, 1024, 1024, 512, 256, 1], "relu", "none", {}),
    "wide512": ([64] + [512] * 4 + [64], "gelu", "none", {}),
}


@pytest.mark.parametrize("widths, io", [((259, 512, 512, 512, 1), "float16"), ((259, 512, 512, 512, 1), "bfloat16"),
                                       ((259, 512, 512, 512, 1), "float32"), ((512, 384, 384, 384, 1), "float32")])
def test_a_network_reading_x_through_its_copy_gives_the_one_kernels_bits(rng, widths, io):
    """A network whose one streamed kernel would land x through a raw buffer (259 features, or float32) runs as x's pad
    pass and that kernel reading the copy on two warpgroups (_segments._copy_plan): against float64 at odd batches, and
    bit for bit the one kernel reading x itself where that exists (the same values reach the same MMAs)."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the streamed warpgroup kernel runs on sm_90a")
    ws, bs = graph_weights(rng, list(widths), {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation="tanh", device="cuda")
    chain = mlp._kernel(io)
    assert isinstance(chain, _segments.Chain) and len(chain.segments) == 1 and chain.segments[0].x_copy, mlp.segments
    try:
        one = mlp._build(io, io, wgmma=1, resident=0)[0]
    except fusedmlp.LimitError:  # (float32 x of 512 features: no one kernel lands it)
        one = None
    for batch in (1, 129, 4097, 70001):
        if batch > 1:  # (one row is one output here: its relative error is one rounding's luck near a zero of tanh)
            err, tol, nan, _ = check(mlp, ws, bs, "float16", io, batch, batch)
            assert not nan and err <= tol, (batch, err)
        if one is not None:
            x32 = rng.standard_normal((batch, widths[0])).astype(np.float32)
            assert np.array_equal(run_io(mlp, x32, io)[1], run_io_kernel(one, x32, io)[1]), batch


@pytest.mark.parametrize("name", NETWORKS)
@pytest.mark.parametrize("policy", ["streamed", "resident"])
def test_benchmark_networks_match_float64(rng, name, policy):
    widths, act, out_act, concat = NETWORKS[name]
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, concat=concat or None, device="cuda")
    mlp._segment_policy = policy
    for batch, io in [(1, "float32"), (129, "float16"), (65537, "float32"), (4097, "bfloat16")]:
        err, tol, nan, _ = check(mlp, ws, bs, "float16", io, batch, batch)
        assert not nan and err <= tol, (name, policy, mlp.segments, batch, io, err)


def test_torch_tensors_out_and_cuda_graphs_through_a_segmented_network(rng):
    """CUDA tensors in and out (the torch call path), out=, batch 0, and a CUDA graph capture of a segmented call
    after one warm-up call of its batch size: replaying with new inputs gives their outputs."""
    torch = pytest.importorskip("torch")
    widths, act, out_act, concat = NETWORKS["sdf512"]
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, concat=concat, device="cuda")
    assert mlp.segments is not None and "segments=" in repr(mlp)
    x = torch.randn(3000, widths[0], device="cuda", dtype=torch.float16)
    y = mlp(x)
    ref = graph_reference(x.double().cpu().numpy(), ws, bs, mlp)
    assert rel_l2(y.double().cpu().numpy(), ref) <= PREC_TOL["float16"]
    out = torch.full((3000, 1), float("nan"), device="cuda", dtype=torch.float32)
    assert mlp(x, out=out) is out and rel_l2(out.double().cpu().numpy(), ref) <= PREC_TOL["float16"]
    assert mlp(x[:0]).shape == (0, 1)
    check_graph_replays(torch, mlp, widths[0], 1, lambda x: graph_reference(x, ws, bs, mlp), PREC_TOL["float16"])


def check_graph_replays(torch, mlp, n_in, n_out, reference, tol):
    """A CUDA graph captured over mlp's call of 4096 float16 rows (after a warm-up call of that size, which builds
    its kernels), replayed on new inputs, gives their outputs: reference(x float64) within tol."""
    static_x = torch.randn(4096, n_in, device="cuda", dtype=torch.float16)
    static_y = torch.empty(4096, n_out, device="cuda", dtype=torch.float16)
    mlp(static_x, out=static_y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(static_x, out=static_y)
    for seed in range(2):
        static_x.copy_(torch.randn(4096, n_in, device="cuda", dtype=torch.float16,
                                   generator=torch.Generator("cuda").manual_seed(seed)))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(static_y.double().cpu().numpy(), reference(static_x.double().cpu().numpy())) <= tol


@pytest.mark.parametrize("width, prec, io", [(259, "float16", "float16"), (259, "float16", "float32"),
                                             (100, "bfloat16", "bfloat16"), (64, "float16", "float32")])
def test_gemms_reading_x_padded_copy_gives_the_converting_loads_bits(rng, monkeypatch, width, prec, io):
    """A GEMM reading x from the pad pass's copy (pad_rows.cu: rows of whole 16-byte pieces of the compute dtype,
    zeros after x's width) gives the bits it gives converting x on the way in (the same rounding of the same values);
    both within the dtype's bound of float64. A decoder with x re-injected halfway, every layer a GEMM (the first and
    the concat layer read x), batches that end mid-CTA of the pad pass."""
    widths, concat = [width] + [1024] * 4 + [1], {2: "before"}  # (wider than any fused kernel: every layer a GEMM)
    ws, bs = graph_weights(rng, widths, concat, 1.0)

    def outputs(pad):  # (the setting is read when the model's cut and chain are made: at its first call)
        monkeypatch.setenv("FUSEDMLP_GEMM_PAD", pad)
        mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation="tanh", concat=concat, dtype=prec,
                                device="cuda")
        assert any("x read from its copy" in line for line in mlp.segments) == (pad == "1")
        runs = []
        for batch in (1, 33, 4099):
            x32 = np.random.default_rng(batch).standard_normal((batch, width)).astype(np.float32)
            runs.append(run_io(mlp, x32, io) + (mlp,))
        return runs

    ys, refs = [], []
    for (x, y, mlp), (_, y_plain, _) in zip(outputs("1"), outputs("-1")):
        np.testing.assert_array_equal(y, y_plain)
        ys.append(y)
        refs.append(graph_reference(x, ws, bs, mlp))
    # over every batch's rows (one row's one output near zero is no measure of a relative error)
    tol = max(PREC_TOL[prec], PREC_TOL["bfloat16"] if io == "bfloat16" else 0)
    assert rel_l2(np.concatenate(ys), np.concatenate(refs)) <= tol


@pytest.mark.parametrize("name", ["rec1024", "sdf512", "hazards"])
def test_dependent_launches_give_the_plain_launches_bits(rng, monkeypatch, name):
    """A chain's kernels after its first start while the one before finishes (programmatic dependent launch, sm_90+;
    FUSEDMLP_PDL=0 at chain creation launches them plainly). Each kernel waits for the one before it before it reads
    or writes: same bits as plain launches, call after call on one stream (the NumPy path, torch tensors with the
    fast path, a CUDA graph's replays), at batches from one row to several waves. "hazards": workspace slots reused
    (a kernel writes the slot the kernel before it read), residuals and a concat read across the cuts, a norm
    layer's GEMM and row pass, x's padded copy."""
    torch = pytest.importorskip("torch")
    if name == "hazards":
        widths = [259, 600, 600, 300, 600, 256, 256, 5]
        concat = {3: "before"}
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        options = dict(activation=["gelu", "relu", "silu", "tanh", "relu", "gelu", "none"], concat=concat,
                       residual={1: "add", 3: ("add", "none", 0), 5: "add"},
                       norm={2: "layernorm"})
    else:
        widths, act, out_act, concat = NETWORKS[name]
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        options = dict(activation=act, output_activation=out_act, concat=concat or None)
    models = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("FUSEDMLP_PDL", pdl)
        mlp = fusedmlp.FusedMLP(ws, bs, device="cuda", **options)
        mlp(np.zeros((1, widths[0]), np.float16))  # the chains are made now, under this setting
        mlp(torch.zeros((1, widths[0]), device="cuda", dtype=torch.float16))
        models[pdl] = mlp
    assert models["1"].segments is not None and len(models["1"]._kernel("float16", rows=1000).info["segments"]) > 1
    assert models["1"]._kernel("float16", rows=1000)._after and not models["0"]._kernel("float16", rows=1000)._after
    for batch in (1, 1000, 4099, 300000):
        x = np.random.default_rng(batch).standard_normal((batch, widths[0])).astype(np.float16)
        ys = {pdl: [m(x) for _ in range(3)] for pdl, m in models.items()}
        for y in ys["1"] + ys["0"][1:]:
            assert np.array_equal(y.view(np.uint16), ys["0"][0].view(np.uint16)), (name, batch)
        xt = torch.from_numpy(x).cuda()
        outs = {pdl: [m(xt) for _ in range(5)] for pdl, m in models.items()}  # back to back on one stream
        torch.cuda.synchronize()
        for y in outs["1"] + outs["0"]:
            assert torch.equal(y.cpu(), torch.from_numpy(ys["0"][0])), (name, batch)
    static_x = torch.randn(4096, widths[0], device="cuda", dtype=torch.float16)
    ys = {}
    for pdl, m in models.items():
        static_y = torch.full((4096, widths[-1]), float("nan"), device="cuda", dtype=torch.float16)
        m(static_x, out=static_y)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            m(static_x, out=static_y)
        static_y.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        ys[pdl] = static_y.cpu()
    assert torch.equal(ys["1"], ys["0"]) and not torch.isnan(ys["1"]).any()


def test_small_batches_of_wide_stretches_run_every_layer_as_a_gemm(rng):
    """sdf512's shape below 64 rows per SM runs the all-GEMM chain (gemms_at), above it the default cut: both near
    float64, on NumPy and torch, and a CUDA graph of the small call replays its answer."""
    torch = pytest.importorskip("torch")
    widths = [259, 512, 512, 512, 512, 512, 512, 512, 512, 1]  # x as wide as sdf512's: its concat layer is a GEMM
    concat = {4: "before"}
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, "relu", concat=concat, output_activation="tanh", device="cuda")
    if mlp.segments is None:
        pytest.skip("one fused kernel on this GPU: no cut to change")
    sm = mlp._sm_count or fusedmlp._api._gpu(0).info["sm_count"]
    for rows in (1000, 64 * sm + 5):
        x = rng.standard_normal((rows, widths[0])).astype(np.float32)
        y = mlp(x)
        every = mlp._segments_for(*mlp._target(), "float32", "float32", "gemm")
        assert (mlp._kernel("float32", rows=rows).segments == every) == (rows == 1000), rows
        assert rel_l2(y, graph_reference(x, ws, bs, mlp)) < 1e-2, rows
    xt = torch.from_numpy(x[:1000]).cuda().half()
    out = torch.empty(1000, 1, device="cuda", dtype=torch.float16)
    mlp(xt, out=out)
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp(xt, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def gemm_infos(mlp, io):
    """plan.info of each GEMM layer of mlp's cut on its GPU (io in and out), as the chain builds it (with
    mlp._gemm_options)."""
    info = mlp._gpu_info()
    target = (info["arch"], info["smem_per_block"], info["sm_count"], info["smem_per_sm"])
    return [mlp._gemm_plan(seg.first, *target, *_segments.gemm_dtypes(mlp, seg.first, io, io)).info
            for seg in mlp._segments_for(*target, io, io) or [] if seg.kind == "gemm"]


@pytest.mark.parametrize("prec", ["float16", "bfloat16", "float8", "int8"])
def test_a_by_tensor_maps_gives_the_cp_async_bits(rng, prec):
    """A warp-specialised GEMM's producer loads each stage's A rows with one TMA copy (fm_plan.gemm_tma, the default
    where every input part copies as it is) instead of its 128 threads' cp.async: the same bytes in the same swizzled
    places, zeros past the batch and the part's width, so the same bits (tma=-1 forces the copies). rec1024; sdf512,
    whose concat GEMM reads x's padded copy beside h; a residual network; a batch ending mid-tile and a small one,
    whose 64-row tiles take a producer too."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the warp-specialised GEMM runs on sm_90a")
    x32 = rng.standard_normal((4097, 259)).astype(np.float32)
    cases = [(NETWORKS["rec1024"], None), (NETWORKS["sdf512"], None),
             (([256, 768, 768, 768, 10], "silu", "none", {}), {2: ("add", "relu", 0)})]
    for (widths, act, out_act, concat), residual in cases:
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        outs, tmas = [], []
        for options in ({}, {"tma": -1}):
            mlp = fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, residual=residual,
                                    concat=concat or None, dtype=prec, device="cuda")
            mlp._gemm_options = options
            if prec in fusedmlp.LOWBIT_PRECISIONS:
                mlp.calibrate(x32[:1024, :widths[0]])
            tmas.append([info["tma"] for info in gemm_infos(mlp, "float16")])
            outs.append([run_io(mlp, x32[:batch, :widths[0]], "float16")[1] for batch in (4097, 100)])
        assert any(tmas[0]) and not any(tmas[1]), (widths, tmas)
        for a, b in zip(*outs):
            assert np.array_equal(a, b), (widths, prec)  # (float16 outputs, as float64)
