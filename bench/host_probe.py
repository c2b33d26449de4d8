"""Where a small call's time goes, on the host: per-call microseconds (medians of 2000 back-to-back calls, no sync
between them, so the GPU never holds the host up) of the pieces of FusedMLP.__call__ on a CUDA float16 tensor (and of
the call into a preallocated output, mlp(x, out=y), which skips torch.empty), and the sync round trip that bench.py's
call_us and call_out_us add (host-timed call + stream synchronize).

python bench/host_probe.py [workload]  (on a CUDA GPU, torch installed)
"""
import statistics
import sys
import time

import numpy as np
import torch

import fusedmlp
from fusedmlp.bench import WORKLOADS, _time_host, fused_options


def per_call_us(fn, calls=2000, reps=7):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def synced_us(fn, calls=300):
    """The bench's call_us measure: median of host-timed fn() + stream synchronize."""
    return _time_host(torch, lambda k: fn(), calls)["call_us"]


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "tcnn64"
    wl = WORKLOADS[name]
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32) for i, o in zip(wl.widths[:-1], wl.widths[1:])]
    bs = [rng.standard_normal(o).astype(np.float32) * 0.1 for o in wl.widths[1:]] if wl.bias else None
    mlp = fusedmlp.FusedMLP(ws, bs, device="cuda", **fused_options(wl))
    x = torch.randn(1024, wl.widths[0], device="cuda", dtype=torch.float16)
    mlp(x)
    torch.cuda.synchronize()
    kernel = mlp._kernel("float16", rows=1024)
    y = torch.empty((1024, wl.widths[-1]), device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    raw = torch._C._cuda_getCurrentRawStream
    rows = {
        "mlp(x) (FusedMLP.__call__)": lambda: mlp(x),
        "mlp(x, out=y) (preallocated out)": lambda: mlp(x, out=y),
        "torch.empty(out)": lambda: torch.empty((1024, wl.widths[-1]), device="cuda", dtype=torch.float16),
        "mlp._kernel lookup": lambda: mlp._kernel("float16", rows=1024),
        "Kernel.launch (C: cuLaunchKernel)": lambda: kernel.launch(x.data_ptr(), y.data_ptr(), 1024, stream),
        "raw current stream": lambda: raw(0),
        "x.data_ptr() + checks": lambda: (x.is_cuda, x.requires_grad, x.dim(), x.shape[1], x.is_contiguous(),
                                           x.data_ptr() % 16, x.get_device()),
        "torch eager x * 2 (one small kernel)": lambda: x * 2,
    }
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  workload {name}, 1024 rows")
    for label, fn in rows.items():
        print(f"  {label:40s} {per_call_us(fn):7.2f} us per call, back to back")
    print(f"  {'sync round trip, empty stream':40s} {synced_us(lambda: None):7.2f} us")
    print(f"  {'mlp(x) + sync (bench call_us)':40s} {synced_us(lambda: mlp(x)):7.2f} us")
    print(f"  {'mlp(x, out=y) + sync (bench call_out_us)':40s} {synced_us(lambda: mlp(x, out=y)):7.2f} us")
    print(f"  {'Kernel.launch + sync':40s} {synced_us(lambda: kernel.launch(x.data_ptr(), y.data_ptr(), 1024, stream)):7.2f} us")
    print(f"  {'torch eager x * 2 + sync':40s} {synced_us(lambda: x * 2):7.2f} us")


if __name__ == "__main__":
    main()
