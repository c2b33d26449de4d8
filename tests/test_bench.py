"""fusedmlp.bench without a GPU: the floor arithmetic, the table, the plot, and a whole run on the CPU with the CUDA
parts (events, graphs, the fused kernel) replaced by host stand-ins."""

import ctypes
import importlib.util
import json
import subprocess
import sys
import time

import numpy as np
import pytest

import fusedmlp
from fusedmlp import bench

CEILINGS = {"copy_GBps": 3000.0, "matmul_TFLOPs": 600.0}


def test_floor_is_the_slower_of_moving_the_io_and_doing_the_math():
    widths = bench.WORKLOADS["tcnn64"].widths  # 32-64-64-64-64-16
    rows = 2**21
    assert bench.io_bytes(widths, rows) == rows * (32 + 16) * 2
    assert bench.flops(widths, rows) == 2 * rows * (32 * 64 + 3 * 64 * 64 + 64 * 16)
    ms, bound = bench.floor_ms(widths, rows, CEILINGS)
    assert bound == "compute"
    assert ms == pytest.approx(2 * rows * 15360 / 600e12 * 1e3)  # 0.1074 ms; the I/O alone takes 0.0671 ms
    # one output feature and two inputs: memory is the larger term only when the math is tiny
    ms, bound = bench.floor_ms((2, 1), rows, CEILINGS)
    assert bound == "memory"
    assert ms == pytest.approx(rows * 3 * 2 / 3000e9 * 1e3)


def test_flops_count_real_widths_not_the_padded_ones():
    # pinn50 pads 50 to 64 and 2 to 16 inside the kernel; the floor must not count that padding
    assert bench.flops(bench.WORKLOADS["pinn50"].widths, 1) == 2 * (2 * 50 + 4 * 50 * 50 + 50 * 1)
    assert bench.flops(bench.WORKLOADS["siren256"].widths, 3) == 3 * 2 * (2 * 256 + 2 * 256 * 256 + 256 * 3)


def test_workload_set_is_the_issue_set():
    assert list(bench.WORKLOADS) == ["tcnn64", "tcnn128", "flex", "pinn50", "siren256", "res128",  # issue 4
                                     "nerf", "nerfenc",  # issue 29's NeRF, and as written (its encoding in forward)
                                     "deep256", "wide512", "sdf512", "rec1024",  # issue 29
                                     "rl256", "r256", "rl1024", "r1024",  # issue 30 (r*: rl* without norms)
                                     "cls10", "cls1000",  # classifiers: softmax heads
                                     "simba64",  # SimBa's pre-norm residual blocks (issue 30's RL MLPs as written)
                                     "twin256"]  # TD3's twin critics: parallel stacks read as one network
    cls = bench.WORKLOADS["cls1000"]
    assert cls.output_activation == "softmax" and bench.fused_options(cls) == {
        "activation": "relu", "output_activation": "softmax"}
    nerf, sdf = bench.WORKLOADS["nerf"], bench.WORKLOADS["sdf512"]
    assert nerf.widths == (63,) + (256,) * 8 + (4,) and nerf.concat == ((5, "before"),)
    assert nerf.layer_inputs()[5] == 63 + 256 and bench.flops(nerf.widths, 1, nerf.concat) == 2 * (
        63 * 256 + 4 * 256 * 256 + 319 * 256 + 2 * 256 * 256 + 256 * 4)
    assert sdf.output_activation == "tanh" and bench.fused_options(sdf) == {
        "activation": "relu", "concat": {4: "before"}, "output_activation": "tanh"}
    flex = bench.WORKLOADS["flex"]
    assert flex.widths == (3, 64, 128, 96, 64, 32, 16, 4) and flex.activation == "silu" and flex.bias
    res = bench.WORKLOADS["res128"]  # 64-128, four blocks x + gelu(Linear128(x)), -64
    assert res.widths == (64, 128, 128, 128, 128, 128, 64) and res.activation == "gelu" and res.residual
    assert bench.fused_options(res) == {"activation": "gelu", "residual": {1: "add", 2: "add", 3: "add", 4: "add"}}
    twin = bench.WORKLOADS["twin256"]  # the floor counts the stacks' own multiply-adds, not the zero blocks
    assert twin.out_features() == 2 and bench.flops(twin.widths, 1, (), twin.stacks) == 2 * 2 * (
        23 * 256 + 256 * 256 + 256) and bench.io_bytes(twin.widths, 1, stacks=2) == (23 + 2) * 2


