"""What the tuner chooses, and what a cold first call costs, per workload and batch size, in one process:

    python bench/tune_probe.py [--rows 1024 --rows 2097152] [--templates FOLDER] [workload ...]

Each workload (the benchmark's, or plan_probe.EXTRA's) gets a fresh cache folder, and NVRTC's own cache is off
(bench.never_compiled_sources); for each batch size the first call of that size on a CUDA fp16 tensor is timed on
the host (render, NVRTC and tuning included where the bucket is new, then a sync), and the tuner's log line (its
choice and every candidate's time) is printed. --templates: the kernel templates from that folder (as ab_probe's
--base), to compare a template change's cold first calls.
"""

import argparse
import functools
import logging
import os
import tempfile
import time

from act_cost import workload_weights  # bench/ is the script's folder, so on sys.path
from plan_probe import workload

import fusedmlp
from fusedmlp import _api, bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=list(bench.WORKLOADS))
    ap.add_argument("--rows", type=int, action="append")
    ap.add_argument("--templates", help="a folder holding the kernel template files to use")
    args = ap.parse_args(argv)
    if args.templates:
        _api._template = functools.partial(_api._template, folder=args.templates)
    import torch

    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    root = tempfile.mkdtemp(prefix="tune-probe-")
    for name in args.workloads:
        wl = workload(name)
        ws, bs = workload_weights(wl)
        mlp = fusedmlp.FusedMLP(ws, bs, device="cuda", dtype="float16", cache_dir=os.path.join(root, name),
                                **bench.fused_options(wl))
        for rows in args.rows or [1024, 2**21]:
            x = torch.randn(rows, wl.widths[0], device="cuda", dtype=torch.float16)
            torch.cuda.synchronize()
            with bench.never_compiled_sources():
                t = time.perf_counter()
                mlp(x)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t
            print(f"{name:11s} {rows:8d} rows: first call {seconds:.3f} s", flush=True)


if __name__ == "__main__":
    main()
