"""from_torch and from_onnx on random module architectures (CPU path) against torch in float64: residual blocks written
the ways models write them (pre-norm with dropout on one or both paths, post-norm, a norm after the activation, plain
residuals, none), LayerNorm / RMSNorm / an Identity in a norm's place, an input norm, a BatchNorm1d after a Linear, a
final norm and a concat of the input before the head. Each model is read by the fx tracer and, where torch's exporter
writes it (the TorchScript exporter has no RMSNorm at opset 20), from its ONNX graph. A wrong reading (a residual read
from the wrong value, a norm fused where it needs a layer of its own) is far outside the bound: the error of torch's
own float32 forward, a few times over."""

import io
import random
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

import fusedmlp  # noqa: E402
from fusedmlp import torch as ft  # noqa: E402,F401  (fusedmlp.from_torch)

ACTS = (nn.ReLU, nn.Tanh, nn.SiLU, nn.GELU, nn.Sigmoid, nn.Identity, nn.Mish, nn.ELU, lambda: nn.LeakyReLU(0.1))
KINDS = ("pre", "pre_both", "post", "norm_act", "res", "plain")


def _norm(rnd, width):
    return rnd.choice([nn.LayerNorm(width), nn.RMSNorm(width), nn.Identity()])


class _Block(nn.Module):
    def __init__(self, width, kind, rnd):
        super().__init__()
        inner = rnd.choice([width, 2 * width, 24])
        self.kind, self.norm = kind, _norm(rnd, width)
        self.up, self.down = nn.Linear(width, inner), nn.Linear(inner, width, bias=rnd.random() < 0.7)
        self.act, self.out_act = rnd.choice(ACTS)(), rnd.choice(ACTS)()
        self.drop = nn.Dropout(0.1)

    def forward(self, h):
        kind = self.kind
        if kind == "pre":  # h + f(norm(h))
            return h + self.down(self.act(self.up(self.drop(self.norm(h)))))
        if kind == "pre_both":  # dropout on both paths: two calls of one Dropout on h
            return self.drop(h) + self.down(F.silu(self.up(self.norm(self.drop(h)))))
        if kind == "post":  # norm(h + f(h))
            return self.norm(h + self.down(self.act(self.up(h))))
        if kind == "norm_act":  # act(norm(W h)) after a hidden layer
            return self.act(self.norm(self.down(self.act(self.up(h)))))
        if kind == "res":  # act(f(h)) + h
            return self.out_act(self.down(self.act(self.up(h)))) + h
        return self.down(self.act(self.up(h)))


class _Net(nn.Module):
    def __init__(self, rnd):
        super().__init__()
        self.d_in, width, d_out = rnd.choice([3, 7, 16]), rnd.choice([8, 16, 32]), rnd.choice([1, 4, 5])
        self.in_norm = rnd.choice([nn.Identity(), nn.LayerNorm(self.d_in)])
        self.inp = nn.Linear(self.d_in, width)
        self.bn = nn.BatchNorm1d(width) if rnd.random() < 0.3 else nn.Identity()
        self.act = rnd.choice(ACTS)()
        self.blocks = nn.ModuleList(_Block(width, rnd.choice(KINDS), rnd) for _ in range(rnd.randint(1, 3)))
        self.out_norm = rnd.choice([nn.Identity(), nn.LayerNorm(width)])
        self.cat = rnd.random() < 0.3
        self.out = nn.Linear(width + (self.d_in if self.cat else 0), d_out)

    def forward(self, x):
        h = self.act(self.bn(self.inp(self.in_norm(x))))
        for block in self.blocks:
            h = block(h)
        h = self.out_norm(h)
        return self.out(torch.cat([h, x], -1) if self.cat else h)


def _spelled(rnd):
    """An activation function as model code writes it, some spelled out over two values of the layer's output."""
    return rnd.choice([torch.relu, torch.tanh, F.silu, F.gelu, lambda t: t * torch.sigmoid(t), F.softplus,
                       lambda t: F.leaky_relu(t, 0.2), lambda t: torch.clamp(t, -1, 1), lambda t: 0.5 * t,
                       lambda t: F.gelu(t, approximate="tanh"), lambda t: t * torch.tanh(F.softplus(t)),
                       lambda t: 0.5 * t * (1 + torch.erf(t / 1.4142135623730951))])


