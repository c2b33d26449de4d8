"""Builds and runs >= 20 generated kernels once each with few rows, for compute-sanitizer (memcheck, racecheck,
synccheck) to observe: every template path (resident and streamed weights, one and two activation buffers,
small- and large-tile variants), tail rows, odd widths, fp32 and fp16 I/O, and graphs (kept residual buffers,
concat inputs) in every compute dtype with bfloat16 I/O too. Exits non-zero on a wrong result.

    compute-sanitizer --tool memcheck --error-exitcode 1 python bench/sanitize_target.py
"""

import numpy as np

import fusedmlp


def rel_err(y, ref):
    """Relative L2 error of a kernel's output against the CPU forward."""
    return np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)


CASES = [  # widths, activation
    ([32, 64, 64, 64, 64, 16], "relu"), ([3, 64, 128, 96, 64, 32, 16, 4], "silu"), ([2, 50, 50, 50, 1], "tanh"),
    ([2, 256, 256, 3], "sin"), ([1, 1], "none"), ([7, 13, 5], "gelu"), ([17, 33, 129, 255, 1], "sigmoid"),
    ([256, 256, 256, 256], "x * tanh(softplus(x))"), ([96, 200, 96], "elu"), ([5, 300 - 44, 9], "mish"),
]
rng = np.random.default_rng(0)
count = 0


KERNELS = []
for widths, act in CASES:
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=act, device="cuda")
    for dtype in (np.float32, np.float16):
        for variant_rows in (129, 20_000):  # selects the small-tile and the large-tile kernel
            kernel = mlp._kernel(np.dtype(dtype).name, rows=variant_rows)
            KERNELS.append(kernel)
            x = rng.standard_normal((300, widths[0])).astype(dtype)  # 300 rows: partial last tile in both
            y = kernel.run(x, poison=True)
            ref = mlp._net.forward_cpu(x.astype(np.float32))
            err = rel_err(y, ref)
            assert np.isfinite(y).all() and err < 5e-2, (widths, act, variant_rows, err)
            count += 1
kernels = len({id(k) for k in KERNELS})
print(f"ran {count} launches: {len(CASES)} networks x 2 dtypes x 2 tile variants, {kernels} distinct kernels (a variant "
      "that does not fit a network falls back to its default kernel): OK")

# Graphs (issue 5): kept buffers for residual operands from earlier layers and the input, two-part concat inputs,
# in-place layers next to out-of-place ones, a residual in the staged last layer, streamed 256-wide chunks; each in
# the three compute dtypes, with float32, float16 and bfloat16 I/O (bf16 as its uint16 bits).
GRAPHS = [  # widths, residual, concat
    ([24, 64, 64, 64, 24], {1: "add", 2: ("mul", "none", 0), 3: ("add", "none", "input")}, None),
    ([63, 256, 256, 256, 4], {2: ("add", "relu", 0)}, {2: "before"}),
    ([3, 32, 32, 32, 32], {3: ("add", "tanh", 1)}, {1: "after", 3: "after"}),
]
graph_launches = 0
for widths, residual, concat in GRAPHS:
    ws, bs = [], []
    for l, (i, o) in enumerate(zip(widths[:-1], widths[1:])):
        k = i + (widths[0] if concat and l in concat else 0)
        ws.append(rng.uniform(-1, 1, (o, k)).astype(np.float32) / np.sqrt(k))
        bs.append(rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(k))
    for prec in fusedmlp.PRECISIONS:
        mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", residual=residual, concat=concat, dtype=prec, device="cuda")
        for io in ("float32", "float16", "bfloat16"):
            x32 = rng.standard_normal((300, widths[0])).astype(np.float32)
            if io == "bfloat16":
                u = x32.view(np.uint32)
                x = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                x32 = (x.astype(np.uint32) << 16).view(np.float32)
                y = (mlp._kernel(io).run(x, poison=True).astype(np.uint32) << 16).view(np.float32)
            else:
                x = x32.astype(io)
                x32 = x.astype(np.float32)
                y = mlp._kernel(io).run(x, poison=True).astype(np.float32)
            ref = mlp._net.forward_cpu(x32)
            err = rel_err(y, ref)
            assert np.isfinite(y).all() and err < 5e-2, (widths, prec, io, err)
            graph_launches += 1
print(f"ran {graph_launches} graph launches: {len(GRAPHS)} graphs x 3 compute dtypes x 3 I/O dtypes: OK")

# The sm_90a warpgroup kernel (on an sm_90 GPU): every warpgroup count, own-input residuals, both 16-bit compute
# dtypes, tail rows; built explicitly so tuning choices cannot leave it out.
wg_launches = 0
if fusedmlp._api._gpu(0).info["arch"] == 90:
    for widths, residual in (([32, 64, 64, 64, 64, 16], {2: "mul"}), ([3, 64, 128, 96, 64, 32, 16, 4], None),
                             ([64, 128, 128, 128, 64], {1: "add", 2: ("add", "relu")}), ([5, 256, 9], None)):
        ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
        bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
        for prec, warps in (("float16", 4), ("bfloat16", 8), ("float16", 12), ("float16", 16)):
            mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual=residual, dtype=prec, device="cuda")
            try:
                kernel, plan = mlp._build("float32", wgmma=1, warps=warps)[:2]
            except fusedmlp.LimitError:
                continue
            x = rng.standard_normal((300, widths[0])).astype(np.float32)
            y = kernel.run(x, poison=True)
            ref = mlp._net.forward_cpu(x)
            err = rel_err(y, ref)
            assert plan.info["wgmma"] == 1 and np.isfinite(y).all() and err < 5e-2, (widths, prec, warps, err)
            wg_launches += 1
    assert wg_launches >= 10, wg_launches  # (a few warp counts do not fit some of these networks' buffers)
print(f"ran {wg_launches} sm_90a wgmma launches: OK")
