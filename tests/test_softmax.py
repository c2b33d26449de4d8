"""Softmax and log_softmax over a layer's features (a classifier's head), fused as that layer's norm: the spellings,
the CPU path against float64, from_torch, the plans and ahead-of-time compiles of every kernel form and of the row pass
that finishes a head wider than the fused kernels hold (no GPU needed), and, marked `gpu`, every form on the device
against float64 with poisoned outputs."""

import re
import types

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _api, _core, _segments
from conftest import rel_l2
from test_gpu import run_io_kernel as run_kernel
from test_norm import (assert_every_form, check_cpu_random_graphs, check_default, check_forms, fused, gpu_forms,
                       norm_forward, norm_layer_chunks, weights_for)

SOFT = ("softmax", "log_softmax")


def head(rng, widths, kind, hidden_norms=None, acts=None, bias_offset=0.0, logit_scale=1.0):
    """A classifier namespace (test_norm's graph form): widths, weights (the last layer's times logit_scale, so that
    its logits spread), `kind` on the last layer, optional hidden norms {layer: kind}."""
    ws, bs = weights_for(rng, widths, bias_offset=bias_offset)
    ws[-1] = (ws[-1] * logit_scale).astype(np.float32)
    norms = {l: (k, None, None, 0.0) for l, k in (hidden_norms or {}).items()}
    norms[len(widths) - 2] = (kind, None, None, 0.0)
    acts = acts or ["gelu"] * (len(widths) - 2) + ["none"]
    return types.SimpleNamespace(widths=widths, ws=ws, bs=bs, acts=acts, norms=norms, residual={}, concat={})


def model(g, **kwargs):
    return fusedmlp.FusedMLP(g.ws, g.bs, activation=g.acts, norm={l: e[0] for l, e in g.norms.items()}, **kwargs)


# ------------------------------------------------------------------------------------------------ the CPU path

@pytest.mark.parametrize("kind", SOFT)
@pytest.mark.parametrize("widths", [[20, 64, 10], [7, 33, 1], [16, 48, 48, 300], [5, 2]])
def test_cpu_softmax_heads_match_float64(rng, kind, widths):
    g = head(rng, widths, kind, logit_scale=8.0)
    x = rng.standard_normal((257, widths[0])).astype(np.float32)
    y = model(g, device="cpu")(x).astype(np.float64)
    ref = norm_forward(x, g.ws, g.bs, g.acts, norms=g.norms)
    assert rel_l2(y, ref) < 1e-6
    if kind == "softmax":
        assert np.allclose(y.sum(1), 1.0, atol=1e-6) and (y >= 0).all()
    else:
        assert (y <= 1e-7).all() and np.allclose(np.exp(y).sum(1), 1.0, atol=1e-5)


def test_cpu_softmax_of_huge_logits_is_finite(rng):
    """Logits near float32's largest: exp(z - max) never overflows (the max is taken first)."""
    g = head(rng, [4, 32, 6], "softmax", bias_offset=3e4, logit_scale=1e3)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    for kind in SOFT:
        y = fusedmlp.FusedMLP(g.ws, g.bs, "relu", kind, device="cpu")(x)
        assert np.all(np.isfinite(y))


def test_cpu_random_graphs_mixing_softmax_norms_residuals_and_concats_match_float64():
    """test_norm's random graphs, each norm layer's kind redrawn among the four (a softmax takes no affine and no eps):
    softmaxes on hidden and last layers, before any activation, under residuals and concats, against float64."""
    def redraw(rng, g):
        for l, entry in list(g.norms.items()):
            kind = str(rng.choice(["layernorm", "rmsnorm", "softmax", "log_softmax"]))
            g.norms[l] = (kind, None, None, 0.0) if kind in SOFT else (kind, *entry[1:])

    checked = check_cpu_random_graphs(31, redraw)
    assert len(checked) >= 50 and sum(any(e[0] in SOFT for e in g.norms.values()) for g in checked) >= 20


