"""FusedMLP.set_weights on the GPU: after new weights, every kernel the model had loaded (fused, streamed, a chain's
GEMMs, row passes and fused stretches, 8-bit ones, the small-batch forms) gives the bits of a model built fresh from
them, a CUDA graph captured before replays them, and FusedModule follows optimizer steps through it. Marked `gpu`."""

import numpy as np
import pytest

import fusedmlp
from conftest import graph_weights, reference, rel_l2, torch_init

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

ROWS = (1, 100, 5000)  # (one row and 100 rows take the small-batch kernels and chains, 5000 the default ones)

# name: widths, FusedMLP kwargs (every form a network of these takes on an H100)
CASES = {
    "fused_residual": ([24, 64, 64, 64, 8], dict(activation="silu", residual={1: "add", 2: ("mul", "none", 0)})),
    "norm_streamed": ([64, 256, 256, 256, 16], dict(activation="silu", norm={0: "layernorm", 1: "layernorm",
                                                                              2: "rmsnorm"})),
    "concat": ([63] + [256] * 6 + [4], dict(activation="relu", concat={4: "before"})),
    "chain_norms": ([64, 512, 512, 64, 10], dict(activation="gelu", norm={0: "layernorm", 1: "rmsnorm"},
                                                 output_activation="softmax")),
    "rec": ([256, 1024, 512, 256, 1], dict(activation="relu")),
    "int8_chain": ([64, 300, 64, 8], dict(activation="gelu", norm={0: "layernorm"}, dtype="int8")),
    "float8": ([32, 128, 128, 16], dict(activation="relu", dtype="float8")),
    "sine_rebuilt": ([2, 128, 128, 3], dict(activation=["sin(30 * x)", "sin(x)"])),
}


def arrays(rng, widths, kwargs, scale=1.0):
    ws, _ = graph_weights(rng, widths, kwargs.get("concat") or {}, scale)
    bs = [rng.uniform(-0.1, 0.1, n).astype(np.float32) for n in widths[1:]]
    norm = {l: (n, rng.uniform(0.5, 1.5, widths[l + 1]).astype(np.float32),
                rng.normal(0, 0.3, widths[l + 1]).astype(np.float32)) for l, n in (kwargs.get("norm") or {}).items()}
    return ws, bs, norm or None


@pytest.mark.parametrize("name", list(CASES))
def test_new_weights_give_the_bits_of_a_fresh_model(name):
    widths, kwargs = CASES[name]
    arch = fusedmlp._api._gpu(0).info["arch"]
    if kwargs.get("dtype") == "float8" and arch < 89:
        pytest.skip("float8 needs sm_89")
    rng = np.random.default_rng(sum(map(ord, name)))
    ws, bs, norm = arrays(rng, widths, kwargs)
    model = fusedmlp.FusedMLP(ws, bs, device="cuda", **{**kwargs, "norm": norm})
    sample = rng.standard_normal((512, widths[0])).astype(np.float32)
    if model._precision in ("int8", "float8"):
        model.calibrate(sample)
    xs = {rows: torch.from_numpy(rng.standard_normal((rows, widths[0])).astype(np.float32)).cuda().half()
          for rows in ROWS}
    before = {rows: model(x) for rows, x in xs.items()}  # (every kernel these calls take, loaded)
    ws2, bs2, norm2 = arrays(rng, widths, kwargs, scale=200.0 if name == "sine_rebuilt" else 1.0)
    in_place = model.set_weights(ws2, bs2, norm=norm2)
    assert in_place == (name != "sine_rebuilt")  # (sine arguments past 400 take another form: rebuilt)
    fresh = fusedmlp.FusedMLP(ws2, bs2, device="cuda", **{**kwargs, "norm": norm2})
    if model._precision in ("int8", "float8"):
        fresh._set_act_scales(model.act_scales)
    for rows, x in xs.items():
        y, want = torch.full_like(before[rows], float("nan")), fresh(x)
        model(x, out=y)
        assert torch.equal(y, want), (rows, (y.float() - want.float()).abs().max().item())
        assert not torch.equal(y, before[rows]) or rows == 1 and widths[-1] == 1
    if name == "rec":  # (and the fresh model's bits are right: against float64)
        x = xs[5000].float().cpu().numpy()
        want, _ = reference(x, ws2, bs2, ["relu"] * (len(ws2) - 1) + ["none"])
        assert rel_l2(model(xs[5000]).float().cpu().numpy(), want) <= 5e-3


@pytest.mark.parametrize("widths", [[24, 64, 64, 8], [64, 512, 512, 64]])
def test_a_cuda_graph_captured_before_replays_the_new_weights(widths):
    rng = np.random.default_rng(len(widths) + widths[1])
    ws, bs = torch_init(rng, widths)
    model = fusedmlp.FusedMLP(ws, bs, activation="gelu", device="cuda")
    x = torch.randn(3000, widths[0], device="cuda", dtype=torch.float16)
    y = torch.empty(3000, widths[-1], device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x, out=y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        model(x, out=y)
    ws2, bs2 = torch_init(rng, widths)
    assert model.set_weights(ws2, bs2)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = fusedmlp.FusedMLP(ws2, bs2, activation="gelu", device="cuda")(x)
    assert torch.equal(y, want)


def test_fused_module_follows_optimizer_steps_in_place_on_cuda():
    import fusedmlp.torch as ft

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(17, 256), nn.LayerNorm(256), nn.SiLU(), nn.Linear(256, 256), nn.LayerNorm(256),
                          nn.SiLU(), nn.Linear(256, 6)).cuda()
    fused = ft.FusedModule(model)
    compiled = torch.compile(fused, fullgraph=True)
    mlp = fused._mlp
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 17, device="cuda")
    for step in range(4):
        with torch.no_grad():
            want = model(x).double()
            for y in (fused(x), compiled(x)):
                err = ((y.double() - want).norm() / want.norm()).item()
                assert err <= 5e-3, (step, err)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert fused._mlp is mlp  # every step in place
