"""One cluster-form kernel built and launched once in a fresh process, for compute-sanitizer racecheck:

    compute-sanitizer --tool racecheck python bench/race_one.py 2-256-256-256 sin float32 cluster=2,warps=8 [launches]

(so that a hazard report cannot come from another kernel of the same process).
"""

import sys

import numpy as np

import fusedmlp

widths = [int(v) for v in sys.argv[1].split("-")]
act, dtype = sys.argv[2], sys.argv[3]
options = {k: int(v) for k, v in (item.split("=") for item in sys.argv[4].split(",") if item)}
launches = int(sys.argv[5]) if len(sys.argv) > 5 else 1
rng = np.random.default_rng(0)
ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
mlp = fusedmlp.FusedMLP(ws, bs, activation=act, device="cuda")
kernel, plan = mlp._build(dtype, **options)[:2]
print(f"--- {widths} {act} {dtype} {options} -> cluster {plan.info['cluster']} warps {plan.info['warps']}", flush=True)
x = rng.standard_normal((300, widths[0])).astype(dtype)
for _ in range(launches):
    y = kernel.run(x, poison=True)
err = np.linalg.norm(y.astype(np.float64) - mlp._net.forward_cpu(x.astype(np.float32))) / np.linalg.norm(y)
print(f"    rel err {err:.2e}", flush=True)
