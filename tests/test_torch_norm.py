"""from_torch on models as they are written (issue 30), CPU path: BatchNorm1d folded into a neighbouring Linear,
parametrized Linears read as their effective weight, in Sequentials and through torch.fx."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
from torch.nn.utils import parametrizations  # noqa: E402

import fusedmlp  # noqa: E402
from fusedmlp import torch as ft  # noqa: E402


def ref64(module, x):
    """The module's own eval-mode forward in float64 (on a copy, so the module keeps its dtype)."""
    with torch.no_grad():
        return copy.deepcopy(module).double()(x.double())


def ref64_in_place(module, x):
    """ref64 for modules deepcopy refuses (the old weight_norm hook's computed weight): the module itself in
    float64, so read it before calling this."""
    with torch.no_grad():
        return module.double()(x.double())


def rel(y, ref):
    y = torch.as_tensor(y).double()
    return float((y - ref).norm() / ref.norm())


def trained_bn(features, seed, affine=True):
    """A BatchNorm1d with running statistics far from (0, 1) and a random affine: a fold that ignored any of them
    would be off by far more than float32 rounding."""
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm1d(features, affine=affine)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(features, generator=g) * 3)
        bn.running_var.copy_(torch.rand(features, generator=g) * 4 + 0.05)
        if affine:
            bn.weight.copy_(torch.randn(features, generator=g))
            bn.bias.copy_(torch.randn(features, generator=g))
    return bn.eval()


# ------------------------------------------------------------------------------------------------ BatchNorm1d


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_after_each_linear_folds_exactly(affine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 32), trained_bn(32, 1, affine), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(32, 24, bias=False), trained_bn(24, 2, affine), nn.SiLU(),
                          nn.Linear(24, 3)).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths == (7, 32, 24, 3) and mlp.activations == ("relu(x)", "silu(x)", "none(x)")
    x = torch.randn(200, 7)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


def test_batchnorm_folds_into_the_weights_as_float64_then_float32():
    """The fold's arrays are the float64 products rounded once: W' = diag(s) W, b' = s b + t."""
    lin, bn = nn.Linear(5, 4), trained_bn(4, 3)
    weights, biases, _, _ = ft.read_module(nn.Sequential(lin, bn).eval())
    s = 1 / np.sqrt(bn.running_var.double().numpy() + bn.eps) * bn.weight.double().detach().numpy()
    t = bn.bias.double().detach().numpy() - bn.running_mean.double().numpy() * s
    w64, b64 = lin.weight.double().detach().numpy(), lin.bias.double().detach().numpy()
    np.testing.assert_array_equal(weights[0], (s[:, None] * w64).astype(np.float32))
    np.testing.assert_array_equal(biases[0], (s * b64 + t).astype(np.float32))
    assert weights[0].dtype == np.float32 and biases[0].dtype == np.float32


def test_batchnorm_before_a_linear_folds_into_its_input_side():
    """Input normalisation (BN first), BN after an activation (BN -> Linear: W' = W diag(s), b' = b + W t), two BNs
    in a row, and a BN after the output Linear."""
    torch.manual_seed(4)
    model = nn.Sequential(trained_bn(6, 5), nn.Linear(6, 40, bias=False), nn.Tanh(), trained_bn(40, 6),
                          trained_bn(40, 7, affine=False), nn.Linear(40, 16), nn.GELU(), trained_bn(16, 8),
                          nn.Identity(), nn.Linear(16, 2), trained_bn(2, 9)).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths == (6, 40, 16, 2)
    x = torch.randn(300, 6)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


def test_batchnorm_in_torchvision_mlp():
    tv = pytest.importorskip("torchvision")
    try:
        model = tv.ops.MLP(6, [32, 32, 3], norm_layer=nn.BatchNorm1d, activation_layer=nn.SiLU)
    except Exception as e:  # torchvision's ops may fail to import beside this torch build
        pytest.skip(f"torchvision unusable here: {e}")
    for i, m in enumerate(model.modules()):
        if isinstance(m, nn.BatchNorm1d):
            m.load_state_dict(trained_bn(m.num_features, 20 + i).state_dict())
    model.eval()
    x = torch.randn(50, 6)
    assert rel(fusedmlp.from_torch(model, device="cpu")(x), ref64(model, x)) <= 1e-6


