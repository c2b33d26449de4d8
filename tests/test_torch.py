"""PyTorch integration on the CPU path (CI): from_torch, FusedModule, the custom op, the notebook."""

import copy
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

import fusedmlp  # noqa: E402
from fusedmlp import _layers, torch as ft  # noqa: E402

ACTIVATION_MODULES = [nn.ReLU(), nn.LeakyReLU(0.2), nn.ELU(0.5), nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(),
                      nn.Sigmoid(), nn.Tanh(), nn.Softplus(beta=2, threshold=10), nn.Mish(), nn.SELU(), nn.ReLU6(),
                      nn.Hardtanh(-2, 2), nn.Hardsigmoid(), nn.Hardswish(), nn.Softsign(), nn.Identity(),
                      nn.CELU(0.7), nn.LogSigmoid(), nn.Tanhshrink(), nn.Softshrink(0.3), nn.Hardshrink(0.3),
                      nn.PReLU(init=-0.13), nn.Threshold(0.1, 0.0), nn.Threshold(-0.25, 1.5), nn.RReLU(0.1, 0.3).eval()]


def ref64(module, x):
    """The module's own forward in float64 (on a copy, so the module keeps its dtype)."""
    import copy

    with torch.no_grad():
        return copy.deepcopy(module).double()(x.double())


def reads_as(model, widths, rows=40):
    """from_torch's CPU model of `model` has these widths and gives its float64 outputs within 1e-6."""
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.in_features == widths[0] and list(mlp.widths) == widths, mlp
    x = torch.randn(rows, widths[0], dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-6
    return mlp


def max_rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("act", ACTIVATION_MODULES, ids=lambda m: repr(m))
def test_from_torch_matches_each_activation_module(act):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 40), act, nn.Linear(40, 33), act, nn.Linear(33, 2)).eval()
    x = torch.randn(300, 7)
    mlp = fusedmlp.from_torch(model, device="cpu")
    with torch.no_grad():
        y = mlp(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (300, 2)
    assert max_rel(y, ref64(model, x)) <= 1e-6


def test_traced_activation_functions_match_torch():
    """The functional forms of the activations written as expressions (celu, logsigmoid, tanhshrink, softshrink,
    hardshrink), through torch.fx."""
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d, self.e, self.f = (nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                                                              nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 3))

        def forward(self, x):
            h = F.celu(self.a(x), alpha=0.6)
            h = F.softshrink(self.b(h), 0.2) + h
            h = F.hardshrink(self.c(h), lambd=0.1)
            h = F.tanhshrink(self.d(h))
            return self.f(F.logsigmoid(self.e(h)))

    torch.manual_seed(4)
    model = Net().eval()
    x = torch.randn(200, 6)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6


def test_traced_activations_spelled_out_over_two_values_match_torch():
    """Activations written as products and sums of the layer's output with functions of it, as models write them
    (x * torch.sigmoid(x), mish as x * tanh(softplus(x)), erf's gelu, a gate of a LayerNorm's output, x * x): one
    activation expression over the layer's output, through torch.fx. A residual with a kept value still reads as
    one (relu(W h) + h after such an activation)."""
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d, self.e = (nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 32),
                                                      nn.Linear(32, 32), nn.Linear(32, 3))
            self.n = nn.LayerNorm(32)

        def forward(self, x):
            z = self.a(x)
            h = z * torch.sigmoid(z)
            z = self.b(h)
            h = z * torch.tanh(F.softplus(z)) + h
            z = self.c(h)
            h = 0.5 * z * (1 + torch.erf(z / 1.4142135623730951))
            z = self.n(self.d(h))
            h = torch.sigmoid(z) * z + z * z * 0.25
            return self.e(h)

    torch.manual_seed(8)
    model = Net().eval()
    with torch.no_grad():
        model.n.weight.uniform_(0.5, 1.5), model.n.bias.uniform_(-0.5, 0.5)
    x = torch.randn(200, 6)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [6, 32, 32, 32, 32, 3] and mlp._norm[3] is not None
    assert [r[2] if r else None for r in mlp._residual] == [None, 0, None, None, None]
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6


def test_traced_products_with_parameter_matrices_are_linears():
    """Hand-written MLPs (PINN code): h @ W + b with parameters W (in, out) and b, torch.matmul(h, W.T), h.matmul(W),
    torch.mm and a residual, read as Linears with the bias folded in; a product with a 3-D parameter is named."""
    import torch.nn.functional as F

    class Hand(nn.Module):
        def __init__(self):
            super().__init__()
            self.W1, self.b1 = nn.Parameter(torch.randn(3, 24)), nn.Parameter(torch.randn(24))
            self.W2, self.b2 = nn.Parameter(torch.randn(24, 24) / 5), nn.Parameter(torch.randn(24))
            self.W3 = nn.Parameter(torch.randn(24, 24) / 5)
            self.W4 = nn.Parameter(torch.randn(24, 2) / 5)

        def forward(self, x):
            h = torch.tanh(x @ self.W1 + self.b1)
            h = torch.tanh(torch.matmul(h, self.W2.T) + self.b2) + h
            h = F.silu(h.matmul(self.W3))
            return torch.mm(h, self.W4)

    torch.manual_seed(10)
    model = Hand().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [3, 24, 24, 24, 2] and mlp._residual[1] is not None
    w, b, _, _ = ft.read_module(model)
    assert np.array_equal(w[0], model.W1.detach().numpy().T) and np.array_equal(w[1], model.W2.detach().numpy())
    assert b[2] is None and b[3] is None
    x = torch.randn(60, 3)
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6

    class Cube(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(2, 3, 4))

        def forward(self, x):
            return x @ self.W

    with pytest.raises(fusedmlp.ArgumentError, match=r"a product with a \(2, 3, 4\) tensor"):
        fusedmlp.from_torch(Cube(), device="cpu")


def test_a_value_head_squeezing_its_output_reads_and_fused_module_squeezes_as_it_does():
    """A value head's forward ending in y.squeeze(-1) / torch.squeeze(y, 1) / y.squeeze(): from_torch gives y with its
    column, FusedModule returns it squeezed as the module does (eager and under torch.compile); a squeeze of a hidden
    value or over the rows is named."""

    class Value(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.a, self.b, self.how = nn.Linear(4, 16), nn.Linear(16, 1), how

        def forward(self, x):
            y = self.b(torch.relu(self.a(x)))
            return y.squeeze(-1) if self.how == 0 else torch.squeeze(y, 1) if self.how == 1 else y.squeeze()

    torch.manual_seed(11)
    x = torch.randn(30, 4)
    for how in range(3):
        model = Value(how).eval()
        assert fusedmlp.from_torch(model, device="cpu")(x.numpy()).shape == (30, 1)
        fused = ft.FusedModule(model)
        with torch.no_grad():
            y, want = fused(x), model(x)
            assert y.shape == want.shape == (30,) and max_rel(y, ref64(model, x)) <= 1e-6
            if how == 0:
                assert torch.compile(fused, fullgraph=True)(x).shape == (30,)

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 1), nn.Linear(1, 2)

        def forward(self, x):
            return self.b(self.a(x).squeeze(-1).unsqueeze(-1))

    class Rows(Value):
        def forward(self, x):
            return self.b(torch.relu(self.a(x))).squeeze(0)

    for model in (Hidden(), Rows(0)):
        with pytest.raises(fusedmlp.ArgumentError, match="a squeeze of a value other than the network's output"):
            fusedmlp.from_torch(model, device="cpu")


def test_tensor_methods_that_keep_the_value_are_other_names_of_it():
    """obs.float(), x.to(torch.float32), .to("cpu", dtype=torch.float64), .contiguous(), .clone(), .detach() in a
    forward (RL policies cast their observations first) are the value itself; a cast to float16 is named."""

    class Methods(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 2)

        def forward(self, obs):
            h = torch.relu(self.a(obs.float().to(torch.float32)))
            h = torch.tanh(self.b(h.contiguous())) + h.clone()
            return self.c(h.detach().to("cpu", dtype=torch.float64).float())

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 2)

        def forward(self, x):
            return self.a(x.to(torch.float16).float())

    torch.manual_seed(12)
    model = Methods().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [4, 16, 16, 2] and mlp._residual[1] is not None
    x = torch.randn(40, 4)
    with torch.no_grad():
        assert float((mlp(x) - model(x)).abs().max()) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="a cast to torch.float16; fusedmlp reads casts to float32"):
        fusedmlp.from_torch(Half(), device="cpu")


def test_linear_heads_on_one_trunk_merge_into_the_last_layer():
    """An actor-critic's forward returning pi(h), v(h) (and a third head, one without a bias) on one trunk: the heads'
    rows join one last layer; from_torch's model gives the heads side by side, FusedModule the tuple the module
    returns (eager and under torch.compile). A head with an activation of its own, or a number times it, is its
    columns' piece of the last layer's activation (test_heads_and_output_slices_with_activations_of_their_own)."""

    class ActorCritic(nn.Module):
        def __init__(self, act=False, use=False):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU())
            self.pi, self.v, self.aux = nn.Linear(32, 4), nn.Linear(32, 1), nn.Linear(32, 2, bias=False)
            self.act, self.use = act, use

        def forward(self, x):
            h = self.trunk(x)
            pi = self.pi(h)
            if self.act:
                pi = torch.tanh(pi)
            v = self.v(h)
            return (pi, v * 2, self.aux(h)) if self.use else (pi, v, self.aux(h))

    torch.manual_seed(13)
    model = ActorCritic().eval()
    x = torch.randn(50, 6)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [6, 32, 32, 7]
    fused = ft.FusedModule(model)
    with torch.no_grad():
        want = list(ref64(model, x))
        got = fused(x)
        assert [tuple(g.shape) for g in got] == [(50, 4), (50, 1), (50, 2)]
        assert all(max_rel(g, w) <= 1e-6 for g, w in zip(got, want))
        assert max_rel(mlp(x), torch.cat([w.float() for w in want], -1).double()) <= 1e-6
        compiled = torch.compile(fused, fullgraph=True)(x)
        assert all(torch.equal(c, g) for c, g in zip(compiled, got))
    for model, pieces in ((ActorCritic(act=True), "tanh(x):4 | none(x):3"),
                          (ActorCritic(use=True), "none(x):4 | (2 * x):1 | none(x):2")):
        model = model.eval()
        assert fusedmlp.from_torch(model, device="cpu").activations[-1] == pieces
        with torch.no_grad():
            assert all(max_rel(g, w) <= 1e-6 for g, w in zip(ft.FusedModule(model)(x), ref64(model, x)))


class _Dueling(nn.Module):
    """A dueling Q-network (Wang et al. 2016): a value head and an advantage head on one trunk, combined linearly."""

    def __init__(self, form):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.v, self.a, self.form = nn.Linear(64, 1), nn.Linear(64, 6), form

    def forward(self, x):
        h = self.trunk(x)
        v, a = self.v(h), self.a(h)
        if self.form == "mean":
            return v + a - a.mean(-1, keepdim=True)
        if self.form == "functions":
            return torch.add(v, torch.sub(a, torch.mean(a, 1, True)))
        if self.form == "halved_softmax":
            return torch.softmax((v + (a - a.mean(dim=1, keepdim=True))) / 2, -1)
        if self.form == "then_linear":  # (a combination read by a later layer: the last layer, then the next)
            return self.a2(torch.relu(v - a))
        return v + a - a.max(-1, keepdim=True).values  # (not linear: refused)


