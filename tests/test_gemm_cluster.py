"""The wgmma GEMM's forms beyond one plain CTA a tile (csrc/gemm.c; kernel_templates/gemm_layer.cu), on the CPU: clusters
of two CTAs sharing the weight tile (fm_plan.gemm_cluster) and the warp-specialised form (fm_plan.gemm_ws): which plans
take them, the weight blob's tiles read back on the host, and ahead-of-time compiles for sm_90a of the benchmark
networks' GEMMs in every I/O dtype without spills."""

import re

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _api, _core, _segments
from conftest import graph_weights

H100 = (90, 232448, 132, 233472)  # arch, shared memory per block, SMs, per SM

NETWORKS = {  # widths, activation, output activation, concat, residual (bench.WORKLOADS and a residual wide layer)
    "wide768": ([64] + [768] * 4 + [64], "gelu", None, {}, {}),  # (wide512 is one streamed kernel on sm_90)
    "rec1024": ([256, 1024, 1024, 512, 256, 1], "relu", None, {}, {}),
    "sdf512": ([259] + [512] * 8 + [1], "relu", "tanh", {4: "before"}, {}),
    "res768": ([96, 768, 768, 768, 10], "silu", None, {}, {2: ("add", "relu", 0), 1: "add"}),
}


def model(rng, name, dtype="float16"):
    widths, act, out_act, concat, residual = NETWORKS[name]
    ws, bs = graph_weights(rng, widths, concat, 1.0)
    return fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, concat=concat or None,
                             residual=residual or None, dtype=dtype, device="cpu"), ws


def gemm_plans(mlp, io, **options):
    """The plans of mlp's GEMM layers for an H100 with fp I/O dtype io (layer, plan); with ws=2 (the form in turn,
    which takes no residual yet) those of its layers without one."""
    segments = mlp._segments_for(*H100, io, io)
    dtypes = {seg.first: _segments.gemm_dtypes(mlp, seg.first, io, io) for seg in segments if seg.kind == "gemm"}
    return [(l, mlp._gemm_plan(l, *H100, *d, **options)) for l, d in dtypes.items()
            if not (options.get("ws") == 2 and d[2] is not None)]