@pytest.mark.parametrize("text, rows", [("1024", 1024), ("2^14", 16384), ("2**18", 262144), ("1<<21", 2097152)])
def test_rows_accept_powers_written_three_ways(text, rows):
    assert bench.parse_rows(text) == rows


def test_rows_label_and_device_folder_names():
    assert [bench.rows_label(r) for r in (1024, 2**21, 1000)] == ["2^10", "2^21", "1000"]
    assert bench.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.device_slug("NVIDIA H200") == "h200"
    assert bench.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert bench.device_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert bench.device_slug("???") == "gpu"


def fake_report():
    """Two batch sizes of tcnn64 with made-up times, one failed peer, one skipped workload."""
    widths = bench.WORKLOADS["tcnn64"].widths
    results = []
    for rows, fused, eager, graph, comp in ((2**10, 0.004, 0.05, 0.012, None), (2**21, 0.25, 1.66, 1.58, 1.2)):
        floor, bound = bench.floor_ms(widths, rows, CEILINGS)
        results.append({
            "workload": "tcnn64", "rows": rows, "floor_ms": floor, "floor_bound": bound, "n_buffers": 4,
            "methods": {
                "fusedmlp": {"ms": fused, "rel_l2": 4.9e-4, "check_ok": True, "call_us": 12.0},
                "fusedmlp_graph": {"ms": fused * 0.9, "rel_l2": 4.9e-4, "check_ok": True},
                "fusedmlp_call": {"ms": fused * 1.2, "call_us": 30.0 + fused * 1e3,
                                  "call_out_us": 20.0 + fused * 1e3, "rel_l2": 4.9e-4, "check_ok": True},
                "torch_eager": {"ms": eager, "call_us": 80.0, "rel_l2": 3e-4},
                "torch_graph": {"ms": graph, "rel_l2": 3e-4},
                "torch_compile": {"ms": comp, "rel_l2": 3e-4} if comp else {"error": "RuntimeError: no triton"},
            },
        })
    return {
        "device": {"name": "NVIDIA H100 80GB HBM3"}, "torch": "2.13.0", "fusedmlp": "0.1.0", "tolerance": 2e-3,
        "ceilings": dict(CEILINGS),
        "workloads": {
            "tcnn64": {"widths": list(widths), "activation": "relu", "skipped": None, "cold_ms": 471.2, "warm_ms": 1.0},
            "res128": {"widths": [128] * 6, "activation": "relu", "skipped": "fusedmlp has no residual epilogue yet"},
        },
        "results": results,
    }


def test_summary_ratios_use_the_best_peer_that_ran():
    big = fake_report()["results"][1]
    s = bench.summarize(big)
    assert s["best_peer"] == "torch_compile" and s["best_peer_ms"] == 1.2
    assert s["x_peer"] == pytest.approx(1.2 / 0.25)
    assert s["x_floor"] == pytest.approx(0.25 / big["floor_ms"])
    assert s["rows_per_s"] == pytest.approx(2**21 / 0.25e-3)
    small = fake_report()["results"][0]  # compile failed: the best peer is the graph
    assert bench.summarize(small)["best_peer"] == "torch_graph"
    assert bench.summarize(small)["x_peer"] == pytest.approx(0.012 / 0.004)


def test_table_has_a_line_per_result_with_ratios_and_notes():
    text = bench.format_table(fake_report())
    lines = text.splitlines()
    assert "copy 3000 GB/s" in lines[0] and "600 TFLOP/s" in lines[0]
    row10 = next(line for line in lines if line.startswith("tcnn64") and " 2^10 " in line)
    row21 = next(line for line in lines if line.startswith("tcnn64") and " 2^21 " in line)
    cells = row21.split()
    # call 280 us, call+out (into a preallocated output) 270 us
    assert cells[:9] == ["tcnn64", "2^21", "0.2500", "0.2250", "0.2800", "0.2700", "1.660", "1.580", "1.200"]
    assert cells[9] == "0.1074c"  # compute-bound floor
    assert row10.split()[2:6] == ["0.004000", "0.003600", "0.03400", "0.02400"]
    assert cells[10] == "8.39G" and cells[11] == f"{0.25 / 0.1073741824:.2f}" and cells[12] == "4.80"
    assert row10.split()[8] == "err"
    head = lines[1].split()
    assert head[4:6] == ["call", "call+out"] and lines[2].split() == ["ms"] * 8
    assert "res128     skipped: fusedmlp has no residual epilogue yet" in text
    assert "cold 471.2 ms" in text and "warm 1.00 ms" in text
    assert "error: tcnn64 2^10 torch_compile: RuntimeError: no triton" in text


