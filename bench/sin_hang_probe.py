"""Which kernel of test_branch_free_sin_stays_within_16_bit_rounding_below_its_far_bound hangs (session 9: that test
hung three times on the H100, its kernels' SASS identical to session 8's, where it passed). Each (act, options) runs
in its own process with a time limit; prints done / HANG / the error per kernel and batch.

    python bench/sin_hang_probe.py [seconds per kernel]
"""
import subprocess
import sys

CHILD = r'''
import sys, numpy as np, fusedmlp
act, opt, part = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
x = np.arange(0, 0x7c00, dtype=np.uint16).view(np.float16).astype(np.float32)
x = x[x <= 1100]
x = {"all": np.concatenate([x, -x]), "near": x[x < 1024], "far": x[x >= 1024]}[part][:, None]
w0 = np.ones((128, 1), np.float32); w1 = np.zeros((1, 128), np.float32); w1[0, 0] = 1.0
mlp = fusedmlp.FusedMLP([w0, w1], None, activation=[act, "none"], device="cuda")
kernel, plan = mlp._build("float32", **opt)[:2]
print(plan.info["cluster"], plan.info["warps"], end=" ", flush=True)
y = kernel.run(x, poison=True)
err = np.abs(y[:, 0].astype(np.float64) - getattr(np, act)(x[:, 0].astype(np.float64))).max()
print(f"rows {len(x)} max err {err:.2e}", flush=True)
'''

limit = float(sys.argv[1]) if len(sys.argv) > 1 else 30
for act in ("sin", "cos"):
    for opt in ('{"wgmma": 1, "cluster": -1, "warps": 4}', '{"cluster": 1}', '{"cluster": 2}'):
        for part in ("near", "far", "all"):
            try:
                r = subprocess.run([sys.executable, "-c", CHILD, act, opt, part], capture_output=True, text=True,
                                   timeout=limit)
                what = r.stdout.strip() if r.returncode == 0 else "ERROR " + r.stderr.strip()[-300:]
            except subprocess.TimeoutExpired as e:
                what = f"HANG (> {limit:.0f} s) " + (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
            print(f"{act} {opt} {part}: {what}", flush=True)
