"""The warpgroup kernel with layers split into equal column groups (a forced n_chunk) against the same kernel
unsplit and float64. Part 1: the random chains of tests/test_gpu.py::test_wgmma_layers_split_into_column_groups
(per case, both errors, the largest difference between them, which output columns differ). Part 2: small networks
under variants of the kernel source (string edits of the rendered source), to isolate what goes wrong.

python bench/wgmma_split_diag.py  (on an sm_90 GPU)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_gpu import graph_reference, rel_l2, run_io_kernel, split_chain_cases  # noqa: E402

import fusedmlp  # noqa: E402
from fusedmlp import _api  # noqa: E402

# Source edits: name -> [(old, new)]
VARIANTS = {
    "as is": [],
    "zero-init d, scale_d 1": [("float d[NC / 2];", "float d[NC / 2] = {};"),
                               ("s > 0 || BIAS_IN_D ? 1 : 0", "1")],
    "fence d before": [("        fm_fence_regs(a);\n        fm_wg_fence();",
                        "        fm_fence_regs(a);\n        fm_fence_regs(d);\n        fm_wg_fence();")],
}


def build(mlp, io, variant, **options):
    gpu = _api._gpu(0)
    info = gpu.info
    plan, source = mlp._render(info["arch"], info["smem_per_block"], info["sm_count"], io, io, info["smem_per_sm"],
                               **options)
    for old, new in VARIANTS[variant]:
        assert old in source, (variant, old)
        source = source.replace(old, new)
    entry = _api.compile_cubin(source, info["arch"], mlp._cache, plan.info["wgmma"])
    return plan.load(gpu, entry.cubin, _api.KERNEL_NAME)


def chains(variant):
    bad = 0
    for c in split_chain_cases():
        ys = []
        for nc in (0, c.n_chunk):
            x, y = run_io_kernel(build(c.mlp, c.io, variant, wgmma=1, warps=4, n_chunk=nc), c.x32, c.io)
            ys.append(y)
        ref = graph_reference(x, c.ws, c.bs, c.mlp)
        diff = np.abs(ys[0] - ys[1])
        cols = sorted(set(np.argwhere(~(diff == 0))[:, 1].tolist()))
        bad += bool(cols)
        print(f"{c.i:2d} nc={c.n_chunk} {c.widths} {c.acts} res={c.residual} bias={[b is not None for b in c.bs]} "
              f"{c.prec}/{c.io} batch={c.batch}: err unsplit {rel_l2(ys[0], ref):.2e} split {rel_l2(ys[1], ref):.2e} "
              f"max|diff| {np.nanmax(diff):.2e} cols {cols[:10]}{'...' if len(cols) > 10 else ''}", flush=True)
    print(f"== chains, {variant}: {bad} of 24 differ from unsplit", flush=True)


def small(variant):
    rng = np.random.default_rng(1)
    for widths in ([16, 128, 16], [16, 128, 128, 16], [16, 192, 16]):
        for bias in ((1, 1), (0, 1), (1, 0), (0, 0)):
            for act in ("relu", "tanh"):
                bias_l = list(bias) + [1] * (len(widths) - 1 - len(bias))
                ws = [(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
                      for i, o in zip(widths[:-1], widths[1:])]
                bs = [rng.standard_normal(o).astype(np.float32) if b else None for o, b in zip(widths[1:], bias_l)]
                mlp = fusedmlp.FusedMLP(ws, bs, activation=act, dtype="float16", device="cuda")
                x = rng.standard_normal((1000, widths[0])).astype(np.float16)
                y0 = build(mlp, "float16", variant, wgmma=1, warps=4).run(x, poison=True).astype(np.float64)
                y1 = build(mlp, "float16", variant, wgmma=1, warps=4, n_chunk=64).run(x, poison=True).astype(np.float64)
                print(f"  {variant}: {widths} bias {bias_l} {act}: split vs unsplit max|diff| "
                      f"{np.nanmax(np.abs(y0 - y1)):.2e}", flush=True)


def main():
    for variant in VARIANTS:
        small(variant)
    for variant in VARIANTS:
        chains(variant)


if __name__ == "__main__":
    main()