def test_batchnorm_in_training_mode_names_the_module():
    model = nn.Sequential(nn.Linear(3, 8), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 1))
    with pytest.raises(fusedmlp.ArgumentError, match=r"^1\.1: BatchNorm1d is in training mode.*model\.eval\(\)"):
        fusedmlp.from_torch(model, device="cpu")


@pytest.mark.parametrize("layers, match", [
    # an activation between the BN and the next Linear: no exact fold
    (lambda: [nn.Linear(4, 8), nn.ReLU(), trained_bn(8, 1), nn.ReLU(), nn.Linear(8, 2)],
     r"^2: BatchNorm1d is followed by an activation \(3\) before the next Linear"),
    # at the end, after an activation (a diagonal layer of its own where the widths agree)
    (lambda: [nn.Linear(4, 8), nn.Tanh(), trained_bn(6, 1)],
     r"^2: BatchNorm1d has 6 features but the network's output has 8"),
    (lambda: [nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=False).eval(), nn.Linear(8, 2)],
     r"^1: BatchNorm1d\(track_running_stats=False\)"),
    (lambda: [nn.Linear(4, 8), trained_bn(6, 1), nn.Linear(6, 2)],
     r"^1: BatchNorm1d has 6 features but the Linear before it has 8 outputs"),
    (lambda: [nn.Linear(4, 8), nn.ReLU(), trained_bn(6, 1), nn.Linear(8, 2)],
     r"^2: BatchNorm1d has 6 features but the Linear after it \(3\) takes 8 inputs"),
])
def test_batchnorm_without_an_exact_fold_is_an_error_naming_it(layers, match):
    model = nn.Sequential(*layers())
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.eval()
    model.eval()
    with pytest.raises((fusedmlp.ArgumentError, fusedmlp.ShapeError), match=match):
        fusedmlp.from_torch(model, device="cpu")


class _TracedBN(nn.Module):
    """A non-Sequential model: BN after a Linear, BN before a Linear (after an activation), a residual from the
    pre-BN value and from the network input."""

    def __init__(self):
        super().__init__()
        self.a, self.bn_a = nn.Linear(10, 32), trained_bn(32, 11)
        self.bn_h = trained_bn(32, 12)
        self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 10)
        self.bn_c = trained_bn(10, 13)

    def forward(self, x):
        h = torch.relu(self.bn_a(self.a(x)))
        g = self.bn_h(h)  # folded into b's input side; the residual below reads h, before it
        h = h + nn.functional.silu(self.b(g))
        return x * torch.sigmoid(self.bn_c(self.c(h)))


def test_traced_batchnorm_folds_before_and_after_linears():
    torch.manual_seed(7)
    model = _TracedBN().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert [r[2] if r else None for r in mlp._residual] == [None, 0, -1]
    x = torch.randn(120, 10)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


class _ResidualOfBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), trained_bn(8, 14), nn.Linear(8, 8)

    def forward(self, x):
        g = self.bn(torch.tanh(self.a(x)))
        return g + self.b(g)


def test_traced_residual_of_a_folded_batchnorm_is_an_error():
    with pytest.raises(fusedmlp.ArgumentError, match="residual operand bn is the output of bn .BatchNorm1d., which "
                                                     "was folded into the next Linear"):
        fusedmlp.from_torch(_ResidualOfBN().eval(), device="cpu")


def test_traced_batchnorm_in_training_mode_names_the_module():
    model = _TracedBN().eval()
    model.bn_h.train()
    with pytest.raises(fusedmlp.ArgumentError, match="^bn_h: BatchNorm1d is in training mode"):
        fusedmlp.from_torch(model, device="cpu")


# ------------------------------------------------------------------------------------------------ parametrizations


