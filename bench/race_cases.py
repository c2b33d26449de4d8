"""Launches each cluster-form kernel of bench/sanitize_target.py's networks once, printing a label before each, so that
compute-sanitizer's racecheck reports (printed as each kernel completes) can be told apart:

    compute-sanitizer --tool racecheck python bench/race_cases.py [N | i,j,..]

(N: the first N cases; i,j,..: those cases.) The last two have a last layer wider than 16 columns, split over the
cluster (each CTA computes and stores its share of y's columns; the last exchange goes to every CTA).
"""

import sys

import numpy as np

import fusedmlp

CASES = [([2, 256, 256, 3], "sin"), ([17, 33, 129, 255, 1], "sigmoid"), ([256, 256, 256, 256], "x * tanh(softplus(x))"),
         ([2, 256, 256, 256], "sin"), ([64, 256, 256, 40], "tanh")]
if len(sys.argv) > 1:
    pick = sys.argv[1]
    CASES = [CASES[int(i)] for i in pick.split(",")] if "," in pick else CASES[: int(pick)]
rng = np.random.default_rng(0)
for widths, act in CASES:
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=act, device="cuda")
    for dtype in ("float32", "float16"):
        for options in ({"wgmma": 1, "warps": 8}, {"wgmma": 1, "warps": 4}, {"cluster": 4}, {"cluster": 2},
                        {"cluster": 1}):
            try:
                kernel, plan = mlp._build(dtype, **options)[:2]
            except fusedmlp.LimitError:
                continue
            print(f"--- {widths} {act} {dtype} {options} -> cluster {plan.info['cluster']} warps {plan.info['warps']}",
                  flush=True)
            x = rng.standard_normal((300, widths[0])).astype(dtype)
            y = kernel.run(x, poison=True)
            err = np.linalg.norm(y.astype(np.float64) - mlp._net.forward_cpu(x.astype(np.float32))) / np.linalg.norm(y)
            print(f"    rel err {err:.2e}", flush=True)
            sys.stdout.flush()