def test_clusters_of_two_are_a_wgmma_plan_option(rng):
    mlp, _ = model(rng, "wide768")
    one = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", cluster=1, ws=-1).info
    two = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", cluster=2).info
    assert (one["cluster"], two["cluster"]) == (1, 2) and one["wgmma"] == two["wgmma"] == 1
    assert (two["bm"], two["bn"], two["stages"]) == (128, 256, 4)
    assert two["smem_bytes"] == one["smem_bytes"] + 16 * 4  # a full and an empty mbarrier a stage
    assert mlp._gemm_plan(1, *H100, "float16", None, None, "float16").info["cluster"] in (1, 2)
    for bm, bn in _segments.SMALL_TILES:  # the small-batch tiles take it too
        info = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", bm=bm, bn=bn, cluster=2).info
        assert (info["bm"], info["bn"], info["cluster"]) == (bm, bn, 2)
    with pytest.raises(fusedmlp.LimitError, match="clusters of 2 needs the wgmma form"):
        mlp._gemm_plan(1, 80, 166912, 108, 167936, "float16", None, None, "float16", cluster=2)
    with pytest.raises(fusedmlp.LimitError, match="clusters of 2 needs the wgmma form"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", wgmma=0, cluster=2)
    with pytest.raises(ValueError, match="cluster=3"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", cluster=3)


def test_the_environment_forces_the_form_where_the_wgmma_form_runs(rng, monkeypatch):
    mlp, _ = model(rng, "wide768")
    tf32, _ = model(rng, "wide768", dtype="tf32")
    for value, form in (("2", 2), ("1", 1)):
        monkeypatch.setenv("FUSEDMLP_GEMM_CLUSTER", value)
        assert all(p.info["cluster"] == form for _, p in gemm_plans(mlp, "float16"))
        assert mlp._gemm_plan(1, *H100, "float16", None, None, "float16", cluster=1).info["cluster"] == 1  # asked
        assert all(p.info["cluster"] == 1 and not p.info["wgmma"] for _, p in gemm_plans(tf32, "float32"))
    monkeypatch.setenv("FUSEDMLP_GEMM_CLUSTER", "4")
    with pytest.raises(ValueError, match="FUSEDMLP_GEMM_CLUSTER='4'"):
        gemm_plans(mlp, "float16")


def test_a_small_batchs_smaller_tiles_take_the_warp_specialised_forms_where_they_won(rng):
    """A tile smaller than 128 x 256, given (a small batch's, _segments.gemm_tile), takes the form that won at it on
    the H100 (bench/results/h100-gemm-small/): 128 x 128 in turn (ws=2), 64-row tiles a producer warpgroup (ws=1),
    for 16-bit wgmma layers of more than 128 outputs whose parts copy as they are; the plain form elsewhere (a part
    converted on the way, a residual in turn, 8-bit, a narrow layer, mma.sync), and wherever a form is asked for."""
    mlp, _ = model(rng, "rec1024")

    def ws(layer=1, a0="float16", res=None, net=mlp, **tile):
        return net._gemm_plan(layer, *H100, a0, None, res, "float16", **tile).info["ws"]

    assert [ws(bm=bm, bn=bn) for bm, bn in _segments.SMALL_TILES] == [2, 1, 1]
    assert [ws(layer=0, a0="float32", bm=bm, bn=bn) for bm, bn in _segments.SMALL_TILES] == [0, 0, 0]  # converted
    assert ws(bm=128, bn=256) == 3 and ws(bm=64, bn=128, ws=-1) == 0 and ws(bm=128, bn=128, ws=1) == 1
    res, _ = model(rng, "res768")  # layer 1 adds layer 0's output: not in turn
    assert ws(1, net=res, res="float16", bm=128, bn=128) == 0 and ws(1, net=res, res="float16", bm=64, bn=64) == 1
    int8, _ = model(rng, "rec1024", dtype="int8")
    int8.calibrate(rng.standard_normal((64, 256)).astype(np.float32))
    assert int8._gemm_plan(1, *H100, "float16", None, None, "float16", bm=64, bn=64).info["ws"] == 0


def test_warp_specialisation_is_a_wgmma_plan_option_and_the_default_where_inputs_copy_as_they_are(rng, monkeypatch):
    """ws=1: a producer warpgroup more (12 warps for 128-row tiles), a full and an empty mbarrier a stage, its register
    share counted in the CTAs an SM; the default where the tile is 128 x 256 and every input part is the compute dtype
    with 16-byte rows (rec1024 on the H100: 22.60 -> 20.28 ms), not where a part is converted on the way (sdf512's x,
    259 columns: 26.35 -> 33.77 ms). (A smaller tile given has its own rule: the next test.)"""
    mlp, _ = model(rng, "rec1024")
    plain = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=-1).info
    ws = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=1).info
    assert (plain["ws"], ws["ws"], plain["warps"], ws["warps"]) == (0, 1, 8, 12)
    assert ws["smem_bytes"] == plain["smem_bytes"] + 16 * 4 and ws["blocks_per_sm"] == 1
    assert mlp._gemm_plan(1, *H100, "float16", None, None, "float16").info["ws"] == 3  # the default: ws=1's, persistent
    assert mlp._gemm_plan(0, *H100, "float32", None, None, "float16").info["ws"] == 0  # x converted on the way
    small = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", bm=128, bn=128, ws=1).info
    assert (small["warps"], small["blocks_per_sm"]) == (12, 1)  # 112 registers a thread: one CTA of 384
    sdf, _ = model(rng, "sdf512")
    assert [p.info["ws"] for _, p in gemm_plans(sdf, "float16")] == [3]  # x read from its padded copy, as it is
    monkeypatch.setenv("FUSEDMLP_GEMM_PAD", "-1")
    assert [p.info["ws"] for _, p in gemm_plans(sdf, "float16")] == [0]  # x converted on the way
    with pytest.raises(fusedmlp.LimitError, match=r"ws=1\) is the wgmma form on one CTA"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=1, cluster=2)
    with pytest.raises(fusedmlp.LimitError, match=r"ws=1\) is the wgmma form on one CTA"):
        mlp._gemm_plan(1, 80, 166912, 108, 167936, "float16", None, None, "float16", ws=1)
    with pytest.raises(ValueError, match="ws=4"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=4)



