"""Residual epilogues y = then(act(W x + b) op x) on the CPU path (CI) and their kernels' compiles."""

import math

import numpy as np
import pytest

import fusedmlp
from conftest import rel_l2, torch_init

ERF = np.vectorize(math.erf)
NUMPY_ACTS = {"none": lambda z: z, "relu": lambda z: np.maximum(z, 0), "tanh": np.tanh,
              "gelu": lambda z: 0.5 * z * (1 + ERF(z / math.sqrt(2))), "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
              "silu": lambda z: z / (1 + np.exp(-z))}


def numpy_forward(x, ws, bs, acts, residual):
    h = x.astype(np.float64)
    for w, b, act, res in zip(ws, bs, acts, residual):
        y = h @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64))
        y = NUMPY_ACTS[act](y)
        if res is not None:
            op, then = res if isinstance(res, tuple) else (res, "none")
            y = NUMPY_ACTS[then](y + h if op == "add" else y * h)
        h = y.astype(np.float32).astype(np.float64)  # float32 storage between layers, as the CPU path keeps
    return h


def random_residual_net(rng, depth):
    width = int(rng.choice([3, 16, 48, 64, 100, 128, 256]))
    widths = [int(rng.integers(1, 40))] + [width] * depth + [int(rng.integers(1, 20))]
    acts = [str(rng.choice(list(NUMPY_ACTS))) for _ in range(depth)] + ["none"]
    residual = [None]
    for _ in range(depth - 1):
        r = rng.random()
        residual.append(None if r < 0.25 else "add" if r < 0.6 else ("add", "relu") if r < 0.8 else
                        ("mul", str(rng.choice(["none", "tanh", "sigmoid"]))))
    residual.append(None)
    return widths, acts, residual


@pytest.mark.parametrize("seed", range(12))
def test_cpu_path_matches_numpy_on_random_residual_networks(seed):
    rng = np.random.default_rng(seed)
    widths, acts, residual = random_residual_net(rng, int(rng.integers(2, 6)))
    ws, bs = torch_init(rng, widths, bool(seed % 2))
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, device="cpu")
    x = rng.standard_normal((77, widths[0])).astype(np.float32)
    assert rel_l2(mlp(x), numpy_forward(x, ws, bs, acts, residual)) <= 1e-6


def test_resnet_mlp_matches_the_torch_module():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(128, 128)

        def forward(self, x):
            return x + nn.functional.gelu(self.linear(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), *[Block() for _ in range(4)], nn.Linear(128, 64)).double()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    mlp = fusedmlp.FusedMLP([m.weight.detach().float().numpy() for m in linears],
                            [m.bias.detach().float().numpy() for m in linears], activation="gelu",
                            residual={1: "add", 2: "add", 3: "add", 4: "add"}, device="cpu")
    x = torch.randn(200, 64, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x).numpy()
    assert rel_l2(mlp(x.float().numpy()), ref) <= 1e-6


@pytest.mark.parametrize("residual, error, match", [
    ({0: "add"}, fusedmlp.ShapeError, "layer 0 has 8 output features but its residual operand, the network input, has "
                                      "4; a residual needs equal widths"),
    ({5: "add"}, fusedmlp.ArgumentError, "residual names layer 5; the network has layers 0..2"),
    ({1: "sub"}, fusedmlp.ArgumentError, "residual op of layer 1 is 'sub'; it must be 'add' or 'mul'"),
    ({1: ("add", "nope")}, fusedmlp.ExpressionError, "residual activation of layer 1: unknown name 'nope'"),
    ({1: ("add", 3)}, fusedmlp.ArgumentError, "residual 'then' of layer 1 is 3"),
    ([None, "add"], fusedmlp.ArgumentError, "residual has 2 entries; the network has 3 layers"),
    ("add", fusedmlp.ArgumentError, "must be None, a dict"),
])
def test_bad_residuals_name_the_layer_and_rule(residual, error, match):
    ws, bs = torch_init(np.random.default_rng(0), [4, 8, 8, 2])
    with pytest.raises(error, match=match):
        fusedmlp.FusedMLP(ws, bs, residual=residual, device="cpu")


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_residual_kernels_compile(arch, tmp_path):
    # in place (res128's shape), residual in the last layer (two buffers), and streamed multi-chunk 256-wide layers
    cases = [([64, 128, 128, 128, 64], {1: "add", 2: ("add", "relu")}), ([32, 48, 48], {1: ("mul", "tanh")}),
             ([256, 256, 256, 256], {0: "add", 2: ("add", "sigmoid")})]
    for widths, residual in cases:
        ws, bs = torch_init(np.random.default_rng(1), widths)
        mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual=residual, device="cpu", cache_dir=tmp_path)
        path = mlp.compile(arch, "float16")
        with open(path, "rb") as f:
            assert b"\x7fELF" in f.read()
        ops = {1 if (r if isinstance(r, str) else r[0]) == "add" else 2 for r in residual.values()}
        assert all(f"RES = {op}, RES_BUF = " in mlp.source for op in ops)
        assert "static __device__ __forceinline__ float post(float x)" in mlp.source
