"""Tile plans compared on the GPU, in one process: each workload's kernel (fp16 x and y, or --io's) built with each
forced plan (and the default one), all timed in alternating rounds at each batch size.

    python bench/plan_probe.py [--rows 1024 --rows 2097152] [--rounds 5] [--io float32] --plan cluster=4,warps=4
        [--plan ...] [workload ...]

Prints per workload and batch size the median over rounds of each plan's time (Kernel.time: best of 5 launches) and
its ratio to the default plan's. A plan the network does not take (LimitError) is listed once as not built. Besides
the benchmark's workloads it knows a few shapes outside the benchmark's set (EXTRA).
"""

import argparse
import statistics

import numpy as np

from ab_probe import check  # bench/ is the script's folder, so on sys.path
from act_cost import workload_weights

import fusedmlp
from fusedmlp import bench
from fusedmlp.errors import LimitError


#: Shapes outside the benchmark's set: residual networks too wide for the register-A kernel (the cluster kernel's
#: residual epilogues), siren256 with residual hidden layers, and wide last layers.
EXTRA = {
    "res256": bench.Workload((64, 256, 256, 256, 256, 256, 64), "gelu", True, residual=True),
    "res224": bench.Workload((64, 224, 224, 224, 224, 224, 64), "relu", True, residual=True),
    "siren256res": bench.Workload((2, 256, 256, 256, 3), "sin", True, residual=True),
    # wide last layers: on clusters split over the CTAs since session 15 (before, the last layer ran whole in CTA 0
    # while the others waited, and 2-256-256-256 with 16-bit y fitted no cluster plan); in the register-A kernel its
    # 128 accumulators leave room for one warpgroup
    "wideout192": bench.Workload((64, 256, 256, 192), "relu", True),
    "wideout256": bench.Workload((64, 128, 128, 128, 256), "relu", True),
    "sirenout256": bench.Workload((2, 256, 256, 256), "sin", True),
}


def workload(name):
    """The benchmark's workload of that name, else EXTRA's."""
    return bench.WORKLOADS[name] if name in bench.WORKLOADS else EXTRA[name]


def parse(text):
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=list(bench.WORKLOADS))
    ap.add_argument("--rows", type=int, action="append")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--io", default="float16", choices=("float16", "float32", "bfloat16"), help="x's and y's dtype")
    ap.add_argument("--plan", action="append", default=[], help="forced plan options, e.g. cluster=4,warps=4")
    ap.add_argument("--check", action="store_true", help="first compare each plan's outputs (float16 or float32 "
                    "I/O) with the default's and the CPU reference's")
    args = ap.parse_args(argv)
    rows_list = args.rows or [1024, 2**21]
    for name in args.workloads:
        wl = workload(name)
        ws, bs = workload_weights(wl)
        mlp = fusedmlp.FusedMLP(ws, bs, device="cuda", **bench.fused_options(wl))
        built = []
        for text in ["default"] + args.plan:
            try:
                kernel, plan = mlp._build(args.io, **({} if text == "default" else parse(text)))[:2]
            except LimitError as e:
                print(f"{name:9s} {text}: not built ({e.message})", flush=True)
                continue
            info = plan.info
            clusters = f" x{kernel.info['max_clusters']}" if info.get("cluster", 0) > 1 else ""
            built.append((f"{text} [{info['warps']}w c{info.get('cluster', 0)}{clusters}]", kernel))
        if args.check and args.io != "bfloat16":  # NumPy has no bfloat16 to hand the kernel
            check(name, mlp, [kernel for _, kernel in built], [label for label, _ in built], np.dtype(args.io))
        for rows in rows_list:
            times = [[] for _ in built]
            for _ in range(args.rounds):
                for t, (_, kernel) in zip(times, built):
                    t.append(kernel.time(rows, 5))
            medians = [statistics.median(t) for t in times]
            parts = [f"{label} {m * 1e3:.2f} us ({m / medians[0]:.3f})" for (label, _), m in zip(built, medians)]
            print(f"{name:9s} {args.io} {rows:8d} rows: " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