def test_a_by_tensor_maps_is_the_default_of_the_warp_specialised_forms_whose_parts_copy_as_they_are(rng, monkeypatch):
    """tma=1 (fm_plan.gemm_tma): the producer's thread 0 loads each stage's A rows with one TMA copy of a tensor map
    the launch encodes, the full barrier counting its arrival alone; the default wherever a producer warpgroup runs
    and every input part is the compute dtype with 16-byte rows (x's padded copy too), in every warp-specialised
    form and both 8-bit dtypes; tma=-1 keeps the 128 threads' cp.async. Elsewhere tma=1 is a LimitError."""
    mlp, _ = model(rng, "rec1024")
    for ws in (1, 2, 3):
        info = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=ws, bn=128 if ws == 2 else 0).info
        assert (info["ws"], info["tma"]) == (ws, 1)
    plan = mlp._gemm_plan(1, *H100, "float16", None, None, "float16")
    source = _api._source_of(plan)
    assert "#define FM_GEMM_TMA 1" in source and "; A by tensor maps" in source
    off = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", tma=-1)
    assert off.info["tma"] == 0 and "#define FM_GEMM_TMA 0" in _api._source_of(off)
    assert mlp._gemm_plan(0, *H100, "float32", None, None, "float16").info["tma"] == 0  # x converted on the way
    assert mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=-1).info["tma"] == 0  # no producer
    sdf, _ = model(rng, "sdf512")
    assert [p.info["tma"] for _, p in gemm_plans(sdf, "float16")] == [1]  # x's padded copy beside h
    for dtype in fusedmlp.LOWBIT_PRECISIONS:
        low, _ = model(rng, "rec1024", dtype)
        low.calibrate(rng.standard_normal((256, 256)).astype(np.float32))
        assert [p.info["tma"] for l, p in gemm_plans(low, "float16") if l > 0] == [1, 1, 1, 0]  # codes between layers
        # (every layer a GEMM; x is quantised on the way into layer 0, and the one-output layer's tile has no producer)
    monkeypatch.setenv("FUSEDMLP_GEMM_TMA", "-1")  # (the process's switch back to cp.async)
    assert [p.info["tma"] for _, p in gemm_plans(sdf, "float16")] == [0]
    monkeypatch.setenv("FUSEDMLP_GEMM_TMA", "on")
    with pytest.raises(ValueError, match="FUSEDMLP_GEMM_TMA='on' is not a way to load A"):
        gemm_plans(sdf, "float16")
    monkeypatch.delenv("FUSEDMLP_GEMM_TMA")
    with pytest.raises(fusedmlp.LimitError, match="tma=1 needs a warp-specialised form"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=-1, tma=1)
    with pytest.raises(ValueError, match="tma=2"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", tma=2)


def test_tma_stores_of_y_are_a_plan_option_of_the_persistent_form(rng, monkeypatch):
    """tma_store=1 (fm_plan.gemm_tma_store; FUSEDMLP_GEMM_TMA_STORE=1 for a process): the persistent form's consumer
    warps store each staged slab (16 rows by 128 bytes) with one TMA store of a tensor map of y, two unpadded slabs a
    warp from the first 1024-byte boundary after the stages; the default wherever y allows (tma_store=-1 and
    FUSEDMLP_GEMM_TMA_STORE=-1: the warps' 16-byte stores). Refused where the form is not the persistent one or a tile
    row is an odd number of slabs; the forced environment leaves such a layer its own store. Every such GEMM of the
    benchmark networks and a residual one, 16- and 8-bit, compiles for sm_90a without spills."""
    _api._nvrtc_info()
    mlp, _ = model(rng, "rec1024")
    off = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", tma_store=-1).info
    on = mlp._gemm_plan(1, *H100, "float16", None, None, "float16")
    assert (off["ws"], off["tma_store"], on.info["tma_store"]) == (3, 0, 1)
    # four 48 KB stages and their mbarriers, up to the next 1 KB, then 8 warps x 2 slabs x 2 KB, and the alignment
    assert (off["smem_bytes"], on.info["smem_bytes"]) == (4 * (48 * 1024 + 16) + 1024 + 8 * 16 * 144,
                                                          197632 + 8 * 2 * 2048 + 1024)
    source = _api._source_of(on)
    assert "#define FM_GEMM_TMA_STORE 1" in source and "; y by TMA stores" in source
    assert "#define FM_GEMM_TMA_STORE 0" in _api._source_of(mlp._gemm_plan(1, *H100, "float16", None, None, "float16",
                                                                             tma_store=-1))
    with pytest.raises(fusedmlp.LimitError, match="tma_store=1 needs the persistent form"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=1, tma_store=1)
    with pytest.raises(fusedmlp.LimitError, match="an even number of 128-byte slabs"):
        mlp._gemm_plan(4, *H100, "float16", None, None, "float16", ws=3, tma_store=1)  # 1 output: a 64-column tile
    with pytest.raises(ValueError, match="tma_store=2"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", tma_store=2)
    monkeypatch.setenv("FUSEDMLP_GEMM_WS", "3")
    monkeypatch.setenv("FUSEDMLP_GEMM_TMA_STORE", "1")
    assert [p.info["tma_store"] for _, p in gemm_plans(mlp, "float16")] == [1, 1, 1]
    wide, _ = model(rng, "wide768")
    assert [p.info["tma_store"] for _, p in gemm_plans(wide, "float16")] == [1, 1, 1, 1, 0]  # (64 outputs: one slab)
    monkeypatch.setenv("FUSEDMLP_GEMM_TMA_STORE", "-1")
    assert [p.info["tma_store"] for _, p in gemm_plans(mlp, "float16")] == [0, 0, 0]
    monkeypatch.setenv("FUSEDMLP_GEMM_TMA_STORE", "2")
    with pytest.raises(ValueError, match="FUSEDMLP_GEMM_TMA_STORE='2' is not a way to store y"):
        gemm_plans(mlp, "float16")
    monkeypatch.delenv("FUSEDMLP_GEMM_TMA_STORE")
    sources = {}
    for name in ("rec1024", "sdf512", "res768"):
        for dtype in ("float16", "bfloat16", "float8", "int8"):
            net, _ = model(rng, name, dtype)
            if dtype in fusedmlp.LOWBIT_PRECISIONS:
                net.calibrate(rng.standard_normal((256, NETWORKS[name][0][0])).astype(np.float32))
            for io in ("float32", "float16"):
                for layer, plan in gemm_plans(net, io):
                    if plan.info["bn"] == 256:  # (the wider layers: 256-column tiles, four slabs a row or more)
                        plan = net._gemm_plan(layer, *H100, *_segments.gemm_dtypes(net, layer, io, io), ws=3,
                                              tma_store=1)
                        sources.setdefault(_api._source_of(plan), (name, dtype, io, layer))
    assert len(sources) >= 10
    for source, case in sources.items():
        log = ptxas_report(source)
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (case, log)

def test_the_persistent_form_is_a_plan_option_with_slabs_of_staged_output(rng):
    """ws=3: ws=1's 128 x 256 tile and its 12 warps, 4 stages of 48 KB and their mbarriers, and after them each
    consumer warp's staged slab (16 rows of 128 bytes, a row padded by 16 bytes) for any y dtype where the warps store
    y (tma_store=-1; the TMA stores' slabs: the test above); one CTA an SM, the grid at most a CTA an SM (the tiles a
    CTA takes: gemm_layer.cu). 64-row tiles take it too; not on mma.sync."""
    mlp, _ = model(rng, "rec1024")
    for out in ("float16", "float32"):
        info = mlp._gemm_plan(1, *H100, "float16", None, None, out, ws=3, tma_store=-1).info
        assert (info["ws"], info["warps"], info["bm"], info["bn"], info["stages"], info["blocks_per_sm"]) == (
            3, 12, 128, 256, 4, 1)
        assert info["smem_bytes"] == 4 * (384 * 128 + 16) + 1024 + 128 * (128 + 16)
    plan = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=3)
    source = _api._source_of(plan)
    assert "#define FM_GEMM_WS 3" in source and "a persistent grid" in source
    small = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", bm=64, bn=128, ws=3, tma_store=-1).info
    assert (small["ws"], small["warps"], small["smem_bytes"]) == (3, 8, 3 * (192 * 128 + 16) + 1024 + 64 * 144)
    with pytest.raises(fusedmlp.LimitError, match=r"ws=3\) is the wgmma form on one CTA"):
        mlp._gemm_plan(1, 80, 166912, 108, 167936, "float16", None, None, "float16", ws=3)
    paired = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=3, cluster=2, tma_store=-1)  # pairs
    # sharing B
    assert (paired.info["ws"], paired.info["cluster"], paired.info["smem_bytes"]) == (3, 2, info["smem_bytes"])
    assert "__cluster_dims__(FM_GEMM_CLUSTER, 1, 1)" in _api._source_of(paired)
    with pytest.raises(fusedmlp.LimitError, match=r"ws=1\) is the wgmma form on one CTA a tile, or for ws=3"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=1, cluster=2)


