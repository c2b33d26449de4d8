"""fusedmlp.probe (``python -m fusedmlp.bench probe ...``): every subcommand's help, the plans and tuner candidates it
lists for a GPU ahead of time, its usage errors, the GPU subcommands' message on a machine without one, and on a GPU
the comparison and timing helpers the timing subcommands share."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import gpu_available

from fusedmlp import _api, _segments, _tune, bench, bench_lowbit, probe

#: Each subcommand, what its help says it needs, and arguments that pass parsing (for the no-GPU message).
SUBCOMMANDS = {
    "list": ("(no GPU)", ["tcnn64"]),
    "plans": ("(GPU)", ["--plan", "warps=4", "tcnn64"]),
    "ab": ("(GPU)", ["--base", "build/ab_base", "tcnn64"]),
    "tune": ("(GPU, PyTorch)", ["tcnn64"]),
    "act": ("(GPU)", ["tcnn64", "relu", "gelu"]),
    "cold": ("(GPU, PyTorch)", ["siren256"]),
    "host": ("(GPU, PyTorch)", ["tcnn64"]),
    "steps": ("(GPU, PyTorch)", ["--dtype", "int8", "--gemm", "bn=128", "--base", "build/ab_base", "--check",
                                 "rec1024"]),
    "gemm": ("(GPU)", ["--dtype", "float8", "wide512"]),
    "same": ("(no GPU)", ["--base", "build/base", "tcnn64"]),
}
GPU_ONLY = [name for name in SUBCOMMANDS if name not in ("list", "same")]


def run_main(capsys, argv):
    """probe.main(argv): (exit status, stdout, stderr); a usage error's SystemExit becomes its status."""
    try:
        status = probe.main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


# ------------------------------------------------------------------------------------------------ help and usage