class _Critic(nn.Module):
    """Q(obs, act): a normalized observation joined with the action, a Linear with a LayerNorm (module or functional,
    normalized_shape read from the value), a weight_norm Linear, a residual or gating product, spelled-out
    activations."""

    def __init__(self, rnd):
        super().__init__()
        self.d_obs, self.d_act, width = rnd.choice([3, 5]), rnd.choice([1, 2]), rnd.choice([16, 32])
        self.register_buffer("mean", torch.randn(self.d_obs))
        self.register_buffer("std", torch.rand(self.d_obs) + 0.5)
        self.l1, self.l3 = nn.Linear(self.d_obs + self.d_act, width), nn.Linear(width, 1)
        self.ln = rnd.choice([nn.LayerNorm(width), nn.Identity()])
        self.l2 = nn.Linear(width, width)
        if rnd.random() < 0.5:
            self.l2 = nn.utils.parametrizations.weight_norm(self.l2)
        self.a1, self.a2 = _spelled(rnd), _spelled(rnd)
        self.gate, self.functional_norm = rnd.random() < 0.3, rnd.random() < 0.3

    def forward(self, obs, act):
        h = self.a1(self.ln(self.l1(torch.cat([(obs - self.mean) / self.std, act], -1))))
        if self.functional_norm:
            h = F.layer_norm(h, h.shape[-1:])
        g = self.a2(self.l2(h))
        return self.l3(g * h if self.gate else g + h)