def test_softmax_spellings_agree(rng):
    """output_activation='softmax', norm={last: 'softmax'}, the activation list, LogSoftmax spelled without the
    underscore; a hidden layer's softmax too. The spellings are one model: same repr, same outputs."""
    ws, bs = weights_for(rng, [12, 40, 40, 9])
    x = rng.standard_normal((50, 12)).astype(np.float32)
    a = fusedmlp.FusedMLP(ws, bs, "tanh", "softmax", device="cpu")
    b = fusedmlp.FusedMLP(ws, bs, "tanh", norm={2: "softmax"}, device="cpu")
    c = fusedmlp.FusedMLP(ws, bs, ["tanh", "tanh", "softmax"], device="cpu")
    assert repr(a) == repr(b) == repr(c) and "norm={2: softmax}" in repr(a)
    assert np.array_equal(a(x), b(x)) and np.array_equal(a(x), c(x))
    d = fusedmlp.FusedMLP(ws, bs, "tanh", "LogSoftmax", device="cpu")
    assert np.allclose(d(x), np.log(a(x)), atol=1e-6)
    e = fusedmlp.FusedMLP(ws, bs, ["softmax", "relu"], "log_softmax", device="cpu")  # a hidden layer's softmax
    ref = norm_forward(x, ws, bs, ["none", "relu", "none"], norms={0: ("softmax",), 2: ("log_softmax",)})
    assert rel_l2(e(x), ref) < 1e-6


def test_a_softmax_model_saves_and_loads(rng, tmp_path):
    ws, bs = weights_for(rng, [6, 24, 5])
    m = fusedmlp.FusedMLP(ws, bs, "silu", "log_softmax", device="cpu")
    m.save(tmp_path / "head.npz")
    back = fusedmlp.FusedMLP.from_npz(tmp_path / "head.npz", device="cpu")
    x = rng.standard_normal((33, 6)).astype(np.float32)
    assert repr(back) == repr(m) and np.array_equal(back(x), m(x))


@pytest.mark.parametrize("kwargs, match", [
    ({"norm": {1: ("softmax", np.ones(5, np.float32))}}, r"norm of layer 1 is a softmax with weight; a softmax "
                                                          r"takes no weight, bias or eps"),
    ({"norm": {1: {"kind": "log_softmax", "eps": 1e-5}}}, r"log_softmax with eps=1e-05"),
    ({"norm": {1: "layernorm"}, "output_activation": "softmax"}, r"layer 1 has the activation 'softmax' and the "
                                                                   r"norm layernorm"),
    ({"norm": {1: "softmin"}}, r"norm kind of layer 1 is 'softmin'; it must be 'layernorm', 'rmsnorm', 'softmax' or "
                               r"'log_softmax'"),
])
def test_bad_softmax_specs_name_the_field_the_value_and_the_rule(rng, kwargs, match):
    ws, bs = weights_for(rng, [6, 24, 5])
    with pytest.raises(fusedmlp.ArgumentError, match=match):
        fusedmlp.FusedMLP(ws, bs, "relu", device="cpu", **kwargs)


def test_the_core_refuses_an_affine_softmax():
    w = [np.ones((3, 2), np.float32)]
    with pytest.raises(fusedmlp.FusedMLPError, match="softmax of layer 0 takes no weight"):
        _core.Network(w, [None], ["none"], None, None, [(3, 0.0, np.ones(3, np.float32), None)])
    with pytest.raises(fusedmlp.FusedMLPError, match="norm kind 5 of layer 0 is not layernorm"):
        _core.Network(w, [None], ["none"], None, None, [(5, 0.0, None, None)])


# ------------------------------------------------------------------------------------------------ from_torch

def test_from_torch_reads_softmax_heads():
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)

    class Traced(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.a, self.b, self.how = nn.Linear(16, 64), nn.Linear(64, 10), how

        def forward(self, x):
            z = self.b(torch.tanh(self.a(x)))
            return (F.log_softmax(z, dim=-1) if self.how == 0 else z.softmax(-1) if self.how == 1 else
                    torch.softmax(z, 1))

    models = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmax(dim=-1)),
              nn.Sequential(nn.Linear(16, 64), nn.LogSoftmax(dim=1), nn.Linear(64, 10), nn.LogSoftmax(-1)),
              # a BatchNorm1d after the softmax folds into the next Linear's input side
              nn.Sequential(nn.Linear(16, 64), nn.Softmax(-1), nn.BatchNorm1d(64), nn.Linear(64, 10)),
              Traced(0), Traced(1), Traced(2),
              # softmin(z) = softmax(-z): the layer's rows and bias negated (after an activation: -I's layer)
              nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10), nn.Softmin(dim=-1)),
              nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Softmin(1))]
    x = torch.randn(100, 16)
    for m in models:
        for p in m.modules():
            if isinstance(p, nn.BatchNorm1d):
                p.running_mean.uniform_(-0.1, 0.1), p.running_var.uniform_(0.5, 2.0)
        m.eval()
        f = fusedmlp.from_torch(m, device="cpu")
        assert "softmax" in repr(f)
        if isinstance(m, nn.Sequential) and isinstance(m[-1], nn.Softmin) and isinstance(m[-2], nn.Linear):
            assert np.array_equal(f._w[-1], -m[-2].weight.detach().numpy()), "negated, not added as a layer"
        with torch.no_grad():
            want = m(x).double().numpy()
        assert rel_l2(f(x.numpy()), want) < 1e-5, m


