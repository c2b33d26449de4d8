"""The model readers' conversions on the GPU: what from_torch, from_onnx and from_sklearn read (a flattened input,
constants folded into Linears or joined to activations, a critic's two inputs, an L2-normalized head, ONNX and
scikit-learn graphs) runs on CUDA with check=True (the CPU path computes the same network and the call raises past
the dtype's bound) and against the framework's own outputs."""

import io
import warnings

import numpy as np
import pytest

import fusedmlp
from conftest import rel_l2

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional
from fusedmlp.torch import FusedModule  # noqa: E402

pytestmark = pytest.mark.gpu


class _Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("obs_mean", torch.randn(11))
        self.register_buffer("obs_std", torch.rand(11) + 0.5)
        self.l1, self.l2, self.l3 = nn.Linear(11, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, obs):
        x = (obs - self.obs_mean) / self.obs_std
        h = torch.relu(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        return 2.5 * torch.tanh(self.l3(h))


class _Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(9, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, obs, act):
        return self.l3(F.relu(self.l2(F.relu(self.l1(torch.cat([obs, act], -1))))))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 128), nn.Linear(128, 64)

    def forward(self, x):
        return F.normalize(self.b(F.gelu(self.a(x))), dim=-1)


def _check(y, want, tol=fusedmlp.CHECK_TOLERANCES["float16"]):
    y, want = y.double().cpu().numpy(), want.double().cpu().numpy()
    assert not np.isnan(y).any() and rel_l2(y, want) <= tol, rel_l2(y, want)


def test_torch_models_as_written_on_cuda():
    torch.manual_seed(20)
    mnist = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10), nn.LogSoftmax(-1))
    images = torch.randn(300, 1, 28, 28, device="cuda")
    for model, args in [(mnist, (images,)), (_Actor(), (torch.randn(500, 11, device="cuda"),)),
                        (_Head(), (torch.randn(400, 32, device="cuda"),))]:
        model = model.cuda().eval()
        with torch.no_grad():
            want = model(*args)
            mlp = fusedmlp.from_torch(model, check=True)
            _check(mlp(*args), want)
            fused = FusedModule(model)
            _check(fused(*args), want)
    critic = _Critic().cuda().eval()
    obs, act = torch.randn(700, 6, device="cuda"), torch.randn(700, 3, device="cuda")
    with torch.no_grad():
        _check(FusedModule(critic, check=True)(obs, act), critic(obs, act))


def test_onnx_and_sklearn_models_on_cuda():
    onnx = pytest.importorskip("onnx")
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.SiLU(),
                          nn.Linear(64, 5), nn.Softmax(-1)).eval()
    buf = io.BytesIO()
    torch.onnx.export(model, torch.randn(3, 16), buf, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}})
    mlp = fusedmlp.from_onnx(onnx.load_from_string(buf.getvalue()), device="cuda", check=True)
    x = torch.randn(1000, 16)
    with torch.no_grad():
        _check(torch.from_numpy(mlp(x.numpy())), model(x))
    from test_torch import _Heads, _NerfPl, _SplitHead  # heads and output parts: the last layer's column pieces

    for model in (_Heads("cat"), _SplitHead("chunk"), _SplitHead("dict"), _NerfPl()):  # (and NeRF's view branch)
        width = 90 if isinstance(model, _NerfPl) else 6
        buf = io.BytesIO()
        torch.onnx.export(model.eval(), torch.randn(3, width), buf, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "n"}})
        mlp = fusedmlp.from_onnx(buf.getvalue(), device="cuda", check=True)
        x = torch.randn(1000, width)
        with torch.no_grad():
            want = model.double()(x.double())
        parts = list(want.values()) if isinstance(want, dict) else list(want) if isinstance(want, tuple) else [want]
        _check(torch.from_numpy(mlp(x.numpy())), torch.cat([p if p.ndim == 2 else p[:, None] for p in parts], -1))

    pytest.importorskip("sklearn")
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(22)
    xs, ys = rng.standard_normal((2000, 10)) * 5 + 3, rng.integers(0, 4, 2000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(64, 64), max_iter=20,
                                                            random_state=0)).fit(xs, ys)
    mlp = fusedmlp.from_sklearn(clf, device="cuda", check=True)
    got = mlp(xs.astype(np.float32))
    assert rel_l2(got.astype(np.float64), clf.predict_proba(xs)) <= fusedmlp.CHECK_TOLERANCES["float16"]