def parametrized_model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 32)), nn.SiLU(),
                          parametrizations.spectral_norm(nn.Linear(32, 32)), nn.Tanh(),
                          torch.nn.utils.weight_norm(nn.Linear(32, 24)), nn.ReLU(),
                          parametrizations.weight_norm(nn.Linear(24, 4), dim=None))
    with torch.no_grad():  # a weight_g far from the norm of weight_v: the effective weight differs from either
        model[0].parametrizations.weight.original0.mul_(3.0)
        model[4].weight_g.mul_(0.25)
    return model.eval()


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*:FutureWarning")
def test_parametrized_linears_read_as_their_effective_weight():
    model = parametrized_model(8)
    mlp = fusedmlp.from_torch(model, device="cpu")
    weights, _, _, _ = ft.read_module(model)
    np.testing.assert_array_equal(weights[1], model[2].weight.detach().numpy())
    x = torch.randn(100, 6)
    assert rel(mlp(x), ref64_in_place(model, x)) <= 1e-6


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*:FutureWarning")
def test_fused_module_of_parametrized_linears_keeps_state_dict_keys_and_reloads():
    model = parametrized_model(9)
    fused = ft.FusedModule(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    assert "4.weight_g" in fused.state_dict() and "0.parametrizations.weight.original1" in fused.state_dict()
    x = torch.randn(40, 6)
    with torch.no_grad():
        assert rel(fused(x), model(x).double()) <= 1e-5
        other = parametrized_model(10)
        fused.load_state_dict(other.state_dict())  # the old hook's weight attribute is stale until a forward
        assert rel(fused(x), ref64_in_place(other, x)) <= 1e-6


def test_spectral_norm_in_training_mode_is_an_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), parametrizations.spectral_norm(nn.Linear(8, 2)))
    with pytest.raises(fusedmlp.ArgumentError, match=r"^2: spectral_norm runs a power iteration.*model\.eval\(\)"):
        fusedmlp.from_torch(model, device="cpu")


class _TracedParametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(5, 16))
        self.bn = trained_bn(16, 15)
        self.b = parametrizations.spectral_norm(nn.Linear(16, 16))
        self.c = parametrizations.weight_norm(nn.Linear(16, 3))

    def forward(self, x):
        h = nn.functional.gelu(self.bn(self.a(x)))
        h = h + torch.tanh(self.b(h))
        return nn.functional.linear(h, self.c.weight, self.c.bias)  # fx calls c's ParametrizationList here


def test_traced_modules_see_through_parametrizations():
    torch.manual_seed(11)
    model = _TracedParametrized().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    x = torch.randn(80, 5)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6
    fused = ft.FusedModule(model)
    assert list(fused.state_dict()) == ["module." + k for k in model.state_dict()]
    with torch.no_grad():
        assert rel(fused(x), ref64(model, x)) <= 1e-6


# ------------------------------------------------------------------------------------------------ LayerNorm, RMSNorm


