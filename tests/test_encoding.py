"""Input encodings computed in the kernel as x is loaded (FusedMLP's encoding=, fm_spec.enc_*): NeRF's positional
encoding with its skip, per-feature scales, x anywhere among the parts. The argument's rules, save / from_npz, the
CPU path against float64, ahead-of-time compiles of every fused form and dtype, the GEMM refusal, and (marked `gpu`)
every kernel form against float64."""

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _encoding
from conftest import rel_l2

H100 = dict(smem_per_block=232448, sm_count=132, smem_per_sm=233472)


def nerf(rng, freqs=10, width=64, depth=8, skip=5, encoding=None, **kwargs):
    """NeRF's trunk on its encoded 3-D points: depth relu layers of `width`, the encoding joining layer `skip` (None:
    no skip), a linear head of 4; weights as nn.Linear initialises them."""
    encoding = encoding or fusedmlp.frequency_encoding(freqs)
    e = 3 * len(encoding)
    ins = [e] + [width + (e if l == skip else 0) for l in range(1, depth)] + [width]
    outs = [width] * depth + [4]
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(ins, outs)]
    bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(ins, outs)]
    return fusedmlp.FusedMLP(ws, bs, "relu", "none", concat={skip: "before"} if skip else None, encoding=encoding,
                             **kwargs)


def reference(mlp, x):
    """mlp's forward in float64 on x (rows, in_features): the encoding in float64, then the graph."""
    from test_gpu import graph_reference

    return graph_reference(_encoding.apply(mlp._encoding[2], np.asarray(x, np.float64)), mlp._w, mlp._b, mlp)


def test_frequency_encoding_is_nerfs():
    parts = fusedmlp.frequency_encoding(3)
    assert parts == ["x", ("sin", 1.0), ("cos", 1.0), ("sin", 2.0), ("cos", 2.0), ("sin", 4.0), ("cos", 4.0)]
    assert fusedmlp.frequency_encoding(1, include_x=False, scale=np.pi) == [("sin", np.pi), ("cos", np.pi)]
    with pytest.raises(fusedmlp.ArgumentError, match="n_frequencies is 0"):
        fusedmlp.frequency_encoding(0)


@pytest.mark.parametrize("skip", [None, 5])
def test_cpu_path_matches_float64(rng, skip):
    """The CPU path (float32 storage, each sine's argument formed in float32 as the kernels form it) within float32's
    phase of 2^9 x of the float64 forward; x is its own 3 features."""
    mlp = nerf(rng, skip=skip, device="cpu")
    x = rng.uniform(-1.5, 1.5, (300, 3)).astype(np.float32)
    assert mlp.in_features == 3 and mlp.widths[0] == 63
    assert rel_l2(mlp(x), reference(mlp, x)) <= 2e-5
    with pytest.raises(fusedmlp.ShapeError, match=r"the network takes \(batch, 3\)"):
        mlp(np.zeros((4, 63), np.float32))


def test_parts_in_any_order_with_per_feature_scales(rng):
    """x last, twice, per-feature scales and a cos first: column j of a part is its function of feature j."""
    scale = np.array([1.0, 0.5, 3.0])
    parts = [("cos", scale), "x", ("sin", 7.0), ("x", None)]
    w = rng.standard_normal((8, 12)).astype(np.float32)
    mlp = fusedmlp.FusedMLP([w], None, "none", encoding=parts, device="cpu")
    x = rng.standard_normal((50, 3)).astype(np.float32)
    e = np.concatenate([np.cos(scale * x), x, np.sin(7.0 * x), x], 1)
    assert rel_l2(mlp(x), e @ w.T.astype(np.float64)) <= 1e-6
    assert [p if p == "x" else p[0] for p in mlp.encoding] == ["cos", "x", "sin", "x"]


@pytest.mark.parametrize("encoding, error, match", [
    ("nerf", fusedmlp.ArgumentError, "a list of parts"),
    ([], fusedmlp.ArgumentError, "a list of parts"),
    (["x", ("tan", 2.0)], fusedmlp.ArgumentError, r"encoding\[1\] is \('tan', 2.0\)"),
    (["x", ("sin", float("nan"))], fusedmlp.ArgumentError, r"encoding\[1\]'s scale .* not finite"),
    (["x", ("sin", [1.0, 2.0])], fusedmlp.ShapeError, r"makes 4 columns \(2 parts of x's 2 features\) but layer 0 "
                                                      "takes 9"),
    (["x", ("sin", [1.0, 2.0]), ("cos", [1.0, 2.0, 3.0])], fusedmlp.ShapeError, r"scales have \[2, 3\] values"),
    (["x", ("sin", 1.0)], fusedmlp.ShapeError, "no multiple of 2"),
])
def test_bad_encodings_name_the_part_and_the_rule(encoding, error, match):
    w = np.ones((4, 9), np.float32)
    with pytest.raises(error, match=match):
        fusedmlp.FusedMLP([w], encoding=encoding, device="cpu")