def test_encodings_constants_and_softmin_read_this_session_on_cuda():
    """What the readers learned without a GPU at hand (session 36): NeRF's positional encoding written in forward (10
    frequencies: the phase of 2^9 x, formed in float32 as x loads), a PINN's input scaling by its bounds (arithmetic
    on parameters alone), Fourier features of x @ (2 pi B), a Softmin head and an actor's per-action scale after its
    tanh (a diagonal layer of its own), each with check=True and against torch in float64."""
    import copy

    from test_torch import _Encoded, _Pinn, _ScaledActor

    torch.manual_seed(23)
    lo = torch.tensor([-1.0, 0.0, -2.0], device="cuda")
    softmin = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 7), nn.Softmin(-1))
    for model in (_Encoded(), _Encoded(include_input=False, per_feature=True), _Pinn(), softmin,
                  _ScaledActor(inputs=3, width=256)):
        model = model.cuda().eval()
        x = torch.rand(4099, 3, device="cuda") * torch.tensor([2.0, 3.0, 4.5], device="cuda") + lo
        with torch.no_grad():
            want = copy.deepcopy(model).double()(x.double())
            mlp = fusedmlp.from_torch(model, check=True)
            if mlp.encoding is None:  # (an encoding's sines are formed from x in float32 instead)
                assert mlp._net.plan(fusedmlp._api._gpu(0).info["arch"]).info["x_split"] == 1
            _check(mlp(x), want)


def test_nerf_pytorchs_nerf_as_written_on_cuda():
    """nerf-pytorch's NeRF (its input split into points and view directions, alpha carried past the view layer as
    relu(alpha), relu(-alpha)) on CUDA tensors with check=True, against torch in float64, both modes."""
    import copy

    from test_torch import _NerfPytorch

    torch.manual_seed(29)
    for use_viewdirs in (False, True):
        model = _NerfPytorch(use_viewdirs=use_viewdirs).cuda().eval()
        x = torch.randn(4099, 90, device="cuda")
        with torch.no_grad():
            want = copy.deepcopy(model).double()(x.double())
            mlp = fusedmlp.from_torch(model, check=True)
            y = mlp(x)
            _check(y, want)
            _check(y[:, 3:], want[:, 3:])


def test_neus_sdf_network_as_written_on_cuda():
    """NeuS's SDFNetwork (its input scaled, then encoded; weight_norm Linears, Softplus(beta=100), the skip's cat over
    sqrt(2), the SDF column over the scale) on CUDA tensors with check=True, against torch in float64."""
    import copy

    from test_torch import _NeusSdf

    torch.manual_seed(37)
    for scale in (1.0, 0.5):
        model = _NeusSdf(scale=scale).cuda().eval()
        x = torch.rand(4099, 3, device="cuda") * 2 - 1
        with torch.no_grad():
            want = copy.deepcopy(model).double()(x.double())
            _check(fusedmlp.from_torch(model, check=True)(x), want)



def test_deepsdf_decoder_as_written_on_cuda():
    """DeepSDF's Decoder (the `if` on its input's shape, old weight_norm hooks or LayerNorms, the latent code joined
    again at layer 4: sdf512's segments) on CUDA tensors with check=True, against torch in float64."""
    import copy

    from test_torch import _DeepSdfDecoder

    torch.manual_seed(43)
    for options in ({}, {"weight_norm": False}, {"latent_dropout": True}):
        model = _DeepSdfDecoder(**options).cuda().eval()
        x = torch.randn(4099, 259, device="cuda") * 0.5
        with torch.no_grad():
            model(x[:2])  # (the old hook's weight recomputed without grad, so the module deep-copies)
            want = copy.deepcopy(model).double()(x.double())
            _check(fusedmlp.from_torch(model, check=True)(x), want)