def randomized(norm, seed):
    """A LayerNorm / RMSNorm with a random affine (its defaults are ones and zeros, which would hide a mix-up)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if norm.weight is not None:
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    return norm


def rl_mlp(seed, norm_layers):
    """The MLP of recent RL agents: Linear -> norm -> SiLU / Mish per hidden layer."""
    torch.manual_seed(seed)
    layers, widths = [], [17, 64, 64, 48, 5]
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(k, n))
        if i < len(widths) - 2:
            layers += [randomized(norm_layers[i](n), seed + i), nn.SiLU() if i % 2 == 0 else nn.Mish()]
    return nn.Sequential(*layers).eval()


@pytest.mark.parametrize("norms", [
    [lambda n: nn.LayerNorm(n)] * 3,
    [lambda n: nn.LayerNorm(n, elementwise_affine=False), lambda n: nn.LayerNorm(n, bias=False),
     lambda n: nn.LayerNorm(n, eps=1e-3)],
    [lambda n: nn.RMSNorm(n), lambda n: nn.RMSNorm(n, eps=1e-6), lambda n: nn.RMSNorm(n, elementwise_affine=False)],
], ids=["layernorm", "layernorm-variants", "rmsnorm"])
def test_linear_norm_activation_stacks_are_fused(norms):
    model = rl_mlp(12, norms)
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths == (17, 64, 64, 48, 5) and len([n for n in mlp._norm if n]) == 3
    x = torch.randn(150, 17)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


def test_rmsnorm_default_eps_is_float32_epsilon():
    norm = nn.RMSNorm(8)
    mlp = fusedmlp.from_torch(nn.Sequential(nn.Linear(3, 8), norm, nn.Tanh(), nn.Linear(8, 2)).eval(), device="cpu")
    assert norm.eps is None and mlp._norm[0][1] == float(torch.finfo(torch.float32).eps)


def test_batchnorm_after_a_layernorm_folds_into_its_affine():
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(6, 32), randomized(nn.LayerNorm(32), 1), trained_bn(32, 16), nn.GELU(),
                          nn.Linear(32, 32), nn.LayerNorm(32, elementwise_affine=False), trained_bn(32, 17),
                          nn.ReLU(), nn.Linear(32, 3)).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp.widths == (6, 32, 32, 3) and mlp._norm[1][2] is not None  # gamma' = s, beta' = t
    x = torch.randn(90, 6)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


def test_fused_module_of_a_norm_mlp_round_trips_its_state_dict():
    model = rl_mlp(14, [lambda n: nn.LayerNorm(n)] * 3)
    fused = ft.FusedModule(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    other = rl_mlp(15, [lambda n: nn.LayerNorm(n)] * 3)
    x = torch.randn(30, 17)
    with torch.no_grad():
        fused.load_state_dict(other.state_dict())  # new gammas and betas: the fused model must follow
        assert rel(fused(x), ref64(other, x)) <= 1e-6


class _PreNormBlock(nn.Module):
    """A traced module: Linear -> LayerNorm (module) -> SiLU, then residual blocks h + mish(F.layer_norm(W h)), a
    functional rms_norm with a parameter, and BatchNorm1d folded before the output Linear."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln = nn.Linear(9, 64), randomized(nn.LayerNorm(64), 3)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
        self.block_norms = nn.ModuleList([randomized(nn.LayerNorm(64), 4 + i) for i in range(2)])
        self.mid = nn.Linear(64, 32)
        self.rms_weight = nn.Parameter(torch.rand(32) + 0.5)
        self.bn = trained_bn(32, 18)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = nn.functional.silu(self.ln(self.inp(x)))
        for lin, norm in zip(self.blocks, self.block_norms):
            z = nn.functional.layer_norm(lin(h), (64,), norm.weight, norm.bias, 1e-5)
            h = h + nn.functional.mish(z)
        h = torch.tanh(nn.functional.rms_norm(self.mid(h), (32,), self.rms_weight, 1e-6))
        return self.out(self.bn(h))


def test_traced_norms_modules_and_functions():
    torch.manual_seed(16)
    model = _PreNormBlock().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert [n[0] if n else None for n in mlp._norm] == [1, 1, 1, 2, None]
    assert [r[2] if r else None for r in mlp._residual] == [None, 0, 1, None, None]
    x = torch.randn(70, 9)
    assert rel(mlp(x), ref64(model, x)) <= 1e-6


