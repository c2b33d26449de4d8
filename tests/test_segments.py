"""Segmented networks on the CPU: where the planner cuts a network too big for one fused kernel, which values pass
through memory, how the workspace is shared, and that every segment's kernel renders and compiles ahead of time."""

import functools
import os

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _segments, probe
from fusedmlp._api import _source_of
from conftest import graph_weights, reference, rel_l2, set_env

_H100 = tuple(probe.GPUS["h100"][k] for k in ("arch", "smem_per_block", "sm_count", "smem_per_sm"))


def fits_up_to(span, wide=()):
    """A fits() that takes stretches of at most `span` layers containing none of the `wide` layers."""
    def fits(first, last):
        if any(first <= w <= last for w in wide):
            return False, "a wide layer"
        return (True, "resident") if last - first < span else (False, "too many weights")
    return fits


def kinds(segments):
    return [(s.first, s.last, s.kind) for s in segments]


def test_cut_takes_the_longest_resident_stretches():
    segs = _segments.cut(9, [None] * 9, [0] * 9, fits_up_to(4))
    assert kinds(segs) == [(0, 3, "fused"), (4, 7, "fused"), (8, 8, "fused")]
    assert [s.reads for s in segs] == [(-1,), (3,), (7,)]


def test_a_layer_no_stretch_takes_is_a_gemm_with_the_reason():
    segs = _segments.cut(5, [None] * 5, [0] * 5, fits_up_to(9, wide=(2,)))
    assert kinds(segs) == [(0, 1, "fused"), (2, 2, "gemm"), (3, 4, "fused")]
    assert segs[1].reason == "a wide layer"


def test_a_concat_past_the_first_stretch_is_a_gemm_reading_the_network_input():
    concat = [0, 0, 0, 0, 0, 2, 0, 0, 0]  # NeRF: the input joins layer 5
    segs = _segments.cut(9, [None] * 9, concat, fits_up_to(5))
    assert kinds(segs) == [(0, 4, "fused"), (5, 5, "gemm"), (6, 8, "fused")]
    assert segs[1].reads == (-1, 4) and "concat" in segs[1].reason
    # a stretch from layer 0 keeps its concat inside (its input is the network input)
    assert kinds(_segments.cut(9, [None] * 9, concat, fits_up_to(9))) == [(0, 8, "fused")]


def test_a_residual_read_across_a_cut_ends_the_stretch_that_makes_it():
    residual = [None] * 8
    residual[6] = (1, "none", 2)  # layer 6 adds layer 2's output
    segs = _segments.cut(8, residual, [0] * 8, fits_up_to(4))
    # 0-3 would hide value 2 inside a fused kernel: the stretch ends at layer 2, whose output is then the input of
    # the next stretch, which takes layer 6's residual as reading its own input
    assert kinds(segs) == [(0, 2, "fused"), (3, 6, "fused"), (7, 7, "fused")]
    residual[6] = (1, "none", 1)  # from layer 1: read across two cuts, so layer 6 is a GEMM
    segs = _segments.cut(8, residual, [0] * 8, fits_up_to(4))
    assert kinds(segs) == [(0, 1, "fused"), (2, 5, "fused"), (6, 6, "gemm"), (7, 7, "fused")]
    assert segs[2].reads == (1, 5)


def test_workspace_slots_are_shared_by_values_whose_lives_do_not_overlap():
    segs = [_segments.Segment(0, 0, "gemm", "", (-1,)), _segments.Segment(1, 1, "gemm", "", (0,)),
            _segments.Segment(2, 2, "gemm", "", (1,)), _segments.Segment(3, 3, "gemm", "", (2, 0))]
    slot_of, count = _segments.workspace_slots(segs, 4)
    # value 0 lives to segment 3; 1 and 2 alternate with each other but never take 0's slot
    assert count == 3 and slot_of[0] not in (slot_of[1], slot_of[2]) and slot_of[1] != slot_of[2]
    chain = [_segments.Segment(i, i, "gemm", "", (i - 1,)) for i in range(5)]
    slot_of, count = _segments.workspace_slots(chain, 5)
    assert count == 2 and slot_of[0] == slot_of[2] and slot_of[1] == slot_of[3]


def wide_model(rng, widths, **kwargs):
    ws, bs = graph_weights(rng, widths, kwargs.get("concat", {}), 1.0)
    return ws, bs, fusedmlp.FusedMLP(ws, bs, device="cpu", **kwargs)


