"""Launches each cluster-form kernel of bench/sanitize_target.py's networks once, printing a label before each, so that
compute-sanitizer's racecheck reports (printed as each kernel completes) can be told apart:

    compute-sanitizer --tool racecheck python bench/race_cases.py [N | i,j,..]
    compute-sanitizer --tool racecheck python bench/race_cases.py 2-256-256-256 sin float32 cluster=2,warps=8 [launches]

(N: the first N cases; i,j,..: those cases. The second form builds and launches one kernel alone, so that no report
can come from another kernel of the process.) The last two cases have a last layer wider than 16 columns, split over
the cluster (each CTA computes and stores its share of y's columns; the last exchange goes to every CTA).
"""

import sys

import numpy as np

import fusedmlp

CASES = [([2, 256, 256, 3], "sin"), ([17, 33, 129, 255, 1], "sigmoid"), ([256, 256, 256, 256], "x * tanh(softplus(x))"),
         ([2, 256, 256, 256], "sin"), ([64, 256, 256, 40], "tanh")]
FORMS = ({"wgmma": 1, "warps": 8}, {"wgmma": 1, "warps": 4}, {"cluster": 4}, {"cluster": 2}, {"cluster": 1})


def model(widths, act, rng):
    ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    return fusedmlp.FusedMLP(ws, bs, activation=act, device="cuda")


def run(mlp, widths, act, dtype, options, rng, launches=1):
    """Builds mlp's kernel with the forced plan options, launches it on 300 random rows and prints its error."""
    kernel, plan = mlp._build(dtype, **options)[:2]
    print(f"--- {widths} {act} {dtype} {options} -> cluster {plan.info['cluster']} warps {plan.info['warps']}",
          flush=True)
    x = rng.standard_normal((300, widths[0])).astype(dtype)
    for _ in range(launches):
        y = kernel.run(x, poison=True)
    err = np.linalg.norm(y.astype(np.float64) - mlp._net.forward_cpu(x.astype(np.float32))) / np.linalg.norm(y)
    print(f"    rel err {err:.2e}", flush=True)


rng = np.random.default_rng(0)
if len(sys.argv) > 4:  # one kernel: widths, activation, I/O dtype, plan options[, launches]
    widths = [int(v) for v in sys.argv[1].split("-")]
    options = {k: int(v) for k, v in (item.split("=") for item in sys.argv[4].split(",") if item)}
    run(model(widths, sys.argv[2], rng), widths, sys.argv[2], sys.argv[3], options, rng,
        int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    sys.exit()
if len(sys.argv) > 1:
    pick = sys.argv[1]
    CASES = [CASES[int(i)] for i in pick.split(",")] if "," in pick else CASES[: int(pick)]
for widths, act in CASES:
    mlp = model(widths, act, rng)
    for dtype in ("float32", "float16"):
        for options in FORMS:
            try:
                run(mlp, widths, act, dtype, options, rng)
            except fusedmlp.LimitError:
                continue