class _SimBa(nn.Module):
    """SimBa's residual MLP as written (Lee et al., 2024): a Linear in, blocks h + W2 relu(W1 LayerNorm(h)), and a
    LayerNorm before the head. Each block's norm reads the residual stream h, which the block's sum reads too."""

    def __init__(self, width=16, blocks=2, din=9, dout=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(din, width)
        self.norms = nn.ModuleList([randomized(nn.LayerNorm(width), seed + 1 + i) for i in range(blocks)])
        self.ups = nn.ModuleList([nn.Linear(width, 4 * width) for _ in range(blocks)])
        self.downs = nn.ModuleList([nn.Linear(4 * width, width) for _ in range(blocks)])
        self.out_norm, self.out = randomized(nn.LayerNorm(width), seed + 9), nn.Linear(width, dout)

    def forward(self, x):
        h = self.inp(x)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            h = h + down(torch.relu(up(norm(h))))
        return self.out(self.out_norm(h))


def test_pre_norm_blocks_run_each_norm_on_an_identity_layer_of_its_own():
    """A norm that follows no Linear directly (SimBa's LayerNorm of the residual stream, which the block's sum reads
    too) runs on a layer of its own: an identity Linear without bias whose fused norm it is, so the stream stays a
    layer's output for the residual. On inputs far from zero the CPU path matches torch in float64."""
    model = _SimBa().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [9, 16, 16, 64, 16, 16, 64, 16, 16, 3]
    assert [i for i, n in enumerate(mlp._norm) if n] == [1, 4, 7]
    weights, biases, _, _ = ft.read_module(model)
    assert all(np.array_equal(weights[i], np.eye(16, dtype=np.float32)) and biases[i] is None for i in (1, 4, 7))
    assert [r[2] if r else None for r in mlp._residual] == [None, None, None, 0, None, None, 3, None, None]
    x = torch.randn(70, 9) * 4 + 3
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6


def test_an_identity_in_place_of_a_norm_is_another_name_of_the_value():
    """A block configured without its norm (`nn.Identity()` in its place, as configurable models write it) reads the
    residual stream through the Identity while the sum reads it directly: one value, no extra layer. A norm after an
    Identity of a Linear's output that a residual also reads gets a layer of its own, not the Linear's fused norm."""
    model = _SimBa().eval()
    model.norms = nn.ModuleList([nn.Identity(), nn.Identity()])
    model.out_norm = nn.Identity()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [9, 16, 64, 16, 64, 16, 3] and not any(mlp._norm)
    assert [r[2] if r else None for r in mlp._residual] == [None, None, 0, None, 2, None]
    x = torch.randn(40, 9)
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6

    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.skip, self.o = nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 2)
            self.n = randomized(nn.LayerNorm(8), 7)

        def forward(self, x):
            h = self.a(x)
            return self.o(torch.relu(self.n(self.skip(h))) + h)

    model = Aliased().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [8, 8, 8, 2] and mlp._norm[0] is None and mlp._norm[1] is not None
    x = torch.randn(40, 8)
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6


def test_a_dropout_called_again_on_a_value_is_another_name_of_it():
    """A block's Dropout called on the residual stream twice, `drop(h) + f(norm(drop(h)))` (a pre-norm block written
    with dropout on both paths): each call is another name of h, so the norm gets a layer of its own and the sum reads
    h, whichever call's name it reads; a Dropout of a value aside from the chain (its result read later) leaves the
    chain where it was. The CPU path matches torch in float64."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 32), nn.Linear(32, 16)
            self.o, self.n, self.drop = nn.Linear(16, 3), randomized(nn.LayerNorm(16), 5), nn.Dropout(0.2)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            h = self.drop(h) + self.down(nn.functional.silu(self.up(self.n(self.drop(h)))))
            u = self.up(h)
            skip = self.drop(h)  # aside: a Dropout of h after the chain moved on to u
            return self.o(torch.relu(self.down(torch.relu(u))) + skip)

    model = Twice().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [6, 16, 16, 32, 16, 32, 16, 3]
    assert [i for i, n in enumerate(mlp._norm) if n] == [1]
    assert [r[2] if r else None for r in mlp._residual] == [None, None, None, 0, None, 3, None]
    x = torch.randn(50, 6) * 2 + 1
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6


def test_traced_norms_read_normalized_shape_from_the_value():
    """F.layer_norm(z, z.shape[-1:]) / F.rms_norm(z, (z.size(-1),)) / [z.shape[-1]], as functional code writes them:
    the normalized value's last dimension, the layer's width; the shape queries are no readers of z (the norm stays
    fused into the Linear). A normalized_shape read from another tensor, or for a norm of the network input, is
    named."""
    import torch.nn.functional as F

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(5, 16), nn.Linear(16, 16), nn.Linear(16, 3)
            self.g = nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            z = self.a(x)
            h = torch.tanh(F.layer_norm(z, z.shape[-1:]))
            z = self.b(h)
            h = F.silu(F.rms_norm(z, (z.size(-1),), self.g)) + h
            z = self.c(h)
            return F.layer_norm(z, [z.shape[-1]])

    torch.manual_seed(9)
    model = Functional().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert list(mlp.widths) == [5, 16, 16, 3] and all(n is not None for n in mlp._norm)
    x = torch.randn(40, 5) * 2
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 16), nn.Linear(16, 16)

        def forward(self, x):
            z = self.a(x)
            return F.layer_norm(self.b(z), z.shape[-1:])

    class Input(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 16)

        def forward(self, x):
            return self.a(F.layer_norm(x, x.shape[-1:]))

    with pytest.raises(fusedmlp.ArgumentError, match="read from a tensor other than as the normalized value's last"):
        fusedmlp.from_torch(Other(), device="cpu")
    with pytest.raises(fusedmlp.ArgumentError, match="a norm of the network input whose normalized_shape is read"):
        fusedmlp.from_torch(Input(), device="cpu")


class _PostNorm(nn.Module):
    """A post-norm residual block, RMSNorm(h + tanh(W h)), then a softmax after an activation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp, self.hid, self.out = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.norm = randomized(nn.RMSNorm(32), 6)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = self.norm(h + torch.tanh(self.hid(h)))
        return torch.softmax(torch.tanh(self.out(h)), -1)