@pytest.mark.parametrize("form", ["mean", "functions", "halved_softmax", "then_linear"])
def test_a_dueling_head_folds_into_the_last_layer(form):
    """v + a - a.mean(-1, keepdim=True) over a value and an advantage head on one trunk is linear in their rows: the
    last layer becomes the combination of them (W' = M W, b' = M b in float64), one 6-wide output; a softmax or a
    Linear after it reads it as any layer's output."""
    torch.manual_seed(5)
    model = _Dueling(form)
    if form == "then_linear":
        model.a2 = nn.Linear(6, 3)
    model = model.eval()
    x = torch.randn(40, 8)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == ([8, 64, 64, 6, 3] if form == "then_linear" else [8, 64, 64, 6])
    with torch.no_grad():
        want = ref64(model, x)
        assert max_rel(mlp(x), want) <= 1e-6
        assert max_rel(ft.FusedModule(model)(x), want) <= 1e-6


def test_a_dueling_head_combined_otherwise_is_an_error_naming_the_node():
    with pytest.raises(fusedmlp.ArgumentError, match=r"max.*other than through one linear combination of them"):
        fusedmlp.from_torch(_Dueling("max").eval(), device="cpu")


class _DuelingStreams(_Dueling):
    """Wang et al.'s dueling network as written: a value stream and an advantage stream of two Linears each on one
    trunk (parallel stacks), combined as _Dueling's forms, or ("tuple") returned beside one stream's own output."""

    def __init__(self, form):
        super().__init__(form)
        self.trunk = nn.Sequential(nn.Linear(8, 64), nn.ReLU())
        self.v = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
        self.a = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 6))

    def forward(self, x):
        if self.form != "tuple":
            return super().forward(x)
        h = self.trunk(x)
        v = self.v(h)
        return v + self.a(h), v


@pytest.mark.parametrize("form", ["mean", "halved_softmax"])
def test_dueling_streams_of_two_layers_merge_and_fold_into_the_last_layer(form):
    """The streams merge into one network (block-diagonal hidden layer, their last Linears side by side) and the
    combination of the merged last layer's slices folds into its rows: 8-64-64-6, against torch in float64."""
    torch.manual_seed(6)
    model = _DuelingStreams(form).eval()
    x = torch.randn(40, 8)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [8, 64, 64, 6]
    with torch.no_grad():
        want = ref64(model, x)
        assert max_rel(mlp(x), want) <= 1e-6
        assert max_rel(ft.FusedModule(model)(x), want) <= 1e-6


@pytest.mark.parametrize("form, match", [("max", r"max.*reads the end of one of the parallel stacks"),
                                         ("tuple", r"output.*other than through one linear combination")])
def test_dueling_streams_combined_otherwise_are_an_error_naming_the_node(form, match):
    with pytest.raises(fusedmlp.ArgumentError, match=match):
        fusedmlp.from_torch(_DuelingStreams(form).eval(), device="cpu")


class _Heads(nn.Module):
    """A trunk and heads with activations of their own, returned as a tuple or one torch.cat, or one Linear whose
    output's slices take their own activations (NeRF-style rgb / density heads)."""

    def __init__(self, kind):
        super().__init__()
        self.trunk, self.rgb, self.sigma, self.kind = nn.Linear(6, 32), nn.Linear(32, 3), nn.Linear(32, 1), kind
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.kind == "slices":
            y = self.out(h)
            return torch.cat([3 * torch.sigmoid(y[..., :3] / 2), F.softplus(y[..., 3:4])], -1)
        if self.kind == "slices_reordered":
            y = torch.tanh(self.out(h))
            return torch.cat([y[:, 3:], torch.sigmoid(y[:, :3])], -1)
        rgb, sigma = self.rgb(h), self.sigma(h)  # (both Linears before either activation)
        if self.kind == "tuple":
            return torch.sigmoid(rgb), sigma
        if self.kind == "cat_reordered":
            return torch.cat([F.relu(sigma), torch.sigmoid(rgb)], -1)
        return torch.exp(torch.cat([torch.sigmoid(rgb), F.softplus(sigma)], -1))


@pytest.mark.parametrize("kind, pieces", [
    ("slices", "(3 * sigmoid(x)):3 | softplus(x, 1, 20):1"),
    ("slices_reordered", "tanh(x):1 | sigmoid(tanh(x)):3"),
    ("tuple", "sigmoid(x):3 | none(x):1"),
    ("cat_reordered", "relu(x):1 | sigmoid(x):3"),
    ("cat", "exp(sigmoid(x)):3 | exp(softplus(x, 1, 20)):1")])
def test_heads_and_output_slices_with_activations_of_their_own(kind, pieces):
    """Each head's (or slice's) activation, and numbers after it, become its columns' piece of the last layer's
    activation, in the output's column order; an op after the cat composes over every piece."""
    torch.manual_seed(46)
    model = _Heads(kind).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths[-1] == 4 and mlp.activations[-1].replace(" ", "") == pieces.replace(" ", ""), mlp.activations
    x = torch.randn(64, 6, dtype=torch.float64)
    want = ref64(model, x)
    want = torch.cat(list(want), -1) if isinstance(want, tuple) else want
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), want) <= 1e-6


def test_fourier_features_read_as_one_sine_layer():
    """Fourier features as neural fields write them, torch.cat([sin(z), cos(z)], -1) of z = 2 pi x @ B (B a frozen
    parameter) or of a Linear's output, in either order: one sine layer of the rows twice, the cos copy's bias
    shifted by pi / 2 (cos z = sin(z + pi / 2)); within float32's rounding of the shifted phases."""
    import math

    class Fourier(nn.Module):
        def __init__(self, cos_first):
            super().__init__()
            self.B = nn.Parameter(torch.randn(2, 16) * 3, requires_grad=False)
            self.a, self.f, self.b = nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(16, 1)
            self.cos_first = cos_first

        def forward(self, x):
            p = 2 * math.pi * x @ self.B
            h = torch.relu(self.a(torch.cat([torch.sin(p), torch.cos(p)], -1)))
            z = self.f(h)
            parts = [torch.cos(z), torch.sin(z)] if self.cos_first else [torch.sin(z), torch.cos(z)]
            return self.b(torch.cat(parts, -1))

    torch.manual_seed(14)
    x = torch.rand(64, 2)
    for cos_first in (False, True):
        model = Fourier(cos_first).eval()
        mlp = fusedmlp.from_torch(model, device="cpu")
        assert list(mlp.widths) == [2, 32, 32, 16, 1] and mlp.activations[0] == "sin(x)"
        assert max_rel(mlp(x), ref64(model, x)) <= 1e-5


def test_threshold_is_exact_at_its_step_and_at_infinities():
    """Threshold(t, v): x where x > t, else v; at x = t exactly v, x just above t itself, -inf v, inf inf; its
    functional form through torch.fx."""
    import torch.nn.functional as F

    for t, v in ((0.1, 0.0), (-0.25, 1.5), (0.0, -3.0)):
        expr = _layers.threshold_text(t, v)
        mlp = fusedmlp.FusedMLP([np.eye(1, dtype=np.float32)], None, activation=[expr], device="cpu")
        above = float(np.nextafter(np.float32(t), np.float32(1)))
        x = np.array([[t], [above], [t - 1], [t + 1], [-np.inf], [np.inf]], dtype=np.float32)
        want = torch.nn.Threshold(t, v)(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(mlp(x), want)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 24), nn.Linear(24, 2)

        def forward(self, x):
            return self.b(F.threshold(self.a(x), 0.05, -0.5))

    torch.manual_seed(6)
    model = Net().eval()
    x = torch.randn(100, 5)
    assert max_rel(fusedmlp.from_torch(model, device="cpu")(x), ref64(model, x)) <= 1e-6


@pytest.mark.parametrize("drop", [nn.Dropout1d(0.2), nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.2)],
                         ids=lambda m: type(m).__name__)
def test_every_dropout_form_is_the_identity_in_eval_mode_and_an_error_in_training(drop):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), drop, nn.Linear(16, 3)).eval()
    x = torch.randn(50, 4)
    assert max_rel(fusedmlp.from_torch(model, device="cpu")(x), ref64(model, x)) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match=f"2: {type(drop).__name__}.*training mode.*model.eval"):
        fusedmlp.from_torch(model.train(), device="cpu")


def test_traced_dropout_functions_follow_their_training_argument():
    """F.dropout defaults to training=True (it drops units in eval mode too unless told not to): refused without
    training=False; F.alpha_dropout defaults to False: the identity."""
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self, fn, **kw):
            super().__init__()
            self.a, self.b, self.fn, self.kw = nn.Linear(4, 8), nn.Linear(8, 2), fn, kw

        def forward(self, x):
            return self.b(self.fn(torch.relu(self.a(x)), 0.3, **self.kw))

    x = torch.randn(20, 4)
    for model in (Net(F.dropout, training=False), Net(F.alpha_dropout)):
        model.eval()
        assert max_rel(fusedmlp.from_torch(model, device="cpu")(x), ref64(model, x)) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="training=True is active"):
        fusedmlp.from_torch(Net(F.dropout).eval(), device="cpu")


def test_a_prelu_with_a_slope_per_channel_names_what_is_supported():
    model = nn.Sequential(nn.Linear(4, 8), nn.PReLU(8), nn.Linear(8, 2)).eval()
    with pytest.raises(fusedmlp.ArgumentError, match=r"1: PReLU is not supported; .*PReLU \(one slope\)"):
        fusedmlp.from_torch(model, device="cpu")


def test_an_rrelu_in_training_mode_is_an_error_saying_to_call_eval():
    model = nn.Sequential(nn.Linear(4, 8), nn.RReLU(), nn.Linear(8, 2))
    with pytest.raises(fusedmlp.ArgumentError, match=r"RReLU\(lower=.*training mode.*model\.eval\(\)"):
        fusedmlp.from_torch(model, device="cpu")


def test_nested_sequentials_dropout_and_linear_without_bias():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 16, bias=False), nn.Tanh()), nn.Dropout(0.3),
                          nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Softplus())), nn.Linear(16, 4)).eval()
    x = torch.randn(64, 3)
    y = fusedmlp.from_torch(model, device="cpu")(x)
    assert max_rel(y, ref64(model, x)) <= 1e-6


def test_consecutive_activations_compose():
    model = nn.Sequential(nn.Linear(4, 8), nn.Softplus(), nn.Tanh(), nn.Linear(8, 1)).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.activations[0] == "tanh(softplus(x, 1, 20))"
    x = torch.randn(50, 4)
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6


def test_torchvision_mlp():
    tv = pytest.importorskip("torchvision")
    try:
        model = tv.ops.MLP(6, [32, 32, 3], activation_layer=nn.SiLU, dropout=0.1).eval()
    except Exception as e:  # torchvision's ops may fail to import beside this torch build
        pytest.skip(f"torchvision unusable here: {e}")
    x = torch.randn(20, 6)
    assert max_rel(fusedmlp.from_torch(model, device="cpu")(x), ref64(model, x)) <= 1e-6


def test_unsupported_module_names_its_path():
    model = nn.Sequential(nn.Linear(3, 8), nn.Sequential(nn.Linear(8, 8), nn.GroupNorm(2, 8)), nn.Linear(8, 1))
    with pytest.raises(fusedmlp.ArgumentError, match=r"1\.1: GroupNorm is not supported; supported: Linear"):
        fusedmlp.from_torch(model)


def test_an_unknown_module_can_be_mapped_to_an_expression():
    class MyMish(nn.Module):
        def forward(self, x):
            return x * torch.tanh(nn.functional.softplus(x))

    model = nn.Sequential(nn.Linear(5, 24), MyMish(), nn.Linear(24, 2)).eval()
    mlp = fusedmlp.from_torch(model, activations={"1": "x * tanh(softplus(x))"}, device="cpu")
    x = torch.randn(40, 5)
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="not modules of the model"):
        fusedmlp.from_torch(model, activations={"1": "x", "7": "x"}, device="cpu")


def test_training_mode_with_active_dropout_is_an_error():
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 1))  # training mode by default
    with pytest.raises(fusedmlp.ArgumentError, match="2: Dropout.*training mode.*model.eval"):
        fusedmlp.from_torch(model)


