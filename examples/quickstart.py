"""fusedmlp in one page: run a PyTorch-layout MLP, see where its kernel went, check it against float64.

    python examples/quickstart.py

On a machine with an NVIDIA GPU this runs the fused kernel; without one it runs the CPU path and still generates and
compiles the kernel for sm_90 ahead of time (that needs NVRTC: `pip install nvidia-cuda-nvrtc`).
"""

import os
import warnings

import numpy as np

import fusedmlp

rng = np.random.default_rng(0)

# Weights as PyTorch stores them: [layer.weight.detach().cpu().numpy() for layer in linears], each (out, in),
# here drawn like nn.Linear's default initialisation.
widths = [32, 64, 64, 64, 16]
weights = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
biases = [rng.uniform(-1, 1, o).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
x = rng.standard_normal((100_000, widths[0])).astype(np.float32)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the "no GPU, using the CPU path" notice: printed below instead
    mlp = fusedmlp.FusedMLP(weights, biases, activation="silu", output_activation="none")
y = mlp(x)
print(mlp)

# The kernel: generated CUDA source beside its CUBIN in the cache. Without a GPU, compile it for an H100 anyway.
if mlp.device == "cpu":
    print("no CUDA GPU here: ran the CPU path")
    try:
        mlp.compile("sm_90")
    except fusedmlp.LibraryNotFoundError as e:
        print(f"(skipping the ahead-of-time compile: {e})")
if mlp.cache_path:
    print(f"kernel CUBIN : {mlp.cache_path}")
    print(f"kernel source: {os.path.splitext(mlp.cache_path)[0]}.cu ({len(mlp.source.splitlines())} lines)")

# Correctness against a float64 forward of the same weights.
h = x.astype(np.float64)
for i, (w, b) in enumerate(zip(weights, biases)):
    h = h @ w.T.astype(np.float64) + b
    if i < len(weights) - 1:
        h = h / (1 + np.exp(-h))  # silu
err = np.linalg.norm(y - h) / np.linalg.norm(h)
print(f"device {mlp.device}: output {y.shape} {y.dtype}, relative L2 error vs float64 = {err:.2e}")
