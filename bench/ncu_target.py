"""Runs one workload's fused kernel a few times, for ncu / compute-sanitizer to observe (not named profile.py: that
shadows the standard library module when scripts run from bench/).

    ncu --kernel-name fusedmlp_forward --launch-skip 2 --launch-count 1 python bench/ncu_target.py tcnn64 2097152
    python bench/ncu_target.py tcnn64 2097152 warps=4 m_tiles=2       # a forced tile shape

Workload names and weights are fusedmlp.probe's (the benchmark's workloads and probe.EXTRA, fixed random weights).
"""

import sys

import torch

from fusedmlp import probe

name = sys.argv[1] if len(sys.argv) > 1 else "tcnn64"
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 21
options = probe.parse_plan(",".join(sys.argv[3:]))
wl = probe.workload(name)
mlp = probe.model(wl)
kernel = mlp._build("float16", **options)[0] if options else mlp._kernel("float16")
x = torch.randn(rows, wl.widths[0], device="cuda", dtype=torch.float16)
y = torch.empty(rows, wl.widths[-1], device="cuda", dtype=torch.float16)
for _ in range(5):
    kernel.launch(x.data_ptr(), y.data_ptr(), rows, torch.cuda.current_stream().cuda_stream)
torch.cuda.synchronize()
print(name, rows, options, kernel.info, "mean |y|", float(y.float().abs().mean()))