def test_save_and_from_npz_keep_the_encoding(rng, tmp_path):
    mlp = nerf(rng, freqs=4, encoding=["x", ("sin", [1.0, 2.0, 0.25]), ("cos", 3.0)], device="cpu")
    path = mlp.save(tmp_path / "nerf")
    back = fusedmlp.FusedMLP.from_npz(path, device="cpu")
    x = rng.uniform(-1, 1, (20, 3)).astype(np.float32)
    np.testing.assert_array_equal(back(x), mlp(x))
    assert "encoding=[x + 2 sin/cos parts of 3 features]" in repr(back)
    with pytest.raises(fusedmlp.ArgumentError, match="encoding cannot be given"):
        fusedmlp.FusedMLP.from_npz(path, encoding=["x"], device="cpu")


def test_plans_load_x_whole_and_never_split_it(rng):
    """An encoded x lands as it is (a raw landing buffer: the loader computes the layers' columns from it) and no
    plan splits it (its sines are formed from x in float32); the rendered source carries one Enc<C> per column."""
    mlp = nerf(rng, freqs=2, device="cpu")
    for options in ({}, {"x_split": 0}):
        plan, source = mlp._render(90, H100["smem_per_block"], H100["sm_count"], "float16", "float16",
                                   H100["smem_per_sm"], **options)
        assert plan.info["x_split"] == 0
    assert "constexpr int IN_REAL = 3;" in source and "constexpr int ENC_COLS = 15;" in source
    assert source.count("template <> struct Enc<") == 15
    with pytest.raises(fusedmlp.LimitError, match="x_split=1 was asked for, but x is encoded"):
        mlp._render(90, H100["smem_per_block"], H100["sm_count"], "float16", "float16", H100["smem_per_sm"],
                    x_split=1)


def encoded_chain(rng, dtype="float16", device="cpu"):
    """27-1024-256-256-4 on 4 frequencies of 3-D points, x joined again before layer 2: on the H100 a GEMM chain
    (1024 features: no fused kernel) whose first GEMM and concat GEMM read x."""
    ins, outs = [27, 1024, 256 + 27, 256], [1024, 256, 256, 4]
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(ins, outs)]
    bs = [rng.uniform(-0.1, 0.1, o).astype(np.float32) for o in outs]
    return fusedmlp.FusedMLP(ws, bs, "relu", concat={2: "after"}, encoding=fusedmlp.frequency_encoding(4),
                             dtype=dtype, device=device)


def test_an_encoded_chain_reads_the_pad_passs_encoded_copy(rng, tmp_path):
    """Cut into segments, a network's GEMMs read x as the pad pass's copy, which the pass encodes (pad_rows.cu; an
    8-bit network's copy is float16, which its GEMMs quantise on the way in); every plan compiles ahead of time. A
    GEMM reading x any other way (a tf32 chain's, which takes x as it is) is a LimitError naming the layer, and the
    CPU path runs any."""
    from test_lowbit import nvrtc_or_skip

    from fusedmlp import _api, _segments

    target = (90, H100["smem_per_block"], H100["sm_count"], H100["smem_per_sm"])
    mlp = encoded_chain(rng)
    segments = mlp._segments_for(*target, "float32", "float32")
    assert [s.kind for s in segments] == ["gemm", "gemm", "gemm", "fused"]
    assert "x read from its encoded copy in rows of 32 float16" in segments[0].reason
    plans = _segments.plans(mlp, 90, "float32", "float32", target)
    assert plans[0].info["pad_pass"] and "x (3 features, float32) encoded copied" in _api._source_of(plans[0])
    nvrtc_or_skip()
    cache = fusedmlp._cache.KernelCache(tmp_path)
    for plan in plans:
        _api.compile_cubin(_api._source_of(plan), 90, cache, plan.info["wgmma"])
    with pytest.raises(fusedmlp.LimitError, match="layer 0 reads x's input encoding .* as a GEMM input part other "
                                                  "than the pad pass's encoded copy"):
        mlp._net.gemm_plan(0, 90, H100["smem_per_block"], H100["sm_count"], "float16", None, None, "float16",
                           smem_per_sm=H100["smem_per_sm"])  # (x itself: no a0_row naming the copy)
    for dtype in ("int8", "float8"):
        low = encoded_chain(rng, dtype=dtype)
        low.calibrate(rng.uniform(-1, 1, (64, 3)).astype(np.float32))
        plans = _segments.plans(low, 90, "float32", "float32", target)
        assert "in rows of 32 float16" in low._segments_for(*target, "float32", "float32")[0].reason
        for plan in plans:
            _api.compile_cubin(_api._source_of(plan), 90, cache, plan.info["wgmma"])
    with pytest.raises(fusedmlp.LimitError, match="layer 0 reads x's input encoding"):
        _segments.plans(encoded_chain(rng, dtype="tf32"), 80, "float32", "float32", (80, 166912, 108, 167936))
    x = rng.uniform(-1, 1, (10, 3)).astype(np.float32)
    assert rel_l2(mlp(x), reference(mlp, x)) <= 2e-5