def test_table_shows_a_dash_where_a_report_has_no_call_out_time():
    report = fake_report()  # as reports written before call_out_us existed
    del report["results"][1]["methods"]["fusedmlp_call"]["call_out_us"]
    row21 = next(line for line in bench.format_table(report).splitlines() if " 2^21 " in line)
    assert row21.split()[4:6] == ["0.2800", "-"]


def test_table_flags_a_failed_accuracy_check():
    report = fake_report()
    report["results"][1]["methods"]["fusedmlp"].update(rel_l2=float("nan"), check_ok=False)
    text = bench.format_table(report)
    assert "0.2500!" in text
    assert "error: tcnn64 2^21 fusedmlp: relative L2 error nan exceeds 0.002" in text


def test_json_output_keeps_nan_readable(tmp_path):
    report = fake_report()
    report["results"][0]["methods"]["fusedmlp"]["rel_l2"] = float("nan")
    bench.write_outputs(report, tmp_path, with_plot=False)
    back = json.loads((tmp_path / "bench.json").read_text())  # strict JSON: no bare NaN
    assert back["results"][0]["methods"]["fusedmlp"]["rel_l2"] == "nan"
    assert back["results"][1]["methods"]["torch_eager"]["ms"] == 1.66
    assert (tmp_path / "bench.txt").read_text().startswith("NVIDIA H100")


def test_plot_writes_a_png_with_a_panel_per_workload(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.plot(fake_report(), path) is True
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2 * 5 * 120, 3.8 * 120)  # two panels side by side at 120 dpi


def test_module_imports_without_torch_and_main_says_what_is_missing():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import fusedmlp.bench as b\n"
            "assert b.floor_ms((2, 1), 8, {'copy_GBps': 1.0, 'matmul_TFLOPs': 1.0})[1] == 'memory'\n"
            "b.main(['--rows', '1024'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "fusedmlp.bench needs PyTorch" in proc.stderr


# ------------------------------------------------------------------------------------------------ a run on the CPU


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class FakeStream:
    cuda_stream = 0

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


class FakeGraph:
    """What _graph_of builds: replay() reruns the captured calls, writing into the outputs of the capture."""

    def __init__(self, body, order):
        self.body, self.order = body, order
        self.outs = [body(j) for j in order]

    def replay(self):
        for j, out in zip(self.order, self.outs):
            y = self.body(j)
            if out is not None:
                out.copy_(y)


class FakeKernel:
    """Kernel.launch on host pointers: the C CPU forward of the same network, through ctypes views."""

    scale = 1.0

    def __init__(self, net):
        self.net = net
        self.info = {"blocks_per_sm": 1, "smem_bytes": 0, "threads": 256}

    def launch(self, xp, yp, rows, stream=0):
        n_in, n_out = self.net.widths[0], self.net.widths[-1]
        x = np.ctypeslib.as_array((ctypes.c_uint16 * (rows * n_in)).from_address(xp)).view(np.float16)
        y = np.ctypeslib.as_array((ctypes.c_uint16 * (rows * n_out)).from_address(yp)).view(np.float16)
        out = self.net.forward_cpu(x.reshape(rows, n_in).astype(np.float32)) * self.scale
        y[:] = out.astype(np.float16).ravel()


class FakeGpu:
    info = {"name": "Fake GPU", "arch": 90, "sm_count": 132, "smem_per_block": 232448, "smem_per_sm": 233472}


