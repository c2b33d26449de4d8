"""Runs one workload's fused kernel a few times, for ncu / compute-sanitizer to observe (not named profile.py: that
shadows the standard library module when scripts run from bench/).

    ncu --kernel-name fusedmlp_forward --launch-skip 2 --launch-count 1 python bench/ncu_target.py tcnn64 2097152
    python bench/ncu_target.py tcnn64 2097152 warps=4 m_tiles=2       # a forced tile shape
"""

import sys

import numpy as np
import torch

from fusedmlp.bench import WORKLOADS  # noqa: E402  name -> Workload(widths, activation, bias)

import fusedmlp  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "tcnn64"
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 21
options = {k: int(v) for k, v in (kv.split("=") for kv in sys.argv[3:])}
wl = WORKLOADS[name]
widths, act, bias = wl.widths, wl.activation, wl.bias
rng = np.random.default_rng(0)
ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
bs = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) if bias else None for i, o in zip(widths[:-1], widths[1:])]
mlp = fusedmlp.FusedMLP(ws, bs, activation=act, device="cuda")
kernel, plan = mlp._build("float16", **options)[:2] if options else (mlp._kernel("float16"), None)
x = torch.randn(rows, widths[0], device="cuda", dtype=torch.float16)
y = torch.empty(rows, widths[-1], device="cuda", dtype=torch.float16)
for _ in range(5):
    kernel.launch(x.data_ptr(), y.data_ptr(), rows, torch.cuda.current_stream().cuda_stream)
torch.cuda.synchronize()
print(name, rows, options, kernel.info, "mean |y|", float(y.float().abs().mean()))
