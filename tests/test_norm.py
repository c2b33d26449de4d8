"""LayerNorm and RMSNorm fused into a layer's epilogue (issue 30): the norm= option, the CPU path against a float64
NumPy reference, the plans and ahead-of-time compiles of every kernel form (no GPU needed), and, marked `gpu`, every
kernel form on the device against float64 with poisoned outputs."""

import re
import types

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _api, _core, _segments
from fusedmlp._cache import KernelCache
from test_gpu import run_io_kernel as run_kernel  # io-typed input and output, bfloat16 as bits
from conftest import rel_l2

ACTS = ["relu", "gelu", "silu", "tanh", "none", "mish", "x * tanh(softplus(x))", "sigmoid"]


def norm_forward(x, ws, bs, acts, residual=None, concat=None, norms=None):
    """Float64 forward of a graph with norms: z = W h + b, then the layer's norm over its features (torch's
    LayerNorm: biased variance; RMSNorm: mean square; softmax / log_softmax), act, the residual op and its activation.
    residual: {layer: (op, then, source)} with source -1 (input), k (layer k's output); concat: {layer: 'after' |
    'before'}; norms: {layer: (kind, weight, bias, eps)} (weight / bias None: ones / zeros)."""
    def act(text, y):
        return _core.eval_expr(text, np.ascontiguousarray(y.ravel())).reshape(y.shape)

    x0 = np.asarray(x, dtype=np.float64)
    values, h = {-1: x0}, x0
    for l, (w, b) in enumerate(zip(ws, bs)):
        cat = (concat or {}).get(l)
        inp = h if cat is None else np.concatenate([h, x0] if cat == "after" else [x0, h], 1)
        z = inp @ np.asarray(w, np.float64).T + (0 if b is None else np.asarray(b, np.float64))
        if norms and l in norms and norms[l][0] in ("softmax", "log_softmax"):
            zc = z - z.max(1, keepdims=True)
            lse = np.log(np.exp(zc).sum(1, keepdims=True))
            z = np.exp(zc - lse) if norms[l][0] == "softmax" else zc - lse
        elif norms and l in norms:
            kind, g, beta, eps = norms[l]
            mean = z.mean(1, keepdims=True) if kind == "layernorm" else 0.0
            var = ((z - mean) ** 2).mean(1, keepdims=True)
            z = (z - mean) / np.sqrt(var + eps)
            z = z * (1.0 if g is None else np.asarray(g, np.float64)) + (0.0 if beta is None else beta)
        y = act(acts[l], z)
        if residual and l in residual:
            op, then, src = residual[l]
            r = values[src]
            y = act(then, y + r if op == "add" else y * r)
        h = values[l] = y
    return h


def random_norm(rng, width, kind=None):
    """(kind, weight, bias, eps): random affine parts (or none), eps from torch's defaults and others."""
    kind = kind or str(rng.choice(["layernorm", "rmsnorm"]))
    g = rng.uniform(0.5, 1.5, width).astype(np.float32) * rng.choice([-1, 1], width) if rng.random() < 0.7 else None
    beta = rng.uniform(-0.5, 0.5, width).astype(np.float32) if rng.random() < 0.6 else None
    eps = float(rng.choice([1e-5, 1e-6, float(np.finfo(np.float32).eps), 1e-3]))
    return kind, g, beta, eps


def spec(entry):
    kind, g, beta, eps = entry
    return {"kind": kind, "weight": g, "bias": beta, "eps": eps}


def weights_for(rng, widths, concat=(), bias_offset=0.0):
    """Uniform(+-1/sqrt(fan_in)) weights and biases (shifted by bias_offset: rows whose mean is far from 0, where a
    variance as E[z^2] - mean^2 would cancel)."""
    ws, bs = [], []
    for l in range(len(widths) - 1):
        fan_in = widths[l] + (widths[0] if l in concat else 0)
        bound = 1 / np.sqrt(fan_in)
        ws.append(rng.uniform(-bound, bound, (widths[l + 1], fan_in)).astype(np.float32))
        bs.append((rng.uniform(-bound, bound, widths[l + 1]) + bias_offset).astype(np.float32)
                  if rng.random() < 0.75 else None)
    return ws, bs


def finish_graph(rng, widths, concat, acts, norms):
    """A random graph's namespace from its widths, concats, activations and norms: one-wide norm layers made
    LayerNorm (below), residuals drawn from the layer's input, an earlier output or the network input, weights with
    rows near or far from zero."""
    # RMSNorm over one feature is gamma * sign(z), discontinuous at z = 0: any rounding flips the rows near it (on one
    # such graph, rounding the weights to float16 alone moved the float64 reference by 0.42%), so a one-wide norm
    # layer takes LayerNorm, which is its bias there (no draw changes: the other graphs stay the same).
    norms = {l: ("layernorm", *e[1:]) if widths[l + 1] == 1 else e for l, e in norms.items()}
    residual = {}
    for l in range(len(widths) - 1):
        sources = [v for v in range(-1, l) if widths[v + 1] == widths[l + 1]]
        if sources and rng.random() < 0.5:
            residual[l] = (str(rng.choice(["add", "add", "mul"])), str(rng.choice(["none", "relu", "tanh"])),
                           int(rng.choice(sources)))
    ws, bs = weights_for(rng, widths, concat, bias_offset=float(rng.choice([0.0, 0.0, 30.0])))
    return types.SimpleNamespace(widths=widths, ws=ws, bs=bs, acts=acts, norms=norms, residual=residual,
                                 concat=concat)


def random_graph(rng):
    """A random chain mixing norms, residuals and input concats: widths 1..256, each layer's norm with probability
    0.6 (any affine, any eps), residuals from the layer's input, an earlier output or the network input."""
    depth = int(rng.integers(1, 7))
    common = int(rng.choice([1, 3, 16, 50, 64, 128, 200, 256]))
    widths = [common if rng.random() < 0.4 else int(rng.integers(1, 40))]
    widths += [common if rng.random() < 0.7 else int(rng.integers(1, 257)) for _ in range(depth)]
    concat = {l: str(rng.choice(["after", "before"])) for l in range(1, depth) if rng.random() < 0.25}
    acts = [str(rng.choice(ACTS)) for _ in range(depth - 1)] + [str(rng.choice(["none", "tanh"]))]
    norms = {l: random_norm(rng, widths[l + 1]) for l in range(depth) if rng.random() < 0.6}
    return finish_graph(rng, widths, concat, acts, norms)


def fused(g, **kwargs):
    """The FusedMLP of a random_graph."""
    residual = {l: (op, then, "input" if src < 0 else src) for l, (op, then, src) in g.residual.items()}
    return fusedmlp.FusedMLP(g.ws, g.bs, activation=g.acts, residual=residual or None, concat=g.concat or None,
                             norm={l: spec(e) for l, e in g.norms.items()} or None, **kwargs)