def test_the_consumers_in_turn_are_a_plan_option_with_tiles_of_their_own(rng):
    """ws=2 (ping-pong): 12 warps, each consumer warpgroup a 128 x 128 tile of its own
    in two m64 MMAs (a warp 32 rows), 4 stages of 32 KB, and after them each consumer warp's staged output (32 rows of
    128 outputs, a row padded by 16 bytes); one CTA an SM. Not with a 256-column or 64-row tile, not on mma.sync."""
    mlp, _ = model(rng, "rec1024")
    plan = mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=2)
    info = plan.info
    assert (info["ws"], info["warps"], info["bm"], info["bn"], info["stages"], info["blocks_per_sm"]) == (
        2, 12, 128, 128, 4, 1)
    assert info["smem_bytes"] == 4 * (256 * 128 + 16) + 16 + 1024 + 8 * 32 * (128 * 2 + 16)  # (16: turn mbarriers)
    source = _api._source_of(plan)
    assert "#define FM_GEMM_WS 2" in source and "in turn on tiles of their own" in source
    f32 = mlp._gemm_plan(1, *H100, "float16", None, None, "float32", ws=2)
    assert f32.info["smem_bytes"] == 4 * (256 * 128 + 16) + 16 + 1024  # float32 y: stored from the fragments
    assert re.findall(r"(\d+) bytes spill stores", ptxas_report(_api._source_of(f32))) == ["0"]
    with pytest.raises(ValueError, match=r"128x256 in turn \(ws=2\)"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=2, bn=256)
    with pytest.raises(ValueError, match=r"64x128 in turn"):
        mlp._gemm_plan(1, *H100, "float16", None, None, "float16", ws=2, bm=64, bn=128)
    with pytest.raises(fusedmlp.LimitError, match=r"ws=2\) is the wgmma form on one CTA"):
        mlp._gemm_plan(1, 80, 166912, 108, 167936, "float16", None, None, "float16", ws=2)
    res, _ = model(rng, "res768")
    with pytest.raises(fusedmlp.LimitError, match=r"in turn \(ws=2\) takes no residual operand yet"):
        res._gemm_plan(1, *H100, "float16", None, "float16", "float16", ws=2)


