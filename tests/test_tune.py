"""The tuner's bookkeeping (no GPU): buckets, the persisted store, and its failure modes."""

import json
import os

import pytest

from fusedmlp import _tune


@pytest.mark.parametrize("rows, expected", [(1, 1), (2, 4), (4, 4), (5, 16), (1000, 1024), (1024, 1024),
                                            (1025, 4096), (2**21, 2**22)])
def test_buckets_are_powers_of_four_at_or_above(rows, expected):
    assert _tune.bucket(rows) == expected


def test_store_round_trip_and_a_new_store_reads_it(tmp_path):
    store = _tune.TuningStore(tmp_path)
    record = {"1024": {"options": {"warps": 8, "m_tiles": 1}, "ms": {"w8m1": 0.01, "w4m1": 0.02}}}
    store.save("k" * 64, record)
    assert store.load("k" * 64) == record
    assert _tune.TuningStore(tmp_path).load("k" * 64) == record
    assert not [f for f in os.listdir(tmp_path / "tuning") if f.startswith(".tmp-")]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 999, "buckets": {"1": {}}}), "[]", ""])
def test_a_damaged_or_foreign_record_is_a_miss(tmp_path, content):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / ("a" * 64 + ".json")).write_text(content)
    assert _tune.TuningStore(tmp_path).load("a" * 64) == {}


def test_an_unwritable_store_keeps_the_choice_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = _tune.TuningStore(blocker)  # <file>/tuning cannot be created
    store.save("b" * 64, {"16": {"options": {"warps": 4, "m_tiles": 1}, "ms": {"w4m1": 1.0}}})
    assert store.load("b" * 64)["16"]["options"] == {"warps": 4, "m_tiles": 1}


def test_model_key_depends_on_everything_that_changes_the_best_tile():
    class Model:
        widths, activations, _has_bias = (3, 64, 1), ("relu(x)", "none(x)"), [True, True]
        _precision, _residual, _concat, _norm = "float16", [None, None], [0, 0], [None, None]

    gpu = {"name": "NVIDIA H100 80GB HBM3", "arch": 90, "sm_count": 132}
    base = _tune._model_key(Model, "float16", "float16", gpu)
    assert base != _tune._model_key(Model, "float32", "float32", gpu)
    assert base != _tune._model_key(Model, "float16", "float16", dict(gpu, sm_count=114))
    other = type("Other", (Model,), {"activations": ("tanh(x)", "none(x)")})
    assert base != _tune._model_key(other, "float16", "float16", gpu)
    for field, value in [("_precision", "bfloat16"), ("_residual", [None, (1, "none", 0)]), ("_concat", [0, 1]),
                         ("_norm", [(1, 1e-5, None, None), None])]:
        assert base != _tune._model_key(type("Changed", (Model,), {field: value}), "float16", "float16", gpu), field


@pytest.mark.parametrize("arch, dtype, concat, residual, takes", [
    (90, "float16", None, None, True), (80, "float16", None, None, False), (90, "tf32", None, None, False),
    # an input concat: the streamed register-A form (x's fragments kept in registers), as NeRF's ran 3.12 ms at 2^21
    # rows on the H100 against 9.4 cut into segments; that form takes no residual on the concat layer
    (90, "float16", {1: "after"}, None, True), (90, "float16", {1: "after"}, {1: "add"}, False)])
