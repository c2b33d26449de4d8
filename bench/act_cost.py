"""What an activation costs inside a benchmark workload: its kernel timed with the activation swapped out.

python bench/act_cost.py res128 gelu relu none --rows 2097152 [--dtype float16]

Same network, weights, tile shape and batch; only the hidden layers' activation differs, so the differences are the
epilogue's activation cost (the ncu-free answer to "is it the MUFU/FMA work or the mma?"). Kernel time per launch,
best of 5, on random inputs (Kernel.time).
"""

import argparse

import numpy as np

import fusedmlp
from fusedmlp import bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(bench.WORKLOADS))
    ap.add_argument("activations", nargs="+", help="hidden-layer activations to compare")
    ap.add_argument("--rows", type=int, default=2**21)
    ap.add_argument("--dtype", default="float16", choices=fusedmlp.PRECISIONS)
    args = ap.parse_args(argv)
    wl = bench.WORKLOADS[args.workload]
    rng = np.random.default_rng(0)
    widths = wl.widths
    ws = [rng.uniform(-1, 1, (n, k)).astype(np.float32) / np.sqrt(k) for k, n in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-0.1, 0.1, n).astype(np.float32) for n in widths[1:]] if wl.bias else None
    base = None
    for act in args.activations:
        options = dict(bench.fused_options(wl), activation=act)
        mlp = fusedmlp.FusedMLP(ws, bs, dtype=args.dtype, device="cuda", **options)
        ms = mlp._kernel("float16", rows=args.rows).time(args.rows, 5)
        base = ms if base is None else base
        print(f"{args.workload} {args.dtype} {act:>24}: {ms:.4f} ms ({ms / base:.2f}x the first)")


if __name__ == "__main__":
    main()
