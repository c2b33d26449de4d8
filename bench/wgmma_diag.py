"""Isolates which layer shapes the sm_90a kernel gets wrong: each network with wgmma forced on and off, vs float64.

python bench/wgmma_diag.py  (on an sm_90 GPU)
"""
import numpy as np

import fusedmlp

NETS = [[16, 128, 16], [16, 192, 16], [16, 240, 16], [16, 256, 16], [16, 16, 256], [256, 16], [16, 256],
        [256, 256], [16, 64, 256, 16], [64, 256, 64], [16, 144, 16], [16, 176, 16], [16, 208, 16], [16, 224, 16]]


def main():
    rng = np.random.default_rng(0)
    for widths in NETS:
        ws = [(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
        mlp = fusedmlp.FusedMLP(ws, None, activation="relu", device="cuda")
        x = rng.standard_normal((4096, widths[0])).astype(np.float32)
        ref = x.astype(np.float64)
        for l, w in enumerate(ws):
            ref = ref @ w.T.astype(np.float64)
            if l < len(ws) - 1:
                ref = np.maximum(ref, 0)
        row = []
        for opts in ({"wgmma": 0}, {"wgmma": 1, "warps": 4}, {"wgmma": 1, "warps": 8}):
            try:
                kernel, plan = mlp._build("float32", **opts)[:2]
            except fusedmlp.LimitError:
                row.append(f"{opts}: limit")
                continue
            y = kernel.run(x, poison=True)
            err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
            bad = np.argwhere(~(np.abs(y - ref) <= 1e-2 * np.abs(ref).max()))
            where = f" first bad (row, col) {tuple(bad[0])}, bad cols {sorted(set(bad[:, 1].tolist()))[:12]}" if len(bad) else ""
            row.append(f"{opts}: {err:.2e}{where}")
        print(widths, " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