def test_sm90_candidates_are_the_warpgroup_kernel_where_it_takes_the_network(monkeypatch, arch, dtype, concat,
                                                                             residual, takes):
    """On sm_90 a network the warpgroup kernel takes (concat graphs included, on its streamed form) is tuned over its
    warpgroup counts only; anything else (other GPUs, tf32, a residual on a concat layer) over the mma.sync tiles."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": arch, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(0)
    widths = [32, 64, 64, 16]
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    if concat:
        ws[1] = rng.standard_normal((64, 96)).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, None, "relu", dtype=dtype, concat=concat, residual=residual, device="cpu")
    assert _tune._takes_wgmma(mlp, "float16", "float16") is takes
    assert _tune._candidates(mlp, "float16", "float16") == (_tune.CANDIDATES_WGMMA if takes else _tune.CANDIDATES)


def test_a_call_finds_its_kernel_again_without_the_walk(monkeypatch):
    """_kernel remembers its answer per (dtypes, batch bucket, size class, FUSEDMLP_AUTOTUNE) for the next call of
    that kind, and gives the same kernel as the full walk in both tuning modes, for batches on both sides of the
    untuned choice's thresholds (16, 64 and 128 rows per SM); tune() makes calls look again."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(1)
    mlp = fusedmlp.FusedMLP([rng.standard_normal((64, 32)).astype(np.float32)], None, "relu", device="cpu")
    built = []

    def build(dtype, out_dtype=None, **options):
        built.append(tuple(sorted(options.items())))
        return object(), None, "source", None

    monkeypatch.setattr(mlp, "_build", build)
    monkeypatch.setattr(_tune, "choose", lambda m, d, o, rows, info, store: {"wgmma": 1, "warps": 4 if rows < 5000 else 16})
    monkeypatch.setattr(_api, "_entry_path", lambda entry: None)
    small = 132 * 128
    for autotune in ("1", "0"):
        monkeypatch.setenv("FUSEDMLP_AUTOTUNE", autotune)
        for rows in (1000, 1024, small // 8 - 1, small // 8, 4096, 5000, small // 2 - 1, small // 2, small - 1, small,
                     70000):
            kernel = mlp._kernel("float16", rows=rows)
            assert mlp._kernel("float16", rows=rows) is kernel
            calls, mlp._calls = mlp._calls, {}
            assert mlp._kernel("float16", rows=rows) is kernel, (autotune, rows)  # the full walk agrees
            mlp._calls = calls
    # on: wgmma at 4 warps below 5000 rows, 16 from there; off: one warpgroup below `small` / 2, else the default plan
    assert sorted(set(built)) == sorted({(("warps", 4), ("wgmma", 1)), (("warps", 16), ("wgmma", 1)), ()})
    assert mlp._kernel("float16", rows=1000) is not mlp._kernel("float16", rows=70000)


@pytest.mark.parametrize("widths, act, labels", [
    ([2, 256, 256, 256, 3], "sin", ["wg8", "wg4", "wg4c2", "wg4c4"]),  # siren256: two warpgroups on clusters of 2
    ([64, 224, 224, 32], "silu", ["wg8", "wg4", "wg4c2", "wg4c4"]),    # likewise
    # streamed register-A form by default (deep256, and what was 64-256-256-192's one warpgroup on clusters of 2):
    # on the H100 it ran deep256 1.7-4.3x faster than one warpgroup on clusters of 2 or 4 at 16384 rows
    ([64, 256, 256, 256, 256, 256, 64], "relu", ["wg8", "wg4"]),
    ([64, 256, 256, 192], "relu", ["wg8", "wg4"]),
    ([32, 64, 64, 16], "relu", ["wg16", "wg12", "wg8", "wg4"]),
    # layers wider than 256 (the streamed form's wide layers): also one warpgroup split over clusters of 2 and 4
    ([64, 512, 512, 512, 512, 64], "gelu", ["wg8", "wg4", "wg4s2", "wg4s4"])])