def test_a_network_that_fits_is_not_cut(rng):
    _, _, mlp = wide_model(rng, [64, 128, 128, 16], activation="relu")
    assert mlp.segments is None


@pytest.mark.parametrize("widths, expect", [
    ([64, 512, 512, 512, 512, 64], None),                                # wide512: one streamed kernel on sm_90
    ([256, 1024, 1024, 512, 256, 1], ["gemm"] * 3 + ["fused"]),          # rec1024: its 512-256-1 tail fused
    ([100, 2048, 3], ["gemm", "gemm"]),
    ([100, 600, 512, 3], ["gemm", "gemm", "fused"]),                   # 600 -> 512 reads 600
])
def test_layers_past_512_are_gemms_and_the_rest_fused(rng, widths, expect):
    """On sm_90a the streamed warpgroup kernel holds layers up to 512 wide; a layer reading or writing a wider value
    is a GEMM."""
    _, _, mlp = wide_model(rng, widths, activation="relu")
    got = None if mlp.segments is None else [line.split(": ")[1].split(" ")[0] for line in mlp.segments]
    assert got == expect


def test_sdf_decoder_cut_reads_the_input_where_it_joins(rng):
    """sdf512's concat layer (x's 259 features and 512: 784 inputs) does not fit the streamed kernel's registers, so
    it is a GEMM reading the network input, between two fused stretches."""
    widths = [259] + [512] * 8 + [1]
    _, _, mlp = wide_model(rng, widths, activation="relu", output_activation="tanh", concat={4: "before"})
    assert len(mlp.segments) == 3, mlp.segments
    assert mlp.segments[0].startswith("layers 0-3: fused (wgmma, weights streamed")
    assert "layer 4: gemm" in mlp.segments[1] and "input concat reads the network input" in mlp.segments[1]
    assert mlp.segments[2].startswith("layers 5-8: fused (wgmma, weights streamed")


def test_cpu_path_of_a_wide_network_matches_float64(rng):
    """The CPU path has no width limit and is unchanged: the oracle the GPU tests compare segmented kernels with."""
    ws, bs, mlp = wide_model(rng, [40, 700, 300, 9], activation="gelu")
    x = rng.standard_normal((33, 40)).astype(np.float32)
    ref, _ = reference(x, ws, bs, mlp.activations)
    assert rel_l2(mlp(x), ref) < 1e-6


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("prec", fusedmlp.PRECISIONS)
def test_segmented_kernels_compile_ahead_of_time(rng, tmp_path, arch, prec):
    """Every segment renders and NVRTC compiles (no GPU needed): a concat and a residual across the cuts, a GEMM of
    an odd width, a fused tail."""
    widths = [63, 384, 300, 300, 384, 20, 5]
    ws, bs = graph_weights(rng, widths, {3: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["relu", "gelu", "tanh", "silu", "relu", "none"], dtype=prec,
                            concat={3: "before"}, residual={3: ("add", "none", 0), 2: "add"}, device="cpu",
                            cache_dir=tmp_path)
    paths = mlp.compile(arch=arch)
    assert isinstance(paths, tuple) and len(paths) >= 4 and all(os.path.exists(p) for p in paths)
    src = mlp.source
    form = "wgmma" if arch == "sm_90" and prec != "tf32" else "mma.sync"  # sm_90a's warpgroup MMA takes 16-bit
    assert f"{form} GEMM" in src and "(concat)" in src and "residual" in src
    # each GEMM's plan comment names its shape; the layer's index is not in the source
    for line in mlp.segments:
        if ": gemm" in line:
            layer = int(line.split(":")[0].split()[-1])
            assert f"-> {mlp.widths[layer + 1]}; sm_" in src and "// Plan: one layer, " in src


def test_kernels_with_x_in_the_wide_buffers_compile_ahead_of_time(rng):
    """in_shared's kernels render and NVRTC compiles for sm_90a without spills (no GPU needed): sdf512's chain (the pad
    pass, its first stretch reading the copy, the concat GEMM, its last stretch reading the GEMM's output as it is)
    and a one-kernel network whose 259 float16 features still land through a raw buffer."""
    sdf = probe.model(probe.workload("sdf512"), device="cpu")
    ws, bs = graph_weights(rng, [259, 300, 300, 1], {}, 1.0)
    raw = fusedmlp.FusedMLP(ws, bs, activation="gelu", device="cpu")
    for mlp, io, shared in ((sdf, "float16", 2), (raw, "float16", 1)):
        plans = [p for p in probe.kernel_plans(mlp, probe.GPUS["h100"], io) if p.info.get("in_shared")]
        assert len(plans) == shared, [p.info for p in plans]
        for plan in plans:
            source = _source_of(plan)
            assert "#define FM_IN_SHARED 1 " in source and plan.info["warps"] == 8
            _, log = fusedmlp._api._core().nvrtc_compile(source, fusedmlp._api.KERNEL_NAME, 90, True,
                                                          ("--ptxas-options=-v",) + fusedmlp._api.nvrtc_no_cache())
            assert " 0 bytes spill stores" in log, log


def test_equal_layers_share_one_gemm_kernel(rng, tmp_path):
    """An SDF decoder's hidden 512 x 512 layers render to one source: one compile, one cache entry for them all (on
    sm_80, where every layer of it is a GEMM)."""
    widths = [259] + [512] * 8 + [1]
    ws, _ = graph_weights(rng, widths, {4: "before"}, 1.0)
    bs = [rng.uniform(-0.1, 0.1, w.shape[0]).astype(np.float32) for w in ws]  # every layer with a bias, as the SDF's
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation="tanh", concat={4: "before"}, device="cpu",
                            cache_dir=tmp_path)
    paths = mlp.compile("sm_80", "float16")
    # x's pad pass (259 float16 features: 518-byte rows), layer 0, the six equal ones, the concat layer, the last
    assert len(paths) == 10 and len(set(paths)) == 5