def test_from_torch_runs_a_softmax_after_no_linear_on_an_identity_layer():
    """A softmax after an activation or after a norm runs on an identity layer of its own (its fused softmax); one over
    another dim, or of the network input, is an error naming it."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(2)
    x = torch.randn(40, 8)
    for m in (nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Softmax(-1)),
              nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.LogSoftmax(-1))):
        f = fusedmlp.from_torch(m.eval(), device="cpu")
        assert list(f.widths) == [8, 16, 16] and f._norm[0] != f._norm[1] and f._norm[1] is not None
        with torch.no_grad():
            want = m.double()(x.double()).numpy()
        assert rel_l2(f(x.numpy()), want) < 1e-5, m
    cases = [(nn.Sequential(nn.Linear(8, 16), nn.Softmax(0)), r"1: Softmax\(dim=0\) does not run over the features"),
             (nn.Sequential(nn.LogSoftmax(-1), nn.Linear(8, 16)), r"0: LogSoftmax of the network input")]
    for m, match in cases:
        with pytest.raises(fusedmlp.ArgumentError, match=match):
            fusedmlp.from_torch(m.eval(), device="cpu")


# ------------------------------------------------------------------------------------------------ plans and compiles

COMPILE_CASES = [
    # (name, widths, {layer: kind}, arch, plan options, compute dtype)
    ("mma.sync one chunk", [7, 64, 48, 10], {0: "log_softmax", 2: "softmax"}, 80, {}, "float16"),
    ("mma.sync two passes", [16, 64, 200, 40], {1: "softmax"}, 80, {"m_tiles": 2, "warps": 4}, "bfloat16"),
    ("mma.sync two passes, log", [16, 64, 200, 40], {1: "log_softmax", 2: "softmax"}, 80, {"m_tiles": 2, "warps": 4},
     "float16"),
    ("mma.sync tf32", [10, 64, 33], {1: "log_softmax"}, 80, {}, "tf32"),
    ("mma.sync sm_75", [10, 64, 33], {0: "softmax", 1: "log_softmax"}, 75, {}, "float16"),
    ("register-A", [7, 64, 48, 10], {0: "log_softmax", 2: "softmax"}, 90, {"wgmma": 1, "cluster": -1, "warps": 8},
     "bfloat16"),
    ("register-A K-pipelined", [7, 64, 48, 10], {2: "softmax"}, 90, {"wgmma": 1, "cluster": -1, "warps": 4,
                                                                    "kpipe": 1}, "float16"),
    ("cluster of 2, split layers", [24, 256, 256, 40], {0: "softmax", 2: "log_softmax"}, 90, {"cluster": 2},
     "float16"),
    ("cluster of 4", [3, 256, 256, 256, 5], {1: "log_softmax", 3: "softmax"}, 90, {"cluster": 4, "warps": 4},
     "bfloat16"),
    ("streamed", [64, 256, 256, 256, 100], {3: "softmax"}, 90, {"wgmma": 1, "resident": 0}, "float16"),
]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_softmax_kernels_compile_ahead_of_time(case, rng, tmp_path):
    name, widths, kinds, arch, options, prec = case
    ws, bs = weights_for(rng, widths)
    mlp = fusedmlp.FusedMLP(ws, bs, "gelu", norm=kinds, dtype=prec, device="cpu", cache_dir=tmp_path)
    for io in ("float32", "float16"):
        plan, source = mlp._render(arch, 0, 0, io, io, **options)
        if "cluster" in options:
            assert plan.info["cluster"] == max(options["cluster"], 0), plan.info
        if "two passes" in name:
            assert any(nc < n for n, nc in norm_layer_chunks(source)), name
        assert sorted(re.findall(r"static constexpr int NORM = ([34]);", source)) == sorted(
            str(_api._norm.KINDS[k]) for k in kinds.values())
        options_v = ("--ptxas-options=-v",) + _api.nvrtc_no_cache()
        cubin, log = _core.nvrtc_compile(source, _api.TEMPLATE_SM90 if plan.info["wgmma"] else _api.TEMPLATE,
                                         arch, arch == 90, options_v)
        assert cubin[:4] == b"\x7fELF"
        assert set(re.findall(r"(\d+) bytes spill stores", log)) <= {"0"}, (name, io, log)


@pytest.mark.parametrize("prec, arch", [("int8", 80), ("int8", 90), ("float8", 89), ("float8", 90)])
def test_8bit_softmax_heads_compile_ahead_of_time(rng, tmp_path, prec, arch):
    """8-bit networks with a softmax head and a hidden log_softmax: calibrated (the CPU emulation), rendered and
    compiled for each arch's 8-bit form, without spills."""
    ws, bs = weights_for(rng, [16, 64, 64, 10])
    mlp = fusedmlp.FusedMLP(ws, bs, ["log_softmax", "relu"], "softmax", dtype=prec, device="cpu", cache_dir=tmp_path)
    mlp.calibrate(rng.standard_normal((512, 16)).astype(np.float32))
    plan, source = mlp._render(arch, 0, 0, "float16", "float32")
    assert sorted(re.findall(r"static constexpr int NORM = ([34]);", source)) == ["3", "4"]
    options = ("--ptxas-options=-v",) + _api.nvrtc_no_cache()
    cubin, log = _core.nvrtc_compile(source, _api.TEMPLATE_SM90 if plan.info["wgmma"] else _api.TEMPLATE, arch,
                                     arch == 90, options)
    assert cubin[:4] == b"\x7fELF" and set(re.findall(r"(\d+) bytes spill stores", log)) <= {"0"}, log