@pytest.fixture
def cpu_bench(monkeypatch):
    torch = pytest.importorskip("torch")
    import fusedmlp
    from fusedmlp import _api

    props = type("Props", (), {"L2_cache_size": 4096, "multi_processor_count": 132, "major": 9, "minor": 0,
                               "total_memory": 80 << 30})()
    stream = FakeStream()
    for name, value in {
        "is_available": lambda: True, "get_device_name": lambda i=0: "NVIDIA Fake 100", "get_device_properties":
        lambda i=0: props, "synchronize": lambda: None, "Event": FakeEvent, "current_stream": lambda d=None: stream,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny fp16 ops on a few shared cores: one thread is faster and steadier
    monkeypatch.setattr(bench, "COPY_BYTES", 1 << 20)
    monkeypatch.setattr(bench, "MATMUL_N", 64)
    monkeypatch.setattr(bench, "HOST_CALL_S", 0.01)
    monkeypatch.setattr(bench, "MAX_METHOD_S", 0.05)
    monkeypatch.setattr(bench, "MIN_REPS", 3)  # CPU fp16 is slow: a forward of 1000 rows takes ~0.1 s
    monkeypatch.setattr(bench, "_graph_of", lambda torch, body, order: (g := FakeGraph(body, order), g.outs))
    monkeypatch.setattr(_api, "_nvrtc_info", lambda: ("libnvrtc.so.13", (13, 0)))
    monkeypatch.setattr(_api, "_gpu", lambda ordinal: FakeGpu())
    kernels = {}

    def fake_kernel(self, dtype, out_dtype=None, rows=None):
        if id(self) not in kernels:
            time.sleep(0.002)  # a "compile", so cold > 0
            kernels[id(self)] = (self, FakeKernel(self._net))
        return kernels[id(self)][1]

    monkeypatch.setattr(fusedmlp.FusedMLP, "_kernel", fake_kernel)

    def fake_compile(model, mode=None, dynamic=None):
        assert mode == "max-autotune-no-cudagraphs" and dynamic is False
        if len(model) == 11:  # pinn50: a compile that fails must be recorded, not end the run

            def broken(x):
                raise RuntimeError("inductor: no triton")

            return broken
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    yield torch
    torch.set_num_threads(threads)


def test_a_whole_run_on_the_cpu_writes_every_number(cpu_bench, tmp_path, capsys):
    code = bench.main(["--workloads", "tcnn64,pinn50", "res128", "--rows", "16", "48", "--reps", "12",
                       "--show-autotune", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["device"]["name"] == "NVIDIA Fake 100"
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    assert report["workloads"]["res128"]["skipped"] is None and report["workloads"]["res128"]["residual"]
    assert [(r["workload"], r["rows"]) for r in report["results"]] == [
        ("tcnn64", 16), ("tcnn64", 48), ("pinn50", 16), ("pinn50", 48), ("res128", 16), ("res128", 48)]
    for name in ("tcnn64", "pinn50", "res128"):
        info = report["workloads"][name]
        assert info["cold_ms"] > 0 and info["warm_ms"] > 0
        assert info["plan"]["in_dtype"] == "float16" and info["kernel"]["threads"] == 256
        assert info["call_path"].startswith("shim")  # the fake kernel has no run(): the tensor path refuses
    for r in report["results"]:
        wl = bench.WORKLOADS[r["workload"]]
        assert r["floor_ms"] == pytest.approx(bench.floor_ms(wl.widths, r["rows"], report["ceilings"])[0])
        assert 4 <= r["n_buffers"] <= bench.MAX_BUFFERS
        for method in ("fusedmlp", "fusedmlp_graph", "fusedmlp_call"):
            entry = r["methods"][method]
            assert entry["check_ok"] is True and entry["rel_l2"] < 2e-3, (method, entry)
            assert entry["ms"] > 0 and entry["reps"] >= bench.MIN_REPS
        for method in ("torch_eager", "torch_graph"):
            assert r["methods"][method]["ms"] > 0 and r["methods"][method]["rel_l2"] < 1e-2
        assert r["methods"]["fusedmlp_call"]["call_us"] > 0 and "call_us" not in r["methods"]["torch_graph"]
        call = r["methods"]["fusedmlp_call"]  # its check also compared fused(x, out=y) with fused(x), bit for bit
        assert call["call_out_us"] > 0 and call["call_out_calls"] >= 30 and call["calls"] >= 30
        assert "call_out_us" not in r["methods"]["torch_eager"]
        assert r["summary"]["fused_ms"] == r["methods"]["fusedmlp"]["ms"] and r["summary"]["x_peer"] > 0
        comp = r["methods"]["torch_compile"]
        if r["workload"] == "pinn50":
            assert comp["error"] == "RuntimeError: inductor: no triton"
        else:
            assert comp["ms"] > 0 and comp["compile_s"] >= 0
    assert (tmp_path / "bench.txt").read_text().strip() in out
    if importlib.util.find_spec("matplotlib") is None:
        assert not (tmp_path / "bench.png").exists()
    else:
        assert (tmp_path / "bench.png").stat().st_size > 10000


def test_a_wrong_fused_result_fails_the_run(cpu_bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(FakeKernel, "scale", 1.5)
    code = bench.main(["--workloads", "tcnn64", "--rows", "32", "--reps", "10", "--no-compile",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    entry = json.loads((tmp_path / "bench.json").read_text())["results"][0]["methods"]["fusedmlp"]
    assert entry["check_ok"] is False and entry["rel_l2"] == pytest.approx(0.5, rel=1e-2)
    assert "CHECK FAILED" in out and "error: tcnn64 2^5 fusedmlp: relative L2 error" in out


def test_cold_first_calls_compile_with_nvrtcs_own_cache_off(tmp_path, monkeypatch):
    """Inside never_compiled_sources NVRTC compiles with its own cache off (12.9 and later have one: on the H100
    machines it answered a source an earlier process had compiled, comments aside, in a tenth of the time), so a
    cold first call pays the whole compile; outside it NVRTC gets no extra option. The compiles are real, so an
    NVRTC that refused the option would fail here."""
    import fusedmlp
    from fusedmlp import _api, _core
    from fusedmlp._cache import KernelCache

    options = []
    real = _core.nvrtc_compile
    monkeypatch.setattr(_core, "nvrtc_compile", lambda *args: options.append(args[4]) or real(*args))
    rng = np.random.default_rng(2)
    mlp = fusedmlp.FusedMLP([rng.standard_normal((16, 8)).astype(np.float32)], None, "relu", device="cpu")
    source = mlp._render(80, 0, 0, "float16", "float16")[1]
    with bench.never_compiled_sources():
        cold = _api.compile_cubin(source, 80, KernelCache(tmp_path / "cold"))
    warm = _api.compile_cubin(source, 80, KernelCache(tmp_path / "plain"))
    no_cache = ("--no-cache",) if _api._nvrtc_info()[1] >= (12, 9) else ()
    assert options == [no_cache, ()] and _api.nvrtc_no_cache() == no_cache and _api._extra_options == ()
    assert cold.cubin == warm.cubin  # an option outside the cache key must not change the code


@pytest.mark.parametrize("name", ["tcnn64", "res128", "nerf", "nerfenc", "sdf512", "rl256", "simba64", "twin256"])
def test_fused_options_describe_the_torch_model(name):
    """The benchmark's torch model and the FusedMLP built from its Linears' weights (fused_layers: SimBa's identity
    layers inserted) with fused_options compute the same function (CPU path vs torch in float64): residuals, concats,
    output activations and LayerNorms included; for SimBa and parallel stacks the same network fusedmlp.from_torch
    reads."""
    torch = pytest.importorskip("torch")
    wl = bench.WORKLOADS[name]
    torch.manual_seed(0)
    model = bench.torch_model(torch, wl).double().eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight.detach().float().numpy() for m in linears]
    biases = [m.bias.detach().float().numpy() if wl.bias else None for m in linears]
    mlp = fusedmlp.FusedMLP(*bench.fused_layers(wl, weights, biases), device="cpu", **bench.fused_options(wl))
    x = np.random.default_rng(0).standard_normal((33, wl.x_features())).astype(np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.astype(np.float64))).numpy()
    assert np.linalg.norm(mlp(x) - ref) / np.linalg.norm(ref) < 1e-5
    if wl.encoding:  # NeRF as written: from_torch reads its encoding and skip, the benchmark's model too
        read = fusedmlp.from_torch(model.float(), device="cpu")
        assert read.widths == mlp.widths and read.in_features == 3 and read._concat == mlp._concat
    if wl.stacks > 1:  # the stacks as one chain: from_torch reads the same block-diagonal layers
        read = fusedmlp.from_torch(model.float(), device="cpu")
        assert read.widths == mlp.widths and all(np.array_equal(a, b) for a, b in zip(read._w, mlp._w))
    if wl.blocks:
        read = fusedmlp.from_torch(model.float(), device="cpu")  # (its norms with their ones and zeros)
        assert (read.widths, read._residual) == (mlp.widths, mlp._residual)
        assert np.linalg.norm(read(x) - mlp(x)) / np.linalg.norm(ref) < 1e-6


def test_host_section_lists_each_measure_and_the_floor():
    from fusedmlp import bench_host

    text = bench_host.format_section({"launch_floor": {"async_us": 3.59, "sync_us": 9.52},
                                      "rows": [{"workload": "tcnn64", "rows": 1024, "kernel_us": 4.03, "call_us": 8.41,
                                                "call_out_us": 5.8},
                                               {"workload": "res128", "rows": 1, "error": "CudaError: boom"}]})
    assert "launch floor from C: 3.59 back to back, 9.52 with a sync" in text
    line = next(l for l in text.splitlines() if l.startswith("tcnn64"))
    assert line.split()[:5] == ["tcnn64", "1024", "4.03", "8.41", "5.80"] and line.split()[5] == "-"
    assert "res128         1 error: CudaError: boom" in text
    assert bench_host.format_section(None) == ""


def test_low_bit_dtypes_are_timed_beside_float16_with_their_own_bounds(cpu_bench, tmp_path, capsys):
    code = bench.main(["--workloads", "tcnn64", "--rows", "32", "--reps", "10", "--no-compile", "--no-host",
                       "--dtype", "float16", "int8", "float8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "bench.json").read_text())
    r = report["results"][0]
    for dtype in ("int8", "float8"):
        entry = r["methods"][f"fusedmlp_{dtype}"]
        assert entry["ms"] > 0 and entry["check_ok"] is True, entry
        assert 1e-4 < entry["rel_l2"] <= fusedmlp.CHECK_TOLERANCES[dtype]  # 8-bit codes: an error, bounded by its own
    assert "matmul8_TFLOPs" in report["ceilings"] or "matmul8_error" in report["ceilings"]
    text = (tmp_path / "bench.txt").read_text()
    assert "low-bit kernels, ms" in text
    line = next(l for l in text.splitlines() if l.startswith("tcnn64") and len(l.split()) == 9)
    assert line.split()[1] == "2^5" and all(c != "err" for c in line.split()[2:5])


def test_host_array_section_rates_each_form_against_torch_and_the_floor():
    """The --arrays section: the bus rates, then per (workload, rows) each form's ms, fused+out over torch, and
    fused+out over the larger of the bus floor and the kernel; a failed row says its error."""
    from fusedmlp import bench_arrays

    row = {"workload": "nerf", "rows": 1 << 24, "fused_ms": 109.6, "fused_out_ms": 96.7, "fused_one_ms": 661.3,
           "torch_ms": 841.7, "kernel_ms": 26.0, "floor_ms": 76.4, "same_bits": True}
    slow_kernel = dict(row, workload="siren256", kernel_ms=200.0)
    text = bench_arrays.format_section({"rates": {"h2d_GBps": 55.3, "d2h_GBps": 55.2},
                                        "rows": [row, slow_kernel, {"workload": "pinn50", "rows": 1024,
                                                                    "error": "CudaError: boom"}]})
    assert "page-locked bus: 55.3 GB/s to the device, 55.2 GB/s back" in text
    cells = next(l for l in text.splitlines() if l.startswith("nerf")).split()
    assert cells[:8] == ["nerf", str(1 << 24), "109.60", "96.70", "661.30", "841.70", "26.00", "76.40"]
    assert cells[8:] == ["8.70", "1.27", "True"]  # 841.7 / 96.7; 96.7 / 76.4
    assert next(l for l in text.splitlines() if l.startswith("siren256")).split()[9] == "0.48"  # 96.7 / 200
    assert "pinn50         1024  CudaError: boom" in text


def test_arrays_takes_batch_sizes_as_rows_does():
    args = bench._parse_args(["--arrays", "2^20", "1<<24", "--no-host"])
    assert args.arrays == [1 << 20, 1 << 24] and bench._parse_args([]).arrays is None