def test_activation_before_first_linear_is_an_error():
    with pytest.raises(fusedmlp.ArgumentError, match="0: ReLU comes before the first Linear"):
        fusedmlp.from_torch(nn.Sequential(nn.ReLU(), nn.Linear(3, 2)))


def test_tensor_dtypes_shapes_and_requires_grad():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 5)).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    x = torch.randn(3, 4, 6)
    ref = ref64(model, x)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = mlp(x.to(dtype))
        assert y.dtype == dtype and y.shape == (3, 4, 5)
        assert max_rel(y, ref64(model, x.to(dtype).float())) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert mlp(x, out_dtype=torch.float16).dtype == torch.float16
    assert mlp(x[:, ::2, :]).shape == (3, 2, 5)  # a non-contiguous view
    assert max_rel(mlp(x), ref) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="requires grad.*no_grad"):
        mlp(x.requires_grad_())
    with torch.no_grad():
        assert mlp(x).shape == (3, 4, 5)
    with pytest.raises(fusedmlp.DTypeError, match="int64"):
        mlp(torch.ones(2, 6, dtype=torch.int64))
    with pytest.raises(fusedmlp.ShapeError, match=r"\(\.\.\., 6\)"):
        mlp(torch.ones(2, 7))


def test_fused_module_state_dict_round_trip_and_reload():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 3)).eval()
    fused = ft.FusedModule(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(30, 4)
    with torch.no_grad():
        before = fused(x)
        assert max_rel(before, ref64(model, x)) <= 1e-6
        other = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 3)).eval()
        fused.load_state_dict(other.state_dict())  # new weights: the fused model must follow
        assert max_rel(fused(x), ref64(other, x)) <= 1e-6
        model.load_state_dict(fused.state_dict())  # and back into a plain module
        assert max_rel(model(x), ref64(other, x)) <= 1e-6


def test_fused_module_is_inference_only():
    fused = ft.FusedModule(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).eval())
    with pytest.raises(fusedmlp.ArgumentError, match="inference-only"):
        fused(torch.randn(2, 4))
    with torch.inference_mode():
        assert fused(torch.randn(2, 4)).shape == (2, 1)


def test_custom_op_opcheck_and_torch_compile_fullgraph():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    fused = ft.FusedModule(model)
    x = torch.randn(17, 8)
    torch.library.opcheck(torch.ops.fusedmlp.mlp_forward.default, (x, next(fused.parameters()), 4, fused._dup))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(8, 8)
            self.mlp = fused

        def forward(self, x):
            return self.mlp(torch.relu(self.pre(x))) * 2

    net = Net().eval()
    with torch.no_grad():
        eager = net(x)
        compiled = torch.compile(net, fullgraph=True)(x)
    assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-6)