@pytest.mark.parametrize("prec, io, arch", [("float16", "float16", 90), ("bfloat16", "float32", 80),
                                            ("tf32", "float32", 80), ("float16", "float16", 75)])
def test_a_wide_head_is_its_gemm_then_a_softmax_row_pass(rng, tmp_path, prec, io, arch):
    """A 1000-class head (and a 4100-wide one, read three times) is no fused kernel's: the chain ends in the GEMM of
    its logits and a row pass, as does a narrow head after a wide layer (the chain's last GEMM); the row passes compile
    without spills."""
    for widths, kind in (([64, 256, 1000], "softmax"), ([32, 4100], "log_softmax"), ([16, 514, 3], "softmax")):
        ws, bs = weights_for(rng, widths)
        mlp = fusedmlp.FusedMLP(ws, bs, "relu", kind, dtype=prec, device="cpu", cache_dir=tmp_path)
        rows = [p for p in _segments.plans(mlp, arch, io, io) if p.info.get("norm_pass")]
        assert len(rows) == 1, [p.info for p in _segments.plans(mlp, arch, io, io)]
        source = _api._source_of(rows[0])
        assert f"static constexpr int NORM = {_api._norm.KINDS[kind]};" in source
        options = ("--ptxas-options=-v",) + _api.nvrtc_no_cache()
        _, log = _core.nvrtc_compile(source, _api.TEMPLATE_NORM, arch, arch == 90, options)
        assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (widths, prec, arch, log)


# ------------------------------------------------------------------------------------------------ on the GPU