@pytest.mark.parametrize("layers, identities", [
    (lambda: [randomized(nn.LayerNorm(4), 1), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)], [0]),
    (lambda: [nn.Linear(4, 8), nn.ReLU(), randomized(nn.LayerNorm(8), 2), nn.Linear(8, 2)], [1]),
    (lambda: [nn.Linear(4, 8), randomized(nn.LayerNorm(8), 3), randomized(nn.RMSNorm(8), 4), nn.SiLU(),
              nn.Linear(8, 2)], [1]),
    (lambda: [nn.Linear(4, 8), nn.ReLU(), trained_bn(8, 1), randomized(nn.LayerNorm(8), 5), nn.Linear(8, 2)], [1]),
    (lambda: [nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3), nn.Tanh(), nn.LogSoftmax(-1)], [2]),
])
def test_norms_after_no_linear_convert_onto_identity_layers(layers, identities):
    """The norm of the network input, after an activation, after another norm, or after a batch norm (which folds into
    the identity: diag(s), bias t), and a softmax after an activation: each on an identity layer of its own."""
    model = nn.Sequential(*layers()).eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    weights = ft.read_module(model)[0]
    for i in identities:
        assert mlp._norm[i] is not None and weights[i].shape[0] == weights[i].shape[1]
    x = torch.randn(50, 4) * 2 + 1
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6
    post = _PostNorm().eval()
    mlp = fusedmlp.from_torch(post, device="cpu")
    assert list(mlp.widths) == [6, 32, 32, 32, 5, 5] and [i for i, n in enumerate(mlp._norm) if n] == [2, 4]
    x = torch.randn(50, 6)
    assert rel(mlp(x.numpy()), ref64(post, x)) <= 1e-6


@pytest.mark.parametrize("layers, match", [
    (lambda: [nn.Linear(4, 8), nn.LayerNorm((2, 8)), nn.Linear(8, 2)],
     r"^1: LayerNorm normalizes over \(2, 8\), but the Linear before it has 8 outputs"),
    (lambda: [nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(6), nn.Linear(6, 2)],
     r"^2: LayerNorm normalizes over \(6,\), but the value before it has 8 features"),
    (lambda: [nn.Softmax(-1), nn.Linear(4, 2)], r"^0: Softmax of the network input"),
])
def test_norms_fusedmlp_cannot_take_are_errors_naming_the_module(layers, match):
    with pytest.raises((fusedmlp.ArgumentError, fusedmlp.ShapeError), match=match):
        fusedmlp.from_torch(nn.Sequential(*layers()).eval(), device="cpu")


