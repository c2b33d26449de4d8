"""What an activation costs inside a benchmark workload: its kernel timed with the activation swapped out.

python bench/act_cost.py res128 gelu relu none --rows 2097152 [--dtype float16] [--plan resident=0,warps=8 ...]

Same network, weights, tile shape and batch; only the hidden layers' activation differs, so the differences are the
epilogue's activation cost (the ncu-free answer to "is it the MUFU/FMA work or the mma?"). With --plan, each forced
tile shape (plan options warps, m_tiles, n_chunk, resident) is timed too, with the first activation. Kernel time per
launch, best of 5, on random inputs (Kernel.time).
"""

import argparse

import numpy as np

import fusedmlp
from fusedmlp import bench


def workload_weights(wl):
    """Fixed random weights and biases (None without) for a benchmark workload (also bench/ab_probe.py's)."""
    rng = np.random.default_rng(0)
    widths = wl.widths
    ws = [rng.uniform(-1, 1, (n, k)).astype(np.float32) / np.sqrt(k) for k, n in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-0.1, 0.1, n).astype(np.float32) for n in widths[1:]] if wl.bias else None
    return ws, bs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(bench.WORKLOADS))
    ap.add_argument("activations", nargs="+", help="hidden-layer activations to compare")
    ap.add_argument("--rows", type=int, default=2**21)
    ap.add_argument("--dtype", default="float16", choices=fusedmlp.PRECISIONS)
    ap.add_argument("--plan", nargs="*", default=[], help="forced plan options, e.g. resident=0,warps=8")
    args = ap.parse_args(argv)
    wl = bench.WORKLOADS[args.workload]
    ws, bs = workload_weights(wl)
    base = None
    for act in args.activations:
        options = dict(bench.fused_options(wl), activation=act)
        mlp = fusedmlp.FusedMLP(ws, bs, dtype=args.dtype, device="cuda", **options)
        ms = mlp._kernel("float16", rows=args.rows).time(args.rows, 5)
        base = ms if base is None else base
        print(f"{args.workload} {args.dtype} {act:>24}: {ms:.4f} ms ({ms / base:.2f}x the first)")
    for text in args.plan:
        forced = {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
        mlp = fusedmlp.FusedMLP(ws, bs, dtype=args.dtype, device="cuda",
                                **dict(bench.fused_options(wl), activation=args.activations[0]))
        kernel, plan = mlp._build("float16", **forced)[:2]
        ms = kernel.time(args.rows, 5)
        info = plan.info
        print(f"{args.workload} {args.dtype} {text:>24}: {ms:.4f} ms ({ms / base:.2f}x the first; "
              f"{info['warps']}w x {info['m_tiles'] * 16} rows, resident {info['resident']}, "
              f"{info['blocks_per_sm']} CTA/SM, {info['smem_bytes']} B)")


if __name__ == "__main__":
    main()