def test_nerf_pl_nerf_as_written_on_cuda():
    """nerf_pl's NeRF (sigma carried past the view layer, the last layer's column pieces 'sigmoid:3 | none:1') on
    CUDA tensors with check=True, against torch in float64; sigma's column checked on its own too."""
    import copy

    from test_torch import _NerfPl

    torch.manual_seed(45)
    model = _NerfPl().cuda().eval()
    x = torch.randn(4099, 90, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        y = fusedmlp.from_torch(model, check=True)(x)
        _check(y, want)
        _check(y[:, 3:], want[:, 3:])


def test_heads_and_output_slices_with_activations_on_cuda():
    """Heads with activations of their own, returned as a tuple or one torch.cat, and output slices with their own
    activations (the last layer's column pieces) on CUDA tensors with check=True, against torch in float64."""
    import copy

    from fusedmlp.torch import FusedModule
    from test_torch import _Heads, _SplitHead

    torch.manual_seed(47)
    for kind in ("slices", "slices_reordered", "tuple", "cat_reordered", "cat"):
        model = _Heads(kind).cuda().eval()
        x = torch.randn(2051, 6, device="cuda")
        with torch.no_grad():
            want = copy.deepcopy(model).double()(x.double())
            want = torch.cat(list(want), -1) if isinstance(want, tuple) else want
            _check(fusedmlp.from_torch(model, check=True)(x), want)
    for kind in ("chunk", "split", "tuple", "dict"):  # FusedModule's tuple or dict of the output's parts
        model = _SplitHead(kind).cuda().eval()
        x = torch.randn(2051, 6, device="cuda")
        with torch.no_grad():
            want, got = copy.deepcopy(model).double()(x.double()), FusedModule(model, check=True)(x)
            for g, w in ([(got[k], want[k]) for k in want] if kind == "dict" else zip(got, want)):
                assert g.shape == w.shape
                _check(g, w)


def test_torchscript_and_compiled_modules_on_cuda(tmp_path):
    """A scripted policy saved and loaded back (read through torch's ONNX exporter) and a torch.compile'd module, on
    CUDA tensors with check=True: FusedModule's heads against torch in float64."""
    import copy

    pytest.importorskip("onnx")
    from fusedmlp.torch import FusedModule

    torch.manual_seed(52)
    model = nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 6)).cuda().eval()
    x = torch.randn(3001, 12, device="cuda")
    torch.jit.save(torch.jit.script(model), tmp_path / "policy.pt")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
        for wrapped in (torch.jit.load(tmp_path / "policy.pt"), torch.compile(model)):
            _check(FusedModule(wrapped, check=True)(x), want)


def test_parallel_stacks_on_cuda():
    """Parallel stacks of Linears on one value (TD3's twin critics on two inputs, an actor and a critic of their own,
    three stacks returned as a dict, two-layer heads joined by one torch.cat) as one block-diagonal chain on CUDA
    tensors with check=True, from torch and from its ONNX export, against torch in float64; at 1, 1000 and 70001
    rows (the 512-wide TD3 chain in the streamed kernel's wide form)."""
    import copy

    import fusedmlp.onnx  # noqa: F401 (from_onnx)
    from test_torch import _Stacks, _TD3Critic

    torch.manual_seed(48)
    for kind in ("td3", "ac", "three", "heads"):
        model = (_TD3Critic() if kind == "td3" else _Stacks(kind)).cuda().eval()
        width = {"td3": 11, "ac": 17}.get(kind, 9)
        for rows in (1, 1000, 70001):
            args = (torch.randn(rows, width, device="cuda"),) + ((torch.randn(rows, 3, device="cuda"),)
                                                                   if kind == "td3" else ())
            with torch.no_grad():
                want = copy.deepcopy(model).double()(*(a.double() for a in args))
                got = FusedModule(model, check=True)(*args)
            pairs = [(got[k], want[k]) for k in want] if kind == "three" else [(got, want)] if kind == "heads" \
                else list(zip(got, want))
            for g, w in pairs:
                assert g.shape == w.shape
                _check(g, w)
        if kind in ("td3", "ac"):  # the exported graph: its outputs side by side
            buf, names = io.BytesIO(), ["state", "action"] if kind == "td3" else ["x"]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model.cpu(), tuple(a.cpu() for a in args), buf, dynamo=False, input_names=names,
                                  dynamic_axes={n: {0: "n"} for n in names})
            mlp = fusedmlp.from_onnx(buf.getvalue(), check=True)
            x = torch.cat(args, -1)
            with torch.no_grad():
                want = torch.cat(list(copy.deepcopy(model).double()(*(a.double().cpu() for a in args))), -1)
            _check(mlp(x), want)