GPU_HEADS = [
    # widths, {hidden layer: kind}, the head's kind, bias offset, logit scale
    ([7, 64, 64, 10], {}, "softmax", 0.0, 8.0),
    ([24, 200, 256, 40], {0: "softmax"}, "log_softmax", 2.0, 4.0),
    ([64, 256, 256, 256, 100], {}, "softmax", 0.0, 6.0),
    ([3, 17, 50, 1], {1: "log_softmax"}, "softmax", 30.0, 1.0),
    ([12, 128, 128, 256], {}, "log_softmax", 0.0, 16.0),
    ([10, 48, 200], {}, "softmax", 0.0, 3.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["float16", "bfloat16"])
def test_gpu_softmax_heads_in_every_kernel_form(prec):
    """Classifier heads (and hidden softmaxes) in every kernel form, the I/O dtypes and batch sizes rotating over the
    networks, poisoned outputs, against float64; and the default plan, what a call gets."""
    rng = np.random.default_rng(500)
    forms = gpu_forms()
    failures, seen = [], set()
    for i, (widths, hidden, kind, offset, scale) in enumerate(GPU_HEADS):
        g = head(rng, widths, kind, hidden, bias_offset=offset, logit_scale=scale)
        mlp = model(g, dtype=prec, device="cuda")
        # one batch and I/O dtype a network, rotating (each form compiles once for it: the suite's time)
        batch, io = (1, 4099, 129, 70001, 63)[i % 5], ("float32", "float16", "bfloat16")[i % 3]
        x32 = rng.standard_normal((batch, widths[0])).astype(np.float32)
        check_forms(mlp, g, x32, io, forms, seen, failures, (i, widths))
        check_default(mlp, g, x32, io, failures, (i, widths))
    assert_every_form(forms, seen, failures)


@pytest.mark.gpu
def test_gpu_wide_heads_run_as_a_gemm_and_a_row_pass():
    """1000- and 4100-class heads (GEMM, then the softmax row pass; 4100 read three times), each compute dtype,
    against float64; rows sum to 1."""
    rng = np.random.default_rng(501)
    failures = []
    for i, (widths, kind) in enumerate([([64, 256, 1000], "softmax"), ([32, 4100], "log_softmax"),
                                        ([259, 512, 512, 300], "softmax"), ([16, 2048], "log_softmax")]):
        for prec in ("float16", "bfloat16", "tf32"):
            g = head(rng, widths, kind, logit_scale=4.0)
            mlp = model(g, dtype=prec, device="cuda")
            assert any("second kernel" in s for s in mlp.segments), mlp.segments
            io = ("float32", "float16", "bfloat16")[i % 3]
            x32 = rng.standard_normal((int(rng.choice([1, 77, 3001])), widths[0])).astype(np.float32)
            x, y = run_kernel(mlp._kernel(io, rows=len(x32)), x32, io)
            err = np.inf if np.isnan(y).any() else rel_l2(y, norm_forward(x, g.ws, g.bs, g.acts, norms=g.norms))
            if not err <= max(fusedmlp.CHECK_TOLERANCES[prec], 1.6e-2 if io == "bfloat16" else 0):
                failures.append((widths, kind, prec, io, len(x32), err))
            if kind == "softmax" and io == "float32":
                assert np.allclose(y.sum(1), 1.0, atol=1e-3)
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["int8", "float8"])
def test_gpu_8bit_softmax_heads_match_the_emulation(prec):
    """A calibrated 8-bit classifier with a hidden log_softmax: the GPU's outputs against the CPU path's emulation of
    its roundings (test_lowbit's allowances) and against float64 within the dtype's check=True bound."""
    rng = np.random.default_rng(502)
    ws, bs = weights_for(rng, [16, 64, 64, 10])
    ws[-1] = (ws[-1] * 6).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, ["log_softmax", "relu"], "softmax", dtype=prec, device="cuda")
    x = rng.standard_normal((3001, 16)).astype(np.float32)
    mlp.calibrate(x)
    y = mlp._kernel("float32", rows=len(x)).run(x, poison=True).astype(np.float64)
    emulated = mlp._net.forward_cpu(x).astype(np.float64)
    ref = norm_forward(x, ws, bs, ["none", "relu", "none"], norms={0: ("log_softmax",), 2: ("softmax",)})
    assert not np.isnan(y).any()
    assert rel_l2(y, emulated) <= (2e-3 if prec == "int8" else 1e-2)
    assert rel_l2(y, ref) <= fusedmlp.CHECK_TOLERANCES[prec]


@pytest.mark.gpu
def test_gpu_softmax_classifier_from_torch():
    """A torch classifier (Linear-ReLU-Linear-ReLU-Linear-Softmax) through from_torch on CUDA tensors, check=True
    (the CPU path agrees), out=, batch 0."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10),
                      nn.Softmax(dim=-1)).cuda().eval()
    f = fusedmlp.from_torch(m, check=True)
    x = torch.randn(5000, 32, device="cuda")
    with torch.no_grad():
        want = m.double()(x.double()).cpu().numpy()
    y = f(x)
    assert y.dtype == torch.float32 and rel_l2(y.double().cpu().numpy(), want) <= fusedmlp.CHECK_TOLERANCES["float16"]
    out = torch.full((5000, 10), float("nan"), device="cuda", dtype=torch.float16)
    assert f(x.half(), out=out) is out and rel_l2(out.double().cpu().numpy(), want) <= 2e-3
    assert f(x[:0]).shape == (0, 10)
