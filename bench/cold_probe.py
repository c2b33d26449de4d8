"""Where a workload's cold first call goes on the GPU: each call below is the first of a new FusedMLP on an empty
cache folder with NVRTC's own cache off (bench.never_compiled_sources), at 1024 rows, as the benchmark's cold_ms;
printed with each NVRTC compile's span (start, end: ms from the call's start; the tuner compiles its candidates at
once, so the call waits for the slowest).

    python bench/cold_probe.py [workload] [--calls 4]

FUSEDMLP_AUTOTUNE=0 in the environment: the untuned choice alone (one compile).
"""

import argparse
import sys
import tempfile
import time

import torch

from act_cost import workload_weights  # bench/ is the script's folder, so on sys.path

import fusedmlp
import fusedmlp._core as core
from fusedmlp import bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", nargs="?", default="siren256")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args(argv)
    wl = bench.WORKLOADS[args.workload]
    ws, bs = workload_weights(wl)
    make = dict(bench.fused_options(wl), device="cuda")
    x = torch.randn(1024, wl.widths[0], device="cuda", dtype=torch.float16)
    with bench.never_compiled_sources():  # NVRTC and the driver loaded first, as in the benchmark
        fusedmlp.FusedMLP(ws, bs, cache_dir=tempfile.mkdtemp(), **make)(x)
    torch.cuda.synchronize()
    spans, compile_ = [], core.nvrtc_compile

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return compile_(*a, **k)
        finally:
            spans.append((t, time.perf_counter()))

    core.nvrtc_compile = timed
    try:
        for _ in range(args.calls):
            mlp = fusedmlp.FusedMLP(ws, bs, cache_dir=tempfile.mkdtemp(), **make)
            spans.clear()
            with bench.never_compiled_sources():
                t = time.perf_counter()
                mlp(x)
                torch.cuda.synchronize()
                total = time.perf_counter() - t
            compiles = ", ".join(f"{(a - t) * 1e3:.0f}-{(b - t) * 1e3:.0f}" for a, b in sorted(spans))
            print(f"{args.workload} cold first call {total * 1e3:.1f} ms; NVRTC compiles (ms) {compiles}", flush=True)
    finally:
        core.nvrtc_compile = compile_
    return 0


if __name__ == "__main__":
    sys.exit(main())
