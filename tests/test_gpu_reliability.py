"""GPU reliability: flat memory over many calls and many models, a GPU fault as CudaError. Marked `gpu`."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fusedmlp
from conftest import torch_init

pytestmark = pytest.mark.gpu


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def device_used_mib():
    torch = pytest.importorskip("torch")
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def test_ten_thousand_calls_keep_memory_flat(rng):
    torch = pytest.importorskip("torch")
    ws, bs = torch_init(rng, [16, 64, 64, 8], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cuda")
    x_np = rng.standard_normal((1000, 16)).astype(np.float32)
    x_t = torch.from_numpy(x_np).cuda()
    for _ in range(200):  # warm-up: kernels built, staging buffers grown, allocator pools settled
        mlp(x_np), mlp(x_t)
    torch.cuda.synchronize()
    rss0, dev0 = rss_mib(), device_used_mib()
    for i in range(10_000):
        y = mlp(x_np) if i % 2 else mlp(x_t)
    torch.cuda.synchronize()
    rss1, dev1 = rss_mib(), device_used_mib()
    print(f"\n10,000 calls: host RSS {rss0:.1f} -> {rss1:.1f} MiB, device used {dev0:.1f} -> {dev1:.1f} MiB")
    assert rss1 - rss0 < 8 and abs(dev1 - dev0) < 4
    assert y.shape == (1000, 8)


def test_thousand_models_created_and_destroyed_keep_memory_flat(rng, tmp_path):
    pytest.importorskip("torch")
    ws, bs = torch_init(rng, [16, 64, 64, 8], True)
    x = rng.standard_normal((300, 16)).astype(np.float32)

    def cycle():
        mlp = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cuda", cache_dir=tmp_path)
        y = mlp(x)
        del mlp
        return y

    for _ in range(20):
        cycle()
    gc.collect()
    rss0, dev0 = rss_mib(), device_used_mib()
    for _ in range(1000):
        cycle()
    gc.collect()
    rss1, dev1 = rss_mib(), device_used_mib()
    print(f"\n1,000 create/destroy cycles: host RSS {rss0:.1f} -> {rss1:.1f} MiB, device used {dev0:.1f} -> "
          f"{dev1:.1f} MiB")
    assert rss1 - rss0 < 16 and abs(dev1 - dev0) < 4


def test_a_gpu_fault_is_a_cuda_error_with_the_driver_name(tmp_path):
    # In a child process: a fault poisons the CUDA context for the rest of that process (documented).
    script = textwrap.dedent("""
        import numpy as np, fusedmlp
        ws = [np.ones((8, 8), np.float32)]
        mlp = fusedmlp.FusedMLP(ws, None, device="cuda")
        mlp(np.ones((4, 8), np.float32))
        kernel = mlp._kernel("float32", rows=1 << 20)
        kernel.launch(0x10, 0x20, 1 << 20)          # unmapped addresses: the kernel faults
        try:
            mlp(np.ones((4, 8), np.float32))        # the next synchronising call reports it
        except fusedmlp.CudaError as e:
            print("CAUGHT", e.name)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, FUSEDMLP_CACHE_DIR=str(tmp_path)))
    assert "CAUGHT CUDA_ERROR_ILLEGAL_ADDRESS" in out.stdout, out.stdout + out.stderr


def test_a_cluster_exchange_that_never_completes_is_a_cuda_error(tmp_path):
    """The cluster kernel's barrier waits are bounded: with the hand-back of the exchange buffer taken out of the
    source (so a CTA's second exchange waits for good, as session 9's deadlock did), the kernel stops once a wait
    passes FM_WAIT_LIMIT_CYCLES (2^28 here, about 0.15 s; 2^37 as shipped): a store to address 0 ends it, and the
    call raises the driver's error instead of hanging.
    In a child process: the fault poisons the CUDA context for the rest of it."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the cluster kernel needs sm_90")
    script = textwrap.dedent("""
        import time
        import numpy as np, fusedmlp
        from fusedmlp import _api
        rng = np.random.default_rng(0)
        widths = [16, 256, 256, 8]
        ws = [rng.standard_normal((o, i)).astype(np.float32) / i ** 0.5 for i, o in zip(widths[:-1], widths[1:])]
        mlp = fusedmlp.FusedMLP(ws, None, activation="relu", device="cuda")
        rendered = _api._source_of
        hand_back = "fm_mbar_arrive_cluster(1u, fm_mapa(s.empty"
        def broken(plan):
            source = rendered(plan)
            assert hand_back in source, "the template's hand-back of the exchange buffer moved: update this test"
            return "#define FM_WAIT_LIMIT_CYCLES (1ll << 28)\\n" + source.replace(hand_back, hand_back.replace("1u", "0u"))
        _api._source_of = broken
        kernel = mlp._build("float32", cluster=2, warps=4)[0]
        x = rng.standard_normal((8192, 16)).astype(np.float32)
        start = time.perf_counter()
        try:
            kernel.run(x)
            print("RETURNED")
        except fusedmlp.CudaError as e:
            print("CAUGHT", e.name, f"{time.perf_counter() - start:.2f}", "|", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, FUSEDMLP_CACHE_DIR=str(tmp_path)))
    print(out.stdout)
    assert "CAUGHT CUDA_ERROR_ILLEGAL_ADDRESS" in out.stdout and "deadlock" in out.stdout, out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 30, out.stdout  # a fraction of a second (the limit), not a hang


def test_a_model_collected_inside_another_models_graph_capture_leaves_the_capture_valid(rng):
    """Python frees a model's device buffers and modules when it collects the model, which may fall inside another
    model's torch.cuda.graph capture (global mode, where cuMemFree and cuModuleUnload fail and invalidate the
    capture: the benchmark's graph of cls1000 failed so once). The releases run in relaxed capture mode: the capture
    ends, and its replays are right. A segmented network (its workspace allocated inside the capture too) and a
    fused one."""
    torch = pytest.importorskip("torch")
    for widths in ([32, 64, 64, 16], [32, 300, 16]):
        ws, bs = torch_init(rng, widths)
        mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", device="cuda")
        x = torch.randn(1000, 32, device="cuda", dtype=torch.float16)
        y = torch.empty(1000, 16, device="cuda", dtype=torch.float16)
        mlp(x, out=y)  # (its kernels built before the capture)
        doomed = [fusedmlp.FusedMLP(ws, bs, activation="relu", device="cuda") for _ in range(2)]
        for d in doomed:
            d(x)  # kernels loaded, workspaces allocated: what collecting them releases
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mlp(x, out=y)
            del d, doomed
            gc.collect()
        x.copy_(torch.randn(1000, 32, device="cuda", dtype=torch.float16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cpu = fusedmlp.FusedMLP(ws, bs, activation="relu", device="cpu")(x.float().cpu().numpy())
        got = y.float().cpu().numpy()
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - cpu) <= 2e-3 * np.linalg.norm(cpu), widths
