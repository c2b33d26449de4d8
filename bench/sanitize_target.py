"""Builds and runs >= 20 generated kernels once each with few rows, for compute-sanitizer (memcheck, racecheck,
synccheck) to observe: every template path (resident and streamed weights, one and two activation buffers,
small- and large-tile variants), tail rows, odd widths, fp32 and fp16 I/O. Exits non-zero on a wrong result.

    compute-sanitizer --tool memcheck --error-exitcode 1 python bench/sanitize_target.py
"""

import numpy as np

import fusedmlp

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
            err = np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
            assert np.isfinite(y).all() and err < 5e-2, (widths, act, variant_rows, err)
            count += 1
kernels = len({id(k) for k in KERNELS})
print(f"ran {count} launches: {len(CASES)} networks x 2 dtypes x 2 tile variants, {kernels} distinct kernels (a variant "
      "that does not fit a network falls back to its default kernel): OK")