def test_pre_norm_networks_compile_ahead_of_time(tmp_path):
    """SimBa as one fused kernel (64 wide) and as a chain (512 wide: its 2048-wide layers GEMMs, each 512-wide norm
    an identity GEMM and a row pass), planned and compiled for sm_90a."""
    small = fusedmlp.from_torch(_SimBa(width=64, blocks=1).eval(), device="cpu", cache_dir=tmp_path)
    assert str(small.compile("sm_90", "float16")).endswith(".cubin")  # (one kernel: its path)
    wide = fusedmlp.from_torch(_SimBa(width=512, blocks=1, din=17).eval(), device="cpu", cache_dir=tmp_path)
    x = torch.randn(40, 17)
    assert rel(wide(x.numpy()), ref64(_SimBa(width=512, blocks=1, din=17).eval(), x)) <= 1e-6
    assert len(wide.compile("sm_90", "float16")) >= 4
    assert sum("layernorm in a second kernel" in s for s in wide.segments) == 2, wide.segments


@pytest.mark.gpu
@pytest.mark.parametrize("width", [64, 512])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_pre_norm_simba_matches_torch_float64(width, dtype):
    """SimBa on the GPU (64 wide: one fused kernel; 512: a chain of GEMMs, identity GEMMs and row passes) against torch
    in float64, inputs far from zero, float32 x and y."""
    model = _SimBa(width=width, blocks=2, din=17, dout=5, seed=width).eval()
    mlp = fusedmlp.from_torch(model.cuda(), dtype=dtype)
    x = torch.randn(4099, 17, device="cuda") * 3 + 2
    with torch.no_grad():
        y = mlp(x)
    assert y.dtype == torch.float32 and not torch.isnan(y).any()
    assert rel(y.cpu(), ref64(model.cpu(), x.cpu())) <= (4e-3 if dtype == "float16" else 3e-2)


@pytest.mark.gpu
def test_gpu_rl_mlp_with_layernorm_matches_torch_float64():
    model = rl_mlp(19, [lambda n: nn.LayerNorm(n)] * 3)
    mlp = fusedmlp.from_torch(model.cuda())
    x = torch.randn(4099, 17, device="cuda")
    with torch.no_grad():
        y = mlp(x)
    assert y.dtype == torch.float32 and not torch.isnan(y).any()
    assert rel(y.cpu(), ref64(model.cpu(), x.cpu())) <= 2e-3


def test_a_wide_layernorm_model_converts_and_compiles_as_gemms_and_row_passes(tmp_path):
    """A SimBa/BRO-style critic as written (Linear -> LayerNorm -> ReLU at 1024 features, a residual block, a weight-norm
    head): from_torch reads it, the CPU path matches torch in float64, and for sm_90 and sm_80 each 1024-wide norm
    layer plans as its GEMM and a row pass (a LimitError before), compiled ahead of time."""
    torch.manual_seed(3)

    class Critic(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.ln0 = nn.Linear(48, 1024), nn.LayerNorm(1024)
            self.hid, self.ln1 = nn.Linear(1024, 1024), nn.LayerNorm(1024)
            self.head = parametrizations.weight_norm(nn.Linear(1024, 1))

        def forward(self, x):
            h = torch.relu(self.ln0(self.inp(x)))
            h = h + torch.relu(self.ln1(self.hid(h)))
            return self.head(h)

    model = Critic().eval()
    with torch.no_grad():
        for ln in (model.ln0, model.ln1):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    mlp = fusedmlp.from_torch(model, device="cpu", cache_dir=tmp_path)
    x = torch.randn(300, 48)
    assert rel(mlp(x.numpy()), ref64(model, x)) <= 1e-6
    for arch in ("sm_90", "sm_80"):
        paths = mlp.compile(arch, "float16")
        assert len(paths) >= 5, paths  # two GEMMs and their row passes, and the head
    assert sum("layernorm in a second kernel" in s for s in mlp.segments) == 2
