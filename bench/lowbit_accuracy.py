"""Low-bit accuracy without a GPU (issue 26): the CPU path's emulation of the int8 / float8 kernels (csrc/ref.c,
the same codes and roundings) against the float network, on the benchmark workloads and on random graphs.

    python bench/lowbit_accuracy.py > bench/results/lowbit-cpu-emulation.txt

Weights: PyTorch's default initialisation (U(+-1/sqrt(fan_in)), weights and biases); inputs N(0, 1); calibrated on
4096 rows, measured on 8192 others. Random graphs: tests/test_lowbit.py's generator (residuals from any earlier value,
input concats, gain 1.7), calibrated on 512 rows, measured on 1000. "x kept" reruns the workloads' emulation with the
network input not quantised (what a 16-bit first layer input would give), the issue's question whether the first layer
needs 16 bits.
"""

import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fusedmlp  # noqa: E402
import test_lowbit as emulation  # noqa: E402
from conftest import rel_l2  # noqa: E402
from fusedmlp import bench  # noqa: E402

LOWBIT = fusedmlp.LOWBIT_PRECISIONS


def workload_model(wl, dtype, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    ws, bs = [], []
    for fan_in, out in zip(wl.layer_inputs(), wl.widths[1:]):
        bound = 1 / np.sqrt(fan_in)
        ws.append(rng.uniform(-bound, bound, (out, fan_in)).astype(np.float32))
        bs.append(rng.uniform(-bound, bound, out).astype(np.float32) if wl.bias else None)
    cal = rng.standard_normal((4096, wl.widths[0])).astype(np.float32)
    x = rng.standard_normal((8192, wl.widths[0])).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu", **bench.fused_options(wl)).calibrate(cal)
    return mlp, ws, bs, x


def without_input_quantisation(mlp, ws, bs, x, dtype):
    """The NumPy emulation with x passed through unquantised (its first fake_quant call)."""
    original, calls = emulation.fake_quant, [0]

    def fake_quant(v, scale, dt):
        calls[0] += 1
        return np.asarray(v, np.float32).astype(np.float64) if calls[0] == 1 else original(v, scale, dt)

    emulation.fake_quant = fake_quant
    try:
        return emulation.emulate(x, ws, bs, mlp, dtype, mlp.act_scales)
    finally:
        emulation.fake_quant = original


def workloads():
    print("workload | int8 | int8, x kept | float8 | float8, x kept   (relative L2 against the float network)")
    for name, wl in bench.WORKLOADS.items():
        if max(wl.widths) > fusedmlp._core.MAX_FUSED_WIDTH:
            print(f"{name} | 8-bit networks run as one fused kernel (layers up to 256 features): not taken")
            continue
        row = [name]
        for dtype in LOWBIT:
            mlp, ws, bs, x = workload_model(wl, dtype)
            ref = mlp._net.forward_cpu(x, quantised=False).astype(np.float64)
            row.append(f"{rel_l2(mlp(x), ref):.1e}")
            row.append(f"{rel_l2(without_input_quantisation(mlp, ws, bs, x, dtype), ref):.1e}"
                       if wl.norm == "none" else "-")
        print(" | ".join(row))


def graphs(n=200):
    rng = np.random.default_rng(2026)
    errors = {d: [] for d in LOWBIT}
    for _ in range(n):
        ws, bs, acts, residual, concat = emulation.random_graph(rng)
        cal = rng.standard_normal((512, ws[0].shape[1])).astype(np.float32)
        x = rng.standard_normal((1000, ws[0].shape[1])).astype(np.float32)
        for dtype in LOWBIT:
            mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, dtype=dtype,
                                    device="cpu").calibrate(cal)
            errors[dtype].append(rel_l2(mlp(x), mlp._net.forward_cpu(x, quantised=False).astype(np.float64)))
    for dtype, e in errors.items():
        e = np.array(e)
        print(f"{n} random graphs, {dtype}: median {np.median(e):.1e}, p99 {np.quantile(e, 0.99):.1e}, "
              f"max {e.max():.1e}; check=True bound {fusedmlp.CHECK_TOLERANCES[dtype]}")


if __name__ == "__main__":
    warnings.simplefilter("ignore", RuntimeWarning)  # calibrate's over-the-bound warnings: the numbers say it
    workloads()
    graphs()