def test_the_benchmark_entry_dispatches_probe_and_lists_every_subcommand():
    proc = subprocess.run([sys.executable, "-m", "fusedmlp.bench", "probe", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m fusedmlp.bench probe")
    for name, (needs, _) in SUBCOMMANDS.items():
        assert f"    {name:6s} {needs}" in proc.stdout  # the module docstring's table
        assert f"    {name:9s} {needs}" in proc.stdout  # argparse's list of subcommands


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_each_subcommand_has_a_help_that_says_what_it_needs(capsys, name):
    status, out, _ = run_main(capsys, [name, "--help"])
    needs, _ = SUBCOMMANDS[name]
    assert status == 0
    assert out.startswith(f"usage: python -m fusedmlp.bench probe {name} ")
    assert needs in out  # the function's docstring is the description
    assert "python -m fusedmlp.bench probe " + name in out.split("\n\n", 2)[2]  # its example command line


def test_no_subcommand_is_a_usage_error(capsys):
    status, _, err = run_main(capsys, [])
    assert status == 2
    assert "the following arguments are required: subcommand" in err


def test_unknown_workload_is_a_usage_error_naming_the_known_ones(capsys):
    status, _, err = run_main(capsys, ["list", "tcnn64", "tcnn65"])
    assert status == 2
    assert err.splitlines()[0].startswith("usage: python -m fusedmlp.bench probe list")
    assert "unknown workload(s) tcnn65; known: tcnn64, tcnn128" in err and "wideout192" in err


def test_plan_options_parse_and_unknown_or_malformed_ones_are_usage_errors(capsys):
    assert probe.parse_plan("wgmma=1,cluster=4,warps=4") == {"wgmma": 1, "cluster": 4, "warps": 4}
    assert probe.plan_text(probe.parse_plan("warps=4,m_tiles=1")) == "warps=4,m_tiles=1"
    assert probe.plan_text({}) == "default"
    status, _, err = run_main(capsys, ["list", "--plan", "warp=4", "tcnn64"])
    assert status == 2 and "unknown plan option(s) warp in 'warp=4'" in err
    status, _, err = run_main(capsys, ["plans", "--plan", "warps", "tcnn64"])
    assert status == 2 and "'warps' is not plan options written as name=int" in err


def test_steps_and_gemm_take_8_bit_compute_dtypes_and_steps_a_forced_gemm_baselines_and_check(capsys):
    """The options behind the deleted one-off chain scripts (gemm_forms.py, gemm_ab.py, gemm8_time.py)."""
    parse = probe._parser().parse_args
    args = parse(["steps", "--dtype", "float8", "--gemm", "bn=128,ws=2", "--base", "a", "--base", "b", "--rounds",
                  "3", "--check", "--rows", "2097152", "wide512"])
    assert (args.dtype, args.gemm, args.base, args.rounds, args.check, args.rows) == \
        ("float8", {"bn": 128, "ws": 2}, ["a", "b"], 3, True, [2097152])
    args = parse(["steps"])
    assert (args.dtype, args.gemm, args.base, args.rounds, args.check, args.rows) == ("float16", {}, [], 9, False, None)
    assert parse(["gemm", "--dtype", "int8"]).dtype == "int8" and parse(["gemm"]).dtype == "float16"
    assert probe.DTYPES == ("float16", "bfloat16", "tf32", "int8", "float8")
    status, _, err = run_main(capsys, ["steps", "--gemm", "bk=64", "rec1024"])
    assert status == 2 and "unknown GEMM option(s) bk in 'bk=64'; the GEMM takes bm, bn, stages, wgmma, cluster, ws" in err
    status, _, err = run_main(capsys, ["steps", "--gemm", "bn", "rec1024"])
    assert status == 2 and "'bn' is not GEMM options written as name=int[,name=int...], e.g. bn=128" in err
    status, _, err = run_main(capsys, ["gemm", "--dtype", "int4", "rec1024"])
    assert status == 2 and "argument --dtype: invalid choice: 'int4'" in err


def test_alternate_calls_times_each_timer_once_a_round_in_turn_and_columns_show_ratios_to_the_first():
    order = []
    timers = [lambda i=i: order.append(i) or 10.0 * (i + 1) for i in range(3)]
    assert probe.alternate_calls(timers, 2) == [[10.0, 10.0], [20.0, 20.0], [30.0, 30.0]]
    assert order == [0, 1, 2, 0, 1, 2]
    assert probe._columns([200.0, 150.0, 410.0]) == "    200.00    150.00    410.00 (0.750) (2.050)"
    assert probe._columns([17091.0]) == "  17091.00"


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_subcommands_without_a_gpu_exit_1_saying_what_is_missing(name):
    with pytest.raises(SystemExit) as e:
        probe.main([name] + SUBCOMMANDS[name][1])
    message = str(e.value.code)  # SystemExit(str): Python prints it to stderr and exits 1
    assert message.startswith(f"probe {name} runs kernels: it needs an NVIDIA GPU with a CUDA driver")
    assert "probe list" in message


# ------------------------------------------------------------------------------------------------ list, no GPU


def test_weights_are_fixed_random_and_shaped_like_the_workload():
    wl = probe.workload("flex")  # 3-64-128-96-64-32-16-4 with biases
    ws, bs = probe.weights(wl)
    again, _ = probe.weights(wl)
    assert [w.shape for w in ws] == [(64, 3), (128, 64), (96, 128), (64, 96), (32, 64), (16, 32), (4, 16)]
    assert [b.shape for b in bs] == [(n,) for n in wl.widths[1:]]
    assert all(np.array_equal(a, b) for a, b in zip(ws, again))
    assert all(np.abs(w).max() <= 1 / np.sqrt(w.shape[1]) and np.abs(w).min() > 0 for w in ws)
    assert probe.weights(probe.workload("tcnn64"))[1] is None  # a workload without biases
    assert probe.workload("res256") is probe.EXTRA["res256"]
    with pytest.raises(KeyError, match="unknown workload 'nope'; known: tcnn64"):
        probe.workload("nope")


def test_siren256_on_the_h100_planned_ahead_of_time():
    table = probe.plan_table(probe.workload("siren256"), probe.GPUS["h100"], plans=[{"wgmma": 0}], rows=[1024, 2**21])
    default, mma, small, large = table
    # two warpgroups per CTA on clusters of 2, every weight resident (bench/results/h100/sass.txt: wgmma 8 warps)
    assert default["what"] == "default" and default["error"] is None
    assert {k: default["info"][k] for k in ("arch", "wgmma", "cluster", "warps", "resident")} == \
        {"arch": 90, "wgmma": 1, "cluster": 2, "warps": 8, "resident": 1}
    assert default["info"]["smem_bytes"] <= probe.GPUS["h100"]["smem_per_block"]
    assert mma["what"] == "wgmma=0" and mma["info"]["wgmma"] == 0 and mma["info"]["cluster"] == 0
    # 1024 rows on 132 SMs: below 16 rows per SM, so untuned is one warpgroup on clusters of 4; more warpgroups
    # cannot win (_tune._dominated). One warpgroup (wg4, warps=4) is the streamed register-A form, no cluster: a forced
    # warp count takes no two-warpgroup cluster entry, and the plan puts the streamed form before one warpgroup on
    # clusters of 2 (at 16384 rows on the H100 it ran r256 and deep256 1.7-4.3x faster than one warpgroup on
    # clusters of 2 or 4), so wg4c2 is a plan of its own
    assert small["rows"] == 1024 and small["untuned"] == {"wgmma": 1, "cluster": 4, "warps": 4}
    assert (small["untuned_info"]["cluster"], small["untuned_info"]["warps"]) == (4, 4)
    assert [label for label, _, _ in small["candidates"]] == ["wg4", "wg4c2", "wg4c4"]
    assert [(info["cluster"], info["warps"], info["resident"]) for _, _, info in small["candidates"]] == \
        [(0, 4, 0), (2, 4, 1), (4, 4, 1)]
    assert small["candidates"][0][2]["stream_slots"] >= 2
    assert small["dominated"] == ["wg16", "wg12", "wg8"] and small["duplicates"] == []
    # 2^21 rows: the default plan, and every candidate that fits is tried
    assert large["untuned"] is None and large["untuned_info"] == default["info"]
    assert large["dominated"] == [] and "wg8" in [label for label, _, _ in large["candidates"]]
    every = [_tune.label(o) for o in _tune.CANDIDATES_CLUSTER]
    tried = [label for label, _, _ in large["candidates"]]
    assert sorted(tried + large["unfit"] + large["duplicates"]) == sorted(every)


def test_the_a100_gets_the_mma_sync_kernel_and_its_tile_candidates():
    for name in [n for n, wl in bench.WORKLOADS.items() if max(wl.widths) * wl.stacks <= 256]:  # the others: segments
        default, entry = probe.plan_table(probe.workload(name), probe.GPUS["a100"], io="float32", rows=[2**21])
        assert default["info"]["arch"] == 80 and default["info"]["wgmma"] == 0 and default["info"]["cluster"] == 0
        assert default["info"]["in_dtype"] == default["info"]["out_dtype"] == "float32"
        assert default["info"]["smem_bytes"] <= probe.GPUS["a100"]["smem_per_block"]
        labels = [label for label, _, _ in entry["candidates"]]
        assert labels and set(labels) <= {_tune.label(o) for o in _tune.CANDIDATES}
        assert all(info["wgmma"] == 0 for _, _, info in entry["candidates"])


def test_a_forced_plan_the_network_does_not_take_is_listed_with_the_reason():
    default, odd = probe.plan_table(probe.workload("tcnn64"), probe.GPUS["h100"], plans=[{"warps": 5}])
    assert default["info"] is not None and odd["info"] is None
    assert "warps=5" in odd["error"] and "232448 bytes of shared memory" in odd["error"]


def test_wide_loop_is_a_plan_option_and_sdf512s_stretches_are_workloads():
    """wide_loop (the streamed kernel's wide layers' column groups as a loop, the default) parses as a plan option;
    wide_loop=-1 plans the default's shape with its groups unrolled; sdf512 has no whole-network plan to force it on, so its two fused
    stretches (layers 0-3 and 5-8 on the H100; the first reading x's padded copy, 264 columns) are workloads of their
    own that plan as its segments do."""
    assert "wide_loop" in probe.PLAN_OPTIONS
    assert probe.parse_plan("wgmma=1,resident=0,wide_loop=-1") == {"wgmma": 1, "resident": 0, "wide_loop": -1}
    sdf = probe.segment_table(probe.workload("sdf512"), probe.GPUS["h100"])
    for name, segment in (("wide512", None), ("sdf512headpad", sdf[0]), ("sdf512tail", sdf[2])):
        default, unrolled = probe.plan_table(probe.workload(name), probe.GPUS["h100"],
                                             plans=[{"wgmma": 1, "resident": 0, "wide_loop": -1}])
        assert default["info"]["wide_loop"] == 1 and unrolled["info"]["wide_loop"] == 0, (name, unrolled)
        assert probe.shape(default["info"]) == probe.shape(unrolled["info"]).replace(
            "streamed (2 slots)", "streamed (2 slots), wide layers' groups looped")
        assert segment is None or segment.endswith(": " + probe.shape(default["info"])), (segment, default)


def test_planning_for_a_named_gpu_is_undone_after_an_error():
    own = _api._gpu
    with pytest.raises(RuntimeError):
        with probe.planning_for(probe.GPUS["a100"]):
            assert _api._gpu(0).info["arch"] == 80
            raise RuntimeError
    assert _api._gpu is own


def test_list_prints_a_line_per_plan_and_per_candidate(capsys):
    status, out, _ = run_main(capsys, ["list", "--rows", "1024", "--plan", "wgmma=0", "--plan", "warps=5", "tcnn64"])
    lines = out.splitlines()
    assert status == 0
    assert lines[0].startswith("NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 232448 B shared memory per block)")
    assert lines[1].split()[:4] == ["tcnn64", "default", "wgmma", "16w"]
    assert lines[2].split()[:4] == ["tcnn64", "wgmma=0", "mma.sync", "8w"]
    assert lines[3].split()[:4] == ["tcnn64", "warps=5", "not", "planned"]
    assert lines[4].split()[:4] == ["tcnn64", "1024", "rows", "untuned:"] and "wg4 [wgmma 4w x 64 rows" in lines[4]
    assert lines[5].split()[:6] == ["tcnn64", "1024", "rows", "tuner", "tries", "wg4"]
    assert lines[6].endswith("tuner skips wg16, wg12, wg8 (cannot win at this size)")
    assert len(lines) == 7


def test_list_plans_8_bit_networks_calibrated_first(capsys):
    """probe list --dtype float8: the model is calibrated on the fixed rows first (an 8-bit plan needs its scales);
    deep256's weights past one CTA take the streamed warpgroup form, wide512 is cut into 8-bit GEMMs."""
    status, out, _ = run_main(capsys, ["list", "--dtype", "float8", "deep256", "wide512"])
    lines = out.splitlines()
    assert status == 0 and lines[0].endswith("float8 compute")
    assert lines[1].split()[:4] == ["deep256", "default", "wgmma", "8w"] and "streamed" in lines[1]
    assert all(line.startswith("wide512     layer ") and "GEMM" in line for line in lines[2:])


def test_an_8_bit_model_that_runs_kernels_is_calibrated_on_fixed_rows_as_the_benchmarks():
    """probe.model calibrates an 8-bit model for a GPU (probe.calibrate), not one for planning ahead of time (device
    'cpu': it takes no scales, and rec1024's calibration takes ~8 s of CPU)."""
    wl = probe.workload("tcnn64")
    assert probe.model(wl, device="cpu", dtype="int8").act_scales is None
    int8, again, float8 = (probe.calibrate(probe.model(wl, device="cpu", dtype=d)) for d in ("int8", "int8", "float8"))
    sample = np.random.default_rng(2).standard_normal((bench_lowbit.CALIBRATION_ROWS, 64)).astype(np.float16)
    assert int8.act_scales[0] * 127 == pytest.approx(float(np.abs(sample).max()), rel=1e-6)  # x's largest value
    assert np.array_equal(int8.act_scales, again.act_scales)
    assert np.allclose(int8.act_scales * 127, float8.act_scales * 448, rtol=1e-6)  # the same values, other codes
    assert 0 < int8.calibration_error < _api.CHECK_TOLERANCES["int8"]
    half = probe.model(wl, device="cpu")
    assert probe.calibrate(half) is half and half.act_scales is None and half.calibration_error is None


def test_resolved_builds_what_a_call_launches_from_each_builds_templates():
    """A chain builds a smaller tile's GEMM and a fused stretch's tuned kernel at its first call of a batch size:
    resolved makes that happen within templates_from(the build's folder), so an A/B's baseline chain is all baseline."""
    seen = []

    def folder_now():
        return getattr(_api._template, "keywords", {}).get("folder")

    class LazyChain(_segments.Chain):
        def __init__(self):  # (no model or GPU: program is all resolved calls)
            pass

        def program(self, rows, stream):
            seen.append(("program", rows, stream, folder_now()))

    class Model:
        def __init__(self, kernel):
            self.kernel = kernel

        def _kernel(self, dtype, rows=None):
            seen.append(("kernel", dtype, rows, folder_now()))
            return self.kernel

    chain, fused, own = LazyChain(), object(), _api._template
    assert probe.resolved([(Model(chain), "build/ab_base"), (Model(fused), None)], 4096, 7) == [chain, fused]
    assert seen == [("kernel", "float16", 4096, "build/ab_base"), ("program", 4096, 7, "build/ab_base"),
                    ("kernel", "float16", 4096, None)]
    assert _api._template is own


def test_gemm_builds_each_gemm_layers_kernels_and_not_the_chain(monkeypatch, capsys):
    """probe gemm on rec1024 planned for the H100 (the GEMM builds and their times faked: no GPU here): a kernel per
    tile and form of each GEMM layer, the chain never built; * marks what the chain picks at the batch size (as probe
    list shows), < the fastest."""
    gpu, built, real_model = probe.GPUS["h100"], [], probe.model

    class Kernel:
        def __init__(self, layer, bm, bn, form):
            self.key = (layer, bm, bn, tuple(sorted(form.items())))

        def time(self, rows, launches):
            return self.key[1] * self.key[2] * 1e-5  # ms: the smallest tile fastest

    def model(wl, **options):
        mlp = real_model(wl, device="cpu", **options)
        mlp._target = lambda: (gpu["arch"], gpu["smem_per_block"], gpu["sm_count"], gpu["smem_per_sm"])
        mlp._build_gemm = lambda layer, *dtypes, bm, bn, **form: built.append(Kernel(layer, bm, bn, form)) or built[-1]
        return mlp

    def no_chain(*a, **k):
        raise AssertionError("probe gemm built the chain")

    monkeypatch.setattr(probe, "model", model)
    monkeypatch.setattr(probe, "require_gpu", lambda command: None)
    monkeypatch.setattr(_segments, "chain", no_chain)
    status, out, _ = run_main(capsys, ["gemm", "rec1024", "--rows", "1024", "--rounds", "1"])
    lines = out.splitlines()
    assert status == 0
    assert [line.split(" (")[0] for line in lines[::2]] == [f"rec1024 layer {l}" for l in range(3)]
    assert all("float16 compute, float16 I/O" in line for line in lines[::2])
    cells = [line.split("rows: ")[1].split("; ") for line in lines[1::2]]
    assert sorted({k.key[0] for k in built}) == [0, 1, 2] and sum(map(len, cells)) == len(built)
    assert len({k.key for k in built}) == len(built)  # each tile and form built once
    picks = [" ".join(cell.split()[:-1]) for layer in cells for cell in layer if "*" in cell]
    assert picks == ["64x128 ws1 tma*", "64x128 ws1 tma*", "64x64 ws1 tma*<"]  # probe list's picks at 1024 rows
    fastest = [cell.split()[0] for layer in cells for cell in layer if "<" in cell]
    assert fastest == ["64x64"] * 3


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_list_plans_what_this_gpu_builds(tmp_path):
    info = _api._gpu(0).info
    mlp = probe.model(probe.workload("tcnn64"), cache_dir=tmp_path)
    (default,) = probe.plan_table(probe.workload("tcnn64"), info)
    assert default["info"] == mlp._net.plan(info["arch"], info["smem_per_block"], info["sm_count"], "float16",
                                            "float16", smem_per_sm=info["smem_per_sm"]).info
    assert not isinstance(_api._gpu(0), probe._NamedGpu)  # planning_for gave the real one back


@pytest.mark.gpu
def test_check_and_alternate_on_two_builds_of_one_plan(tmp_path, capsys):
    mlp = probe.model(probe.workload("tcnn64"), cache_dir=tmp_path)
    kernels = [mlp._build("float16")[0], mlp._build("float16", wgmma=0, warps=4, m_tiles=1)[0]]
    (same_a, err_a), (_, err_b) = probe.check("tcnn64", mlp, kernels, ["A", "B"], rows=4099)
    assert same_a and 0 < err_a < 1e-2 and 0 < err_b < 1e-2
    assert capsys.readouterr().out.startswith("tcnn64      check, 4099 rows: A: A bits, rel err ")
    times = probe.alternate(kernels, 4096, rounds=3, launches=2)
    assert [len(t) for t in times] == [3, 3] and all(0 < ms < 100 for t in times for ms in t)


def test_same_tells_whether_a_template_change_leaves_the_kernels_as_they_were(capsys, tmp_path):
    """probe same (no GPU): the package's templates against a copy of themselves compile to the same bytes, exit 0;
    a copy whose relu pair form no longer clamps makes tcnn64's kernel (relu) differ, exit 1; the chain's kernels of a
    segmented network are each named."""
    import importlib.resources

    _api._nvrtc_info()
    for path in (importlib.resources.files("fusedmlp") / "kernel_templates").iterdir():  # (as _api._template reads)
        if path.name.endswith((".cu", ".cuh")):
            (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    status, out, _ = run_main(capsys, ["same", "--base", str(tmp_path), "tcnn64", "rec1024"])
    assert status == 0 and "tcnn64      float16 sm_90: fused same" in out, out
    assert "rec1024     float16 sm_90: GEMM same, GEMM same, GEMM same, fused same" in out, out
    common = tmp_path / "fm_common.cuh"
    text = common.read_text()
    assert "cvt.rn.relu.f16x2.f32" in text
    common.write_text(text.replace("cvt.rn.relu.f16x2.f32", "cvt.rn.f16x2.f32"))
    status, out, _ = run_main(capsys, ["same", "--base", str(tmp_path), "tcnn64"])
    assert status == 1 and "fused DIFFERS" in out, out


def test_list_shows_how_a_gpu_cuts_a_network_and_each_segments_kernel():
    """probe list on a segmented workload: a line per segment with its reason and kernel (no GPU needed)."""
    sdf = probe.segment_table(probe.workload("sdf512"), probe.GPUS["h100"])  # 512 wide, x concatenated before layer 4
    assert [line.split(":")[0] for line in sdf] == ["layers 0-3", "layer 4", "layers 5-8"]
    assert "wgmma GEMM" in sdf[1] and "input concat" in sdf[1]
    assert "x read from its copy in rows of 264 float16" in sdf[1]
    assert sdf[1].endswith("a producer warpgroup, persistent, A by tensor maps, y by TMA stores")
    assert all("fused (wgmma, weights streamed from L2 through" in sdf[i] for i in (0, 2))
    sdf = probe.segment_table(probe.workload("sdf512"), probe.GPUS["a100"])  # every layer a GEMM there
    assert [line.split(":")[0] for line in sdf] == [f"layer {l}" for l in range(9)]
    assert all("mma.sync GEMM" in line for line in sdf) and "input concat" in sdf[4] and "512" in sdf[3]
    # a fused stretch on the streamed register-A form: 1024 features cut layers 0 and 1 off r256's 256-wide trunk
    wide_in = bench.Workload((64, 1024, 256, 256, 256, 16), "silu", True)
    cut = probe.segment_table(wide_in, probe.GPUS["h100"])
    assert [line.split(":")[0] for line in cut] == ["layer 0", "layer 1", "layers 2-4"]
    assert "1024 features" in cut[1] and "wgmma GEMM 128x256 tiles" in cut[1]
    assert "fused (wgmma, weights streamed from L2 through" in cut[2] and "streamed (2 slots)" in cut[2]
    rec = probe.segment_table(probe.workload("rec1024"), probe.GPUS["a100"])  # no wgmma on sm_80
    assert len(rec) == 5 and all("mma.sync GEMM" in line for line in rec[:4]) and ": fused" in rec[4]
    assert probe.segment_table(probe.workload("tcnn64"), probe.GPUS["h100"]) is None
    # NeRF is one kernel on both: on the H100 the streamed register-A form takes its input concat (3.12 ms at 2^21
    # rows against 9.4 cut into a cluster kernel, a GEMM and a cluster kernel); the A100 keeps mma.sync's streamed one
    assert probe.segment_table(probe.workload("nerf"), probe.GPUS["h100"]) is None
    assert probe.segment_table(probe.workload("nerf"), probe.GPUS["a100"]) is None


def test_list_shows_each_gemms_tile_and_form_per_batch_size():
    """probe list --rows on a segmented workload: per batch size, each GEMM's tile, form and CTA count as the chain
    picks them (_segments.gemm_tile over the tiles' plans): on the H100 the forms that won in probe gemm."""
    rec = probe.segment_table(probe.workload("rec1024"), probe.GPUS["h100"], rows=(1024, 4096, 2 ** 21))
    picks = {line.split(":")[0]: line.split(": ", 1)[1] for line in rec if " rows:" in line}
    assert picks["layer 1 at 1024 rows"].startswith("wgmma GEMM 64x128 tiles") and "128 CTAs" in picks[
        "layer 1 at 1024 rows"] and picks["layer 1 at 1024 rows"].count("producer") == 1
    assert picks["layer 2 at 1024 rows"].startswith("wgmma GEMM 64x64 tiles")
    assert picks["layer 2 at 4096 rows"].startswith("wgmma GEMM 128x128") and "consumers in turn" in picks[
        "layer 2 at 4096 rows"]
    assert picks["layer 1 at 4096 rows"].startswith("wgmma GEMM 128x256") and picks["layer 1 at 2097152 rows"].endswith(
        "65536 CTAs")
    assert len(picks) == 9 and len(rec) == 4 + 9
    a100 = probe.segment_table(probe.workload("rec1024"), probe.GPUS["a100"], rows=(1024,))
    assert all("producer" not in line for line in a100)  # mma.sync: the plain form at every tile