# ------------------------------------------------------------------------------------------------ the CPU path


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_cpu_norm_matches_float64(rng, kind, affine):
    widths = [9, 48, 33, 5]
    ws, bs = weights_for(rng, widths, bias_offset=4.0)
    g = rng.uniform(-2, 2, 48).astype(np.float32) if affine != "none" else None
    beta = rng.uniform(-1, 1, 48).astype(np.float32) if affine == "both" else None
    norms = {0: (kind, g, beta, 1e-5), 2: (kind, None, None, 1e-3)}
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["silu", "gelu", "none"], device="cpu",
                            norm={l: spec(e) for l, e in norms.items()})
    x = rng.standard_normal((300, 9)).astype(np.float32)
    ref = norm_forward(x, ws, bs, ["silu", "gelu", "none"], norms=norms)
    assert rel_l2(mlp(x), ref) <= 1e-6


def check_cpu_random_graphs(seed, redraw=None):
    """60 random graphs (seed), each through redraw(rng, g) first where given, on the CPU path against float64 (rows
    whose reference overflows skipped); returns the graphs checked."""
    rng = np.random.default_rng(seed)
    checked = []
    for i in range(60):
        g = random_graph(rng)
        if redraw is not None:
            redraw(rng, g)
        x = rng.standard_normal((int(rng.choice([1, 7, 130])), g.widths[0])).astype(np.float32)
        ref = norm_forward(x, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        if not np.all(np.isfinite(ref)) or np.max(np.abs(ref)) > 1e6:
            continue
        y = fused(g, device="cpu")(x)
        # float32 storage between layers against float64 throughout; a norm divides by the row's spread, so a
        # nearly constant row (one feature: rmsnorm of a single value) keeps its relative rounding
        err = np.max(np.abs(y - ref)) / max(1.0, float(np.max(np.abs(ref))))
        assert err <= 2e-5, (i, g.widths, g.norms, g.residual, g.concat, err)
        checked.append(g)
    return checked


def test_cpu_random_graphs_mixing_norms_residuals_and_concats_match_float64():
    checked = check_cpu_random_graphs(30)
    assert len(checked) >= 50 and sum(bool(g.norms) for g in checked) >= 35


def test_layernorm_of_rows_far_from_zero_keeps_its_precision(rng):
    """Rows of mean ~1000 and spread ~1: the variance is taken about the mean, not as E[z^2] - mean^2."""
    ws, bs = weights_for(rng, [8, 64, 4])
    bs[0] = (bs[0] if bs[0] is not None else np.zeros(64, np.float32)) + np.float32(1000)
    norms = {0: ("layernorm", None, None, 1e-5)}
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["tanh", "none"], norm={0: "layernorm"}, device="cpu")
    x = rng.standard_normal((50, 8)).astype(np.float32)
    assert rel_l2(mlp(x), norm_forward(x, ws, bs, ["tanh", "none"], norms=norms)) <= 1e-5


def test_norm_spellings_agree(rng):
    ws, bs = weights_for(rng, [6, 32, 32, 3])
    g, beta = rng.uniform(0.5, 2, 32).astype(np.float32), rng.uniform(-1, 1, 32).astype(np.float32)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    spellings = [
        {0: ("layernorm", g, beta, 1e-4), 1: "rmsnorm"},
        {0: {"kind": "layernorm", "weight": g, "bias": beta, "eps": 1e-4}, 1: ("rmsnorm",)},
        [("layernorm", list(g), beta, 1e-4), {"kind": "rmsnorm"}, None],
    ]
    outs = [fusedmlp.FusedMLP(ws, bs, activation="silu", norm=n, device="cpu")(x) for n in spellings]
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])
    ref = norm_forward(x, ws, bs, ["silu", "silu", "none"],
                       norms={0: ("layernorm", g, beta, 1e-4), 1: ("rmsnorm", None, None, np.finfo(np.float32).eps)})
    assert rel_l2(outs[0], ref) <= 1e-6
    y = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation="silu", norm=spellings[0], device="cpu")
    np.testing.assert_array_equal(y, outs[0])
    text = repr(fusedmlp.FusedMLP(ws, bs, activation="silu", norm=spellings[0], device="cpu"))
    assert "norm={0: layernorm(eps=0.0001, weight, bias), 1: rmsnorm(eps=1.19209e-07)}" in text


def test_layernorm_of_one_feature_is_its_bias(rng):
    """A row of one value has mean z and variance 0: layernorm gives beta (z - mean is exactly 0)."""
    ws = [rng.standard_normal((1, 5)).astype(np.float32)]
    mlp = fusedmlp.FusedMLP(ws, None, activation=["none"], norm={0: ("layernorm", [3.0], [0.25])}, device="cpu")
    np.testing.assert_array_equal(mlp(rng.standard_normal((7, 5)).astype(np.float32)), np.full((7, 1), 0.25))


@pytest.mark.parametrize("norm, error, match", [
    ({0: "batchnorm"}, fusedmlp.ArgumentError, r"norm kind of layer 0 is 'batchnorm'; it must be 'layernorm', "
                                               r"'rmsnorm', 'softmax' or 'log_softmax'"),
    ({3: "layernorm"}, fusedmlp.ArgumentError, r"norm names layer 3; the network has layers 0\.\.1"),
    ({-1: "layernorm"}, fusedmlp.ArgumentError, r"norm names layer -1"),
    ({True: "layernorm"}, fusedmlp.ArgumentError, r"norm names layer True"),
    ("layernorm", fusedmlp.ArgumentError, r"norm='layernorm' must be None, a dict \{layer: spec\} or a list"),
    ([None], fusedmlp.ArgumentError, r"norm has 1 entries; the network has 2 layers"),
    ({0: 5}, fusedmlp.ArgumentError, r"norm of layer 0 is 5; write 'layernorm', 'rmsnorm'"),
    ({0: {"kind": "layernorm", "gamma": [1.0] * 16}}, fusedmlp.ArgumentError, r"norm of layer 0 is \{'kind'"),
    ({0: {"weight": [1.0] * 16}}, fusedmlp.ArgumentError, r"norm of layer 0 is"),
    ({0: ("layernorm", None, None, -1e-5)}, fusedmlp.ArgumentError, r"norm eps of layer 0 is -1e-05; it must be a "
                                                                    r"finite number >= 0"),
    ({0: ("layernorm", None, None, float("nan"))}, fusedmlp.ArgumentError, r"norm eps of layer 0 is nan"),
    ({0: ("layernorm", None, None, "1e-5")}, fusedmlp.ArgumentError, r"norm eps of layer 0 is '1e-5'; it must be a "
                                                                     r"number"),
    ({0: ("layernorm", [1.0] * 15)}, fusedmlp.ShapeError, r"norm weight of layer 0 has shape \(15,\); the layer has "
                                                          r"16 outputs, so it must be \(16,\)"),
    ({1: ("rmsnorm", None, np.ones((2, 2)))}, fusedmlp.ShapeError, r"norm bias of layer 1 has shape \(2, 2\); the "
                                                                   r"layer has 2 outputs"),
    ({0: ("layernorm", [1.0] * 15 + [np.inf])}, fusedmlp.ArgumentError, r"norm weight of layer 0 holds a non-finite "
                                                                        r"value inf at index 15"),
    ({0: ("layernorm", ["a"] * 16)}, fusedmlp.DTypeError, r"norm weight of layer 0 has dtype <U1"),
])
def test_bad_norms_name_the_field_the_value_and_the_rule(norm, error, match):
    ws = [np.ones((16, 4), np.float32), np.ones((2, 16), np.float32)]
    with pytest.raises(error, match=match):
        fusedmlp.FusedMLP(ws, None, norm=norm, device="cpu")


