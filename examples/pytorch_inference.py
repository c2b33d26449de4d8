"""Swap a trained PyTorch MLP for fusedmlp's fused kernel inside a bigger model.

    python examples/pytorch_inference.py

Trains a small model for a few steps (GPU if present, else CPU), replaces its MLP with fusedmlp.torch.FusedModule,
and prints the largest difference and the speed-up. On the CPU the fused module runs fusedmlp's CPU path, so the
speed-up is only meaningful on a GPU.
"""

import time

import torch
from torch import nn

import fusedmlp.torch

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.mlp(torch.tanh(self.embed(x)))


model = Model().to(device)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(200):  # learn f(x) = sin(x0) * x1 + x2^2 for a few steps
    x = torch.rand(1024, 3, device=device) * 2 - 1
    target = (torch.sin(3 * x[:, 0]) * x[:, 1] + x[:, 2] ** 2)[:, None]
    loss = nn.functional.mse_loss(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"trained 200 steps on {device}: loss {loss.item():.4f}")

model.eval()
x = torch.rand(1 << 16, 3, device=device) * 2 - 1
with torch.inference_mode():
    reference = model(x)
    original = model.mlp
    model.mlp = fusedmlp.torch.FusedModule(original)  # same call, same dtypes, same state_dict keys
    fused = model(x)
print(f"max abs difference: {(fused - reference).abs().max().item():.2e} (fp16 activations on the GPU)")


def bench(fn, reps=50):
    with torch.inference_mode():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


h = torch.tanh(model.embed(x)).detach()
t_torch, t_fused = bench(lambda: original(h)), bench(lambda: model.mlp(h))
print(f"MLP on {len(x)} rows: PyTorch {t_torch * 1e3:.3f} ms, fusedmlp {t_fused * 1e3:.3f} ms, "
      f"speed-up {t_torch / t_fused:.2f}x")