def _sdf(rng, widths=(259, 512, 512, 512, 512, 512, 1), at=3, **options):
    ws, _ = graph_weights(rng, list(widths), {at: "before"}, 1.0)
    bs = [rng.uniform(-0.1, 0.1, w.shape[0]).astype(np.float32) for w in ws]
    return fusedmlp.FusedMLP(ws, bs, activation="relu", concat={at: "before"}, device="cpu", **options)


@pytest.mark.parametrize("io, width, row, hidden", [("float16", 259, 264, 512), ("float32", 259, 264, 512),
                                                    ("float32", 256, 256, 512), ("bfloat16", 3, 8, 1024)])
def test_gemms_reading_x_read_its_padded_copy(rng, monkeypatch, io, width, row, hidden):
    """x not in the compute dtype, or with rows that are not whole 16-byte pieces, is copied once by the pad pass
    (pad_rows.cu) to rows of whole pieces of the compute dtype, and every GEMM that reads x reads that copy as it is;
    x in float16 with whole rows is read as it is, x narrower than PAD_MIN_WIDTH too unless FUSEDMLP_GEMM_PAD=1."""
    def model():  # (a model's cut, whose lines say where x is read from, is made once)
        return _sdf(rng, (width,) + (hidden,) * 4 + (1,), dtype="bfloat16" if io == "bfloat16" else "float16")

    if width < _segments.PAD_MIN_WIDTH:
        assert not any(p.info.get("pad_pass") for p in _segments.plans(model(), 90, io, io))
        monkeypatch.setenv("FUSEDMLP_GEMM_PAD", "1")
    else:
        monkeypatch.setenv("FUSEDMLP_GEMM_PAD", "off")
        assert not any(p.info.get("pad_pass") for p in _segments.plans(model(), 90, io, io))
        monkeypatch.delenv("FUSEDMLP_GEMM_PAD")
    mlp = model()
    plans = _segments.plans(mlp, 90, io, io)
    pads = [p.info for p in plans if p.info.get("pad_pass")]
    concat = next(p.info for p in plans if p.info.get("gemm") and not p.info["pad_pass"])
    storage = "bfloat16" if io == "bfloat16" else "float16"
    assert len(pads) == 1 and pads[0]["a0_row"] == row and pads[0]["in_dtype"] == io
    assert pads[0]["out_dtype"] == storage
    assert concat["in_dtype"] == storage and concat["a0_row"] == (row if row != width else 0)
    assert concat["ws"] >= 1  # every part copied as it is: a warp-specialised form, the auto choice for such a layer
    src = _source_of(next(p for p in plans if p.info.get("pad_pass")))
    assert f"constexpr int XC = {width};" in src and f"constexpr int XR = {row};" in src
    assert any("x read from its copy in rows of" in line for line in mlp.segments)
    # x already in the compute dtype with whole rows: no pad pass, the GEMM reads x itself
    plain = _sdf(rng, (256, 512, 512, 512, 512, 1))
    assert not any(p.info.get("pad_pass") for p in _segments.plans(plain, 90, "float16", "float16"))
    # 8-bit and tf32 GEMMs read x as before (quantised / taken on the way in)
    tf32 = _sdf(rng, (259, 512, 512, 512, 512, 1), dtype="tf32")
    assert not any(p.info.get("pad_pass") for p in _segments.plans(tf32, 90, "float32", "float32"))