def test_cluster_networks_also_try_one_warpgroup_on_clusters_of_four(monkeypatch, widths, act, labels):
    """A network the sm_90 plan puts on clusters is tuned over its warpgroup counts and over one warpgroup on clusters
    of 2 and 4, each distinct plan once (warps=4 plans one warpgroup on the streamed register-A form: a forced warp
    count takes no two-warpgroup cluster entry, and the plan puts the streamed form first among the rest); a network
    of the register-A kernel, resident or streamed weights, over its warpgroup counts that fit only."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(2)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, act, device="cpu")
    tried = _tune._distinct(mlp, "float16", "float16", _tune._candidates(mlp, "float16", "float16"))
    assert [_tune.label(options) for options in tried] == labels
    infos = [_tune._plan_info(mlp, "float16", "float16", **options) for options in tried]
    assert len({(info["warps"], info["cluster"], info.get("split", 0)) for info in infos}) == len(tried)


@pytest.mark.parametrize("arch, widths, act, tiles", [
    (80, [32, 64, 64, 16], "relu", ["w4m1", "w4m1", "w4m1", "default"]),
    (90, [32, 64, 64, 16], "relu", ["wg4", "wg4", "default", "default"]),
    (90, [2, 256, 256, 256, 3], "sin", ["wg4c4", "default", "default", "default"]),
    # the streamed register-A form by default (before: one warpgroup on clusters of 4 and 2), so one warpgroup of it
    # below 64 rows per SM, as for the resident form
    (90, [64, 256, 256, 256, 256, 256, 64], "relu", ["wg4", "wg4", "default", "default"]),
    (90, [64, 256, 256, 192], "relu", ["wg4", "wg4", "default", "default"]),
    # wide layers: split over clusters of 4 below 16 rows per SM, of 2 below 32 (wide512 on the H100: 25.6 us against
    # 44.7 at 1024 rows, 31.9 against 42.8 at 4096)
    (90, [64, 512, 512, 512, 512, 64], "gelu", ["wg4s4", "wg4s2", "default", "default"]),
])
def test_untuned_calls_take_the_tile_measured_best_for_their_batch_size(monkeypatch, arch, widths, act, tiles):
    """With tuning off, a call's tile follows the batch size per SM (132 SMs: 1024, 4096, 10000 and 20000 rows are
    below 16, 64 and 128 rows per SM, and above) and the kernel the network is on: mma.sync's 4 x 16-row tile below
    128 rows per SM; the register-A warpgroup kernel's (resident or streamed weights) one warpgroup per CTA below 64;
    for a cluster network one warpgroup per CTA on clusters of 4 below 16. Each choice plans as such."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": arch, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, act, device="cpu")
    got = []
    for rows in (1024, 4096, 10000, 20000):
        options = _tune.untuned(mlp, "float16", "float16", rows, 132)
        got.append(_tune.label(options) if options else "default")
        if options:
            info = _tune._plan_info(mlp, "float16", "float16", **options)
            assert (info["wgmma"], info["warps"], info["cluster"]) == (options.get("wgmma", 0), options["warps"],
                                                                        options.get("cluster", 0)), options
            assert info.get("split", 0) == options.get("split", 0), options
    assert got == tiles


def test_residuals_from_further_back_are_tuned_over_the_warpgroup_tiles(monkeypatch):
    """SimBa-like blocks (a residual of the value two layers back) plan on the warpgroup kernel on sm_90 and are tuned
    over its tiles, one warpgroup per CTA below 64 rows per SM untuned, as any network it takes (the benchmark's simba64
    on the H100 at 2^10 rows: wg4 9.39 us, mma.sync's w4m1 13.1)."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(4)
    widths = [17, 64, 256, 64, 256, 64, 5]
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, "relu", residual={2: ("add", "none", 0), 4: ("add", "none", 2)}, device="cpu")
    assert _tune._takes_wgmma(mlp, "float16", "float16")
    assert _tune._candidates(mlp, "float16", "float16") == _tune.CANDIDATES_WGMMA
    assert [_tune.untuned(mlp, "float16", "float16", rows, 132) for rows in (1024, 4096, 10000)] == [
        {"wgmma": 1, "warps": 4}, {"wgmma": 1, "warps": 4}, None]


@pytest.mark.parametrize("bucket, kept", [(1024, ["wg4"]), (4096, ["wg4"]), (16384, ["wg8", "wg4"]),
                                          (65536, ["wg16", "wg12", "wg8", "wg4"])])
def test_warpgroup_counts_a_smaller_one_dominates_are_not_compiled(monkeypatch, bucket, kept):
    """Where one warpgroup less per CTA already gives every SM at most one CTA for the bucket's largest batch, more
    warpgroups only stack the same rows on fewer SMs: the tuner neither compiles nor times them (132 SMs: 2 warpgroups
    from 8449 rows on, 3 from 16897, 4 from 25345). Candidates on clusters of one warpgroup stay."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    built = []

    def fake_build(self, dtype, out_dtype=None, **options):
        built.append(_tune.label(options))
        raise fusedmlp.LimitError("not built here", "")

    monkeypatch.setattr(_api.FusedMLP, "_build", fake_build)
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip([32, 64, 64], [64, 64, 16])]
    mlp = fusedmlp.FusedMLP(ws, None, "relu", device="cpu")
    options, timings = _tune.tune_bucket(mlp, "float16", "float16", min(bucket, 1000), bucket_rows=bucket,
                                         sm_count=132)
    assert sorted(built) == sorted(kept) and options is None and timings == {}
    assert not _tune._dominated({"wgmma": 1, "cluster": 4, "warps": 4}, 1024, 132)
    assert not _tune._dominated({"wgmma": 1, "warps": 16}, 1024, 0)  # SM count unknown: nothing is skipped