def test_compiled_models_of_one_architecture_share_one_graph_and_run_their_own_weights():
    """An agent class built and compiled many times (one per environment, or a notebook re-running its cell): the
    op's graph carries the module's first parameter and the output width, not a handle that differs for every model,
    so dynamo compiles the caller once and never hits its recompile limit (8: past it a caller ran eager whole, its
    Linears included); each call finds its own model by the parameter at run time. A module wrapped twice gets a
    second index (dup), and dropping one wrapper leaves the other's entry."""
    from torch._dynamo.utils import counters

    class Agent(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(6, 6)
            self.mlp = ft.FusedModule(nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 3)))

        def forward(self, x):
            return self.mlp(self.pre(x)) * 2

    torch.manual_seed(60)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(9, 6)
    with torch.no_grad():
        agents = [Agent().requires_grad_(False) for _ in range(12)]
        outs = [torch.compile(a, fullgraph=True)(x) for a in agents]
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        for a, y in zip(agents, outs):
            want = a.mlp.module if hasattr(a.mlp, "module") else nn.Sequential(*a.mlp._modules.values())
            assert torch.allclose(y, want(a.pre(x)) * 2, rtol=1e-5, atol=1e-6)
        assert len({tuple(y.flatten().tolist()) for y in outs}) == len(outs)  # twelve models, twelve answers
        inner = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).requires_grad_(False)
        first, second = ft.FusedModule(inner), ft.FusedModule(inner, activations=None)
        assert (first._dup, second._dup) == (0, 1)
        del first
        assert torch.allclose(torch.compile(second, fullgraph=True)(x), inner(x), rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_in_place_weight_changes_copies_and_pickles_rebuild_the_fused_model():
    """A policy trained while it acts (the optimizer steps the wrapped module's parameters in place) and a target
    network (copy.deepcopy, then Polyak updates under no_grad): the version counters moved, so the next call, eager
    or compiled, runs the new weights. A copy is a model of its own (the original dropped, it still runs), and a
    FusedModule pickles. A write through p.data moves no counter: refresh() rebuilds."""
    import copy
    import pickle

    torch.manual_seed(61)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    fused = ft.FusedModule(model)
    x = torch.randn(7, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    step()
    with torch.no_grad():
        assert close(fused(x), model(x))
        compiled = torch.compile(fused, fullgraph=True)
        before = compiled(x)
        assert close(before, model(x))
    step()
    with torch.no_grad():
        after = compiled(x)
        assert close(after, model(x)) and not close(after, before)
        target = copy.deepcopy(fused)
        assert target._handle != fused._handle and close(target(x), model(x))
        for p in target.parameters():
            p.mul_(0.5)
        assert close(target(x), target._wrapped()(x)) and not close(target(x), fused(x))
        del fused, compiled
        assert close(target(x), target._wrapped()(x))
        again = pickle.loads(pickle.dumps(target))
        assert close(again(x), target(x))
        for p in again.parameters():
            p.data.mul_(2)
        assert not close(again(x), again._wrapped()(x)) and close(again.refresh()(x), again._wrapped()(x))
    torch._dynamo.reset()
    with torch.inference_mode():  # parameters made here track no version (refresh() is how they are re-read)
        made = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        inferred = ft.FusedModule(made)
        assert close(inferred(x), made(x))
        made[0].weight.mul_(2)
        assert close(inferred.refresh()(x), made(x))


def test_calls_on_one_thread_while_another_trains_the_weights():
    """An actor thread calling the FusedModule while a learner thread steps the wrapped module's optimizer: a call
    runs the fused model built before or after a step, never a half-swapped one (no KeyError, no None), and once the
    learner is done the next call runs its last weights."""
    import threading

    torch.manual_seed(62)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    fused = ft.FusedModule(model)
    x = torch.randn(5, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    errors = []

    def learner():
        try:
            for _ in range(40):
                opt.zero_grad()
                model(x).square().sum().backward()
                opt.step()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def actor():
        try:
            with torch.no_grad():
                for _ in range(200):
                    assert fused(x).shape == (5, 3)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=learner), threading.Thread(target=actor), threading.Thread(target=actor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with torch.no_grad():
        assert torch.allclose(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_quickstart_notebook_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}},
                            ).execute()  # raises CellExecutionError if a cell raises
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max abs difference" in outputs


# ------------------------------------------------------------------------------------------------ torch.fx graphs


class ResBlock(nn.Module):
    def __init__(self, width, post_relu=False):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.post_relu = post_relu

    def forward(self, x):
        y = x + nn.functional.gelu(self.linear(x))
        return torch.relu(y) if self.post_relu else y


class ResNetMLP(nn.Module):
    """issue 5's shape: 64-128, four residual gelu blocks, -64 (smaller here), plus functional pieces."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 48)
        self.blocks = nn.ModuleList([ResBlock(48, post_relu=i % 2 == 1) for i in range(4)])
        self.gate = nn.Parameter(torch.randn(48, 48) / 7)
        self.out = nn.Linear(48, 6)

    def forward(self, x):
        h = nn.functional.silu(self.inp(x))
        for block in self.blocks:
            h = block(h)
        h = h * torch.tanh(nn.functional.linear(h, self.gate))  # a multiplicative residual, functional linear
        return self.out(nn.functional.dropout(h, 0.1, training=False))


def test_traced_resnet_mlp_matches_torch():
    torch.manual_seed(5)
    model = ResNetMLP().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert [r if r is None else r[0] for r in mlp._residual] == [None, 1, 1, 1, 1, 2, None]
    assert mlp._residual[2] == (1, "relu", 1) and mlp._residual[1] == (1, "none", 0)
    x = torch.randn(100, 12)
    assert max_rel(mlp(x), ref64(model, x)) <= 1e-6


def test_traced_module_in_fused_module_compiles_fullgraph():
    torch.manual_seed(6)
    model = ResNetMLP().eval()
    fused = ft.FusedModule(model)
    assert list(fused.state_dict()) == ["module." + k for k in model.state_dict()]
    x = torch.randn(33, 12)
    with torch.no_grad():
        assert max_rel(fused(x), ref64(model, x)) <= 1e-6
        assert torch.allclose(torch.compile(fused, fullgraph=True)(x), fused(x), rtol=1e-5, atol=1e-6)


class _Concat(nn.Module):  # NeRF-style input re-injection
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(12, 2)

    def forward(self, x):
        return self.b(torch.cat([torch.relu(self.a(x)), x], dim=-1))


class _SkipTwo(nn.Module):  # a residual over two layers: the network input added to layer 1's output
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        return torch.cumsum(self.a(x), dim=-1)


@pytest.mark.parametrize("model, concat, residual", [(_Concat(), [0, 1], [None, None]),
                                                     (_SkipTwo(), [0, 0], [None, (1, "none", -1)])])
def test_traced_concat_and_skip_graphs_match_torch(model, concat, residual):
    model = model.double().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp._concat == concat and mlp._residual == residual
    x = torch.randn(64, model.a.in_features, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())).double(), ref64(model, x)) <= 1e-6


@pytest.mark.parametrize("model, match", [
    (_Cumsum(), r"cumsum.*is not supported"),
])
def test_traced_graphs_name_the_unsupported_node(model, match):
    with pytest.raises(fusedmlp.ArgumentError, match=match):
        fusedmlp.from_torch(model.eval(), device="cpu")


# ------------------------------------------------------------------------------------------------ out=


def random_mlp(seed, widths=(6, 32, 24, 5)):
    """A FusedMLP on the CPU path with fresh random weights and biases (never zeros)."""
    torch.manual_seed(seed)
    layers = []
    for i, o in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(i, o), nn.SiLU()]
    return fusedmlp.from_torch(nn.Sequential(*layers[:-1]).eval(), device="cpu")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_on_cpu_tensors_receives_the_returned_result(x_dtype, out_dtype):
    mlp = random_mlp(10)
    x = torch.randn(3, 7, 6).to(x_dtype)
    out = torch.full((3, 7, 5), float("nan"), dtype=out_dtype)  # poisoned: a call that writes nothing cannot pass
    with torch.no_grad():
        result = mlp(x, out=out)
        assert result is out
        assert torch.equal(out, mlp(x, out_dtype=out_dtype))
        # out_dtype may repeat out's dtype
        out.fill_(float("nan"))
        assert mlp(x, out=out, out_dtype=out_dtype) is out and torch.equal(out, mlp(x, out_dtype=out_dtype))


def test_out_views_inference_tensors_and_empty_batches_on_cpu():
    mlp = random_mlp(11)
    x = torch.randn(40, 6)
    expected = mlp(x)
    wide = torch.full((40, 12), float("nan"))
    view = wide[:, 2:7]  # a strided view into a wider buffer: only its own columns are written
    assert mlp(x, out=view) is view and torch.equal(view, expected)
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 7:]).all()
    transposed = torch.full((5, 40), float("nan")).t()
    assert mlp(x, out=transposed) is transposed and torch.equal(transposed, expected)
    with torch.inference_mode():
        inference_out = torch.full((40, 5), float("nan"))
    assert mlp(x, out=inference_out) is inference_out and torch.equal(inference_out, expected)
    with torch.inference_mode():  # and a normal tensor written inside inference mode
        plain = torch.full((40, 5), float("nan"))
        assert mlp(x, out=plain) is plain and torch.equal(plain, expected)
    empty = torch.empty(0, 5)
    assert mlp(torch.randn(0, 6), out=empty) is empty
    one = torch.full((5,), float("nan"))  # x of shape (6,): out of shape (5,)
    assert mlp(x[3], out=one) is one and torch.equal(one, expected[3])


def test_out_written_on_cpu_tensors_keeps_autograd_honest():
    mlp = random_mlp(12)
    x = torch.randn(8, 6)
    out = torch.zeros(8, 5)
    version = out._version
    mlp(x, out=out)
    assert out._version > version  # an op that saved out's old values for backward would now refuse


def _bad_outs(x):
    """(label, out, error, message regex) for x of shape (4, 6) and a 6 -> 5 network."""
    return [
        ("numpy array", np.zeros((4, 5), np.float32), fusedmlp.ArgumentError,
         r"out is a numpy\.ndarray.*torch\.Tensor"),
        ("a dtype (out_dtype meant)", torch.float16, fusedmlp.ArgumentError, r"out is a torch\.dtype.*out_dtype="),
        ("wrong shape", torch.empty(4, 6), fusedmlp.ShapeError, r"out has shape \(4, 6\).*must be \(4, 5\)"),
        ("flattened", torch.empty(20), fusedmlp.ShapeError, r"out has shape \(20,\).*must be \(4, 5\)"),
        ("float64", torch.empty(4, 5, dtype=torch.float64), fusedmlp.DTypeError,
         r"out has dtype torch\.float64; it must be torch\.float32, torch\.float16 or torch\.bfloat16"),
        ("int", torch.empty(4, 5, dtype=torch.int32), fusedmlp.DTypeError, r"out has dtype torch\.int32"),
        ("requires grad", torch.empty(4, 5, requires_grad=True), fusedmlp.ArgumentError, r"out requires grad"),
        ("meta device", torch.empty(4, 5, device="meta"), fusedmlp.ArgumentError,
         r"out is on meta but x is on cpu; out must be on x's device"),
        ("expanded", torch.empty(1, 5).expand(4, 5), fusedmlp.ArgumentError, r"elements share memory"),
        ("view of x", x[:, :5], fusedmlp.ArgumentError, r"out shares memory with x.*must not overlap x"),
        ("sparse", torch.zeros(4, 5).to_sparse(), fusedmlp.ArgumentError, r"out has layout torch\.sparse_coo"),
    ]


@pytest.mark.parametrize("label", [case[0] for case in _bad_outs(torch.empty(4, 6))])
def test_bad_out_on_cpu_tensors_names_out_and_the_rule(label):
    mlp = random_mlp(13)
    x = torch.randn(4, 6)
    _, out, error, match = next(case for case in _bad_outs(x) if case[0] == label)
    before = x.clone()
    with pytest.raises(error, match=match):
        mlp(x, out=out)
    assert torch.equal(x, before), label  # nothing was written anywhere


def test_out_must_be_of_x_s_kind():
    mlp = random_mlp(15)
    with pytest.raises(fusedmlp.ArgumentError, match=r"out is a torch\.Tensor; for NumPy \(or list\) x it must be a "
                       r"NumPy ndarray of shape \(4, 5\) and dtype float32"):
        mlp(np.ones((4, 6), np.float32), out=torch.empty(4, 5))
    with pytest.raises(fusedmlp.ArgumentError, match=r"out is a numpy\.ndarray; for a torch x it must be a torch"):
        mlp(torch.ones(4, 6), out=np.empty((4, 5), np.float32))


def test_out_dtype_must_agree_with_out():
    mlp = random_mlp(14)
    x = torch.randn(4, 6)
    with pytest.raises(fusedmlp.ArgumentError, match=r"out_dtype=torch\.float16 but out has dtype torch\.float32"):
        mlp(x, out=torch.empty(4, 5), out_dtype=torch.float16)
    with pytest.raises(fusedmlp.DTypeError, match=r"out_dtype='float16'; it must be torch\.float32"):
        mlp(x, out=torch.empty(4, 5, dtype=torch.float16), out_dtype="float16")
    with pytest.raises(fusedmlp.ShapeError, match=r"out has shape \(3, 5\)"):  # batch 0 still checks out's shape
        mlp(torch.randn(0, 6), out=torch.empty(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_tensors_reach_the_host_call_in_their_own_dtype(dtype, monkeypatch):
    """A float32 / float16 CPU tensor is handed to the NumPy call as a view in its own dtype (no float32 copy; a GPU
    model's host copies then move half the bytes for float16), with the NumPy call's result; bfloat16 and another
    output dtype go through float32."""
    mlp = random_mlp(21)
    x = torch.randn(300, 6).to(dtype)
    seen = []
    numpy_call = fusedmlp.FusedMLP.__call__

    def spy(self, arr, *args, **kwargs):
        if isinstance(arr, np.ndarray):
            seen.append(arr)
        return numpy_call(self, arr, *args, **kwargs)

    monkeypatch.setattr(fusedmlp.FusedMLP, "__call__", spy)
    y = mlp(x)
    assert seen[-1].dtype == np.dtype(str(dtype).split(".")[1]) and np.shares_memory(seen[-1], x.numpy())
    assert y.dtype == dtype and torch.equal(y, torch.from_numpy(numpy_call(mlp, x.numpy())))
    y32 = mlp(x, out_dtype=torch.float32)
    assert seen[-1].dtype == np.float32 and y32.dtype == torch.float32
    yb = mlp(x.to(torch.bfloat16))
    assert seen[-1].dtype == np.float32 and yb.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ flattened inputs

class _Mnist(nn.Module):
    """The MLP of the MNIST tutorials: the image flattened in forward, dropout, log_softmax."""

    def __init__(self, how):
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(784, 64), nn.Linear(64, 10), how

    def forward(self, x):
        if self.how == "view":
            x = x.view(x.size(0), -1)
        elif self.how == "flatten":
            x = torch.flatten(x, 1)
        elif self.how == "reshape":
            x = x.reshape(x.shape[0], -1)
        else:
            x = x.view(-1, 28 * 28)
        x = F.dropout(F.relu(self.fc1(x)), training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmax(-1)),
    _Mnist("view"), _Mnist("flatten"), _Mnist("reshape"), _Mnist("rows")],
    ids=["nn.Flatten", "view(size(0), -1)", "torch.flatten", "reshape(shape[0], -1)", "view(-1, 784)"])
def test_models_that_flatten_their_input_take_images(model):
    """from_torch reads a leading flatten as flatten_input=1: the fused model, FusedModule and a NumPy call take the
    images as the module does; flattened rows still work."""
    torch.manual_seed(3)
    model = model.eval()
    x = torch.randn(6, 1, 28, 28)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp._flatten_input == 1 and "flatten_input=1" in repr(mlp)
    with torch.no_grad():
        want = model(x)
        for y in (mlp(x), torch.from_numpy(mlp(x.numpy())), ft.FusedModule(model)(x), mlp(x.reshape(6, 784))):
            assert y.shape == (6, 10) and max_rel(y.double(), want.double()) <= 1e-5


def test_flatten_input_spelled_directly_saved_and_checked(tmp_path):
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((16, 12)).astype(np.float32), rng.standard_normal((3, 16)).astype(np.float32)]
    mlp = fusedmlp.FusedMLP(ws, activation="tanh", flatten_input=2, device="cpu")
    x = rng.standard_normal((5, 2, 3, 4)).astype(np.float32)  # dims 2.. merge: (5, 2, 12)
    y = mlp(x)
    assert y.shape == (5, 2, 3) and np.array_equal(y, mlp(x.reshape(5, 2, 12)))
    back = fusedmlp.FusedMLP.from_npz(mlp.save(tmp_path / "m.npz"), device="cpu")
    assert back._flatten_input == 2 and np.array_equal(back(x), y)
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(fusedmlp.ArgumentError, match=r"flatten_input=.*; it must be None or the first dim"):
            fusedmlp.FusedMLP(ws, flatten_input=bad, device="cpu")


def test_flattens_fusedmlp_does_not_take_are_named():
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(28, 4)

        def forward(self, x):
            return self.a(torch.flatten(x, 1, 2))

    class ViewRows(_Mnist):
        def forward(self, x):
            return self.fc2(self.fc1(x.view(-1, 392)))

    for model, error, match in [
            (nn.Sequential(nn.Flatten(0), nn.Linear(784, 4)), fusedmlp.ArgumentError, r"0: a flatten of dims 0\.\.-1"),
            (Partial(), fusedmlp.ArgumentError, r"a view or flatten of the input that is not"),
            (ViewRows("rows"), fusedmlp.ShapeError, r"viewed as rows of 392 features, but the Linear takes 784")]:
        with pytest.raises(error, match=match):
            fusedmlp.from_torch(model.eval(), device="cpu")


def test_an_8bit_flattening_model_calibrates_on_images():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    x = torch.randn(64, 1, 28, 28)
    mlp = fusedmlp.from_torch(model, device="cpu", dtype="int8", calibrate=x)
    flat = fusedmlp.from_torch(model, device="cpu", dtype="int8", calibrate=x.reshape(64, 784))
    assert np.array_equal(mlp.act_scales, flat.act_scales)
    assert np.array_equal(mlp(x.numpy()), flat(x.reshape(64, 784).numpy()))
    y = fusedmlp.evaluate_fused_mlp(x.numpy(), [model[1].weight.detach().numpy(), model[3].weight.detach().numpy()],
                                    [model[1].bias.detach().numpy(), model[3].bias.detach().numpy()], "relu",
                                    flatten_input=1, device="cpu")
    with torch.no_grad():
        assert y.shape == (64, 10) and max_rel(torch.from_numpy(y).double(), model(x).double()) <= 1e-5


class _Actor(nn.Module):
    """An RL actor as written: observations normalized by buffers in forward, a scaled tanh output (TD3's
    max_action * tanh), a per-feature scale between layers."""

    def __init__(self):
        super().__init__()
        self.register_buffer("obs_mean", torch.randn(11))
        self.register_buffer("obs_std", torch.rand(11) + 0.5)
        self.gain = nn.Parameter(torch.rand(32) + 0.5, requires_grad=False)
        self.l1, self.l2, self.l3 = nn.Linear(11, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.max_action = 2.5

    def forward(self, obs):
        x = (obs - self.obs_mean) / self.obs_std
        h = torch.relu(self.l1(x)) * self.gain
        h = torch.tanh(self.l2(h)) - 0.5
        return self.max_action * torch.tanh(self.l3(h))


def test_constants_in_forward_fold_or_join_the_activation():
    """(obs - mean) / std folds into the first Linear, a per-feature gain into the next one, and numbers after a layer
    join its activation (tanh(x) - 0.5, 2.5 * tanh(x))."""
    torch.manual_seed(8)
    actor = _Actor().eval()
    mlp = fusedmlp.from_torch(actor, device="cpu")
    assert list(mlp.activations) == ["relu(x)", "(tanh(x) - 0.5)", "(2.5 * tanh(x))"], mlp.activations
    x = torch.randn(40, 11, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(actor, x)) <= 1e-5


class _Pinn(nn.Module):
    """A PINN as the reference codes write it: the input scaled to [-1, 1] by the domain's bounds, lb and ub (here
    parameters, elsewhere buffers or plain tensors), the scale spelled out in forward; a Fourier layer whose frequency
    matrix is a buffer times 2 pi, and an F.linear whose weight is a weight-normalised product of two parameters."""

    def __init__(self):
        super().__init__()
        self.lb = nn.Parameter(torch.tensor([-1.0, 0.0, -2.0]), requires_grad=False)
        self.ub = nn.Parameter(torch.tensor([1.0, 3.0, 2.5]), requires_grad=False)
        self.register_buffer("freq", torch.randn(3, 8))
        self.l1, self.out = nn.Linear(16, 32), nn.Linear(32, 2)
        self.v, self.g = nn.Parameter(torch.randn(32, 32)), nn.Parameter(torch.rand(32, 1) + 0.5)

    def forward(self, x):
        h = 2.0 * (x - self.lb) / (self.ub - self.lb) - 1.0
        z = h @ (2 * torch.pi * self.freq)
        h = torch.tanh(self.l1(torch.cat([torch.sin(z), torch.cos(z)], -1)))
        h = torch.tanh(F.linear(h, self.g * self.v / self.v.norm(dim=1, keepdim=True)))
        return self.out(h)


def test_arithmetic_on_constants_alone_is_folded_while_reading():
    """(ub - lb), 2 pi * B and g * v / ||v|| touch no input: the tracer evaluates them in float64 and the ops that read
    them see one constant, a per-feature map, a Fourier layer's matrix and a Linear's weight."""
    torch.manual_seed(12)
    pinn = _Pinn().eval()
    mlp = fusedmlp.from_torch(pinn, device="cpu")
    assert list(mlp.widths) == [3, 16, 32, 32, 2], mlp.widths
    x = (torch.rand(50, 3, dtype=torch.float64) * torch.tensor([2.0, 3.0, 4.5]) + torch.tensor([-1.0, 0.0, -2.0]))
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(pinn, x)) <= 1e-5


class _Encoded(nn.Module):
    """A coordinate MLP with NeRF's positional encoding in forward: x, then sin and cos of 2^k x (or of x times a
    per-feature buffer), in a torch.cat the first Linear reads."""

    def __init__(self, freqs=10, include_input=True, x_last=False, per_feature=False, skip=False):
        super().__init__()
        self.freqs, self.include_input, self.x_last, self.per_feature, self.skip = (freqs, include_input, x_last,
                                                                                    per_feature, skip)
        self.register_buffer("bands", torch.stack([2.0 ** k * torch.tensor([1.0, 0.5, 2.0]) for k in range(freqs)]))
        width = 3 * (2 * freqs + include_input)
        self.l1, self.l2 = nn.Linear(width, 64), nn.Linear(64 + (width if skip else 0), 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        parts = []
        for k in range(self.freqs):
            z = x * self.bands[k] if self.per_feature else 2.0 ** k * x
            parts += [torch.sin(z), z.cos()]
        if self.include_input:
            parts = parts + [x] if self.x_last else [x] + parts
        e = torch.cat(parts, -1)
        h = torch.relu(self.l1(e))
        h = torch.relu(self.l2(torch.cat([e, h], -1) if self.skip else h))
        return self.out(h)


@pytest.mark.parametrize("options", [{}, {"include_input": False}, {"x_last": True}, {"per_feature": True},
                                     {"freqs": 1}, {"skip": True}], ids=lambda o: ",".join(o) or "nerf")
def test_a_positional_encoding_in_forward_is_the_models_input_encoding(options):
    """torch.cat([x, sin(c x), cos(c x), ...]) of the input becomes FusedMLP's encoding= (computed in the kernel as x
    loads): layer 0 reads its columns, x stays 3 features, and a later torch.cat of it (NeRF's skip) is a concat of
    x; the CPU path within float32's phase of 2^9 x of torch in float64."""
    torch.manual_seed(13)
    model = _Encoded(**options).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    freqs, x_part = options.get("freqs", 10), options.get("include_input", True)
    assert mlp.in_features == 3 and list(mlp.widths[:2]) == [3 * (2 * freqs + x_part), 64]
    kinds = [p if p == "x" else p[0] for p in mlp.encoding]
    sines = [k for _ in range(freqs) for k in ("sin", "cos")]
    assert kinds == (sines + ["x"] if options.get("x_last") else ["x"] + sines) if x_part else sines
    assert bool(mlp._concat and mlp._concat[1]) == options.get("skip", False)
    x = torch.rand(200, 3, dtype=torch.float64) * 3 - 1.5
    # sin(2^9 x) in float32 (the CPU path's storage): its phase to float32's rounding of 2^9 x, ~3e-5
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 2e-4


class _NerfPytorch(nn.Module):
    """nerf-pytorch's NeRF (run_nerf_helpers.py) as written: the input split into encoded points and view
    directions, the trunk on the points with the points joined again after layer 4, and with use_viewdirs the density
    alpha taken from the trunk while the colour goes on through a view layer, returned as torch.cat([rgb, alpha])."""

    def __init__(self, depth=8, width=256, input_ch=63, input_ch_views=27, skips=(4,), use_viewdirs=False,
                 view_act=F.relu):
        super().__init__()
        self.input_ch, self.input_ch_views, self.skips, self.use_viewdirs = input_ch, input_ch_views, skips, use_viewdirs
        self.view_act = view_act
        self.pts_linears = nn.ModuleList([nn.Linear(input_ch, width)] + [
            nn.Linear(width, width) if i not in skips else nn.Linear(width + input_ch, width) for i in range(depth - 1)])
        self.views_linears = nn.ModuleList([nn.Linear(input_ch_views + width, width // 2)])
        if use_viewdirs:
            self.feature_linear = nn.Linear(width, width)
            self.alpha_linear = nn.Linear(width, 1)
            self.rgb_linear = nn.Linear(width // 2, 3)
        else:
            self.output_linear = nn.Linear(width, 4)

    def forward(self, x):
        input_pts, input_views = torch.split(x, [self.input_ch, self.input_ch_views], dim=-1)
        h = input_pts
        for i, l in enumerate(self.pts_linears):
            h = self.pts_linears[i](h)
            h = F.relu(h)
            if i in self.skips:
                h = torch.cat([input_pts, h], -1)
        if self.use_viewdirs:
            alpha = self.alpha_linear(h)
            feature = self.feature_linear(h)
            h = torch.cat([feature, input_views], -1)
            for i, l in enumerate(self.views_linears):
                h = self.views_linears[i](h)
                h = self.view_act(h)
            rgb = self.rgb_linear(h)
            outputs = torch.cat([rgb, alpha], -1)
        else:
            outputs = self.output_linear(h)
        return outputs


@pytest.mark.parametrize("use_viewdirs", [False, True])
def test_nerf_pytorchs_nerf_as_written(use_viewdirs):
    """The input's split parts are x with zero weights for the other part's features (x stays 90 wide); with view
    directions, alpha rides along the view layer as relu(alpha), relu(-alpha) and the last layer returns it beside
    rgb in torch.cat's order: the CPU path within float32's rounding of torch in float64, alpha too."""
    torch.manual_seed(17)
    model = _NerfPytorch(use_viewdirs=use_viewdirs).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.in_features == 90 and mlp._concat[5] == 2
    if use_viewdirs:  # the trunk, [alpha | feature] merged into the view layer with alpha's pair, [rgb | alpha]
        assert list(mlp.widths[-4:]) == [256, 256, 130, 4] and mlp._concat[8] == 1
    x = torch.randn(300, 90, dtype=torch.float64)
    want = ref64(model, x)
    got = torch.from_numpy(mlp(x.float().numpy()))
    assert max_rel(got, want) <= 1e-6 and max_rel(got[:, 3:], want[:, 3:]) <= 1e-6


def test_a_carried_value_across_another_activation_is_named():
    model = _NerfPytorch(depth=2, width=32, skips=(), use_viewdirs=True, view_act=torch.tanh).eval()
    with pytest.raises(fusedmlp.ArgumentError, match=r"alpha.*returned beside a later layer's output, would cross a "
                                                     r"layer with activation tanh"):
        fusedmlp.from_torch(model, device="cpu")


def test_forward_flags_trace_at_their_defaults():
    """forward(x, sigma_only=False) with an `if` on the flag (nerf_pl's NeRF): traced at the default, as a call with x
    alone runs it."""

    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 1), nn.Linear(16, 3)

        def forward(self, x, density_only=False, scale=None):
            h = torch.relu(self.a(x))
            if density_only:
                return self.b(h)
            y = self.c(h)
            return y if scale is None else y * scale

    torch.manual_seed(2)
    model = Flagged().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [6, 16, 3]
    x = torch.randn(20, 6, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-6


class _SplitHead(nn.Module):
    """Policies and fields that split their last layer's output in forward and return the parts: a Gaussian policy's
    mu, log_std = y.chunk(2, -1) (tanh(mu), log_std.clamp(-5, 2)), y.split([3, 1], -1) with an activation each,
    slices returned as a tuple, and a dict with one column indexed away (y[..., 3])."""

    def __init__(self, kind):
        super().__init__()
        self.trunk, self.out, self.kind = nn.Sequential(nn.Linear(6, 32), nn.SiLU()), nn.Linear(32, 4), kind

    def forward(self, x):
        y = self.out(self.trunk(x))
        if self.kind == "chunk":
            mu, log_std = y.chunk(2, -1)
            return torch.tanh(mu), log_std.clamp(-5, 2)
        if self.kind == "split":
            rgb, sigma = torch.split(y, [3, 1], dim=-1)
            return torch.sigmoid(rgb), F.softplus(sigma)
        if self.kind == "tuple":  # (columns taken twice and in another order)
            return y[:, 2:], torch.sigmoid(y[..., :3])
        return {"rgb": torch.sigmoid(y[..., :3]), "sigma": F.relu(y[..., 3])}


@pytest.mark.parametrize("kind", ["chunk", "split", "tuple", "dict"])
def test_output_split_into_parts_returned_as_a_tuple_or_dict(kind):
    """The parts' rows (columns may repeat or go), their activations the last layer's column pieces; FusedModule
    returns the module's tuple or dict, an indexed column squeezed, eager and under torch.compile."""
    torch.manual_seed(48)
    model = _SplitHead(kind).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths[-1] == (5 if kind == "tuple" else 4) and "|" in mlp.activations[-1]
    x = torch.randn(40, 6)
    fused = ft.FusedModule(model)
    with torch.no_grad():
        want, got = ref64(model, x.double()), fused(x)
        pairs = [(got[k], want[k]) for k in want] if kind == "dict" else list(zip(got, want))
        assert type(got) is type(want) and len(pairs) == len(want)
        assert all(g.shape == w.shape and max_rel(g, w) <= 1e-6 for g, w in pairs), [(g.shape, w.shape) for g, w in
                                                                                     pairs]
        compiled = torch.compile(fused, fullgraph=True)(x)
        torch._dynamo.reset()  # (FusedModule.forward's compiles of different architectures count toward one recompile limit)
        flat = list(compiled.values()) if kind == "dict" else list(compiled)
        assert all(torch.equal(c, g) for c, (g, _) in zip(flat, pairs))


class _NerfPl(nn.Module):
    """nerf_pl's NeRF (kwea123, models/nerf.py) as written: its input split into encoded points and directions, the
    points joined again at the skip, sigma a Linear head on the trunk, the view branch on xyz_encoding_final and the
    directions, rgb = Sigmoid(Linear(...)), returned as torch.cat([rgb, sigma], -1); forward(x, sigma_only=False)."""

    def __init__(self, D=8, W=256, in_channels_xyz=63, in_channels_dir=27, skips=(4,)):
        super().__init__()
        self.D, self.in_channels_xyz, self.in_channels_dir, self.skips = D, in_channels_xyz, in_channels_dir, skips
        for i in range(D):
            layer = nn.Linear(in_channels_xyz if i == 0 else W + in_channels_xyz if i in skips else W, W)
            setattr(self, f"xyz_encoding_{i + 1}", nn.Sequential(layer, nn.ReLU(True)))
        self.xyz_encoding_final = nn.Linear(W, W)
        self.dir_encoding = nn.Sequential(nn.Linear(W + in_channels_dir, W // 2), nn.ReLU(True))
        self.sigma = nn.Linear(W, 1)
        self.rgb = nn.Sequential(nn.Linear(W // 2, 3), nn.Sigmoid())

    def forward(self, x, sigma_only=False):
        if not sigma_only:
            input_xyz, input_dir = torch.split(x, [self.in_channels_xyz, self.in_channels_dir], dim=-1)
        else:
            input_xyz = x
        xyz_ = input_xyz
        for i in range(self.D):
            if i in self.skips:
                xyz_ = torch.cat([input_xyz, xyz_], -1)
            xyz_ = getattr(self, f"xyz_encoding_{i + 1}")(xyz_)
        sigma = self.sigma(xyz_)
        if sigma_only:
            return sigma
        xyz_encoding_final = self.xyz_encoding_final(xyz_)
        dir_encoding = self.dir_encoding(torch.cat([xyz_encoding_final, input_dir], -1))
        rgb = self.rgb(dir_encoding)
        return torch.cat([rgb, sigma], -1)


def test_nerf_pl_nerf_as_written():
    """sigma rides along the view layer as relu(v), relu(-v) and comes out of the last layer as one row without its
    sigmoid: the last layer's activation is the column pieces 'sigmoid:3 | none:1'. CPU path against float64."""
    torch.manual_seed(44)
    model = _NerfPl().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.in_features == 90 and mlp.widths[-1] == 4
    assert mlp.activations[-1] == "sigmoid(x):3 | none(x):1", mlp.activations
    x = torch.randn(300, 90, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5

    class Tail(nn.Module):  # sigma first, then rgb; a tanh after the cat composes over both pieces
        def __init__(self, order):
            super().__init__()
            self.trunk, self.sigma, self.final = nn.Linear(6, 16), nn.Linear(16, 1), nn.Linear(16, 16)
            self.view, self.rgb, self.order = nn.Linear(16, 8), nn.Linear(8, 3), order

        def forward(self, x):
            h = torch.relu(self.trunk(x))
            sigma, f = self.sigma(h), self.final(h)
            rgb = torch.sigmoid(self.rgb(torch.relu(self.view(f))))
            return torch.cat([sigma, rgb], -1) if self.order else torch.tanh(torch.cat([rgb, sigma], -1))

    for order, want in ((True, "none(x):1 | sigmoid(x):3"), (False, "tanh(sigmoid(x)):3 | tanh(x):1")):
        model = Tail(order).eval()
        mlp = fusedmlp.from_torch(model, device="cpu")
        assert mlp.activations[-1] == want, mlp.activations
        x = torch.randn(50, 6, dtype=torch.float64)
        assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5


class _NeusSdf(nn.Module):
    """NeuS's SDFNetwork (models/fields.py) as written, geometric init aside: the input scaled, then its embedder's
    torch.cat of x and sin / cos of x times 2^k (a 0-dim tensor each, as torch.linspace gives them), weight_norm
    Linears, Softplus(beta=100), the embedding joined again at layer 4 and the cat divided by sqrt(2), and the SDF
    column divided by the scale at the end."""

    def __init__(self, d_out=257, width=256, n_layers=8, skip_in=(4,), multires=6, scale=1.0):
        super().__init__()
        dims = [3 * (1 + 2 * multires)] + [width] * n_layers + [d_out]
        self.num_layers, self.skip_in, self.scale = len(dims), skip_in, scale
        for l in range(self.num_layers - 1):
            out_dim = dims[l + 1] - dims[0] if l + 1 in skip_in else dims[l + 1]
            setattr(self, "lin" + str(l), nn.utils.parametrizations.weight_norm(nn.Linear(dims[l], out_dim)))
        self.activation = nn.Softplus(beta=100)
        self.freq_bands = 2.0 ** torch.linspace(0.0, multires - 1, multires)
        self.embed_fns = [lambda x: x] + [lambda x, p_fn=p_fn, freq=freq: p_fn(x * freq)
                                          for freq in self.freq_bands for p_fn in (torch.sin, torch.cos)]

    def forward(self, inputs):
        inputs = inputs * self.scale
        inputs = torch.cat([fn(inputs) for fn in self.embed_fns], -1)
        x = inputs
        for l in range(self.num_layers - 1):
            lin = getattr(self, "lin" + str(l))
            if l in self.skip_in:
                x = torch.cat([x, inputs], 1) / np.sqrt(2)
            x = lin(x)
            if l < self.num_layers - 2:
                x = self.activation(x)
        return torch.cat([x[:, :1] / self.scale, x[:, 1:]], dim=-1)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_neus_sdf_network_as_written(scale):
    """The input scale becomes the encoding's (its x part s * x, its sines' frequencies times s), the cat's
    1 / sqrt(2) goes into layer 4's weights and the SDF column's 1 / scale into the last layer's row: CPU path
    within float32's rounding of torch in float64."""
    torch.manual_seed(6)
    model = _NeusSdf(scale=scale).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.in_features == 3 and list(mlp.widths[:6]) == [39, 256, 256, 256, 217, 256] and mlp._concat[4] == 1
    first = mlp.encoding[0]  # x's part: s * x
    assert (first == "x" and scale == 1.0) or (first[0] == "x" and np.allclose(first[1], scale))
    x = torch.rand(200, 3, dtype=torch.float64) * 2 - 1
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5


class _DeepSdfDecoder(nn.Module):
    """DeepSDF's Decoder (networks/deep_sdf_decoder.py) as written: latent code and xyz in one input, `if
    input.shape[1] > 3 and self.latent_dropout` before the layers, xyz = input[:, -3:] (read only with xyz_in_all),
    the input joined again before the latent_in layers, old-style weight_norm hooks or LayerNorms, F.dropout with
    training=self.training, and a Tanh at the end."""

    def __init__(self, latent=256, dims=(512,) * 8, norm_layers=tuple(range(8)), latent_in=(4,), weight_norm=True,
                 xyz_in_all=False, latent_dropout=False):
        super().__init__()
        dims = [latent + 3] + list(dims) + [1]
        self.num_layers, self.norm_layers, self.latent_in = len(dims), norm_layers, latent_in
        self.weight_norm, self.xyz_in_all, self.latent_dropout = weight_norm, xyz_in_all, latent_dropout
        for layer in range(self.num_layers - 1):
            out_dim = dims[layer + 1] - dims[0] if layer + 1 in latent_in else dims[layer + 1]
            if layer + 1 not in latent_in and xyz_in_all and layer != self.num_layers - 2:
                out_dim -= 3
            lin = nn.Linear(dims[layer], out_dim)
            if weight_norm and layer in norm_layers:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # (the old hook, as DeepSDF uses it)
                    lin = nn.utils.weight_norm(lin)
            setattr(self, "lin" + str(layer), lin)
            if not weight_norm and layer in norm_layers:
                setattr(self, "bn" + str(layer), nn.LayerNorm(out_dim))
        self.relu, self.dropout, self.dropout_prob, self.th = nn.ReLU(), list(range(8)), 0.2, nn.Tanh()

    def forward(self, input):
        xyz = input[:, -3:]
        if input.shape[1] > 3 and self.latent_dropout:
            latent_vecs = F.dropout(input[:, :-3], p=0.2, training=self.training)
            x = torch.cat([latent_vecs, xyz], 1)
        else:
            x = input
        for layer in range(0, self.num_layers - 1):
            lin = getattr(self, "lin" + str(layer))
            if layer in self.latent_in:
                x = torch.cat([x, input], 1)
            elif layer != 0 and self.xyz_in_all:
                x = torch.cat([x, xyz], 1)
            x = lin(x)
            if layer < self.num_layers - 2:
                if layer in self.norm_layers and not self.weight_norm:
                    x = getattr(self, "bn" + str(layer))(x)
                x = self.relu(x)
                if layer in self.dropout:
                    x = F.dropout(x, p=self.dropout_prob, training=self.training)
        return self.th(x)


@pytest.mark.parametrize("options", [{}, {"weight_norm": False}, {"latent_dropout": True},
                                     {"xyz_in_all": True, "dims": (128,) * 4, "latent_in": (2,), "latent": 29}])
def test_deepsdf_decoder_as_written(options):
    """DeepSDF's `if` on the input's shape is decided for inputs of the first Linear's in_features (the model then
    reads that many: checked), the unused xyz slice dropped: the CPU path within float32's rounding of float64."""
    torch.manual_seed(41)
    model = _DeepSdfDecoder(**options).eval()
    with torch.no_grad():  # (the old hook's weight recomputed without grad, so the module deep-copies: ref64)
        model(torch.randn(2, model.lin0.in_features))
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.in_features == options.get("latent", 256) + 3 and mlp.widths[-1] == 1
    assert any(mlp._norm) == (options.get("weight_norm") is False)
    x = torch.randn(300, mlp.in_features, dtype=torch.float64) * 0.5
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5


def test_a_cat_of_input_slices_before_the_first_linear_reorders_its_columns():
    """torch.cat of slices of x (and x) before the first Linear, through an eval-mode dropout: the Linear's columns at
    the x columns they read, added where a column is read twice; x itself joined again later stays x."""

    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16 + 6, 3)

        def forward(self, x):  # x: 6 features, read as 8 columns (two of them twice)
            h = torch.cat([F.dropout(x[:, 3:6], 0.2, training=False), x[:, 0:3], x[..., 1:2], x[:, 5:6]], -1)
            return self.b(torch.cat([torch.relu(self.a(h)), x], -1))

    torch.manual_seed(53)
    reads_as(Reordered().eval(), [6, 16, 3])


def test_if_on_the_input_shape_that_cannot_be_decided():
    """An `if` on the row count, on the input's values, or traced at a width the model does not read is refused,
    naming why."""
    class Rows(nn.Module):
        def __init__(self, on):
            super().__init__()
            self.a, self.b, self.on = nn.Linear(6, 8), nn.Linear(8, 2), on

        def forward(self, x):
            if (x.shape[0] > 2) if self.on == "rows" else (x.sum() > 0) if self.on == "values" else x.size(-1) > 4:
                x = x * 2
            return self.b(torch.relu(self.a(x)))

    with pytest.raises(fusedmlp.ArgumentError, match="depends on the number of rows"):
        fusedmlp.from_torch(Rows("rows").eval(), device="cpu")
    with pytest.raises(fusedmlp.ArgumentError, match="more than the input's shape"):
        fusedmlp.from_torch(Rows("values").eval(), device="cpu")
    torch.manual_seed(42)
    model = Rows("width").eval()
    mlp = fusedmlp.from_torch(model, device="cpu")  # 6 > 4: x doubled
    x = torch.randn(20, 6, dtype=torch.float64)
    assert mlp.in_features == 6 and max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-6

    class Late(nn.Module):  # (its first registered Linear is not the first it applies)
        def __init__(self):
            super().__init__()
            self.head, self.body = nn.Linear(8, 2), nn.Linear(5, 8)

        def forward(self, x):
            if x.shape[-1] == 8:
                x = x * 2
            return self.head(torch.relu(self.body(x)))

    with pytest.raises(fusedmlp.ArgumentError, match="traced for inputs of 8 features .* pass from_torch's "
                                                     "in_features= .* but reads 5"):
        fusedmlp.from_torch(Late().eval(), device="cpu")
    torch.manual_seed(54)
    late = Late().eval()  # (traced at the width given: 5 != 8, so x is not doubled)
    mlp = fusedmlp.from_torch(late, device="cpu", in_features=5)
    x = torch.randn(20, 5, dtype=torch.float64)
    assert mlp.in_features == 5 and max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(late, x)) <= 1e-6


def test_output_columns_reordered_or_scaled_fold_into_the_last_layer():
    class Heads(nn.Module):
        def __init__(self, act=False):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(4, 16), nn.Linear(16, 5), act

        def forward(self, x):
            y = self.b(torch.relu(self.a(x)))
            y = torch.tanh(y) if self.act else y
            return torch.cat([y[..., 2:] * 3.0, y[:, :2] / 4], -1)

    torch.manual_seed(8)
    model = Heads().eval()
    x = torch.randn(30, 4, dtype=torch.float64)
    assert max_rel(torch.from_numpy(fusedmlp.from_torch(model, device="cpu")(x.float().numpy())),
                   ref64(model, x)) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="scaled after its activation"):
        fusedmlp.from_torch(Heads(act=True).eval(), device="cpu")


class _Sliced(nn.Module):
    """A goal-conditioned policy slicing its input: obs and goal parts, the goal joined again before the head."""

    def __init__(self, open_end=False):
        super().__init__()
        self.open_end = open_end
        self.a, self.b = nn.Linear(5, 32), nn.Linear(32 + 3, 2)

    def forward(self, x):
        obs, goal = x[..., :5], (x[..., 5:] if self.open_end else x[:, 5:8])
        return self.b(torch.cat([torch.relu(self.a(obs)), goal], -1))


def test_slices_of_the_input_read_as_x_with_zero_weights():
    torch.manual_seed(4)
    reads_as(_Sliced().eval(), [8, 32, 2])
    with pytest.raises(fusedmlp.ArgumentError, match=r"x\[\.\.\., 5:\] leaves x's width unknown"):
        fusedmlp.from_torch(_Sliced(open_end=True).eval(), device="cpu")


class _ScaledActor(nn.Module):
    """CleanRL's DDPG / TD3 actor: per-action scale and bias buffers after the tanh."""

    def __init__(self, inputs=17, width=64):
        super().__init__()
        self.a, self.b = nn.Linear(inputs, width), nn.Linear(width, 6)
        self.register_buffer("action_scale", torch.rand(6) + 0.5)
        self.register_buffer("action_bias", torch.randn(6) * 0.1)

    def forward(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x)))) * self.action_scale + self.action_bias


def test_a_constant_map_after_the_last_activation_is_a_diagonal_layer():
    """An RL actor's tanh(z) * action_scale + action_bias with per-action buffers (CleanRL's DDPG / TD3 actor) and a
    BatchNorm1d closing a Sequential after its activation fold into no Linear: each is a layer of its own, diag(s)
    and bias t."""

    class Over(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            return 1.0 / self.a(x)

    torch.manual_seed(15)
    bn = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Tanh(), nn.BatchNorm1d(3))
    bn[-1].running_mean.uniform_(-1, 1), bn[-1].running_var.uniform_(0.5, 2.0)
    for model, k in ((_ScaledActor(), 17), (bn, 4)):
        model.eval()
        mlp = fusedmlp.from_torch(model, device="cpu")
        n = mlp.widths[-1]
        assert mlp.widths[-2] == n and mlp.activations[-1] == "none(x)" and mlp.activations[-2] == "tanh(x)"
        assert np.count_nonzero(mlp._w[-1] - np.diag(np.diag(mlp._w[-1]))) == 0  # diag(s)
        x = torch.randn(60, k, dtype=torch.float64)
        assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5
    mlp = fusedmlp.from_torch(Over().eval(), device="cpu")  # a number over the output: an activation expression
    assert list(mlp.activations) == ["(1 / x)"]


def test_clamps_powers_and_elementwise_math_in_forward():
    """torch.clamp / Tensor.clamp with number bounds, x ** c, and the math functions a forward may call between
    layers (square, sqrt, neg, log1p, exp, ...) are read into the layer's activation."""
    class Math(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = torch.clamp(self.a(x), -1.0, 2.0)
            h = self.b(h).clamp(min=0.0) ** 2
            h = -torch.sqrt(torch.square(h) + 1.0)
            return torch.log1p(self.c(h).exp())

    torch.manual_seed(9)
    model = Math().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.activations)[0] == "min(max(x, (-1)), 2)"
    x = torch.randn(64, 4, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5


class _Critic(nn.Module):
    """SAC's / TD3's Q(obs, act): the inputs joined by one torch.cat before the first Linear."""

    def __init__(self, order="oa"):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(9, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.order = order

    def forward(self, obs, act):
        x = torch.cat([obs, act] if self.order == "oa" else [act, obs], dim=-1)
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


@pytest.mark.parametrize("order", ["oa", "ao"])
def test_a_critic_of_two_inputs_runs_on_their_concatenation(order):
    torch.manual_seed(10)
    critic = _Critic(order).eval()
    obs, act = torch.randn(20, 6), torch.randn(20, 3)
    with torch.no_grad():
        want = critic(obs, act)
        joined = torch.cat([obs, act] if order == "oa" else [act, obs], -1)
        mlp = fusedmlp.from_torch(critic, device="cpu")
        assert max_rel(mlp(joined).double(), want.double()) <= 1e-5
        fused = ft.FusedModule(critic)
        assert max_rel(fused(obs, act).double(), want.double()) <= 1e-5
        with pytest.raises(fusedmlp.ArgumentError, match="FusedModule takes 2 inputs, as the module does; got 1"):
            fused(obs)


def test_two_inputs_not_joined_first_are_named():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.a(x) + y

    with pytest.raises(fusedmlp.ArgumentError, match=r"residual operand y is neither|takes 2 inputs; fusedmlp reads"):
        fusedmlp.from_torch(Two().eval(), device="cpu")


def test_flattening_and_two_input_fused_modules_compile_fullgraph():
    """FusedModule's own reshape (flatten_input) and torch.cat (several inputs) trace with its op under
    torch.compile(fullgraph=True): the op's fake shape is the real one."""
    torch.manual_seed(11)
    images = ft.FusedModule(nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 4)).eval())
    critic = ft.FusedModule(_Critic().eval())
    x, obs, act = torch.randn(5, 3, 4, 4), torch.randn(5, 6), torch.randn(5, 3)
    with torch.no_grad():
        assert torch.allclose(torch.compile(images, fullgraph=True)(x), images(x), rtol=1e-5, atol=1e-6)
        assert torch.allclose(torch.compile(critic, fullgraph=True)(obs, act), critic(obs, act), rtol=1e-5, atol=1e-6)


def test_an_l2_normalized_embedding_head_is_a_fused_rmsnorm():
    """F.normalize(z, dim=-1) after a projection head's last Linear (SimCLR's, CLIP's) runs as the layer's rmsnorm
    with gamma 1 / sqrt(N); a zero row stays zero."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 32)

        def forward(self, x):
            return F.normalize(self.b(F.gelu(self.a(x))), dim=-1)

    torch.manual_seed(12)
    head = Head().eval()
    mlp = fusedmlp.from_torch(head, device="cpu")
    assert "1: rmsnorm" in repr(mlp)
    x = torch.randn(50, 16, dtype=torch.float64)
    with torch.no_grad():
        want = head.double()(x)
    y = torch.from_numpy(mlp(x.float().numpy())).double()
    assert max_rel(y, want) <= 1e-5 and torch.allclose(y.norm(dim=-1), torch.ones(50, dtype=torch.float64))
    with torch.no_grad():
        head.b.weight.zero_(), head.b.bias.zero_()
    assert np.array_equal(fusedmlp.from_torch(head.float(), device="cpu")(x.float().numpy()), np.zeros((50, 32)))


def test_a_number_between_a_linear_and_its_norm_folds_into_the_linear():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.n, self.b = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3)

        def forward(self, x):
            return F.softmax(self.b(torch.relu(self.n(self.a(x) * 3.0))) / 2.0, dim=-1)

    torch.manual_seed(13)
    model = Scaled().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert "0: layernorm" in repr(mlp) and "1: softmax" in repr(mlp)
    x = torch.randn(30, 6, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-5


class _NormCritic(nn.Module):
    """A critic that normalizes its observation (buffers) and scales its action (a number) before joining them."""

    def __init__(self, obs_map="vector"):
        super().__init__()
        self.register_buffer("m", torch.randn(6))
        self.register_buffer("s", torch.rand(6) + 0.5)
        self.l1, self.l2 = nn.Linear(9, 32), nn.Linear(32, 1)
        self.obs_map = obs_map

    def forward(self, obs, act):
        o = (obs - self.m) / self.s if self.obs_map == "vector" else obs * 0.5
        return self.l2(torch.relu(self.l1(torch.cat([o, act / 2.0], dim=-1))))


def test_a_critic_normalizing_its_inputs_before_joining_them():
    torch.manual_seed(14)
    critic = _NormCritic().eval()
    obs, act = torch.randn(25, 6, dtype=torch.float64), torch.randn(25, 3, dtype=torch.float64)
    with torch.no_grad():
        want = critic.double()(obs, act)
        fused = ft.FusedModule(critic.float())
        assert max_rel(fused(obs.float(), act.float()).double(), want) <= 1e-5
    with pytest.raises(fusedmlp.ShapeError, match=r"the joined inputs' widths cannot be told from their maps"):
        fusedmlp.from_torch(_NormCritic("number").eval(), device="cpu")


def test_two_linears_with_nothing_between_merge_where_that_is_fewer_multiply_adds():
    """W2 (W1 h + b1) + b2 is one layer (float64 product) where it costs fewer multiply-adds, its neighbours' residual
    sources and concats renumbered; a bottleneck (64 -> 8 -> 64) stays two layers."""
    torch.manual_seed(50)

    class Net(nn.Module):
        def __init__(self, bottleneck):
            super().__init__()
            mid = 8 if bottleneck else 96
            self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, mid), nn.Linear(mid + 64, 64)
            self.d, self.e = nn.Linear(64, 64), nn.Linear(64, 5)

        def forward(self, x):
            h = torch.relu(self.a(x))
            g = torch.relu(self.c(torch.cat([self.b(h), x], -1)))  # b and c: nothing between them but x's concat
            return self.e(torch.tanh(self.d(g)) + g)  # d's residual reads c's output: layer 2, merged 1

    for bottleneck in (False, True):
        model = Net(bottleneck).eval()
        mlp = fusedmlp.from_torch(model, device="cpu")
        assert len(mlp.widths) == (6 if bottleneck else 5), mlp.widths
        assert mlp._concat[1 if bottleneck else 2] == 0 and mlp._concat[2 if bottleneck else 1] == 1
        x = torch.randn(80, 64, dtype=torch.float64)
        assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(model, x)) <= 1e-6
    seq = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    mlp = fusedmlp.from_torch(seq, device="cpu")
    assert list(mlp.widths) == [16, 32, 4]
    big = copy.deepcopy(seq)
    with torch.no_grad():  # a product over MERGE_LIMIT (float16 keeps each layer's own weights): two layers
        big[0].weight *= 3000
        big[1].weight *= 3000
    assert list(fusedmlp.from_torch(big, device="cpu").widths) == [16, 32, 32, 4]
    x = torch.randn(30, 16, dtype=torch.float64)
    assert max_rel(torch.from_numpy(mlp(x.float().numpy())), ref64(seq, x)) <= 1e-6


def test_wrapped_and_torchscript_modules_read_as_the_module_they_run(tmp_path):
    """torch.compile's OptimizedModule and DataParallel read as the module they wrap; a TorchScript module
    (torch.jit.script / trace, a deployed policy's torch.jit.save file loaded back) through torch's ONNX exporter,
    its tuple of heads and squeezed value head given back by FusedModule as the module gives them."""
    pytest.importorskip("onnx")

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU())
            self.pi, self.v = nn.Linear(32, 3), nn.Linear(32, 1)

        def forward(self, x):
            h = self.trunk(x)
            return torch.tanh(self.pi(h)), self.v(h).squeeze(-1)

    torch.manual_seed(51)
    seq = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(40, 8)
    for wrapped in (torch.compile(seq), nn.DataParallel(seq), torch.jit.script(seq), torch.jit.trace(seq, x[:2])):
        mlp = fusedmlp.from_torch(wrapped, device="cpu")
        assert list(mlp.widths) == [8, 16, 4], type(wrapped)
        assert max_rel(torch.from_numpy(mlp(x.numpy())), ref64(seq, x.double())) <= 1e-6, type(wrapped)
    class Critic(nn.Module):  # Q(obs, act): two inputs, whose widths the scripted module does not say
        def __init__(self):
            super().__init__()
            self.q = nn.Sequential(nn.Linear(11 + 3, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, obs, act):
            return self.q(torch.cat([obs, act], -1)).squeeze(-1)

    critic = Critic().eval()
    with pytest.raises(fusedmlp.ArgumentError, match=r"needs in_features=\(one width per input\)"):
        fusedmlp.from_torch(torch.jit.script(critic), device="cpu")
    obs, act = torch.randn(40, 11), torch.randn(40, 3)
    with torch.no_grad():
        got = ft.FusedModule(torch.jit.script(critic), in_features=(11, 3))(obs, act)
    assert got.shape == (40,) and max_rel(got, critic.double()(obs.double(), act.double())) <= 1e-6
    policy = Policy().eval()
    torch.jit.save(torch.jit.script(policy), tmp_path / "policy.pt")
    loaded = torch.jit.load(tmp_path / "policy.pt")
    assert fusedmlp.from_torch(loaded, device="cpu").activations[-1] == "tanh(x):3 | none(x):1"
    with torch.no_grad():
        got, want = ft.FusedModule(loaded)(x), ref64(policy, x.double())
    assert [g.shape for g in got] == [w.shape for w in want] == [(40, 3), (40,)]
    assert all(max_rel(g, w) <= 1e-6 for g, w in zip(got, want))


class _Stacks(nn.Module):
    """Parallel stacks of Linears on one value: Stable-Baselines3's actor and critic networks of their own on one input
    ("ac", tanh, a Dropout in one of them), three
    stacks with their own output activations returned as a dict ("three"), two heads of two layers each on a shared
    trunk joined by one torch.cat ("heads", one weight_norm'd; "inline": GELU written out between the layers, several
    nodes); the TD3 critic below."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "ac":
            self.pi = nn.Sequential(nn.Linear(17, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh())
            self.vf = nn.Sequential(nn.Linear(17, 48), nn.Tanh(), nn.Linear(48, 64), nn.Tanh())
            self.action, self.value = nn.Linear(64, 6), nn.Linear(64, 1)
        elif kind == "three":
            self.s = nn.ModuleList(nn.Sequential(nn.Linear(9, 20 + i), nn.SiLU(), nn.Linear(20 + i, 2 + i))
                                   for i in range(3))
        else:  # (heads, inline)
            self.trunk = nn.Linear(9, 32)
            self.a1, self.a2 = nn.utils.parametrizations.weight_norm(nn.Linear(32, 16)), nn.Linear(16, 3)
            self.b1, self.b2 = nn.Linear(32, 24), nn.Linear(24, 1, bias=False)

    def forward(self, x):
        if self.kind == "ac":
            return self.action(self.pi(x)), self.value(self.vf(x))
        if self.kind == "three":
            return {"mu": torch.tanh(self.s[0](x)), "log_std": self.s[1](x).clamp(-5, 2), "v": self.s[2](x) * 2}
        h = F.gelu(self.trunk(x))
        if self.kind == "inline":  # GELU written out between the layers (several nodes each)
            def act(z):
                return z * 0.5 * (1.0 + torch.erf(z / 1.4142135623730951))
        else:
            act = F.elu
        return torch.cat([self.b2(act(self.b1(h))), torch.sigmoid(self.a2(act(self.a1(h))))], -1)


class _TD3Critic(nn.Module):
    """Fujimoto's TD3 critic as written: state and action joined, twin Q stacks of F.relu layers."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(14, 256), nn.Linear(256, 256), nn.Linear(256, 1)
        self.l4, self.l5, self.l6 = nn.Linear(14, 256), nn.Linear(256, 256), nn.Linear(256, 1)

    def forward(self, state, action):
        sa = torch.cat([state, action], 1)
        q1 = F.relu(self.l1(sa))
        q1 = F.relu(self.l2(q1))
        q2 = F.relu(self.l4(sa))
        q2 = F.relu(self.l5(q2))
        return self.l3(q1), self.l6(q2)


@pytest.mark.parametrize("kind, widths", [("ac", [17, 112, 128, 7]), ("td3", [14, 512, 512, 2]),
                                          ("three", [9, 63, 9]), ("heads", [9, 32, 40, 4]),
                                          ("inline", [9, 32, 40, 4])])
def test_parallel_stacks_on_one_value_run_as_one_chain(kind, widths):
    """Stacks of Linears on one value, each as deep, the same activation between their layers: one chain whose first
    layer holds every stack's rows, its later ones block-diagonal (zero weights across the stacks), each stack's
    output its columns of the last layer with its own ops after it (the layer's column pieces). From_torch's model and
    FusedModule (eager and under torch.compile) give the module's outputs in float64's tolerance."""
    torch.manual_seed(7)
    model = (_TD3Critic() if kind == "td3" else _Stacks(kind)).eval()
    x = torch.randn(40, 11 if kind == "td3" else widths[0])
    args = (x, torch.randn(40, 3)) if kind == "td3" else (x,)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == widths, mlp
    fused = ft.FusedModule(model)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(*(a.double() for a in args))
        got = fused(*args)
        pairs = list(zip(got.values(), want.values())) if kind == "three" else \
            [(got, want)] if kind in ("heads", "inline") else list(zip(got, want))
        assert [g.shape for g, _ in pairs] == [w.shape for _, w in pairs]
        assert all(max_rel(g, w) <= 1e-6 for g, w in pairs), [max_rel(g, w) for g, w in pairs]
        compiled = torch.compile(fused, fullgraph=True)(*args)
        torch._dynamo.reset()  # (FusedModule.forward's compiles of different architectures count toward one recompile limit)
        one = kind in ("heads", "inline")  # (one tensor returned)
        assert all(torch.equal(c, g) for c, g in zip(*(
            (v.values() if isinstance(v, dict) else [v] if one else v) for v in (compiled, got))))
    if kind == "ac":  # the block-diagonal layer: stack i's rows read stack i's columns only
        w1 = mlp._w[1]
        assert not w1[:64, 64:].any() and not w1[64:, :64].any() and w1[:64, :64].any() and w1[64:, 64:].any()


def test_parallel_stacks_that_cannot_be_one_chain():
    """Stacks of two layers or more but unequal depth, with different activations between their layers, with a norm
    between them, or whose ends another layer reads: an error naming the stacks and the rule; a layer reading a sum
    of their ends reads the merged last layer's rows combined. (A one-layer head beside deeper stacks is the walker's:
    a value riding along the layers, test_nerf_pl_nerf_as_written.)"""

    class Bad(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            self.a1, self.a2, self.b1, self.b2 = (nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(8, 16),
                                                  nn.Linear(16, 2))
            self.norm, self.out, self.b3 = nn.LayerNorm(16), nn.Linear(2, 1), nn.Linear(2, 2)

        def forward(self, x):
            a = self.a2(torch.relu(self.a1(x)))
            if self.kind == "depth":
                return a, self.b3(torch.relu(self.b2(torch.relu(self.b1(x)))))
            if self.kind == "act":
                return a, self.b2(torch.tanh(self.b1(x)))
            if self.kind == "norm":
                return self.a2(self.norm(self.a1(x))), self.b2(self.norm(self.b1(x)))
            if self.kind == "sum":  # (a linear combination of their ends, then a layer: that reads, below)
                return self.out(a + self.b2(torch.relu(self.b1(x))))
            return torch.cat([a, x], -1), self.b2(torch.relu(self.b1(x)))

    for kind, words in (("depth", r"\[2, 3\] layers"), ("act", "layer 0 activations differ"),
                        ("norm", "between two Linears of parallel stacks"), ("read", "reads the end")):
        with pytest.raises(fusedmlp.ArgumentError, match=words):
            fusedmlp.from_torch(Bad(kind).eval(), device="cpu")
    model, x = Bad("sum").eval(), torch.randn(30, 8)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [8, 32, 1]  # (the stacks' last Linears summed, and `out` after them, one layer)
    with torch.no_grad():
        assert max_rel(mlp(x), ref64(model, x)) <= 1e-6


def test_op_handles_differ_between_processes():
    """The handle a traced graph records differs between processes (each counts from a random start): inductor's FX
    graph cache is shared on disk and keyed by the graph, so two processes' models must never share one (a graph
    compiled for one model's output width then asserted its shape on the other's)."""
    import subprocess
    import sys

    code = ("import torch, fusedmlp, fusedmlp.torch as ft; "
            "print(ft._register(fusedmlp.FusedMLP([torch.ones(2, 3).numpy()], device='cpu')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        fusedmlp.__file__)), os.environ.get("PYTHONPATH")])))
    handles = {int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  env=env).stdout) for _ in range(2)}
    assert len(handles) == 2 and min(handles) >= 1 << 20, handles


def test_torchscript_parallel_stacks_read_as_one_chain():
    """A scripted TD3 critic (two inputs, twin stacks) and a traced actor-critic read through torch's ONNX exporter:
    from_onnx's parallel stacks, FusedModule giving the module's tuple."""
    pytest.importorskip("onnx")
    torch.manual_seed(50)
    critic, ac = _TD3Critic().eval(), _Stacks("ac").eval()
    obs, act, x = torch.randn(30, 11), torch.randn(30, 3), torch.randn(30, 17)
    with torch.no_grad():
        for fused, want in ((ft.FusedModule(torch.jit.script(critic), in_features=(11, 3))(obs, act),
                             copy.deepcopy(critic).double()(obs.double(), act.double())),
                            (ft.FusedModule(torch.jit.trace(ac, x[:3]))(x), ref64(ac, x))):
            assert len(fused) == 2 and all(max_rel(g, w) <= 1e-6 for g, w in zip(fused, want))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_an_ensembles_stacked_outputs_come_back_stacked(dim):
    """An ensemble whose members are parallel stacks on one input, returned as torch.stack(members, dim): one
    block-diagonal chain; from_torch's model gives the members side by side, FusedModule the module's stack (eager and
    under torch.compile). Its mean over the members folds into one last layer of their rows averaged (float64); a
    mean over another dim, or over members with an activation after their last Linear, is an error naming it."""
    class Ensemble(nn.Module):
        def __init__(self, mean=None, tail=False):
            super().__init__()
            self.members = nn.ModuleList(nn.Sequential(nn.Linear(6, 24), nn.SiLU(), nn.Linear(24, 24), nn.SiLU(),
                                                       nn.Linear(24, 3), *([nn.Tanh()] if tail else []))
                                         for _ in range(4))
            self.mean_dim = mean

        def forward(self, x):
            y = torch.stack([m(x) for m in self.members], dim)
            return y if self.mean_dim is None else y.mean(self.mean_dim)

    torch.manual_seed(51)
    model, x = Ensemble().eval(), torch.randn(37, 6)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [6, 96, 96, 12]
    fused = ft.FusedModule(model)
    with torch.no_grad():
        want, got = ref64(model, x), fused(x)
        assert got.shape == want.shape and max_rel(got, want) <= 1e-6
        assert torch.equal(torch.compile(fused, fullgraph=True)(x), got)
        torch._dynamo.reset()  # (as above: one recompile limit for different architectures)
        assert max_rel(torch.from_numpy(mlp(x.numpy())), torch.cat(list(want.movedim(dim, 0)), -1)) <= 1e-6
    mean = Ensemble(mean=dim).eval()
    mean.load_state_dict(model.state_dict())
    mlp = fusedmlp.from_torch(mean, device="cpu")
    assert list(mlp.widths) == [6, 96, 96, 3]
    with torch.no_grad():
        assert max_rel(torch.from_numpy(mlp(x.numpy())), ref64(mean, x)) <= 1e-6
        assert max_rel(ft.FusedModule(mean)(x), ref64(mean, x)) <= 1e-6
    with pytest.raises(fusedmlp.ArgumentError, match="torch.stack of parallel stacks"):
        fusedmlp.from_torch(Ensemble(mean=(dim + 1) % 3).eval(), device="cpu")  # (the batch's, or the features')
    with pytest.raises(fusedmlp.ArgumentError, match="after their own activations"):
        fusedmlp.from_torch(Ensemble(mean=dim, tail=True).eval(), device="cpu")