def test_a_chains_fused_head_stretch_encodes_x_itself(rng):
    """A network cut into segments whose first stretch is fused and reads x as it is (tf32: no pad pass) runs that
    stretch as a FusedMLP of its own: it must carry the encoding (x's 3 features in, the encoded columns to its
    layers), as the plan of the stretch does; its CPU forward is the network's first layer on the encoded x."""
    from test_gpu import graph_reference

    from fusedmlp import _segments

    ws = [rng.uniform(-1, 1, (256, 27)).astype(np.float32) / 6] + [
        rng.uniform(-1, 1, (256, 256)).astype(np.float32) / 16 for _ in range(2)] + [
        rng.uniform(-1, 1, (3, 256)).astype(np.float32) / 16]
    mlp = fusedmlp.FusedMLP(ws, None, ["sin"] * 3 + ["none"], encoding=fusedmlp.frequency_encoding(4), dtype="tf32",
                            device="cpu")
    head = mlp._segments_for(90, H100["smem_per_block"], H100["sm_count"], H100["smem_per_sm"], "float32",
                             "float32")[0]
    assert head.kind == "fused" and head.first == 0 and not head.x_copy
    sub, k_in, _ = _segments.stretch_model(mlp, head, "float32", "float32")
    assert sub.in_features == 3 and sub.widths[0] == 27 and k_in == "float32"
    x = rng.uniform(-1, 1, (40, 3)).astype(np.float32)
    e = _encoding.apply(mlp._encoding[2], x.astype(np.float64))
    assert rel_l2(sub(x), graph_reference(e, sub._w, sub._b, sub)) <= 2e-5


FORMS = [(80, {}), (90, {"wgmma": 1, "cluster": -1}), (90, {"wgmma": 1, "resident": 0}), (90, {"wgmma": 0})]


@pytest.mark.parametrize("arch, options", FORMS, ids=lambda v: str(v))
def test_encoded_kernels_compile_ahead_of_time(rng, tmp_path, arch, options):
    from test_lowbit import nvrtc_or_skip

    nvrtc_or_skip()
    cache = fusedmlp._cache.KernelCache(tmp_path)
    wgmma = arch == 90 and options.get("wgmma") != 0  # (the warpgroup forms take 16-bit compute dtypes)
    for io, dtype in (("float32", "float16"), ("float16", "bfloat16"), ("bfloat16", "float16" if wgmma else "tf32")):
        mlp = nerf(rng, freqs=4, dtype=dtype, device="cpu")
        plan, source = mlp._render(arch, H100["smem_per_block"], H100["sm_count"], io, io, H100["smem_per_sm"],
                                   **options)
        fusedmlp._api.compile_cubin(source, arch, cache, plan.info["wgmma"])


# ------------------------------------------------------------------------------------------------ on the GPU