def test_pad_pass_compiles_for_every_arch_and_refuses_bad_requests(rng, tmp_path):
    mlp = _sdf(rng, cache_dir=tmp_path)
    for arch, io in (("sm_75", "float32"), ("sm_80", "bfloat16"), ("sm_90a", "float16")):
        assert mlp.compile(arch, io)
    net = mlp._net
    with pytest.raises(fusedmlp.FusedMLPError, match="rows of 264"):
        net.gemm_plan(3, 90, 0, 132, "float16", None, None, "float16", pad_pass=True, a0_row=260)
    with pytest.raises(fusedmlp.LimitError, match="float16 or bfloat16"):
        net.gemm_plan(3, 90, 0, 132, "float16", None, None, "float16", pad_pass=True, a0_row=264, precision="tf32")
    for row in (258, 328):  # narrower than x, wider than its K stages (320)
        with pytest.raises(fusedmlp.FusedMLPError, match=f"a0_row={row}: input part 0 has 259 features"):
            net.gemm_plan(3, 90, 0, 132, "float16", "float16", None, "float16", a0_row=row)


def test_gemm_plan_refuses_bad_requests(rng):
    ws, bs, mlp = wide_model(rng, [64, 512, 8], activation="relu")
    with pytest.raises(ValueError, match="layer 5"):
        mlp._gemm_plan(5, 90, 0, 0, 0, "float16", None, None, "float16")
    with pytest.raises(ValueError, match="has no input concat"):
        mlp._gemm_plan(1, 90, 0, 0, 0, "float16", "float16", None, "float16")
    with pytest.raises(fusedmlp.LimitError, match="bfloat16"):
        mlp._gemm_plan(0, 75, 0, 0, 0, "bfloat16", None, None, "float16")
    info = mlp._gemm_plan(0, 90, 0, 0, 0, "float32", None, None, "float16").info
    assert info["gemm"] == 1 and info["threads"] == 256 and info["smem_bytes"] <= 227 * 1024