def test_the_core_checks_norms_too(rng):
    """The binding's Network validates what reaches it (a caller past FusedMLP's parsing): kind, eps and lengths."""
    ws, bs, acts = [np.ones((4, 3), np.float32)], [None], ["none"]
    for norms, match in [([(7, 1e-5, None, None)], "norm kind 7 of layer 0 is not layernorm"),
                         ([(1, -1.0, None, None)], "norm eps of layer 0 is -1; it must be a finite number >= 0"),
                         ([(2, 1e-5, np.ones(3, np.float32), None)], "norm weight of layer 0 has 3 elements; the "
                                                                     "layer has 4 outputs")]:
        with pytest.raises(fusedmlp.FusedMLPError, match=match):
            _core.Network(ws, bs, acts, None, None, norms)


# ------------------------------------------------------------------------------------------------ plans and compiles


def norm_layer_chunks(source):
    """(N, NC) of each Layer<l> with a norm in a rendered source."""
    out = []
    for body in re.findall(r"template <> struct Layer<\d+> \{(.*?)\n\};", source, flags=re.S):
        if re.search(r"static constexpr int NORM = [1-4];", body):
            n, nc = re.search(r"N = (\d+), NR = \d+, NC = (\d+);", body).groups()
            out.append((int(n), int(nc)))
    return out


def test_mma_sync_plans_a_norm_layer_in_one_chunk_where_the_accumulators_allow(rng):
    """Up to 64 columns per m tile in networks over 128 wide (128 otherwise) a norm layer is one chunk (statistics from
    the registers); wider, its chunks run twice (fused_mlp.cu, fm_layer)."""
    ws, bs = weights_for(rng, [16, 64, 200, 64, 8])
    mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", norm={0: "layernorm", 1: "layernorm", 2: "rmsnorm"},
                            device="cpu")
    for options, want in [({}, [(64, 64), (208, None), (64, 64)]),
                          ({"m_tiles": 2, "warps": 4}, [(64, None), (208, None), (64, None)]),
                          ({"resident": 0}, [(64, 64), (208, None), (64, 64)])]:
        plan, source = mlp._render(80, 0, 0, "float32", "float32", **options)
        assert not plan.info["wgmma"] and plan.info["resident"] == options.get("resident", plan.info["resident"])
        got = norm_layer_chunks(source)
        assert [n for n, _ in got] == [n for n, _ in want], got
        for (n, nc), (_, wanted) in zip(got, want):
            assert nc == wanted if wanted else nc < n, (options, got)
    ws, bs = weights_for(rng, [16, 128, 128, 8])
    plan, source = fusedmlp.FusedMLP(ws, bs, norm={0: "layernorm"}, device="cpu")._render(80, 0, 0, "float32",
                                                                                          "float32")
    assert plan.info["m_tiles"] == 1 and norm_layer_chunks(source) == [(128, 128)]


def test_warpgroup_plans_keep_a_norm_layer_whole_and_clusters_split_it(rng):
    ws, bs = weights_for(rng, [16, 128, 128, 8])
    mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", norm={0: "layernorm"}, device="cpu")
    plan, source = mlp._render(90, 0, 0, "float16", "float16", wgmma=1, cluster=-1, n_chunk=32)
    assert plan.info["wgmma"] and not plan.info["cluster"]
    assert norm_layer_chunks(source) == [(128, 128)]  # n_chunk splits layer 1, not the norm layer
    assert re.search(r"N = 128, NR = 128, NC = 32;", source)
    plan, source = mlp._render(90, 0, 0, "float16", "float16", cluster=2)
    assert plan.info["cluster"] == 2 and norm_layer_chunks(source) == [(128, 64)]