def test_tune_of_a_segmented_network_tunes_each_fused_stretch(monkeypatch, tmp_path):
    """fusedmlp.tune on a network cut into segments tunes each fused stretch as the network of its own it is (the
    first from x's dtype to the compute dtype's storage, the last from it to y's), and reports per segment."""
    import numpy as np

    import fusedmlp
    from fusedmlp import _api

    class Gpu:
        info = {"arch": 90, "smem_per_block": 232448, "smem_per_sm": 233472, "sm_count": 132}

    Gpu.info = dict(Gpu.info, name="NVIDIA Fake 90")
    monkeypatch.setattr(_api, "_gpu", lambda ordinal: Gpu)
    rng = np.random.default_rng(2)
    widths = [32, 64, 64, 1024, 64, 16]  # layers 0-1 fused, 2 and 3 GEMMs (1024 wide), 4 fused
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, "relu", device="cpu", cache_dir=tmp_path)
    mlp._kind, mlp._ordinal = "cuda", 0  # a model of the fake GPU (no driver is touched below)
    tuned = []

    def choose(m, d, o, rows, info, store, force=False):
        tuned.append((list(m.widths), d, o, rows))
        store.save(_tune._model_key(m, d, o, info), {str(_tune.bucket(rows)): {"options": {"wgmma": 1}, "ms": {}}})
        return {"wgmma": 1}

    monkeypatch.setattr(_tune, "choose", choose)
    monkeypatch.setattr(mlp, "_build_gemm", lambda layer, *dtypes: object())  # the chain's GEMMs (no GPU here)
    result = fusedmlp.tune(mlp, batch_sizes=(1024,), io_dtype="float32")
    assert list(result) == ["layers 0-1: fused (wgmma, weights resident)", "layer 4: fused (wgmma, weights resident)"]
    assert tuned == [([32, 64, 64], "float32", "float16", 1024), ([64, 16], "float16", "float32", 1024)]
    assert all(r[1024]["options"] == {"wgmma": 1} for r in result.values())
    chain = mlp._chains[("float32", "float32", None)]  # the chain's own stretch models hold the choices now
    assert [sub._tuned for _, sub, _, _ in chain.fused] == [{("float32", "float16", 1024): {"wgmma": 1}},
                                                            {("float16", "float32", 1024): {"wgmma": 1}}]


def test_large_buckets_are_timed_on_at_most_tune_max_rows(monkeypatch, tmp_path):
    """A first call of 2^26 rows times its candidates on TUNE_MAX_ROWS rows (Kernel.time stages the rows it times, per
    candidate, on the host and the GPU), records the choice under its own bucket; smaller calls time their rows."""
    timed = []

    def tune_bucket(mlp, dtype, out_dtype, rows, reps=5, bucket_rows=None, sm_count=0):
        timed.append((rows, bucket_rows))
        return {"wgmma": 1, "warps": 8}, {"wg8": 1.0}

    monkeypatch.setattr(_tune, "tune_bucket", tune_bucket)
    monkeypatch.setattr(_tune, "_model_key", lambda *a: "c" * 64)
    store = _tune.TuningStore(tmp_path)
    info = {"sm_count": 132}

    class Model:
        widths = (64, 128, 64)

    assert _tune.choose(Model, "float16", "float16", 2 ** 26, info, store) == {"wgmma": 1, "warps": 8}
    assert _tune.choose(Model, "float16", "float16", 3000, info, store) == {"wgmma": 1, "warps": 8}
    assert timed == [(_tune.TUNE_MAX_ROWS, 2 ** 26), (3000, 4096)]
    assert set(store.load("c" * 64)) == {str(2 ** 26), "4096"}
