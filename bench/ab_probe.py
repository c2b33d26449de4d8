"""A/B of a kernel-template change on the GPU, in one process: each workload's kernel built from one or more
baseline copies of the templates (A, B, ...) and from the working tree's (the last letter), all timed in alternating
rounds on the same inputs.

    mkdir -p build/ab_base && for f in kernel_templates/*; do git show HEAD:$f > build/ab_base/${f##*/}; done
    python bench/ab_probe.py --base build/ab_base [--base other] [--rows 2097152] [--rounds 7] [--plan warps=12]
        [--check] [workload ...]

(build/ is git-ignored: the device tool carries it when named in `carry`.) Prints per workload the median over
rounds of each kernel's time (Kernel.time: best of 5 launches) and its ratio to A's. Every kernel comes from the
same plan (the default one, or the forced --plan options), so only the templates differ. --check first runs every
kernel on the same random rows and prints whether each one's outputs are A's bit for bit, and each one's relative L2
error against the CPU reference (a change that only reorders work must leave the bits as they were).
"""

import argparse
import functools
import statistics

import numpy as np

from act_cost import workload_weights  # bench/ is the script's folder, so on sys.path

import fusedmlp
from fusedmlp import _api, bench


def build(wl, forced, template):
    """(kernel, plan, source) of workload wl's fp16 kernel, its templates read by `template` (as _api._template)."""
    ws, bs = workload_weights(wl)
    mlp = fusedmlp.FusedMLP(ws, bs, device="cuda", **bench.fused_options(wl))
    own = _api._template
    _api._template = template
    try:
        kernel, plan, source, _ = mlp._build("float16", **forced)
    finally:
        _api._template = own
    return kernel, plan, source, mlp


def check(name, mlp, kernels, labels, dtype=np.float16, rows=65536 + 37):
    """Prints whether each kernel's outputs on the same random rows (poisoned first) are the first kernel's bit for
    bit, and their relative L2 error against mlp's CPU reference. dtype: x's (and y's) dtype."""
    x = np.random.default_rng(1).uniform(-1, 1, (rows, mlp.widths[0])).astype(dtype)
    ref = mlp._net.forward_cpu(x.astype(np.float32)).astype(np.float64)
    ys = [kernel.run(x, poison=True) for kernel in kernels]
    parts = []
    for label, y in zip(labels, ys):
        err = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
        same = f"{labels[0]}'s bits" if np.array_equal(y.view(np.uint8), ys[0].view(np.uint8)) else \
            f"DIFFERS from {labels[0]}"
        parts.append(f"{label}: {same}, rel err {err:.2e}")
    print(f"{name:9s} check, {rows} rows: " + "  ".join(parts), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=list(bench.WORKLOADS))
    ap.add_argument("--base", action="append", required=True, help="a folder holding baseline template files")
    ap.add_argument("--rows", type=int, default=2**21)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--plan", default="", help="forced plan options for all, e.g. warps=12")
    ap.add_argument("--check", action="store_true", help="compare the kernels' outputs first")
    args = ap.parse_args(argv)
    forced = {k: int(v) for k, v in (item.split("=") for item in args.plan.split(",") if item)}
    labels = [chr(ord("A") + i) for i in range(len(args.base) + 1)]
    for name in args.workloads:
        wl = bench.WORKLOADS[name]
        builds = [build(wl, forced, functools.partial(_api._template, folder=b)) for b in args.base]
        builds.append(build(wl, forced, _api._template))
        sources = {src for _, _, src, _ in builds}
        if args.check:
            check(name, builds[0][3], [kernel for kernel, *_ in builds], labels)
        times = [[] for _ in builds]
        for _ in range(args.rounds):
            for kernel_times, (kernel, *_) in zip(times, builds):
                kernel_times.append(kernel.time(args.rows, 5))
        medians = [statistics.median(t) for t in times]
        info = builds[-1][1].info
        parts = [f"{label} {m:.4f} ms ({m / medians[0]:.3f}, {min(t):.4f}-{max(t):.4f})"
                 for label, m, t in zip(labels, medians, times)]
        print(f"{name:9s} {args.rows} rows, {info['warps']}w cluster={info.get('cluster', 0)}, "
              f"{len(sources)} distinct sources: " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