def test_layernorm_layers_are_packed_centred_and_run_without_their_mean(rng):
    """A 16- or 32-bit plan stores a layernorm layer's weights less each input column's mean over the outputs (in
    float64, then rounded), so W h + b has a zero row mean for any h and the kernel runs rmsnorm's one reduction
    (CENTRED); rmsnorm layers, other layers and 8-bit plans keep their weights as given."""
    ws, bs = weights_for(rng, [16, 64, 48, 8], bias_offset=3.0)
    ws[0] += 0.5  # a common component in every row: what centring takes out
    mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", norm={0: "layernorm", 1: "rmsnorm"}, device="cpu")
    plan, source = mlp._render(80, 0, 0, "float16", "float16", resident=1)
    assert re.findall(r"NORM = (\d);.*\n.*CENTRED = (\w+);", source) == [("1", "true"), ("2", "false"), ("0", "false")]
    assert not plan.info["wgmma"] and plan.info["resident"]
    bits = np.frombuffer(mlp._net.plan(80, 0, 0, "float16", "float16", resident=1).packed_weights(), np.uint16)
    at = 0
    for l, w in enumerate(ws):  # mma.sync's resident blob: each layer's n_pad rows of k_pad + 8 halves
        n_pad, k_pad = -(-w.shape[0] // 16) * 16, -(-w.shape[1] // 16) * 16
        got = bits[at:at + n_pad * (k_pad + 8)].reshape(n_pad, k_pad + 8)[:w.shape[0], :w.shape[1]]
        w64 = w.astype(np.float64)
        want = (w64 - w64.mean(0) if l == 0 else w64).astype(np.float32).astype(np.float16).view(np.uint16)
        assert np.array_equal(got, want), l
        at += n_pad * (k_pad + 8)
    centred = bits[:64 * 24].reshape(64, 24)[:, :16].view(np.float16).astype(np.float64)
    assert np.abs(centred.sum(0)).max() < 64 * 1e-3 < np.abs(ws[0].sum(0)).min()
    x = rng.standard_normal((33, 16)).astype(np.float32)
    ref = norm_forward(x, ws, bs, ["silu", "silu", "none"], norms={0: ("layernorm", None, None, 1e-5),
                                                                   1: ("rmsnorm", None, None, 1e-5)})
    assert rel_l2(mlp(x), ref) <= 1e-6  # the CPU path: the weights as given
    q = fusedmlp.FusedMLP(ws, bs, activation="silu", norm={0: "layernorm"}, dtype="int8", device="cpu")
    q.calibrate(x)
    assert "CENTRED = true" not in q._render(90, 0, 0, "float16", "float16")[1]


@pytest.mark.parametrize("common", [0.0, 0.5, 3.0])
def test_centred_float16_weights_lose_no_more_than_the_weights_as_given(common):
    """What the centring rests on (plan.c, fm_plan_pack): layernorm of W h + b with W rounded to float16 as given,
    against rmsnorm of (W - mean row) h + (b - mean b) with the centred W rounded, both against float64. Without a
    common part in W's rows and b the two lose alike; with one (rows whose mean is large against their spread) the
    centred form loses less, its common part gone before the rounding."""
    rng = np.random.default_rng(7)
    worst = []
    for _ in range(4):
        n = k = 256
        w = rng.uniform(-1, 1, (n, k)) / np.sqrt(k) + common * rng.uniform(-1, 1, k) / np.sqrt(k)
        b = rng.uniform(-0.1, 0.1, n) + common
        h = rng.standard_normal((64, k)).astype(np.float16).astype(np.float64)

        def layernorm(z):
            z = z - z.mean(1, keepdims=True)
            return z / np.sqrt((z ** 2).mean(1, keepdims=True) + 1e-5)

        def f16(a):
            return a.astype(np.float32).astype(np.float16).astype(np.float64)

        ref = layernorm(h @ w.T + b)
        given = layernorm(h @ f16(w).T + b.astype(np.float32))
        z = h @ f16(w - w.mean(0)).T + (b - b.mean()).astype(np.float32)
        centred = z / np.sqrt((z ** 2).mean(1, keepdims=True) + 1e-5)
        worst.append((rel_l2(given, ref), rel_l2(centred, ref)))
    given_err, centred_err = np.max(worst, axis=0)
    assert centred_err <= 1.1 * given_err and centred_err < 5e-4
    if common >= 3.0:
        assert centred_err < 0.5 * given_err


def test_a_norm_layer_in_a_segmented_network_keeps_its_norm(rng):
    """A network one fused kernel cannot hold is cut into stretches that are networks of their own: each keeps its
    layers' norms (a GEMM cannot take one, its rows come in column tiles: a norm layer that is a GEMM is the GEMM of
    the layer cut before its norm, then a row pass, below)."""
    ws, bs = weights_for(rng, [8, 300, 64, 64, 4])
    norm = {2: ("layernorm", rng.uniform(0.5, 1, 64).astype(np.float32), None, 1e-5)}
    mlp = fusedmlp.FusedMLP(ws, bs, activation="silu", norm={2: spec(norm[2])}, device="cpu")
    plans = fusedmlp._segments.plans(mlp, 80, "float32", "float32")  # (on sm_90 one streamed kernel holds 300)
    sources = [_api._source_of(p) for p in plans]
    assert len(plans) >= 2 and any("NORM = 1" in s for s in sources)
    assert mlp.segments is None and "NORM = 1" in mlp.source and "WIDE = true" in mlp.source
    with pytest.raises(fusedmlp.LimitError, match="layer 0 has a layernorm, whose row statistics need all its 300 "
                                                  "columns.*norm_pass=1"):
        fusedmlp.FusedMLP(ws, bs, norm={0: "layernorm"}, device="cpu")._net.gemm_plan(0, 90, 0, 0, "float32", None,
                                                                                       None, "float16")
    x = rng.standard_normal((20, 8)).astype(np.float32)
    assert rel_l2(mlp(x), norm_forward(x, ws, bs, ["silu"] * 3 + ["none"], norms=norm)) <= 1e-6


def wide_norm_model(rng, widths, norms, residual=None, **kwargs):
    """(ws, bs, norms, FusedMLP on the CPU) of a chain with the given norm kinds {layer: kind} (random affine, eps)."""
    ws, bs = weights_for(rng, widths, bias_offset=3.0)
    entries = {l: random_norm(rng, widths[l + 1], kind) for l, kind in norms.items()}
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual=residual, norm={l: spec(e) for l, e in entries.items()},
                            device="cpu", **kwargs)
    return ws, bs, entries, mlp


