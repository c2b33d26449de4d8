"""Per-layer kernel times of 8-bit GEMM chains (wide512, rec1024) at 2^21 rows, per GEMM option set."""
import sys, torch, numpy as np
from fusedmlp import probe, _segments
rows = 1 << 21
def timed(fn, reps=10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(); torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return float(np.median(t))
for name in sys.argv[1:]:
    wl = probe.workload(name)
    x = torch.randn(rows, wl.widths[0], device="cuda", dtype=torch.float16)
    y = torch.empty(rows, wl.widths[-1], device="cuda", dtype=torch.float16)
    for dtype in ("float16", "float8", "int8"):
        for opts in (({},) if dtype == "float16" else ({}, {"bn": 128})):
            try:
                mlp = probe.model(wl, dtype=dtype)
                mlp._segment_policy = "resident"
                if dtype != "float16":
                    mlp.calibrate(x[:4096].float().cpu().numpy())
                mlp._gemm_options = dict(opts)
                chain = mlp._kernel("float16", rows=rows)
                stream = torch.cuda.current_stream().cuda_stream
                total = timed(lambda: chain.launch(x.data_ptr(), y.data_ptr(), rows, stream))
                per = []
                if hasattr(chain, "program"):
                    steps, base, _ = chain.program(rows, stream)
                    where = {-1: x.data_ptr(), -2: 0, -3: y.data_ptr()}
                    for k, *ops, _ in steps:  # (the last: after, a dependent launch)
                        a, b, a1, r = (where.get(c, base + c) for c in ops)
                        per.append(round(timed(lambda: k.launch(a, b, rows, stream, a1, r)), 3))
                print(f"{name:8s} {dtype:8s} {str(opts):28s} total {total:7.3f} ms  per kernel {per}", flush=True)
            except Exception as ex:
                print(f"{name:8s} {dtype:8s} {str(opts):28s} error {type(ex).__name__}: {str(ex)[:200]}", flush=True)