@pytest.mark.parametrize("name,dtype,io,forms", [
    ("wide512", "int8", "float16", [2, 2, 2, 2, 0]), ("wide512", "float8", "float16", [2, 2, 2, 2, 0]),
    ("rec1024", "int8", "float16", [2, 2, 2, 2, 0]), ("rec1024", "float8", "float16", [0, 1, 1, 2, 0]),
    ("sdf512", "int8", "float16", [0, 2, 2, 2, 0, 2, 2, 2, 0]),
    ("sdf512", "float8", "float32", [0, 2, 2, 2, 0, 2, 2, 2, 0]),
    ("rec1024", "float16", "float16", [2, 3, 3]), ("rec1024", "float16", "float32", [2, 3, 3]),
    ("sdf512", "float16", "float16", [3])])
def test_the_form_in_turn_is_the_auto_choice_where_it_won(rng, name, dtype, io, forms):
    """fm_gemm_pp_auto, as timed per GEMM on the H100: 8-bit layers of more than 128 outputs (float8: at most 512
    inputs, a converted x part of at most 128 columns), 16-bit ones of at most 512 bytes of raw input a row; never an
    input whose rows are not whole 16-byte pieces, a residual layer or a layer of <= 128 outputs; the others keep the
    producer form (1; 16-bit ones on a persistent grid, 3) or the plain one (0). 16-bit GEMMs read float32 x, and sdf512's 259 float16 features, from
    x's padded copy: rec1024's first layer then reads 512 bytes a row as they are, sdf512's concat layer 528 + 1024."""
    mlp, ws = model(rng, name, dtype) if name in NETWORKS else (None, None)
    if name == "wide512":  # (a GEMM chain in 8 bits; in 16 one streamed kernel, so not among NETWORKS)
        ws, bs = graph_weights(rng, [64] + [512] * 4 + [64], {}, 1.0)
        mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", dtype=dtype, device="cpu")
    if dtype != "float16":
        mlp.calibrate(rng.standard_normal((256, ws[0].shape[1])).astype(np.float32))
    assert [p.info["ws"] for _, p in gemm_plans(mlp, io)] == forms