def test_a_wide_norm_layer_is_its_gemm_without_the_norm_then_a_row_pass(rng):
    """A norm layer no fused kernel takes (here 512 and 300 features): its GEMM multiplies the layer cut before its
    norm (no activation, no residual; a layernorm's weights less their means over the outputs, an rmsnorm's as
    given), writing z in the compute dtype's storage, and its second kernel (row_norm.cu) reads z, normalises each
    row and runs the rest of the layer's epilogue, its residual operand included."""
    widths = [16, 512, 512, 300, 8]
    ws, bs, norms, mlp = wide_norm_model(rng, widths, {0: "layernorm", 1: "rmsnorm", 2: "layernorm"},
                                         residual={1: ("add", "relu", 0)})
    for arch in (80, 90):
        plans = _segments.plans(mlp, arch, "float16", "float32")
        kinds = [(p.info.get("gemm_layer"), p.info.get("norm_pass")) for p in plans]
        assert kinds[:6] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], kinds
        sources = [_api._source_of(p) for p in plans[:6]]
        for gemm in sources[0::2]:  # the GEMMs: W h + b alone
            assert "NORM = 0" in gemm and "act(float x, int) { return (x); }" in gemm and "FM_RES_TYPE -1" in gemm
        assert "a layernorm layer's second kernel, 512 features" in sources[1] and "NORM = 1" in sources[1]
        assert "NORM = 2" in sources[3] and "FM_RES_TYPE 1 " in sources[3] and "RES = 1" in sources[3]
        assert "y float16" in sources[5]  # (layer 2's output is a value between segments, not y)
    # the GEMMs' weights: a layernorm layer's centred (float64, then rounded), an rmsnorm layer's as given
    for layer, centred in ((0, True), (1, False)):
        plan = mlp._gemm_plan(layer, 80, 0, 0, 0, "float16", None, None, "float16")
        k_pad = -(-widths[layer] // 32) * 32  # (mma.sync: K in stages of 32 halves, the blob row-major)
        packed = np.frombuffer(plan.packed_weights(), np.float16).reshape(-1, k_pad)
        w64 = ws[layer].astype(np.float64)
        want = (w64 - w64.mean(0)) if centred else w64
        n, k = ws[layer].shape
        assert np.array_equal(packed[:n, :k], want.astype(np.float32).astype(np.float16))
    assert "its layernorm in a second kernel over whole rows" in mlp.segments[0]


def test_wide_norm_row_passes_compile_ahead_of_time(rng, tmp_path):
    """The row pass for every kind of row it has: widths whose rows split into chunks of 8, 4, 2 and 1 elements, up
    to 2048 in registers and wider ones read twice; layernorm and rmsnorm; residuals from x (float32, bfloat16) and
    between segments; every compute dtype; sm_75, sm_80 and sm_90a; ptxas reports no spills."""
    cases = [  # (widths, norms, residual, compute dtype, io, arch)
        ([16, 1024, 8], {0: "layernorm"}, None, "float16", "float16", 90),
        ([300, 300, 8], {0: "rmsnorm"}, {0: ("add", "none", "input")}, "bfloat16", "bfloat16", 80),
        ([777, 777, 8], {0: "layernorm"}, {0: ("mul", "tanh", "input")}, "float16", "float32", 75),
        ([8, 2050, 2050, 4], {0: "layernorm", 1: "rmsnorm"}, {1: ("add", "relu", 0)}, "tf32", "float32", 80),
        ([8, 4100, 4], {0: "layernorm"}, None, "bfloat16", "float16", 90),
        ([8, 514, 4], {0: "rmsnorm"}, None, "float16", "float16", 90),
        ([8, 2048, 4], {0: "layernorm"}, None, "float16", "float16", 90),  # 64 values a lane: two CTAs an SM
        ([8, 1536, 4], {0: "rmsnorm"}, None, "tf32", "float32", 90),
    ]
    for widths, kinds, residual, prec, io, arch in cases:
        _, _, _, mlp = wide_norm_model(rng, widths, kinds, residual=residual, dtype=prec, cache_dir=tmp_path)
        rows = [p for p in _segments.plans(mlp, arch, io, io) if p.info.get("norm_pass")]
        assert len(rows) == len(kinds), (widths, [p.info for p in rows])
        for plan in rows:
            options = ("--ptxas-options=-v",) + _api.nvrtc_no_cache()  # (NVRTC's cache would answer without it)
            _, log = _core.nvrtc_compile(_api._source_of(plan), _api.TEMPLATE_NORM, arch, arch == 90, options)
            assert re.findall(r"(\d+) bytes spill stores", log) == ["0"], (widths, prec, arch, log)


COMPILE_CASES = [
    # (name, widths, norms as {layer: kind}, residual, concat, arch, plan options, compute dtype)
    ("mma.sync one chunk", [7, 64, 48, 5], {0: "layernorm", 1: "rmsnorm"}, None, None, 80, {}, "float16"),
    ("mma.sync two passes", [16, 64, 200, 40], {0: "layernorm", 1: "rmsnorm", 2: "layernorm"}, None, None, 80,
     {"m_tiles": 2, "warps": 4}, "bfloat16"),
    ("mma.sync streamed", [64, 256, 256, 256, 16], {0: "layernorm", 1: "layernorm", 2: "layernorm"}, None, None, 80,
     {}, "float16"),
    ("mma.sync tf32 concat", [10, 64, 64, 32, 3], {1: "layernorm", 2: "rmsnorm"}, None, {2: "after"}, 80, {}, "tf32"),
    ("mma.sync sm_90 residual", [12, 96, 96, 8], {0: "layernorm", 1: "layernorm"}, {1: ("add", "relu", 0)}, None, 90,
     {"wgmma": 0}, "float16"),
    ("register-A", [7, 64, 48, 5], {0: "layernorm", 1: "rmsnorm", 2: "layernorm"}, None, None, 90,
     {"wgmma": 1, "cluster": -1, "warps": 8}, "bfloat16"),
    ("register-A K-pipelined", [7, 64, 48, 5], {0: "layernorm", 1: "rmsnorm"}, None, None, 90,
     {"wgmma": 1, "cluster": -1, "warps": 4, "kpipe": 1}, "float16"),
    ("register-A loop, residuals", [12, 128, 128, 128, 128, 8], {l: "layernorm" for l in range(4)},
     {1: ("add", "none", 0), 2: ("add", "none", 1)}, None, 90, {"wgmma": 1, "cluster": -1, "warps": 4}, "float16"),
    ("cluster of 1", [7, 64, 48, 5], {0: "layernorm", 1: "rmsnorm"}, None, None, 90, {"cluster": 1}, "float16"),
    ("cluster of 2, split last", [24, 200, 256, 40], {0: "layernorm", 1: "rmsnorm", 2: "layernorm"}, None, None, 90,
     {"cluster": 2}, "bfloat16"),
    ("cluster of 4, loop", [3, 256, 256, 256, 256, 5], {l: "layernorm" for l in range(4)}, None, None, 90,
     {"cluster": 4, "warps": 4}, "float16"),
    ("rl256 default", [64, 256, 256, 256, 16], {0: "layernorm", 1: "layernorm", 2: "layernorm"}, None, None, 90, {},
     "float16"),
    ("streamed, whole-row groups over 64-column slots", [24, 200, 256, 40], {0: "layernorm", 1: "rmsnorm"},
     None, None, 90, {"wgmma": 1, "resident": 0, "n_chunk": 64}, "bfloat16"),
    ("streamed, residual", [12, 128, 128, 128, 8], {0: "layernorm", 1: "layernorm", 2: "rmsnorm"},
     {1: ("add", "none", 0)}, None, 90, {"wgmma": 1, "resident": 0, "warps": 4}, "float16"),
]


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_norm_kernels_compile_ahead_of_time(case, tmp_path):
    name, widths, kinds, residual, concat, arch, options, prec = case
    rng = np.random.default_rng(len(name))
    ws, bs = weights_for(rng, widths, concat or ())
    norm = {l: random_norm(rng, widths[l + 1], kind) for l, kind in kinds.items()}
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", residual=residual, concat=concat, dtype=prec,
                            norm={l: spec(e) for l, e in norm.items()}, device="cpu", cache_dir=tmp_path)
    for io in ("float32", "float16"):
        plan, source = mlp._render(arch, 0, 0, io, io, **options)
        want_wgmma = options.get("wgmma", 1 if arch == 90 and prec != "tf32" and not concat else 0)
        assert plan.info["wgmma"] == want_wgmma, plan.info
        if "cluster" in options:
            assert plan.info["cluster"] == max(options["cluster"], 0), plan.info
        if "kpipe" in options:
            assert plan.info["kpipe"] == 1
        assert len(re.findall(r"static constexpr int NORM = [12];", source)) == len(kinds)
        entry = _api.compile_cubin(source, arch, KernelCache(str(tmp_path)), plan.info["wgmma"])
        assert entry.cubin[:4] == b"\x7fELF"
    if not options:  # the default plan through the public call
        with open(mlp.compile(f"sm_{arch}"), "rb") as f:  # a cache entry: its header, then the CUBIN
            assert b"\x7fELF" in f.read()
        assert "NORM = 1" in mlp.source