class _Head(nn.Module):
    """A classifier head: Linear, BatchNorm1d, ReLU, Dropout, Linear, an activation, a scale and shift, a softmax."""

    def __init__(self, rnd):
        super().__init__()
        self.d_in, width = rnd.choice([4, 9]), rnd.choice([16, 24])
        self.body = nn.Sequential(nn.Linear(self.d_in, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(width, width), rnd.choice([nn.Tanh(), nn.GELU()]))
        self.out = nn.Linear(width, rnd.choice([3, 10]))
        self.soft, self.scale = rnd.choice([None, "softmax", "log_softmax"]), rnd.random() < 0.5

    def forward(self, x):
        h = self.body(x)
        z = self.out(h * 2.0 + 1.0 if self.scale else h)
        return torch.softmax(z, -1) if self.soft == "softmax" else F.log_softmax(z, dim=-1) if self.soft else z


def _randomized(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    return model.eval()


def _model(seed):
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    return _randomized(_Net(rnd))


def _onnx_bytes(model, inputs):
    names = ["x", "a"][:len(inputs)]
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # (the TorchScript exporter's deprecation: it still writes these graphs)
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(model, tuple(t[:3] for t in inputs), buf, dynamo=False, input_names=names,
                              output_names=["y"], dynamic_axes={n: {0: "n"} for n in names})
    except Exception:  # (an op the exporter does not write: RMSNorm at opset 20)
        return None
    return buf.getvalue()


def _check(model, inputs, onnx_ok):
    """Reads model by from_torch and (where it exports) from_onnx, each within four times torch's own float32 error
    of its float64 outputs; whether the ONNX graph was read too."""
    with torch.no_grad():
        ref = model.double()(*[t.double() for t in inputs]).numpy()
        model.float()
        bound = 1e-6 + 4 * _rel(model(*inputs).numpy(), ref)  # torch's own float32 error, four times over
    mlps = [("from_torch", fusedmlp.from_torch(model, device="cpu"))]
    data = _onnx_bytes(model, inputs) if onnx_ok else None
    if data is not None:
        mlps.append(("from_onnx", fusedmlp.from_onnx(data, device="cpu")))
    x = torch.cat(inputs, -1).numpy()  # (several inputs: the models take their concatenation)
    for how, mlp in mlps:
        err = _rel(mlp(x), ref)
        assert err <= bound, (how, err, bound, mlp)
    return data is not None


def _rel(y, ref):
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def test_random_module_architectures_read_by_from_torch_and_from_onnx_match_torch_float64():
    onnx_ok = pytest.importorskip("onnx") is not None
    exported = 0
    for seed in range(150):
        model = _model(seed)
        exported += _check(model, [torch.randn(33, model.d_in) * 1.5 + 0.3], onnx_ok)
    assert not onnx_ok or exported >= 50, exported


def test_random_critics_and_heads_read_by_from_torch_and_from_onnx_match_torch_float64():
    """Two-input critics (obs normalized by buffers, joined with the action) with spelled-out activations, functional
    layer norms and weight_norm Linears, and classifier heads with BatchNorm1d and softmaxes."""
    onnx_ok = pytest.importorskip("onnx") is not None
    exported = 0
    for seed in range(80):
        rnd = random.Random(seed)
        torch.manual_seed(seed)
        if rnd.random() < 0.6:
            model = _randomized(_Critic(rnd))
            inputs = [torch.randn(20, model.d_obs), torch.randn(20, model.d_act)]
        else:
            model = _randomized(_Head(rnd))
            inputs = [torch.randn(20, model.d_in) * 2]
        exported += _check(model, inputs, onnx_ok)
    assert not onnx_ok or exported >= 40, exported


OUT_ACTS = (torch.sigmoid, torch.tanh, F.softplus, torch.relu, torch.exp, lambda v: v, lambda v: v * 0.5,
            lambda v: torch.clamp(v, -1, 1), lambda v: 2 * torch.sigmoid(v) - 1)


class _Outputs(nn.Module):
    """A trunk, then outputs the way models hand them back: Linear heads on the trunk's value with activations of
    their own, or one Linear whose output is split (split, chunk, slices, an indexed column) with an activation per
    part; returned as a tuple, a dict or one torch.cat in any order, an Identity-activated trunk layer before them."""

    def __init__(self, rnd):
        super().__init__()
        self.d_in, width = rnd.choice([3, 7]), rnd.choice([16, 32])
        self.trunk = nn.Sequential(nn.Linear(self.d_in, width), rnd.choice(ACTS[:4])(), nn.Linear(width, width))
        self.identity = rnd.random() < 0.3  # (the trunk's last Linear then meets the heads with nothing between)
        self.sizes = [rnd.choice([1, 2, 3]) for _ in range(rnd.choice([2, 3]))]
        self.heads = nn.ModuleList(nn.Linear(width, n) for n in self.sizes) if rnd.random() < 0.5 else None
        self.out = nn.Linear(width, sum(self.sizes))
        self.acts = [rnd.randrange(len(OUT_ACTS)) for _ in self.sizes]
        self.form = rnd.choice(["tuple", "dict", "cat"])
        self.order = rnd.sample(range(len(self.sizes)), len(self.sizes))
        self.split = rnd.choice(["split", "chunk", "slices"]) if self.heads is None else None
        if self.split == "chunk":
            self.sizes = [2] * len(self.sizes)
            self.out = nn.Linear(width, sum(self.sizes))
        self.index = self.split == "slices" and self.form == "dict" and self.sizes[0] == 1

    def forward(self, x):
        h = self.trunk(x)
        h = h if self.identity else torch.tanh(h)
        if self.heads is not None:
            parts = [head(h) for head in self.heads]
        else:
            y = self.out(h)
            if self.split in ("split", "chunk"):  # (indexed: torch.fx's proxies unpack, but do not iterate)
                got = y.split(self.sizes, -1) if self.split == "split" else y.chunk(len(self.sizes), -1)
                parts = [got[i] for i in range(len(self.sizes))]
            else:
                ends = np.cumsum([0] + self.sizes).tolist()
                parts = [y[..., a:b] for a, b in zip(ends[:-1], ends[1:])]
                if self.index:
                    parts[0] = y[:, 0]
        parts = [OUT_ACTS[a](p) for a, p in zip(self.acts, parts)]
        parts = [parts[i] for i in self.order]
        if self.form == "dict":
            return {f"p{i}": p for i, p in enumerate(parts)}
        return tuple(parts) if self.form == "tuple" else torch.cat(parts, -1)


def test_random_heads_and_output_parts_read_by_from_torch_and_from_onnx_match_torch_float64():
    """Each part's activation a column piece of the last layer, its rows in the output's order: from_torch's model
    (FusedModule's tuple or dict) and from_onnx's (the outputs side by side) against torch in float64."""
    from fusedmlp.torch import FusedModule

    onnx_ok = pytest.importorskip("onnx") is not None
    exported = 0
    for seed in range(60):
        rnd = random.Random(seed)
        torch.manual_seed(seed)
        model = _Outputs(rnd).eval()
        x = torch.randn(25, model.d_in)
        with torch.no_grad():
            ref = model.double()(x.double())
            model.float()
            got = FusedModule(model)(x)
        refs = list(ref.values()) if isinstance(ref, dict) else list(ref) if isinstance(ref, tuple) else [ref]
        gots = list(got.values()) if isinstance(got, dict) else list(got) if isinstance(got, tuple) else [got]
        assert len(gots) == len(refs) and all(g.shape == r.shape for g, r in zip(gots, refs)), (seed, model.form)
        flat = torch.cat([r if r.ndim == 2 else r[:, None] for r in refs], -1).numpy()
        for g, r in zip(gots, refs):  # (absolute below 1: a relu part may be all zeros)
            assert np.max(np.abs(g.double().numpy() - r.numpy())) <= 1e-5 * max(1.0, r.abs().max().item()), seed
        data = _onnx_bytes(model, [x]) if onnx_ok else None
        if data is not None:
            got = fusedmlp.from_onnx(data, device="cpu")(x.numpy())
            assert got.shape == flat.shape and np.max(np.abs(got - flat)) <= 1e-5 * max(1.0, np.abs(flat).max()), seed
            exported += 1
    assert not onnx_ok or exported >= 40, exported


class _InlineSwish(nn.Module):
    """SiLU as older code writes it: a module of its own, which torch.fx inlines into x * sigmoid(x)."""

    def forward(self, x):
        return x * torch.sigmoid(x)


class _Stacks(nn.Module):
    """Parallel stacks of Linears on one value (a trunk's output or the input): 2-4 stacks, each 2-4 Linears deep and
    of its own width, one activation between their layers (a module, or one fx inlines into several nodes), each
    with its own after its last one, returned as a tuple or one torch.cat; some Linears without a bias, some stacks
    with a Dropout."""

    TAILS = (lambda y: y, torch.tanh, torch.sigmoid, lambda y: 2.0 * y, F.softplus)

    def __init__(self, rnd):
        super().__init__()
        self.d_in, depth, k = rnd.choice([5, 12]), rnd.randint(2, 4), rnd.randint(2, 4)
        self.trunk = nn.Sequential(nn.Linear(self.d_in, 20), rnd.choice(ACTS)()) if rnd.random() < 0.4 else None
        d0, act = 20 if self.trunk is not None else self.d_in, rnd.choice(ACTS + (_InlineSwish,))
        self.stacks = nn.ModuleList()
        for _ in range(k):
            widths = [d0] + [rnd.choice([8, 16, 24, 32])] * (depth - 1) + [rnd.choice([1, 3])]
            layers = []
            for i in range(depth):
                layers.append(nn.Linear(widths[i], widths[i + 1], bias=rnd.random() < 0.8))
                if i < depth - 1:
                    layers += [act()] + ([nn.Dropout(0.1)] if rnd.random() < 0.2 else [])
            self.stacks.append(nn.Sequential(*layers))
        self.tails = [rnd.randrange(len(self.TAILS)) for _ in range(k)]
        self.as_tuple = rnd.random() < 0.5

    def forward(self, x):
        h = self.trunk(x) if self.trunk is not None else x
        outs = [self.TAILS[t](s(h)) for s, t in zip(self.stacks, self.tails)]
        return tuple(outs) if self.as_tuple else torch.cat(outs, -1)


def test_random_parallel_stacks_read_by_from_torch_and_from_onnx_match_torch_float64():
    """Parallel stacks (_torch_fx_trunks, _onnx_stacks): one block-diagonal chain whose outputs are the stacks', in the
    module's order with their own activations, from the traced module and from its ONNX export."""
    onnx_ok = pytest.importorskip("onnx") is not None

    class Joined(nn.Module):  # (the tuple's parts side by side, as fusedmlp's model gives them)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = self.inner(x)
            return torch.cat(list(out), -1) if isinstance(out, tuple) else out

    exported = 0
    for seed in range(60):
        rnd = random.Random(seed)
        torch.manual_seed(seed)
        model = _Stacks(rnd).eval()
        x = torch.randn(33, model.d_in) * 1.5 + 0.3
        with torch.no_grad():
            ref = Joined(model).double()(x.double()).numpy()
            model.float()
            bound = 1e-6 + 4 * _rel(Joined(model)(x).numpy(), ref)
        mlps = [("from_torch", fusedmlp.from_torch(model, device="cpu"))]
        data = _onnx_bytes(model, [x]) if onnx_ok else None
        if data is not None:
            mlps.append(("from_onnx", fusedmlp.from_onnx(data, device="cpu")))
            exported += 1
        for how, mlp in mlps:
            err = _rel(mlp(x.numpy()), ref)
            assert err <= bound, (seed, how, err, bound, mlp)
    assert not onnx_ok or exported >= 40, exported