def test_a_norm_layer_a_gemm_would_take_keeps_the_one_streamed_kernel(rng, tmp_path):
    """NeRF with a LayerNorm on its concat layer: the cut would make that layer a GEMM and a row pass, so the network
    keeps the one kernel that streams its weights (its norm rows stay on chip); a norm layer no fused kernel takes
    (512 features) runs as its GEMM without the norm, then the row pass (test_norm.py has the details)."""
    widths = [63] + [256] * 8 + [4]
    ws, bs = graph_weights(rng, widths, {5: "after"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat={5: "after"}, norm={5: "layernorm"}, device="cpu",
                            cache_dir=tmp_path)
    assert mlp.segments is None and isinstance(mlp.compile("sm_90", "float16"), str)
    ws, bs = graph_weights(rng, [16, 512, 8], {}, 1.0)
    wide = fusedmlp.FusedMLP(ws, bs, activation="relu", norm={0: "layernorm"}, device="cpu", cache_dir=tmp_path)
    assert len(wide.compile("sm_90")) == 3  # the GEMM, its row pass, the 512 -> 8 layer fused
    assert "layernorm in a second kernel" in wide.segments[0]


@pytest.mark.parametrize("rows, n, default, expect", [
    (1024, 512, (128, 256), (64, 64)),  # no tile fills 132 SMs: the smallest (128 CTAs)
    (2048, 512, (128, 256), (64, 64)),  # 256 CTAs of 64 x 64; 64 x 128 gives 128
    (4096, 512, (128, 256), (64, 128)),  # 256 CTAs
    (8448, 512, (128, 256), (128, 256)),  # the default's 66 x 2 = 132 CTAs fill the SMs once
    (2 ** 21, 1024, (128, 256), (128, 256)),
    (1024, 1, (128, 64), (64, 64)),  # a one-output layer: rows alone decide
    (1024, 512, (128, 128), (64, 64)),  # mma.sync's default: no 256-column tiles to step down from
])
def test_small_batches_take_gemm_tiles_that_fill_the_sms(rows, n, default, expect):
    assert _segments.gemm_tile(rows, n, default, 132) == expect


ALL_SPECIALISED = ((128, 256),) + _segments.SMALL_TILES


@pytest.mark.parametrize("rows, n, expect", [
    (4096, 1024, (128, 256)),  # 128 CTAs, over half the SMs (rec1024's 1024 x 1024 layer: 16.9 us, 24.2 in 128 x 128)
    (4096, 512, (128, 128)),  # 64 CTAs of 128 x 256 are fewer than half; 128 of 128 x 128
    (1024, 1024, (64, 128)),  # 128 CTAs
    (1024, 512, (64, 64)),  # 64 CTAs of 64 x 128 are fewer than half (rec1024's 1024 -> 512: 8.1 us, 9.4 in 64 x 128)
    (16384, 512, (128, 256)),
])
def test_warp_specialised_tiles_need_fill_only_half_the_sms(rows, n, expect):
    assert _segments.gemm_tile(rows, n, (128, 256), 132, ALL_SPECIALISED) == expect


@pytest.mark.parametrize("arch, prec", [(90, "float16"), (90, "bfloat16"), (80, "float16"), (90, "tf32")])
@pytest.mark.parametrize("tile", _segments.SMALL_TILES)
def test_small_gemm_tiles_compile_ahead_of_time(rng, tmp_path, arch, prec, tile):
    """Each smaller tile a small batch takes renders and NVRTC compiles, with a concat part and a residual."""
    from fusedmlp import _api
    from fusedmlp._cache import KernelCache

    widths = [63, 512, 512]
    ws, bs = graph_weights(rng, widths, {1: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, dtype=prec, concat={1: "before"}, device="cpu", cache_dir=tmp_path)
    plan = mlp._gemm_plan(1, arch, 232448 if arch == 90 else 166912, 132, 233472, "float16", "float16", None,
                          "float32", bm=tile[0], bn=tile[1])
    assert (plan.info["bm"], plan.info["bn"]) == tile
    entry = _api.compile_cubin(_api._source_of(plan), arch, KernelCache(tmp_path), plan.info["wgmma"])
    assert os.path.getsize(entry.path) > 0


def test_a_chain_builds_a_small_tile_for_a_small_batch_once(rng, monkeypatch):
    """The chain's GEMM layer builds the default tile with the chain and a smaller one on the first small call."""
    widths = [64, 512, 512, 64]
    ws, bs = graph_weights(rng, widths, {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, device="cpu")
    built = []
    monkeypatch.setattr(mlp, "_build_gemm", lambda layer, *dtypes, **tile: built.append((layer, tile)) or object())
    gemm = _segments.GemmLayer(mlp, 1, ("float16", None, None, "float16"), (128, 256), "default kernel", 132)
    assert gemm.kernel(2 ** 20) == "default kernel" and not built
    small = gemm.kernel(1024)
    assert built == [(1, {"bm": 64, "bn": 64})] and gemm.kernel(1000) is small and len(built) == 1
    mlp._gemm_options = {"bm": 128}  # a forced tile (the probe tool's A/B runs): always the chain's own kernel
    assert gemm.kernel(1024) == "default kernel"


def test_a_spilled_streamed_kernel_is_rebuilt_narrower_unless_it_has_wide_layers(monkeypatch, rng):
    """FusedMLP._build rebuilds a streamed kernel that spilled with 64-column groups (half the accumulators), but not
    one with layers wider than 256: their spills (loop-invariant addresses beside 128 input registers) come with
    either width, and 128 columns ran 13% faster (wide512, H100)."""
    import types

    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132, "name": "Fake 90"}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    monkeypatch.setattr(_api, "compile_cubin", lambda *a, **k: types.SimpleNamespace(cubin=b"", path="fake"))
    monkeypatch.setattr(_api, "spilled", lambda kernel, plan: True)  # ptxas spilled, whatever the plan
    built = []
    render = fusedmlp.FusedMLP._render

    def fake_render(self, *args, **options):
        plan, source = render(self, *args, **options)
        built.append(options)
        loaded = types.SimpleNamespace(info={"regs": 255, "local_bytes": 48})
        return types.SimpleNamespace(info=plan.info, load=lambda *a: loaded), source

    monkeypatch.setattr(fusedmlp.FusedMLP, "_render", fake_render)
    for widths, rebuilt in (([64, 256, 256, 256, 16], True), ([64, 512, 512, 64], False)):
        _, _, mlp = wide_model(rng, widths, activation="gelu")
        built.clear()
        plan = mlp._build("float16")[1]
        assert plan.info["stream_slots"] >= 2
        assert built[1:] == ([{"wgmma": 1, "resident": 0, "n_chunk": 64}] if rebuilt else []), (widths, built)


@pytest.mark.parametrize("width, io, pad", [(63, "float16", "auto"), (259, "float16", "-1"), (259, "float32", "-1"),
                                           (3, "float32", "auto")])
def test_gemms_reading_x_as_it_is_take_its_width_as_its_row(rng, monkeypatch, width, io, pad):
    """Where the chain does not pad x (narrower than PAD_MIN_WIDTH, or FUSEDMLP_GEMM_PAD=-1), the GEMMs that read x
    read it as it is: x's dtype, rows of its width (a0_row 0), and no pad pass."""
    monkeypatch.setenv("FUSEDMLP_GEMM_PAD", pad)
    mlp = _sdf(rng, (width, 1024, 1024, 1024, 1), at=2)
    plans = _segments.plans(mlp, 90, io, io)
    assert not any(p.info.get("pad_pass") for p in plans)
    reading = [p.info for p in plans if p.info.get("gemm") and p.info["gemm_layer"] in (0, 2)]
    assert len(reading) == 2 and all(i["in_dtype"] == io and i["a0_row"] == 0 for i in reading)


@pytest.mark.parametrize("io", ["float16", "float32"])
def test_sdf512s_stretches_run_two_warpgroups_reading_x_through_its_copy(io):
    """sdf512's first stretch reads x's padded copy (the pad pass runs first, once for it and the concat GEMM), so it
    needs no raw landing buffer; both stretches keep each warp's input buffer in its wide buffer's bytes
    (in_shared), which leaves room for two warpgroups where their 512-wide buffers took one each. The stretch's first
    layer reads the copy's 264 columns, 5 of them zero weights."""
    mlp = probe.model(probe.workload("sdf512"), device="cpu")
    plans = [p.info for p in _segments.plans(mlp, 90, io, io, _H100)]
    kinds = ["pad" if p.get("pad_pass") else "gemm" if p.get("gemm") else "fused" for p in plans]
    assert kinds == ["pad", "fused", "gemm", "fused"], kinds
    head, tail = plans[1], plans[3]
    assert head["in_dtype"] == "float16" and plans[0]["in_dtype"] == io and plans[0]["a0_row"] == 264
    for info in (head, tail):
        assert info["warps"] == 8 and info["in_shared"] == 1 and info["smem_bytes"] <= _H100[1], info
    assert "x read from its copy in rows of 264 float16" in mlp.segments[0], mlp.segments
    sub = _segments.stretch_model(mlp, _segments.plan(mlp, *_H100, io, io)[0], io, io)[0]
    assert sub.widths[0] == 264 and not np.any(sub._w[0][:, 259:]) and np.array_equal(sub._w[0][:, :259], mlp._w[0])
    # in_shared: off takes one warpgroup again; on, where no wide buffer or a split plan, is a limit naming why
    net = probe.model(probe.workload("sdf512tail"), device="cpu")._net
    plan = functools.partial(net.plan, 90, _H100[1], _H100[2], "float16", "float16", smem_per_sm=_H100[3])
    assert plan(in_shared=-1).info["warps"] == 4 and plan().info["in_shared"] == 1
    assert plan(in_shared=1, warps=4).info["in_shared"] == 1
    with pytest.raises(fusedmlp.LimitError, match="no layer wider than 256"):
        probe.model(probe.workload("tcnn64"), device="cpu")._net.plan(90, _H100[1], _H100[2], "float16", "float16",
                                                                     wgmma=1, resident=0, in_shared=1)
    with pytest.raises(fusedmlp.ArgumentError, match="in_shared=2"):
        plan(in_shared=2)


@pytest.mark.parametrize("widths, io, expect", [
    ((259, 512, 512, 512, 1), "float16", "copy"),  # one warpgroup reading x: two reading its copy
    ((259, 512, 512, 512, 1), "float32", "copy"),
    ((512, 384, 384, 384, 1), "float32", "copy"),  # x's float32 rows land in no one kernel
    ((512, 384, 384, 384, 1), "float16", "one"),   # x's rows land as they are: no copy
    ((259, 256, 256, 1), "float32", "one"),        # too little arithmetic a row to pay for the pass
])
def test_a_network_whose_copy_of_x_gives_two_warpgroups_runs_the_pad_pass_first(rng, widths, io, expect):
    """A network whose one streamed kernel would land x through a raw buffer (a width of no whole 16-byte pieces, or
    float32 x) and so run one warpgroup, or none at all, runs x's pad pass and that kernel reading the copy on two
    warpgroups, where its arithmetic a row pays for the pass's bytes (COPY_FLOPS_PER_BYTE)."""
    ws, bs = graph_weights(rng, list(widths), {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", device="cpu")
    segments = mlp._segments_for(*_H100, io, io)
    if expect == "one":
        assert segments is None
        return
    assert len(segments) == 1 and segments[0].x_copy and "x read from its copy" in segments[0].reason, segments
    plans = [p.info for p in _segments.plans(mlp, 90, io, io, _H100)]
    assert [bool(p.get("pad_pass")) for p in plans] == [True, False]
    assert plans[1]["warps"] == 8 and plans[1]["in_dtype"] == "float16" and plans[0]["in_dtype"] == io
    assert not _segments.gemms_at(mlp, segments, 1024, 132)  # its own small-batch plans, not every layer a GEMM


def test_a_first_stretch_adding_x_as_a_residual_reads_x_itself(rng):
    """Only a first stretch that reads x as its input alone reads the copy: one that also adds x (a residual) reads x
    as it is, and the pad pass stays before the first GEMM reading x."""
    widths, concat = [300, 300, 1024, 16], {2: "before"}
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat=concat, residual={0: ("add", "none", "input")},
                            device="cpu")
    segments = _segments.plan(mlp, *_H100, "float16", "float16")
    assert [s.kind for s in segments] == ["fused", "gemm", "gemm"], segments
    assert _segments.copy_row(mlp, segments[0], "float16") == 0 and _segments.pad_row(mlp, "float16") == 304
    kinds = ["pad" if p.info.get("pad_pass") else "gemm" if p.info.get("gemm") else "fused"
             for p in _segments.plans(mlp, 90, "float16", "float16", _H100)]
    assert kinds == ["fused", "gemm", "pad", "gemm"], kinds
    assert "x read from its copy" not in mlp.segments[0]


def test_a_residual_from_x_reads_x_itself_where_the_parts_read_its_copy(rng):
    """A GEMM whose input part and residual operand are both x: the part is the padded copy (the compute dtype's
    storage), the residual x as it is (its dtype, rows of its width)."""
    widths, concat = [300, 1024, 300], {1: "before"}
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", concat=concat, residual={1: ("add", "none", "input")},
                            device="cpu")
    assert _segments.gemm_dtypes(mlp, 1, "float32", "float16") == ("float16", "float16", "float32", "float16")
    info = next(p.info for p in _segments.plans(mlp, 90, "float32", "float16") if p.info.get("gemm_layer") == 1
                and not p.info["pad_pass"])
    assert info["in_dtype"] == "float16" and info["a0_row"] == 304


class _Launches:
    """A chain step's kernel that records its launches' arguments instead of launching."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def launch(self, x, y, rows, stream=0, x1=0, res=0, after=False):
        self.log.append((self.name, after))


@pytest.mark.parametrize("pdl, expect", [(None, [False, True, True, True, True]), ("0", [False] * 5)])
def test_a_chain_launches_each_kernel_after_the_first_as_a_dependent(rng, monkeypatch, pdl, expect):
    """Chain.launch and Chain.program (the C fast path's steps) mark every kernel but the first as a dependent launch
    (Kernel.launch's after: it starts while the one before finishes, sm_90+); FUSEDMLP_PDL=0, read when the chain is
    made, launches them all plainly. rec1024 on sm_90 in float32: the pad pass, three GEMMs, the fused tail."""
    set_env(monkeypatch, "FUSEDMLP_PDL", pdl)
    widths = [256, 1024, 1024, 512, 256, 1]
    ws, bs = graph_weights(rng, widths, {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, device="cpu")
    segments = mlp._segments_for(90, 232448, 132, 233472, "float32", "float32")
    log = []
    kernels = [_Launches(log, i) for i in range(5)]
    steps = [(lambda rows, k=kernels[0]: k, -1, _segments.X_PAD, None, None)]
    steps += [(lambda rows, k=kernels[i + 1]: k, _segments.X_PAD if i == 0 else i - 1, i, None, None) for i in range(3)]
    steps.append((lambda rows, k=kernels[4]: k, 2, 4, None, None))

    class Buffer:
        ptr = 1 << 20

    monkeypatch.setattr(mlp, "_device_buffer", lambda nbytes: Buffer())
    chain = _segments.Chain(mlp, segments, "float32", "float32", steps, [])
    chain.launch(16, 32, 100)
    assert log == list(enumerate(expect))
    program, _, _ = chain.program(100, 0)
    assert [step[-1] for step in program] == expect and [step[0] for step in program] == kernels
    monkeypatch.setenv("FUSEDMLP_PDL", "maybe")
    with pytest.raises(ValueError, match="FUSEDMLP_PDL='maybe' is not a boolean"):
        _segments.Chain(mlp, segments, "float32", "float32", steps, [])


def test_every_kernel_template_waits_for_the_kernel_before_it():
    """Each kernel template calls fm_grid_wait (griddepcontrol.wait on sm_90+) once, before its tile loop or its
    first read of an input, and fm_grid_release only after it: a chain launches its kernels after the first as
    dependents, which may start before the kernel writing their input is done."""
    folder = os.path.join(os.path.dirname(fusedmlp.__file__), "kernel_templates")
    for name in ("fused_mlp.cu", "fused_mlp_sm90.cu", "gemm_layer.cu", "pad_rows.cu", "row_norm.cu"):
        with open(os.path.join(folder, name)) as f:
            body = f.read().split("__global__", 1)[1]
        assert body.count("fm_grid_wait();") == 1 and body.count("fm_grid_release();") >= 1, name
        wait = body.index("fm_grid_wait();")
        assert wait < body.index("fm_grid_release();"), name
        for first_use in ("fm_prefetch(", "fm_prefetch_x(", "fm_load_input(", "for (long long tile", "fm_ldv<",
                          "*)x + r0", "fm_ws_produce(", "fm_pp_produce(", "fm_mainloop"):
            if first_use in body:
                assert wait < body.index(first_use), (name, first_use)


def test_a_gemms_tile_plans_are_its_default_then_each_smaller_tile(rng):
    """gemm_tile_plans: the plan info a chain reads its GEMM's tiles and their forms from (GemmLayer.specialised):
    rec1024's 1024 x 1024 layer on the H100 at 128 x 256 (the default) and each smaller tile, every one
    warp-specialised; tf32's mma.sync GEMM steps down from 128 x 128, in the plain form."""
    widths = [256, 1024, 1024, 512, 256, 1]
    ws, bs = graph_weights(rng, widths, {}, 1.0)
    target = (90, 232448, 132, 233472)
    for dtype, tiles, forms in (("float16", [(128, 256), (128, 128), (64, 128), (64, 64)], [3, 2, 1, 1]),
                                ("tf32", [(128, 128), (64, 128), (64, 64)], [0, 0, 0])):
        mlp = fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu")
        plans = _segments.gemm_tile_plans(mlp, 1, target, _segments.gemm_dtypes(mlp, 1, "float16", "float16"))
        assert list(plans) == tiles and [info["ws"] for info in plans.values()] == forms
        assert all((info["bm"], info["bn"]) == tile for tile, info in plans.items())


def test_small_batches_of_networks_with_wide_fused_stretches_run_every_layer_as_a_gemm():
    """gemms_at: sdf512's cut has fused stretches of four 512-wide layers, so below 64 rows per SM its calls take
    the all-GEMM chain (policy "gemm", every layer its own segment); rec1024's stretch is its narrow tail, and a
    network that is one fused kernel has no cut to change. Norm layers keep their cut."""
    sdf = probe.model(probe.workload("sdf512"), device="cpu")
    segments = sdf._segments_for(90, 232448, 132, 233472, "float16", "float16")
    assert [seg.kind for seg in segments] == ["fused", "gemm", "fused"]
    assert _segments.gemms_at(sdf, segments, 1024, 132) and _segments.gemms_at(sdf, segments, 8000, 132)
    assert not _segments.gemms_at(sdf, segments, 8448, 132) and not _segments.gemms_at(sdf, segments, 1024, 0)
    every = sdf._segments_for(90, 232448, 132, 233472, "float16", "float16", "gemm")
    assert [(seg.first, seg.last, seg.kind) for seg in every] == [(l, l, "gemm") for l in range(9)]
    rec = probe.model(probe.workload("rec1024"), device="cpu")
    assert not _segments.gemms_at(rec, rec._segments_for(90, 232448, 132, 233472, "float16", "float16"), 1024, 132)
    ws = [np.ones((768, 64), np.float32), np.ones((768, 768), np.float32), np.ones((8, 768), np.float32)]
    normed = fusedmlp.FusedMLP(ws, None, "silu", norm={1: "layernorm"}, device="cpu")
    assert normed._segments_for(90, 232448, 132, 233472, "float16", "float16", "gemm") == \
        normed._segments_for(90, 232448, 132, 233472, "float16", "float16")