GPU_FORMS = [{"wgmma": 0}, {"wgmma": 1, "cluster": -1}, {"wgmma": 1, "resident": 0}, {"cluster": 2}]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32", "int8", "float8"])
def test_gpu_encoded_networks_in_every_kernel_form(rng, dtype):
    """NeRF's trunk (64 wide: every form; 256 wide: streamed) with its skip, a network with per-feature scales, x
    last and a residual of the encoded x, and a 256-wide sine network (the cluster form too), in float32 / float16 /
    bfloat16 x: each kernel against float64 within the dtype's check bound, an 8-bit one against the CPU emulation
    too."""
    from test_gpu import run_io_kernel

    arch = fusedmlp._api._gpu(0).info["arch"]
    bound = fusedmlp.CHECK_TOLERANCES[dtype]
    per_feature = ["x", ("sin", [1.0, 4.0, 0.5]), ("cos", [2.0, 8.0, 32.0])]
    cases = [("nerf64", nerf(rng, width=64, dtype=dtype, device="cuda")),
             ("nerf256", nerf(rng, width=256, dtype=dtype, device="cuda")),
             ("residual", fusedmlp.FusedMLP(
                 [rng.uniform(-0.3, 0.3, (9, 9)).astype(np.float32), rng.uniform(-0.3, 0.3, (5, 9)).astype(np.float32)],
                 None, ["gelu", "none"], residual={0: ("add", "none", "input")}, encoding=per_feature[::-1],
                 dtype=dtype, device="cuda")),
             ("sine256", fusedmlp.FusedMLP(  # no concat: the cluster form takes it
                 [rng.uniform(-1, 1, (256, 27)).astype(np.float32) / 6] +
                 [rng.uniform(-1, 1, (256, 256)).astype(np.float32) / 16 for _ in range(2)] +
                 [rng.uniform(-1, 1, (3, 256)).astype(np.float32) / 16], None, ["sin"] * 3 + ["none"],
                 encoding=fusedmlp.frequency_encoding(4), dtype=dtype, device="cuda"))]
    report = []
    for name, mlp in cases:
        x = rng.uniform(-1.5, 1.5, (4099, 3)).astype(np.float32)
        if dtype in ("int8", "float8"):
            if dtype == "float8" and arch < 89:
                continue
            mlp.calibrate(x[:512])
        want = reference(mlp, x)
        for form in GPU_FORMS if arch == 90 else [{}]:
            for io in ("float32", "float16", "bfloat16"):
                if io == "bfloat16" and arch < 80:
                    continue
                try:
                    kernel, plan = mlp._build(io, **form)[:2]
                except fusedmlp.LimitError:
                    continue
                x_seen, y = run_io_kernel(kernel, x, io)
                err = rel_l2(y, reference(mlp, x_seen))
                report.append(f"{name} {dtype} {form} x {io}: {err:.2e}")
                assert np.all(np.isfinite(y)) and err <= bound, report[-1]
                if dtype in ("int8", "float8"):  # the emulation computes the kernels' roundings (float8's 3-bit
                    # codes after the hidden sines' fast forms: a code flips now and then, 1.4e-2 seen)
                    emu = mlp._net.forward_cpu(x_seen)
                    assert rel_l2(y, emu) <= (1e-2 if dtype == "int8" else 3e-2), report[-1]
        # the public call, float32 x (a 256-wide 8-bit network: its GEMM chain, which reads the encoded copy)
        assert rel_l2(mlp(x), want) <= bound, name
    print("\n" + "\n".join(report))
    assert len(report) >= 6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "float8"])
def test_gpu_encoded_chain_reads_the_encoded_copy(rng, dtype):
    """The GEMM chain of encoded_chain (the pad pass encoding x's copy, the first GEMM and the concat GEMM reading it)
    against float64, float32 and float16 x, at 1, 100 and 5000 rows; and check=True on the public call."""
    mlp = encoded_chain(rng, dtype=dtype, device="cuda")
    if dtype in ("int8", "float8"):
        mlp.calibrate(rng.uniform(-1.5, 1.5, (512, 3)).astype(np.float32))
    bound = fusedmlp.CHECK_TOLERANCES[dtype]
    for rows in (1, 100, 5000):
        x = rng.uniform(-1.5, 1.5, (rows, 3)).astype(np.float32)
        for io in (np.float32, np.float16):
            xi = x.astype(io)
            y = mlp(xi)
            err = rel_l2(y.astype(np.float64), reference(mlp, xi.astype(np.float32)))
            assert y.dtype == io and err <= bound, (rows, io, err)
            if dtype in ("int8", "float8") and rows > 1:  # the emulation rounds the codes as the kernels do
                emu = rel_l2(y.astype(np.float64), mlp._net.forward_cpu(xi.astype(np.float32)))
                assert emu <= 2e-2, (rows, io, emu)
    assert any(s.kind == "gemm" for s in mlp._segments_for(*mlp._target(), "float32", "float32"))
    checked = encoded_chain(rng, dtype=dtype, device="cuda")
    if dtype in ("int8", "float8"):
        checked.calibrate(rng.uniform(-1.5, 1.5, (512, 3)).astype(np.float32))
    checked._check = True
    checked(rng.uniform(-1, 1, (777, 3)).astype(np.float32))


@pytest.mark.gpu
def test_gpu_nerf_written_with_its_encoding_and_skip_runs_as_torch_does():
    """A torch module encoding its input in forward and reading the encoding again at layer 5 (NeRF as written)
    through from_torch on CUDA tensors, check=True, against torch in float64; and under a CUDA graph capture."""
    torch = pytest.importorskip("torch")
    from test_torch import _Encoded

    torch.manual_seed(3)
    model = _Encoded(skip=True).eval().cuda()
    mlp = fusedmlp.from_torch(model, check=True)
    x = torch.rand(5000, 3, device="cuda") * 3 - 1.5
    y = mlp(x)
    with torch.no_grad():
        want = model.double()(x.double())
    assert y.is_cuda and rel_l2(y.double().cpu().numpy(), want.cpu().numpy()) <= 2e-3
