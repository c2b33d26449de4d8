"""Chain and per-kernel times of a workload at 2^21 rows under this process's FUSEDMLP_GEMM_* environment."""
import os, sys, statistics, torch
from fusedmlp import probe
rows = 1 << 21
name, dtype = sys.argv[1].split(":")
wl = probe.workload(name)
x = torch.randn(rows, wl.widths[0], device="cuda", dtype=torch.float16)
y = torch.empty(rows, wl.widths[-1], device="cuda", dtype=torch.float16)
stream = torch.cuda.current_stream().cuda_stream
mlp = probe.model(wl, dtype=dtype)
if dtype != "float16":
    mlp.calibrate(x[:4096].float().cpu().numpy())
chain = mlp._kernel("float16", rows=rows)
def timed(fn, reps=5):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return min(t)
tot = statistics.median(timed(lambda: chain.launch(x.data_ptr(), y.data_ptr(), rows, stream)) for _ in range(5))
per = []
if hasattr(chain, "program"):
    steps, base, _ = chain.program(rows, stream)
    where = {-1: x.data_ptr(), -2: 0, -3: y.data_ptr()}
    for k, *ops, _ in steps:  # (the last: after, a dependent launch)
        a, b, a1, r = (where.get(c, base + c) for c in ops)
        per.append(round(timed(lambda: k.launch(a, b, rows, stream, a1, r)), 3))
print(f"{name:8s} {dtype:8s} WS={os.environ.get('FUSEDMLP_GEMM_WS')} total {tot:.3f} ms per kernel {per}", flush=True)