# ------------------------------------------------------------------------------------------------ on the GPU

#: Plan options forcing each kernel form (as tests/test_gpu.py forces them), by name: mma.sync (its default tile,
#: streamed weights, and two 16-row tiles a warp, where wide norm layers run their chunks twice), the register-A
#: warpgroup kernel (one and two warpgroups, K-pipelined), and the shared-memory-A kernel on clusters of 1, 2 and 4.
GPU_FORMS = {
    "mma.sync": {"wgmma": 0},
    "mma.sync streamed": {"wgmma": 0, "resident": 0},
    "mma.sync 4x32 rows": {"wgmma": 0, "warps": 4, "m_tiles": 2},
}
SM90_FORMS = {
    "register-A": {"wgmma": 1, "cluster": -1, "warps": 4},
    "register-A 2 warpgroups": {"wgmma": 1, "cluster": -1, "warps": 8},
    "K-pipelined": {"wgmma": 1, "cluster": -1, "warps": 4, "kpipe": 1},
    "cluster 1": {"cluster": 1},
    "cluster 2": {"cluster": 2},
    "cluster 2, 1 warpgroup": {"cluster": 2, "warps": 4},
    "cluster 4": {"cluster": 4},
    "cluster 4, 1 warpgroup": {"cluster": 4, "warps": 4},
    "streamed": {"wgmma": 1, "resident": 0},
    "streamed, 1 warpgroup": {"wgmma": 1, "resident": 0, "warps": 4},
    "streamed, 64-column slots": {"wgmma": 1, "resident": 0, "n_chunk": 64},
}


def gpu_forms():
    forms = dict(GPU_FORMS)
    if fusedmlp._api._gpu(0).info["arch"] == 90:
        forms.update(SM90_FORMS)
    return forms


