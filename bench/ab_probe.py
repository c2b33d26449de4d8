"""A/B of a kernel-template change on the GPU, in one process: each workload's kernel built from one or more
baseline copies of the templates (A, B, ...) and from the working tree's (the last letter), all timed in alternating
rounds on the same inputs.

    mkdir -p build/ab_base && for f in kernel_templates/*; do git show HEAD:$f > build/ab_base/${f##*/}; done
    python bench/ab_probe.py --base build/ab_base [--base other] [--rows 2097152] [--rounds 7] [--plan warps=12]
        [workload ...]

(build/ is git-ignored: the device tool carries it when named in `carry`.) Prints per workload the median over
rounds of each kernel's time (Kernel.time: best of 5 launches) and its ratio to A's. Every kernel comes from the
same plan (the default one, or the forced --plan options), so only the templates differ.
"""

import argparse
import functools
import statistics

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
    return kernel, plan, source


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=list(bench.WORKLOADS))
    ap.add_argument("--base", action="append", required=True, help="a folder holding baseline template files")
    ap.add_argument("--rows", type=int, default=2**21)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--plan", default="", help="forced plan options for all, e.g. warps=12")
    args = ap.parse_args(argv)
    forced = {k: int(v) for k, v in (item.split("=") for item in args.plan.split(",") if item)}
    labels = [chr(ord("A") + i) for i in range(len(args.base) + 1)]
    for name in args.workloads:
        wl = bench.WORKLOADS[name]
        builds = [build(wl, forced, functools.partial(_api._template, folder=b)) for b in args.base]
        builds.append(build(wl, forced, _api._template))
        sources = {src for _, _, src in builds}
        times = [[] for _ in builds]
        for _ in range(args.rounds):
            for kernel_times, (kernel, _, _) in zip(times, builds):
                kernel_times.append(kernel.time(args.rows, 5))
        medians = [statistics.median(t) for t in times]
        info = builds[-1][1].info
        parts = [f"{label} {m:.4f} ms ({m / medians[0]:.3f}, {min(t):.4f}-{max(t):.4f})"
                 for label, m, t in zip(labels, medians, times)]
        print(f"{name:9s} {args.rows} rows, {info['warps']}w cluster={info.get('cluster', 0)}, "
              f"{len(sources)} distinct sources: " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