def test_the_environment_asking_for_the_form_in_turn_leaves_residual_layers_theirs(rng, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_GEMM_WS", "2")
    mlp, _ = model(rng, "res768")
    forms = {l: p.info["ws"] for l, p in gemm_plans(mlp, "float16")}
    plain = {l: _segments.gemm_dtypes(mlp, l, "float16", "float16")[2] is None for l in forms}
    assert forms and {forms[l] for l in forms if plain[l]} == {2} and {forms[l] for l in forms if not plain[l]} <= {
        0, 1, 3}


def test_the_environment_forces_warp_specialisation_or_not(rng, monkeypatch):
    mlp, _ = model(rng, "sdf512")
    for value, form in (("1", 1), ("on", 1), ("2", 2), ("pingpong", 2), ("3", 3), ("persistent", 3), ("-1", 0),
                        ("off", 0)):
        monkeypatch.setenv("FUSEDMLP_GEMM_WS", value)
        assert [p.info["ws"] for _, p in gemm_plans(mlp, "float16")] == [form]
    monkeypatch.setenv("FUSEDMLP_GEMM_WS", "4")
    with pytest.raises(ValueError, match="FUSEDMLP_GEMM_WS='4'"):
        gemm_plans(mlp, "float16")


def test_the_warp_specialised_blob_is_the_cluster_forms_tiles(rng):
    """Its producer copies a stage's B as one bulk copy, so its blob is laid out as the cluster form's (unpack_tiles,
    below, reads that back as W)."""
    mlp, _ = model(rng, "res768")
    for bm, bn in ((128, 256), (64, 128)):
        blobs = [mlp._gemm_plan(2, *H100, "float16", None, "float16", "float16", bm=bm, bn=bn, **form).packed_weights()
                 for form in ({"ws": 1}, {"cluster": 2}, {"cluster": 1, "ws": -1})]
        assert blobs[0] == blobs[1] != blobs[2]


def unpack_tiles(blob, n_pad, k_pad, bn):
    """The n_pad x k_pad weight matrix back from the cluster form's blob: per column tile, per K stage of 64 halves, bn
    rows of eight 16-byte chunks, chunk c of row r stored at chunk c ^ (r % 8)."""
    tiles = blob.reshape(n_pad // bn, k_pad // 64, bn, 8, 8)
    r = np.arange(bn)[:, None]
    stored = np.arange(8)[None, :] ^ (r % 8)  # where chunk c of row r lies
    logical = tiles[:, :, r, stored, :]  # (column tiles, stages, bn, 8 chunks, 8 halves)
    return logical.transpose(0, 2, 1, 3, 4).reshape(n_pad, k_pad)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tile", [(128, 256), (128, 128), (64, 64)])
def test_packed_weight_tiles_read_back_as_w(rng, dtype, tile):
    """The cluster form's blob, unpacked on the host, is W rounded to the compute dtype, zero-padded, its concat part at
    the padded K offset; the one-CTA form's is W row-major."""
    widths = [63, 300, 520]  # odd widths: padded K parts and a partial column tile
    ws, bs = graph_weights(rng, widths, {1: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, concat={1: "before"}, dtype=dtype, device="cpu")
    plan = mlp._gemm_plan(1, *H100, "float16", "float32", None, "float16", bm=tile[0], bn=tile[1], cluster=2)
    bn = plan.info["bn"]
    # "before": x (63 columns, one stage of 64) is part 0, layer 0's output (300, five stages) part 1 at k0_pad
    n_pad, k0_pad, k_pad = -(-520 // bn) * bn, 64, 64 + 320
    bits = np.frombuffer(plan.packed_weights(), np.uint16)
    assert bits.size == n_pad * k_pad
    got = unpack_tiles(bits, n_pad, k_pad, bn)
    expect = np.zeros((n_pad, k_pad), np.float32)
    expect[:520, :63] = ws[1][:, :63]
    expect[:520, k0_pad:k0_pad + 300] = ws[1][:, 63:]
    if dtype == "float16":
        want = expect.astype(np.float16).view(np.uint16)
    else:  # round to nearest even, as fm_round_bits
        u = expect.view(np.uint32).astype(np.uint64)
        want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(got, want)
    row_major = np.frombuffer(mlp._gemm_plan(1, *H100, "float16", "float32", None, "float16", bm=tile[0], bn=tile[1],
                                             cluster=1, ws=-1).packed_weights(), np.uint16).reshape(n_pad, k_pad)
    assert np.array_equal(row_major, want)


def ptxas_report(source, arch=90):
    options = ("--ptxas-options=-v",) + _api.nvrtc_no_cache()  # NVRTC's own cache would answer without the report
    _, log = _core.nvrtc_compile(source, _api.TEMPLATE_GEMM, arch, True, options)
    return log


FORMS = {"cluster": ({"cluster": 2}, "clusters of 2 sharing the weight tile"),
         "ws": ({"ws": 1}, "warp-specialised (the last warpgroup loads)"),
         "pingpong": ({"ws": 2}, "in turn on tiles of their own"), "persistent": ({"ws": 3}, "a persistent grid"),
         "persistent2": ({"ws": 3, "cluster": 2}, "a persistent grid")}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NETWORKS)
def test_benchmark_gemms_compile_for_sm_90a_in_the_form_without_spills(rng, monkeypatch, name, form):
    """Every GEMM of wide768, rec1024, sdf512 (a concat) and a residual network, in the cluster and the
    warp-specialised form, float16 and bfloat16 compute, float32, float16 and bfloat16 I/O, x read from its padded
    copy and converted on the way: ptxas's report (-v) shows no spills and no serialised wgmma."""
    _api._nvrtc_info()
    options, comment = FORMS[form]
    sources = {}
    for dtype, pad in (("float16", "auto"), ("bfloat16", "auto"), ("float16", "-1")):
        monkeypatch.setenv("FUSEDMLP_GEMM_PAD", pad)
        mlp, _ = model(rng, name, dtype)
        for io in ("float32", "float16", "bfloat16"):
            for layer, plan in gemm_plans(mlp, io, **options):
                assert plan.info["wgmma"] == 1 and (plan.info["cluster"], plan.info["ws"]) == (
                    options.get("cluster", 1), options.get("ws", 0))
                sources.setdefault(_api._source_of(plan), (dtype, io, layer))
    assert len(sources) >= 3
    for source, case in sources.items():
        assert comment in source
        if "cluster" in options:
            assert "__cluster_dims__(FM_GEMM_CLUSTER, 1, 1)" in source and "#define FM_GEMM_CLUSTER 2" in source
        if "ws" in options:
            assert f"#define FM_GEMM_WS {options['ws']}" in source
        log = ptxas_report(source)
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (case, log)
        assert "C7519" not in log and "C7510" not in log, (case, log)


@pytest.mark.parametrize("form", ["cluster", "ws", "persistent", "persistent2"])  # (in turn: 128 x 128 tiles only)
@pytest.mark.parametrize("tile", _segments.SMALL_TILES)
def test_small_tiles_compile_in_the_form_without_spills(rng, tile, form):
    """The smaller tiles a small batch takes, in each form, with a concat part and a residual: one warpgroup (64 rows)
    or two, 64 or 128 columns (and the warp-specialised form's producer warpgroup)."""
    _api._nvrtc_info()
    widths = [63, 512, 512]
    ws, bs = graph_weights(rng, widths, {1: "before"}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, concat={1: "before"}, residual={1: "add"}, device="cpu")
    plan = mlp._gemm_plan(1, *H100, "float16", "float32", "float16", "bfloat16", bm=tile[0], bn=tile[1],
                          **FORMS[form][0])
    assert (plan.info["bm"], plan.info["bn"]) == tile and FORMS[form][1] in _api._source_of(plan)
    log = ptxas_report(_api._source_of(plan))
    assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], log


def test_a_network_compiles_ahead_of_time_on_clusters(rng, tmp_path, monkeypatch):
    """mlp.compile(arch='sm_90') with the form forced: every segment's kernel, the cluster GEMMs included, in the
    cache."""
    monkeypatch.setenv("FUSEDMLP_GEMM_CLUSTER", "2")
    widths, act, out_act, concat, _ = NETWORKS["sdf512"]
    ws, _ = graph_weights(rng, widths, concat, 1.0)
    bs = [rng.uniform(-0.1, 0.1, w.shape[0]).astype(np.float32) for w in ws]  # all with a bias: equal layers' sources
    mlp = fusedmlp.FusedMLP(ws, bs, activation=act, output_activation=out_act, concat=concat, device="cpu",
                            cache_dir=tmp_path)
    paths = mlp.compile(arch="sm_90")
    assert len(paths) == 4  # layers 0-3 streamed, x's pad pass, the concat layer a GEMM, layers 5-8 streamed
    assert mlp.source.count("clusters of 2 sharing the weight tile") >= 1