def check_forms(mlp, g, x32, io, forms, seen, failures, label):
    """Each form's kernel (where the network takes it) on x32 against float64; records the form in `seen`."""
    for name, options in forms.items():
        try:
            kernel, plan, source, _ = mlp._build(io, io, **options)
        except fusedmlp.LimitError:  # that form does not hold this network (concat, widths, shared memory)
            continue
        if "cluster" in options:
            assert plan.info["cluster"] == max(options["cluster"], 0), (name, plan.info)
        if "kpipe" in options:
            assert plan.info["kpipe"] == 1, (name, plan.info)
        x, y = run_kernel(kernel, x32, io)
        ref = norm_forward(x, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        tol = max(fusedmlp.CHECK_TOLERANCES[mlp._precision], 1.6e-2 if io == "bfloat16" else 0)
        err = np.inf if np.isnan(y).any() else rel_l2(y, ref)
        if not err <= tol:
            failures.append((label, name, io, mlp._precision, len(x32), err))
        seen.add(name)
        if name.startswith("mma.sync") and any(nc < n for n, nc in norm_layer_chunks(source)):
            seen.add("mma.sync two passes")


def check_default(mlp, g, x32, io, failures, label):
    """The kernel a call gets (tuner off: conftest) on x32 against float64, as check_forms checks each form."""
    x, y = run_kernel(mlp._kernel(io, rows=len(x32)), x32, io)
    ref = norm_forward(x, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
    err = np.inf if np.isnan(y).any() else rel_l2(y, ref)
    if not err <= max(fusedmlp.CHECK_TOLERANCES[mlp._precision], 1.6e-2 if io == "bfloat16" else 0):
        failures.append((label, "default", io, mlp._precision, len(x32), err))


def assert_every_form(forms, seen, failures):
    """Every form (and the mma.sync kernel's two passes) ran some network, and none failed."""
    want = set(forms) | {"mma.sync two passes"}
    assert want <= seen, want - seen
    assert not failures, failures[:8]


NAMED_GRAPHS = [
    # widths, norms {layer: kind}, residual {layer: (op, then, source)}, concat, activations
    ([7, 64, 64, 5], {0: "layernorm", 1: "rmsnorm"}, {}, {}, ["silu", "gelu", "none"]),
    ([24, 200, 256, 40], {0: "layernorm", 1: "rmsnorm", 2: "layernorm"}, {}, {}, ["mish", "silu", "none"]),
    ([64, 256, 256, 256, 16], {0: "layernorm", 1: "layernorm", 2: "layernorm"}, {}, {}, ["silu"] * 3 + ["none"]),
    ([12, 128, 128, 128, 128, 128, 8], {l: "layernorm" for l in range(5)}, {l: ("add", "none", l - 1)
                                                                              for l in range(1, 5)}, {},
     ["gelu"] * 5 + ["none"]),
    ([3, 17, 50, 1], {0: "layernorm", 1: "rmsnorm", 2: "layernorm"}, {}, {}, ["tanh", "silu", "none"]),
    ([10, 64, 64, 32, 3], {1: "layernorm", 2: "rmsnorm"}, {}, {2: "after"}, ["relu", "gelu", "silu", "none"]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["float16", "bfloat16"])
def test_gpu_norm_networks_in_every_kernel_form(prec):
    """Named networks (small, wide with a split last layer, rl256, residual blocks looped, narrow odd widths, a concat)
    in every kernel form, float32 / float16 / bfloat16 I/O (two per network), odd batches, vs float64; and each
    network's default plan, what a call gets."""
    rng = np.random.default_rng(300)
    forms = gpu_forms()
    failures, seen = [], set()
    for i, (widths, kinds, residual, concat, acts) in enumerate(NAMED_GRAPHS):
        ws, bs = weights_for(rng, widths, concat, bias_offset=2.0 if i % 2 else 0.0)
        g = types.SimpleNamespace(ws=ws, bs=bs, acts=acts, residual=residual, concat=concat,
                                  norms={l: random_norm(rng, widths[l + 1], k) for l, k in kinds.items()})
        mlp = fused(g, dtype=prec, device="cuda")
        ios = ("float32", "float16", "bfloat16")
        for batch, io in [((1, 129, 63)[i % 3], ios[i % 3]), ((4099, 70001)[i % 2], ios[(i + 1) % 3])]:
            x32 = rng.standard_normal((batch, widths[0])).astype(np.float32)
            check_forms(mlp, g, x32, io, forms, seen, failures, (i, widths))
            check_default(mlp, g, x32, io, failures, (i, widths))
    assert_every_form(forms, seen, failures)


@pytest.mark.gpu
def test_gpu_norms_in_the_streamed_warpgroup_kernel():
    """The streamed register-A kernel's norm layers (one whole-row group whose weights come from several slots), in
    its three forced shapes, on the named networks and random graphs (residuals, concats), float16 and bfloat16,
    vs float64: a short run of the forms the every-form tests above also cover."""
    if fusedmlp._api._gpu(0).info["arch"] != 90:
        pytest.skip("the streamed warpgroup kernel needs sm_90")
    forms = {name: o for name, o in SM90_FORMS.items() if name.startswith("streamed")}
    rng = np.random.default_rng(302)
    failures, seen = [], set()
    graphs = []
    for i, (widths, kinds, residual, concat, acts) in enumerate(NAMED_GRAPHS):
        ws, bs = weights_for(rng, widths, concat, bias_offset=2.0 if i % 2 else 0.0)
        graphs.append(types.SimpleNamespace(ws=ws, bs=bs, acts=acts, residual=residual, concat=concat, widths=widths,
                                            norms={l: random_norm(rng, widths[l + 1], k) for l, k in kinds.items()}))
    graphs += [random_graph(rng) for _ in range(12)]
    for i, g in enumerate(graphs):
        prec, io = ("float16", "bfloat16")[i % 2], ("float32", "float16", "bfloat16")[i % 3]
        mlp = fused(g, dtype=prec, device="cuda")
        x32 = rng.standard_normal((int(rng.choice([1, 129, 4099, 70001])), g.ws[0].shape[1])).astype(np.float32)
        ref = norm_forward(x32, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        if not np.all(np.isfinite(ref)) or np.max(np.abs(ref)) > 6e4:
            continue  # outside what float16 holds
        check_forms(mlp, g, x32, io, forms, seen, failures, (i, [w.shape for w in g.ws]))
    print(f"\nstreamed norms: {len(graphs)} graphs, forms seen {sorted(seen)}, {len(failures)} failures")
    assert set(forms) <= seen, set(forms) - seen
    assert not failures, failures[:8]


@pytest.mark.gpu
def test_gpu_random_graphs_with_norms_in_every_kernel_form():
    """Random chains mixing norms (any affine, any eps, rows far from zero), residuals and concats, every kernel form
    that takes each, vs float64."""
    rng = np.random.default_rng(301)
    forms = gpu_forms()
    failures, seen, checked = [], set(), 0
    for i in range(24):
        g = random_graph(rng)
        prec = ("float16", "bfloat16", "tf32")[i % 3]
        mlp = fused(g, dtype=prec, device="cuda")
        x32 = rng.standard_normal((int(rng.choice([1, 63, 129, 4099])), g.widths[0])).astype(np.float32)
        ref = norm_forward(x32, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        if not np.all(np.isfinite(ref)) or np.max(np.abs(ref)) > 6e4:
            continue  # outside what float16 holds
        checked += 1
        check_forms(mlp, g, x32, ("float32", "float16")[i % 2], forms if prec != "tf32" else GPU_FORMS, seen,
                    failures, (i, g.widths, sorted(g.norms), g.residual, g.concat))
    assert checked >= 18 and {"mma.sync", "cluster 2"} & seen
    assert not failures, failures[:8]


@pytest.mark.gpu
def test_gpu_norm_check_true_agrees_with_the_cpu_path():
    rng = np.random.default_rng(302)
    ws, bs = weights_for(rng, [32, 128, 128, 10])
    norm = {0: ("layernorm", rng.uniform(0.5, 1.5, 128).astype(np.float32), None), 1: "rmsnorm"}
    x = rng.standard_normal((5000, 32)).astype(np.float32)
    y = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation="silu", norm=norm, device="cuda", check=True)
    cpu = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation="silu", norm=norm, device="cpu")
    assert not np.isnan(y).any() and rel_l2(y, cpu.astype(np.float64)) <= 2e-3


# ------------------------------------------------------------------------- norm layers as a GEMM and a row pass (GPU)


def random_wide_norm_graph(rng):
    """A random chain with at least one norm layer no fused kernel takes (257-2050 features: a GEMM and a row pass;
    2050-wide rows are read twice, the others stay in registers), norms on narrow layers too, residuals onto norm
    layers from their input, an earlier output or the network input, input concats (also onto norm layers), rows
    far from zero."""
    depth = int(rng.integers(1, 5))
    pool = [16, 64, 256, 300, 512, 777, 1024, 2050]
    widths = [int(rng.choice([3, 32, 259, 512]))] + [int(rng.choice(pool)) for _ in range(depth)]
    wide = [l for l in range(depth) if widths[l + 1] > 256]
    if not wide:
        wide = [int(rng.integers(depth))]
        widths[wide[0] + 1] = int(rng.choice([300, 512, 777, 1024, 2050]))
    concat = {l: str(rng.choice(["after", "before"])) for l in range(1, depth) if rng.random() < 0.2}
    acts = [str(rng.choice(ACTS)) for _ in range(depth - 1)] + [str(rng.choice(["none", "tanh"]))]
    norms = {l: random_norm(rng, widths[l + 1]) for l in range(depth) if rng.random() < (0.85 if l in wide else 0.3)}
    if not set(norms) & set(wide):
        norms[wide[0]] = random_norm(rng, widths[wide[0] + 1])
    return finish_graph(rng, widths, concat, acts, norms)


@pytest.mark.gpu
def test_gpu_wide_norm_layers_run_as_a_gemm_and_a_row_pass():
    """30 random chains whose norm layers no fused kernel takes, float16 / bfloat16 / tf32 with rotating I/O dtypes,
    batches of 1 to 4099 rows, poisoned outputs, against float64 within each dtype's check=True bound."""
    rng = np.random.default_rng(303)
    failures, checked, passes = [], 0, 0
    for i in range(30):
        g = random_wide_norm_graph(rng)
        prec, io = ("float16", "bfloat16", "tf32")[i % 3], ("float32", "float16", "bfloat16")[(i // 3) % 3]
        mlp = fused(g, dtype=prec, device="cuda")
        x32 = rng.standard_normal((int(rng.choice([1, 63, 1000, 4099])), g.widths[0])).astype(np.float32)
        ref = norm_forward(x32, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        if not np.all(np.isfinite(ref)) or np.max(np.abs(ref)) > 6e4:
            continue  # outside what float16 holds
        x, y = run_kernel(mlp._kernel(io, rows=len(x32)), x32, io)
        ref = norm_forward(x, g.ws, g.bs, g.acts, g.residual, g.concat, g.norms)
        err = np.inf if np.isnan(y).any() else rel_l2(y, ref)
        checked += 1
        passes += sum("second kernel" in s for s in mlp.segments or [])
        if not err <= max(fusedmlp.CHECK_TOLERANCES[prec], 1.6e-2 if io == "bfloat16" else 0):
            failures.append((i, g.widths, sorted(g.norms), g.residual, g.concat, prec, io, len(x32), err,
                             mlp.segments))
    print(f"\nwide norms: {checked} graphs checked, {passes} row passes, {len(failures)} failures")
    assert checked >= 24 and passes >= 24
    assert not failures, failures[:4]


@pytest.mark.gpu
def test_gpu_wide_norm_network_through_torch_out_and_a_cuda_graph():
    """A 1024-wide LayerNorm + SiLU stack (rl1024) through the torch call path, out=, batch 0 and a CUDA graph
    capture after a warm-up call: the row passes' workspace slot and launches replay like the GEMMs'."""
    from test_segments_gpu import check_graph_replays

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(304)
    widths = [64, 1024, 1024, 1024, 16]
    ws, bs = weights_for(rng, widths)
    norms = {l: random_norm(rng, 1024, "layernorm") for l in range(3)}
    acts = ["silu"] * 3 + ["none"]
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, norm={l: spec(e) for l, e in norms.items()}, device="cuda")
    assert sum("second kernel" in s for s in mlp.segments) == 3
    def reference(x):
        return norm_forward(x, ws, bs, acts, norms=norms)

    x = torch.randn(3000, 64, device="cuda", dtype=torch.float16)
    ref = reference(x.double().cpu().numpy())
    assert rel_l2(mlp(x).double().cpu().numpy(), ref) <= fusedmlp.CHECK_TOLERANCES["float16"]
    out = torch.full((3000, 16), float("nan"), device="cuda", dtype=torch.float32)
    assert mlp(x, out=out) is out and rel_l2(out.double().cpu().numpy(), ref) <= fusedmlp.CHECK_TOLERANCES["float16"]
    assert mlp(x[:0]).shape == (0, 16)
    check_graph_replays(torch, mlp, 64, 16, reference, fusedmlp.CHECK_TOLERANCES["float16"])


def _holds(blob, values):
    """Whether the float32 blob holds values as one contiguous run."""
    n = len(values)
    return any(np.array_equal(blob[i:i + n], values) for i in range(len(blob) - n + 1))


def test_a_norm_layer_hands_silu_and_sigmoid_half_their_argument(rng):
    """Where a norm layer's silu or sigmoid runs in its fast form (16-bit results), the plan packs gamma / 2 and
    beta / 2 and the layer's act takes h = x / 2 (fm_silu_h, fm_sigmoid_h): the FMUL by 1/2 goes, with no bit changed
    (halving is exact). Other activations, float32 results and tf32 plans keep gamma and beta as given."""
    ws, bs = weights_for(rng, [16, 64, 48, 32, 8])
    affine = [(rng.uniform(0.5, 2, w.shape[0]).astype(np.float32), rng.uniform(-1, 1, w.shape[0]).astype(np.float32))
              for w in ws[:3]]
    norm = {0: ("layernorm", *affine[0], 1e-5), 1: ("rmsnorm", *affine[1], 1e-5), 2: ("layernorm", *affine[2], 1e-5)}
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["silu", "sigmoid", "gelu", "none"], norm=norm, device="cpu")
    for arch, form in ((90, {"wgmma": 1}), (80, {})):
        plan, source = mlp._render(arch, 0, 0, "float16", "float16", **form)
        acts = re.findall(r"float act\(float x, int\) \{ return (.*?); \}", source)
        assert acts[:2] == ["fm_silu_h(x)", "fm_sigmoid_h(x)"] and "_h(" not in acts[2], acts
        blob = np.frombuffer(mlp._net.plan(arch, 0, 0, "float16", "float16", **form).packed_floats(), np.float32)
        for l, (g, b) in enumerate(affine):
            scale = np.float32(0.5 if l < 2 else 1.0)
            assert _holds(blob, g * scale) and _holds(blob, b * scale), (arch, l)
    tf32 = fusedmlp.FusedMLP(ws, bs, activation=["silu", "sigmoid", "gelu", "none"], norm=norm, dtype="tf32",
                             device="cpu")
    plan, source = tf32._render(80, 0, 0, "float32", "float32")
    assert not any("_h(" in a for a in re.findall(r"float act\(float x, int\) \{ return (.*?); \}", source))
    blob = np.frombuffer(tf32._net.plan(80, 0, 0, "float32", "float32", precision="tf32").packed_floats(), np.float32)
    assert all(_holds(blob, g) for g, _ in affine)


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["float16", "bfloat16"])
def test_gpu_halved_gamma_and_beta_give_the_unhalved_bits(prec):
    """fm_plan.norm_half (a silu or sigmoid norm layer's act takes x / 2 from gamma / 2 and beta / 2) changes no bit
    against the plan without it (norm_half=-1), in every kernel form that holds the network; rl256's shape, a
    sigmoid norm layer, a residual one and a concat."""
    rng = np.random.default_rng(305)
    graphs = [([64, 256, 256, 256, 16], {0: "layernorm", 1: "layernorm", 2: "layernorm"}, {}, {},
               ["silu"] * 3 + ["none"]),
              ([9, 96, 96, 64, 5], {0: "rmsnorm", 1: "layernorm", 2: "layernorm"}, {1: ("add", "none", 0)}, {2: "after"},
               ["sigmoid", "silu", "sigmoid", "none"])]
    compared, halved = 0, 0
    for i, (widths, kinds, residual, concat, acts) in enumerate(graphs):
        ws, bs = weights_for(rng, widths, concat, bias_offset=1.0)
        g = types.SimpleNamespace(ws=ws, bs=bs, acts=acts, residual=residual, concat=concat,
                                  norms={l: random_norm(rng, widths[l + 1], k) for l, k in kinds.items()})
        mlp = fused(g, dtype=prec, device="cuda")
        x32 = rng.standard_normal((4099, widths[0])).astype(np.float32)
        for name, options in gpu_forms().items():
            try:
                kernel, plan, source, _ = mlp._build("float16", "float16", **options)
                plain, _, plain_source, _ = mlp._build("float16", "float16", norm_half=-1, **options)
            except fusedmlp.LimitError:
                continue
            halved += "fm_silu_h(x)" in source and "fm_silu_h(x)" not in plain_source
            _, y = run_kernel(kernel, x32, "float16")
            _, y_plain = run_kernel(plain, x32, "float16")
            assert np.array_equal(y.view(np.uint16), y_plain.view(np.uint16)), (i, name)
            compared += 1
    assert compared >= 10 and halved >= 5, (compared, halved)
