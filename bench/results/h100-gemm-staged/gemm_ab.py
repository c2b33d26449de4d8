"""A/B of gemm_layer.cu: a workload's chain built from base templates (A) and the working tree's (B), same plans;
output bits compared, whole-chain and per-kernel times (CUDA events, median of alternating rounds)."""
import sys, statistics, torch, numpy as np
from fusedmlp import probe
rows = 1 << 21
base, spec = sys.argv[1], sys.argv[2]
name, dtype = spec.split(":")
wl = probe.workload(name)
x = torch.randn(rows, wl.widths[0], device="cuda", dtype=torch.float16)
stream = torch.cuda.current_stream().cuda_stream
def timed(fn, reps=5):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return min(t)
chains, ys = [], []
for folder in (base, None):
    with probe.templates_from(folder):
        mlp = probe.model(wl, dtype=dtype)
        if dtype != "float16":
            mlp.calibrate(x[:4096].float().cpu().numpy())
        chain = mlp._kernel("float16", rows=rows)
    y = torch.full((rows, wl.widths[-1]), float("nan"), device="cuda", dtype=torch.float16)
    chain.launch(x.data_ptr(), y.data_ptr(), rows, stream)
    torch.cuda.synchronize()
    chains.append((mlp, chain)); ys.append(y)
same = torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
nan = bool(torch.isnan(ys[1]).any())
tot, per = [[], []], [[], []]
for r in range(5):
    for i, (mlp, chain) in enumerate(chains):
        tot[i].append(timed(lambda: chain.launch(x.data_ptr(), ys[i].data_ptr(), rows, stream)))
        if hasattr(chain, "program"):
            steps, wsbase, _ = chain.program(rows, stream)
            where = {-1: x.data_ptr(), -2: 0, -3: ys[i].data_ptr()}
            p = []
            for k, *ops, _ in steps:  # (the last: after, a dependent launch)
                a, b, a1, rr = (where.get(c, wsbase + c) for c in ops)
                p.append(timed(lambda: k.launch(a, b, rows, stream, a1, rr), 3))
            per[i].append(p)
med = [statistics.median(t) for t in tot]
perm = [[round(statistics.median(col), 3) for col in zip(*p)] if p else [] for p in per]
print(f"{name:8s} {dtype:8s} bits {'same' if same else 'DIFFER'} nan {nan}  A {med[0]:.3f} ms  B {med[1]:.3f} ms "
      f"({med[1] / med[0]:.3f})  per kernel A {perm[0]}  B {perm[1]}", flush=True)
