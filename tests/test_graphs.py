"""Residuals from any kept value and NeRF-style input concats, and the three compute dtypes, on the CPU path (CI):
against a NumPy float64 forward and PyTorch modules (traced with torch.fx), plus their kernels' compiles."""

import re

import numpy as np
import pytest

import fusedmlp
from conftest import graph_weights, rel_l2, torch_init
from test_residual import NUMPY_ACTS


def graph_forward(x, ws, bs, acts, residual, concat):
    """float64 forward with float32 storage between layers; residual[l] = (op, then, source value), concat[l] a mode."""
    x0 = x.astype(np.float64)
    values, h = {-1: x0}, x0
    for l, (w, b, act) in enumerate(zip(ws, bs, acts)):
        mode = (concat or {}).get(l)
        inp = np.concatenate([h, x0], 1) if mode == "after" else np.concatenate([x0, h], 1) if mode == "before" else h
        y = NUMPY_ACTS[act](inp @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64)))
        if residual[l] is not None:
            op, then, src = residual[l]
            r = values[-1 if src == "input" else src]
            y = NUMPY_ACTS[then](y + r if op == "add" else y * r)
        h = values[l] = y.astype(np.float32).astype(np.float64)
    return h


def random_graph(rng, max_depth=6):
    """A random network whose layers may concat the input and take residuals from any equally wide kept value."""
    depth = int(rng.integers(1, max_depth + 1))
    common = int(rng.choice([3, 16, 24, 64, 100, 128]))
    widths = [common if rng.random() < 0.5 else int(rng.integers(1, 40))]
    widths += [common if rng.random() < 0.75 else int(rng.integers(1, 130)) for _ in range(depth)]
    concat = {l: str(rng.choice(["after", "before"])) for l in range(1, depth) if rng.random() < 0.3}
    acts = [str(rng.choice(list(NUMPY_ACTS))) for _ in range(depth)]
    residual = []
    for l in range(depth):
        sources = [v for v in range(-1, l) if widths[v + 1] == widths[l + 1]]
        if not sources or rng.random() < 0.4:
            residual.append(None)
            continue
        src = int(rng.choice(sources))
        residual.append((str(rng.choice(["add", "mul"])), str(rng.choice(["none", "relu", "tanh"])),
                         "input" if src < 0 else src))
    ws, bs = graph_weights(rng, widths, concat, 1.5)
    return widths, ws, bs, acts, residual, concat


@pytest.mark.parametrize("seed", range(40))
def test_cpu_path_matches_numpy_on_random_graphs(seed):
    rng = np.random.default_rng(1000 + seed)
    widths, ws, bs, acts, residual, concat = random_graph(rng)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, residual=residual, concat=concat, device="cpu")
    x = rng.standard_normal((67, widths[0])).astype(np.float32)
    ref = graph_forward(x, ws, bs, acts, residual, concat)
    assert rel_l2(mlp(x), ref) <= 1e-6


def test_nerf_mlp_traced_from_torch_matches_the_module():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class NeRF(nn.Module):  # the original NeRF trunk: 8 x 256, the encoded input concatenated before layer 5
        def __init__(self, d_in=63, width=256, skip=4):
            super().__init__()
            self.skip = skip
            self.layers = nn.ModuleList([nn.Linear(d_in, width)] + [
                nn.Linear(width + (d_in if i == skip + 1 else 0), width) for i in range(1, 8)])
            self.out = nn.Linear(width, 4)

        def forward(self, x):
            h = x
            for i, layer in enumerate(self.layers):
                if i == self.skip + 1:
                    h = torch.cat([x, h], -1)
                h = torch.relu(layer(h))
            return self.out(h)

    torch.manual_seed(0)
    model = NeRF().double().eval()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert mlp._concat == [0, 0, 0, 0, 0, 2, 0, 0, 0] and "concat={5: before}" in repr(mlp)
    x = torch.randn(300, 63, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x).numpy()
    assert rel_l2(mlp(x.float().numpy()), ref) <= 1e-6
    fused = fusedmlp.torch.FusedModule(NeRF().eval())
    with torch.no_grad():
        assert rel_l2(fused(x.float()).double().numpy(), fused.module(x.float()).double().numpy()) <= 1e-5


def test_dense_skip_residuals_traced_from_torch_match_the_module():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(24, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 24)

        def forward(self, x):
            h1 = torch.tanh(self.a(x))
            h2 = nn.functional.silu(self.b(h1))
            h3 = torch.relu(h1 + nn.functional.gelu(self.c(h2)))  # residual from two layers back
            return x * torch.sigmoid(self.d(h3))  # residual with the network input

    torch.manual_seed(1)
    model = Skips().double()
    mlp = fusedmlp.from_torch(model, device="cpu")
    assert [r[2] if r else None for r in mlp._residual] == [None, None, 0, -1]
    x = torch.randn(150, 24, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x).numpy()
    assert rel_l2(mlp(x.float().numpy()), ref) <= 1e-6


@pytest.mark.parametrize("body, match", [
    ("h = torch.cat([h, h], -1)", "only torch.cat\\(\\[h, x\\], -1\\) or torch.cat\\(\\[x, h\\], -1\\)"),
    ("h = torch.cat([h, x], 0)", "only torch.cat"),
    ("h = torch.relu(torch.cat([h, x], -1))", "must feed a Linear directly"),
    ("h = self.a(torch.relu(h)) + h", "the residual operand a is neither the network input nor a layer.s output"),
])
def test_unsupported_graph_edges_name_the_node(body, match):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    namespace = {"torch": torch, "nn": nn}
    exec(f"""
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        {body}
        return self.b(h)
""", namespace)
    with pytest.raises(fusedmlp.ArgumentError, match=match):
        fusedmlp.from_torch(namespace["M"](), device="cpu")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"concat": {0: "after"}}, fusedmlp.ArgumentError, "concat names layer 0; it must be one of the layers 1..2"),
    ({"concat": {1: "middle"}}, fusedmlp.ArgumentError, "concat mode of layer 1 is 'middle'"),
    ({"concat": [0, 1, 0]}, fusedmlp.ArgumentError, "concat=.* must be None or a dict"),
    ({"concat": {2: "after"}}, fusedmlp.ShapeError, "layer 2's input is the concat of layer 1's 8 outputs and the "
                                                     "network's 4 inputs: 12 features"),
    ({"residual": {2: ("add", "none", 5)}}, fusedmlp.ArgumentError, "residual 'from' of layer 2 is 5"),
    ({"residual": {2: ("add", "none", "input")}}, fusedmlp.ShapeError,
     "layer 2 has 2 output features but its residual operand, the network input, has 4"),
    ({"residual": {1: {"op": "add", "from": 0}}}, None, None),
    ({"dtype": "float64"}, fusedmlp.DTypeError, "dtype='float64' is not a compute dtype; it must be one of float16, "
                                                "bfloat16, tf32"),
])
def test_bad_graph_arguments_name_the_field_and_rule(kwargs, error, match):
    ws, bs = torch_init(np.random.default_rng(0), [4, 8, 8, 2])
    if error is None:
        mlp = fusedmlp.FusedMLP(ws, bs, device="cpu", **kwargs)
        x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
        ref = graph_forward(x, ws, bs, ["relu", "relu", "none"], [None, ("add", "none", 0), None], None)
        assert rel_l2(mlp(x), ref) <= 1e-6
        return
    with pytest.raises(error, match=match):
        fusedmlp.FusedMLP(ws, bs, device="cpu", **kwargs)


GRAPHS = [  # (widths, residual, concat): in place, kept values, two-part inputs, streamed 256-wide layers
    ([63, 256, 256, 256, 4], {2: ("add", "relu", 0)}, {2: "before"}),
    ([3, 32, 32, 32, 8], {2: ("mul", "none", 0)}, {1: "after", 3: "after"}),
    ([64, 128, 128, 128, 64], {1: "add", 2: ("add", "relu"), 3: ("add", "none", "input")}, None),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", fusedmlp.PRECISIONS)
def test_graph_kernels_compile_in_every_precision(arch, dtype, tmp_path):
    for widths, residual, concat in GRAPHS:
        rng = np.random.default_rng(2)
        ws = [rng.standard_normal((n, k + (widths[0] if concat and l in concat else 0))).astype(np.float32)
              for l, (k, n) in enumerate(zip(widths[:-1], widths[1:]))]
        mlp = fusedmlp.FusedMLP(ws, None, activation="silu", residual=residual, concat=concat, dtype=dtype,
                                device="cpu", cache_dir=tmp_path)
        for io in ("float32", "bfloat16"):
            paths = mlp.compile(arch, io)  # a tuple where sm_90 cuts a network that would stream its weights
            for path in paths if isinstance(paths, tuple) else (paths,):
                with open(path, "rb") as f:
                    assert b"\x7fELF" in f.read()
            assert f"#define FM_PREC {fusedmlp.PRECISIONS.index(dtype)}" in mlp.source
            assert f"#define FM_IN_TYPE {0 if io == 'float32' else 2}" in mlp.source
        if concat and not isinstance(paths, tuple) and "fm_wgmma" not in mlp.source:  # (mma.sync's two-part inputs;
            # on sm_90 the streamed warpgroup kernel takes the 32-wide graph: x's fragments and value 0's kept)
            assert "A1_BUF = -1" in mlp.source and any(f"A1_BUF = {b}," in mlp.source for b in range(4))


def test_bf16_and_tf32_need_sm80():
    ws, bs = torch_init(np.random.default_rng(0), [4, 8, 2])
    for dtype in ("bfloat16", "tf32"):
        with pytest.raises(fusedmlp.LimitError, match=f"dtype='{dtype}' needs Tensor Cores of sm_80 or newer; the "
                                                      "target is sm_75"):
            fusedmlp.FusedMLP(ws, bs, dtype=dtype, device="cpu").compile("sm_75")
    with pytest.raises(fusedmlp.LimitError, match="bfloat16 input/output needs sm_80"):
        fusedmlp.FusedMLP(ws, bs, device="cpu").compile("sm_75", "bfloat16")
    with pytest.raises(fusedmlp.DTypeError, match="io_dtype='int8'"):
        fusedmlp.FusedMLP(ws, bs, device="cpu").compile("sm_90", "int8")


def test_bfloat16_numpy_arrays_through_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    ws, bs = torch_init(rng, [6, 16, 3])
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", dtype="bfloat16", device="cpu")
    x = rng.standard_normal((9, 6)).astype(ml_dtypes.bfloat16)
    y = mlp(x)
    assert y.dtype == ml_dtypes.bfloat16 and y.shape == (9, 3)
    ref = graph_forward(x.astype(np.float32), ws, bs, ["gelu", "none"], [None, None], None)
    assert rel_l2(y.astype(np.float32), ref) <= 2 ** -8


@pytest.mark.parametrize("dtype, io, fast_layers", [("float16", "float32", 5), ("float16", "float16", 6),
                                                     ("bfloat16", "float32", 5), ("tf32", "float32", 0),
                                                     ("tf32", "float16", 1)])
def test_fast_tanh_only_where_the_result_is_rounded_to_16_bits(dtype, io, fast_layers):
    """tanh.approx (error ~2^-11) is used by layers whose output is stored in 16 bits next, never for a float32 one."""
    ws, bs = torch_init(np.random.default_rng(4), [2, 50, 50, 50, 50, 50, 1], True)
    mlp = fusedmlp.FusedMLP(ws, bs, "tanh", output_activation="tanh", dtype=dtype, device="cpu")
    mlp.compile("sm_90", io)
    assert mlp.source.count("    FM_FAST_HELPERS") == fast_layers



@pytest.mark.parametrize("dtype, io, hidden, last, want", [
    ("float16", "float16", "relu", "none", ["fm_relu2<1>"] * 3 + ["fm_pack2<1>"]),
    ("bfloat16", "bfloat16", "relu", "relu", ["fm_relu2<2>"] * 4),
    ("float16", "float32", "relu", "none", ["fm_relu2<1>"] * 3 + [None]),        # float32 output: no pair
    ("bfloat16", "float16", "tanh", "sigmoid", [None] * 4),                      # tanh keeps its float32 MUFU form
    ("float16", "float16", "relu(x) + 1", "identity(x)", [None] * 3 + ["fm_pack2<1>"]),
    ("tf32", "float16", "relu", "relu", [None] * 3 + ["fm_relu2<1>"]),           # tf32 keeps float32 activations
])
def test_pair_activations_only_for_their_functions_and_16_bit_results(dtype, io, hidden, last, want):
    """Identity and relu results stored in 16 bits are computed two columns at a time straight into the stored pair
    (fm_common.cuh, "pair activations"); every other layer keeps act()."""
    ws, bs = torch_init(np.random.default_rng(5), [8, 24, 24, 24, 5], True)
    mlp = fusedmlp.FusedMLP(ws, bs, hidden, output_activation=last, dtype=dtype, device="cpu")
    for arch in ("sm_80", "sm_90"):  # the mma.sync and the wgmma kernel render the same Layer<l>
        mlp.compile(arch, io)
        layers = mlp.source.split("template <> struct Layer<")[1:]
        got = [re.search(r"return (fm_\w+<\d>)\(x0, x1\)", layer) for layer in layers]
        assert [m.group(1) if m else None for m in got] == want, arch
        assert sum("static constexpr int PAIR = 0;" in layer for layer in layers) == want.count(None)

@pytest.mark.parametrize("n_chunk", [32, 64])
def test_wgmma_column_groups_render_and_compile(n_chunk):
    """A forced n_chunk splits each warpgroup-kernel layer wider than it into column groups of n_chunk and a last
    group of the rest: Layer<l>::NC says so, one m64nNk16 wgmma is emitted per group width, and NVRTC compiles it
    for sm_90a."""
    from fusedmlp import _api, _core

    _api._nvrtc_info()
    rng = np.random.default_rng(6)
    widths = [32, 128, 192, 96, 64, 5]
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, ["relu", "tanh", "gelu", "silu", "none"], device="cpu")
    plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472, wgmma=1, warps=4, n_chunk=n_chunk)
    assert plan.info["wgmma"] == 1
    groups = [(int(n), int(nc)) for n, nc in re.findall(r"N = (\d+), NR = \d+, NC = (\d+);", source)]
    assert groups == [(n, n_chunk if n > n_chunk else n) for n in (128, 192, 96, 64, 16)]
    widths_emitted = sorted(int(n) for n in re.findall(r"struct fm_wgmma<(\d+)>", source))
    assert widths_emitted == sorted({n_chunk, 16} | ({32} if n_chunk == 64 else set())), widths_emitted
    cubin, _ = _core.nvrtc_compile(source, _api.TEMPLATE, 90, True, ())
    assert len(cubin) > 1000


@pytest.mark.parametrize("widths, act, cluster", [
    # registers per thread: n/2 accumulators + k/4 input + n/4 output fragments (not the last layer's) + 40
    ([64, 256, 64], "relu", 0),             # 128 + 16 + 64 + 40 = 248
    ([32, 208, 208, 8], "relu", 0),         # 104 + 52 + 52 + 40 = 248
    ([256, 256], "relu", 0),                # the last layer stages its output: 128 + 64 + 40
    # over 255: activations in shared memory, each CTA of a cluster holding its share of the weights
    ([64, 256, 256, 64], "relu", 2),        # 128 + 64 + 64 + 40 = 296; 192 KB of weights: two CTAs
    ([32, 224, 224, 8], "relu", 2),         # 264; 224 columns per CTA would not fit the registers either: two CTAs
    ([2, 256, 256, 256, 3], "sin", 2),      # siren256: 280 KB of weights
    ([64, 224, 224, 100, 1], "gelu", 2),
])
def test_wgmma_takes_the_layers_that_fit_the_registers(widths, act, cluster):
    """By default the sm_90a plan keeps a network's activations in registers on the warpgroup kernel only if each
    layer's accumulators, input and output fragments fit 255 registers together; the others keep them in shared
    memory on clusters of CTAs. Both compile for sm_90a without spills."""
    plan, source = render_for_h100(widths, act)
    assert plan.info["wgmma"] == 1 and plan.info["cluster"] == cluster
    assert ("__cluster_dims__" in source) == (cluster > 1)
    assert_clean_sm90a(source)


@pytest.mark.parametrize("widths, act, cluster, forced", [
    # forced: by default these two now run the streamed register-A form (two warpgroups do not fit clusters of 2)
    ([2, 256, 256, 256], "sin", 2, True),     # 16-bit y: with the last layer whole in CTA 0, no cluster plan held it
    ([64, 256, 256, 192], "relu", 2, True),   # whole in CTA 0, its MMAs left the other CTAs idle (clusters of 4)
    ([64, 256, 256, 37], "silu", 2, False),   # 37 pads to 64: 32 columns a CTA
    ([2, 256, 256, 256, 3], "sin", 2, False),  # siren256: 3 columns stay whole in CTA 0
])
def test_cluster_kernel_splits_a_last_layer_wider_than_16_columns(widths, act, cluster, forced):
    """On a cluster, a last layer wider than 16 columns is split like the hidden layers (Layer<last>::NC is its share
    of the padded width), a narrower one stays whole in CTA 0; either compiles for sm_90a without spills."""
    plan, source = render_for_h100(widths, act, **({"cluster": cluster} if forced else {}))
    assert plan.info["wgmma"] == 1 and plan.info["cluster"] == cluster
    n, nc = map(int, re.findall(r" N = (\d+), NR = \d+, NC = (\d+);", source)[-1])
    assert nc * (cluster if widths[-1] > 16 else 1) == n and n >= widths[-1], (n, nc)
    assert_clean_sm90a(source)


@pytest.mark.parametrize("widths, act, residual, cluster, forced", [
    # 590 KB: by default the streamed register-A form (test_benchmark_networks_stream_their_weights_on_the_h100)
    ([64, 256, 256, 256, 256, 256, 64], "gelu", {1: "add", 2: "add", 3: "add", 4: "add"}, 4, True),
    ([2, 256, 256, 256, 3], "sin", {1: "add", 2: ("add", "relu")}, 2, False),  # siren256's shape: far redo by group
    ([64, 224, 224, 32], "silu", {1: "mul"}, 2, False),
    # forced: the last layer's operand (all of its input's columns) and layer 0's (x's fragments, by rank); a wide
    # last layer does not fit CTA 0, which holds it whole
    ([128, 128, 128, 128], "tanh", {0: "add", 1: "add", 2: "mul"}, 2, True),
    ([128, 128, 128, 128], "sin", {0: "add", 1: "add", 2: "add"}, 4, True),
])
def test_cluster_kernel_takes_residual_networks(widths, act, residual, cluster, forced):
    """A residual network too wide for the register-A kernel with resident weights (224-256-wide hidden layers) runs
    the cluster kernel where two warpgroups fit clusters of 2 (the others where forced), which reads a residual
    operand from the columns of its A buffer that the layer's output overwrites (on an H100 it ran the mma.sync kernel
    before); it compiles for sm_90a without spills."""
    plan, source = render_for_h100(widths, act, residual, **({"cluster": cluster} if forced else {}))
    assert plan.info["wgmma"] == 1 and plan.info["cluster"] == cluster
    assert len(re.findall(r"RES = [12],", source)) == len(residual)
    assert_clean_sm90a(source)


def render_for_h100(widths, act, residual=None, **options):
    """(plan, source) of a network of these widths (random weights and biases, fp16 x and y) for an H100's limits."""
    from fusedmlp import _api

    _api._nvrtc_info()
    rng = np.random.default_rng(7)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    bs = [rng.standard_normal(o).astype(np.float32) for o in widths[1:]]
    mlp = fusedmlp.FusedMLP(ws, bs, act, residual=residual, device="cpu")
    return mlp._render(90, 232448, 132, "float16", "float16", 233472, **options)


def assert_clean_sm90a(source):
    """The source compiles for sm_90a without spills, without ptxas serializing its wgmma (warning C7519: each MMA
    then waits for the one before, which a branch or wait between a layer's MMAs can cause) and without the front
    end's warnings (a division by a constant zero in a discarded branch was one). NVRTC's own cache is off: a source
    it answered from there would come with no ptxas report."""
    from fusedmlp import _api, _core

    cubin, log = _core.nvrtc_compile(source, _api.TEMPLATE, 90, True, ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and set(spills) == {"0"}, log
    assert "C7519" not in log and "serialized" not in log, log
    assert "warning #" not in log, log


@pytest.mark.parametrize("widths, residual, options", [
    ([9] + [64] * 7 + [3], {3: ("add", "none", 0), 6: ("add", "none", 3)}, {}),  # SimBa's blocks
    ([64] * 6 + [5], {2: ("add", "relu", "input"), 3: "add", 4: ("mul", "none", 2)}, {}),  # x kept, own input between
    ([17] + [128] * 5 + [4], {2: ("add", "none", 0), 4: ("add", "none", 2)}, {"resident": 0}),  # streamed
])
def test_wgmma_keeps_a_value_for_a_residual_from_further_back(widths, residual, options):
    """A residual reading a value two or more layers back, or x, runs on the warpgroup kernel (it fell back to
    mma.sync on sm_90): the value's fragments stay in registers from its layer on (fm_network's ka), counted in the
    register estimate, one such value at a time; the layers run unrolled. Compiles for sm_90a clean."""
    plan, source = render_for_h100(widths, "gelu", residual, wgmma=1, **options)
    assert plan.info["wgmma"] == 1 and plan.info["cluster"] == 0
    assert "RES_FROM = 3;" in source or "RES_FROM = 2;" in source
    assert_clean_sm90a(source)


def test_wgmma_refuses_two_kept_values_and_8_bit_ones_naming_why():
    """Two values kept at once (layer 3 reads value 0 while layer 4 will read value 1), or an 8-bit network's kept
    value (its codes are packed for the next layer): the warpgroup kernel's LimitError says why, and the default plan
    is the mma.sync kernel."""
    with pytest.raises(fusedmlp.LimitError, match="keep one earlier value for later layers' residuals at a time"):
        render_for_h100([16] * 6, "relu", {3: ("add", "none", 0), 4: ("add", "none", 1)}, wgmma=1)
    plan, _ = render_for_h100([16] * 6, "relu", {3: ("add", "none", 0), 4: ("add", "none", 1)})
    assert plan.info["wgmma"] == 0
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((32, 32)).astype(np.float32) for _ in range(4)]
    mlp = fusedmlp.FusedMLP(ws, None, "relu", residual={3: ("add", "none", 0)}, dtype="float8", device="cpu")
    mlp.calibrate(rng.standard_normal((64, 32)).astype(np.float32))
    with pytest.raises(fusedmlp.LimitError, match="take an 8-bit network's residuals from a layer's own input only"):
        mlp._render(90, 232448, 132, "float16", "float16", 233472, wgmma=1)


@pytest.mark.parametrize("io", ["float16", "float32"])
@pytest.mark.parametrize("name", ["tcnn64", "tcnn128", "flex", "pinn50", "siren256", "res128"])
def test_benchmark_workloads_compile_clean_for_the_h100(name, io):
    """Each benchmark workload's default plan for an H100's limits, fp16 or float32 x and y, is on the warpgroup kernel
    and compiles clean (bench/sass_report.py shows the rest: registers, HGMMA and MUFU counts)."""
    from fusedmlp import _api, bench

    _api._nvrtc_info()
    wl = bench.WORKLOADS[name]
    rng = np.random.default_rng(8)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(wl.widths[:-1], wl.widths[1:])]
    bs = [rng.standard_normal(o).astype(np.float32) for o in wl.widths[1:]] if wl.bias else None
    mlp = fusedmlp.FusedMLP(ws, bs, device="cpu", **bench.fused_options(wl))
    plan, source = mlp._render(90, 232448, 132, io, io, 233472)
    assert plan.info["wgmma"] == 1
    assert_clean_sm90a(source)


@pytest.mark.parametrize("io", ["float16", "float32"])
@pytest.mark.parametrize("name", ["r256", "deep256", "nerf"])
def test_benchmark_networks_stream_their_weights_on_the_h100(name, io):
    """r256 (64-256-256-256-16 silu), deep256 (64-256x5-64) and NeRF (63-256x8-4, x concatenated before layer 5) plan
    for an H100 as one kernel each: the register-A warpgroup kernel with every layer's weights streamed from L2
    through shared-memory slots (two or more; FM_STREAM in the source says how many). Their resident weights fit
    neither one CTA nor two warpgroups on clusters of 2; at 2^21 rows (fp16) the streamed form ran r256 in 1.04 ms and
    deep256 in 1.56 against 2.29 and 7.69 on one warpgroup on clusters of 2 and 4, and NeRF, its concat's x fragments
    kept in registers, in 3.12 ms against 9.4 cut into segments. Each compiles clean for sm_90a."""
    from fusedmlp import _api, probe

    _api._nvrtc_info()
    gpu = probe.GPUS["h100"]
    target = (gpu["arch"], gpu["smem_per_block"], gpu["sm_count"], gpu["smem_per_sm"])
    mlp = probe.model(probe.workload(name), device="cpu")
    assert mlp._segments_for(*target, io, io) is None  # not cut: one fused kernel
    plan, source = mlp._render(*target[:3], io, io, target[3])
    info = plan.info
    assert (info["arch"], info["wgmma"], info["cluster"], info["resident"]) == (90, 1, 0, 0), info
    assert info["stream_slots"] >= 2 and info["warps"] in (4, 8), info
    assert (info["in_dtype"], info["out_dtype"]) == (io, io)
    assert f"#define FM_STREAM {info['stream_slots']} " in source and "__cluster_dims__" not in source
    assert_clean_sm90a(source)


def test_streamed_plans_of_random_chains_compile_clean():
    """The streamed form's default plans (wgmma=1, resident=0: the group width and warps the plan chooses) of random
    chains up to 256 wide, with own-input residuals, input concats and norms, float16 and bfloat16, compile for
    sm_90a without spills or serialized wgmma, or where the plan's register estimate (plan.c, STREAM_WIDE_REGS) let
    128-column groups spill, the 64-column plan that FusedMLP._build then builds does (here one of ten: 3-256-256-256-
    160-160 gelu with a concat and residuals, 12 bytes at 255 registers). Where halved norms (fm_plan.norm_half)
    spilled, the plan without them, _build's first fallback, compiles clean (two of ten, 8 and 16 bytes)."""
    from conftest import graph_weights
    from test_norm import random_norm, spec

    rng = np.random.default_rng(20261125)
    spilled, halves_spilled = 0, []
    for i in range(10):
        depth = int(rng.integers(2, 7))
        widths = [int(rng.choice([3, 17, 63, 200]))] + [int(rng.choice([64, 160, 224, 256])) for _ in range(depth)]
        concat = {int(rng.integers(1, depth)): str(rng.choice(["before", "after"]))} if i % 2 else {}
        residual = {l: "add" for l in range(1, depth) if widths[l] == widths[l + 1] and l not in concat}
        norm = {l: spec(random_norm(rng, widths[l + 1])) for l in range(depth - 1) if rng.random() < 0.4}
        ws, bs = graph_weights(rng, widths, concat, 1.0)
        mlp = fusedmlp.FusedMLP(ws, bs, activation=str(rng.choice(["relu", "silu", "gelu"])), residual=residual or None,
                                concat=concat or None, norm=norm or None, dtype=("float16", "bfloat16")[i % 2],
                                device="cpu")
        plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472, wgmma=1, resident=0)
        assert plan.info["stream_slots"] >= 2, plan.info
        try:
            assert_clean_sm90a(source)
        except AssertionError as e:
            assert "spill stores" in str(e), e
            if plan.info["norm_half"]:  # FusedMLP._build's first fallback: the norms' act on x itself
                plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472, wgmma=1, resident=0,
                                           norm_half=-1)
                halves_spilled.append(i)
                try:
                    assert_clean_sm90a(source)
                    continue
                except AssertionError as e2:
                    e = e2
            assert "spill stores" in str(e) and "NC = 128;" in source, e
            spilled += 1
            plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472, wgmma=1, resident=0, n_chunk=64)
            assert plan.info["stream_slots"] >= 2 and "NC = 128;" not in source, plan.info
            assert_clean_sm90a(source)
    assert spilled <= 2 and len(halves_spilled) <= 2, (spilled, halves_spilled)


def unpack_stream_layer(bits, n_pad, k_pad, nc, kc):
    """A streamed layer's n_pad x k_pad weights back from its part of the blob: column groups of nc rows, each in K
    pieces of kc inputs (the last of each narrower), each piece wgmma's core matrices (8 rows x 8 halves, k fastest,
    then the next 8 inputs, then the next 8 rows)."""
    out = np.zeros((n_pad, k_pad), bits.dtype)
    at = 0
    for c0 in range(0, n_pad, nc):
        w = min(nc, n_pad - c0)
        for k0 in range(0, k_pad, kc):
            kw = min(kc, k_pad - k0)
            piece = bits[at:at + w * kw].reshape(w // 8, kw // 8, 8, 8)  # row group, k chunk, row, k
            out[c0:c0 + w, k0:k0 + kw] = piece.transpose(0, 2, 1, 3).reshape(w, kw)
            at += w * kw
    assert at == bits.size
    return out


@pytest.mark.parametrize("widths, k_chunk", [([64, 512, 512, 300, 64], 0), ([259, 384, 40], 48), ([64, 200, 3], 64)])
def test_streamed_k_pieces_lay_out_each_group_piece_by_piece(widths, k_chunk):
    """The streamed form's blob with K pieces (a network wider than 256, or k_chunk forced): each layer's column
    groups one after another, each group's K pieces one after another, each piece in the core-matrix layout of its own
    width, which is what one cp.async.bulk per piece brings to a slot for the kernel's descriptors."""
    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((o, i)).astype(np.float32) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(ws, None, "relu", device="cpu")
    options = {"wgmma": 1, "resident": 0, "k_chunk": k_chunk} if k_chunk else {}
    plan = mlp._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, **options)
    source = mlp._render(90, 232448, 132, "float16", "float16", 233472, **options)[1]
    assert plan.info["stream_slots"] >= 2
    shapes = [tuple(int(v) for v in m) for m in re.findall(r"K = (\d+), K0 = \d+, KR = \d+, N = (\d+), NR = \d+, "
                                                            r"NC = (\d+);\n.*KC = (\d+);", source)]
    assert len(shapes) == len(ws)
    bits = np.frombuffer(plan.packed_weights(), np.uint16)
    at, pieces = 0, 0
    for l, (k_pad, n_pad, nc, kc) in enumerate(shapes):
        assert kc == (min(k_pad, k_chunk) if k_chunk else kc) and kc % 16 == 0
        pieces += kc < k_pad
        got = unpack_stream_layer(bits[at:at + n_pad * k_pad], n_pad, k_pad, nc, kc)
        want = np.zeros((n_pad, k_pad), np.float32)
        want[:ws[l].shape[0], :ws[l].shape[1]] = ws[l]
        assert np.array_equal(got, want.astype(np.float16).view(np.uint16)), l
        at += n_pad * k_pad
    assert at == bits.size and pieces >= 1
    wide = max(widths) > 256
    assert ("WIDE = true" in source) == wide, source[:2000]


def test_wide_streamed_plans_compile_for_sm_90a():
    """Networks with layers 257-512 wide on sm_90a: one streamed kernel whose wide layers' outputs go through the
    warps' shared-memory buffers (WIDE) and whose weights arrive in 32 KB K pieces; they compile without serialized
    wgmma. (ptxas may spill a few loop-invariant addresses at 255 registers with 128-column groups: wide512 44 bytes,
    which ran 13% faster on the H100 than its 64-column groups, bench/results/h100-wide-stream/.)"""
    from fusedmlp import _api, _core

    for widths, act in (([64, 512, 512, 512, 512, 64], "gelu"), ([3, 300, 512, 256, 16], "silu"),
                        ([512, 256, 512, 1], "relu")):
        plan, source = render_for_h100(widths, act)
        assert plan.info["wgmma"] == 1 and plan.info["stream_slots"] >= 2 and plan.info["warps"] in (4, 8)
        assert "WIDE = true" in source and "wide layers' outputs in shared memory" in source
        _, log = _core.nvrtc_compile(source, _api.TEMPLATE, 90, True, ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
        assert "C7519" not in log and "serialized" not in log and "warning #" not in log, log
        spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
        assert spills and max(spills) <= 64, (widths, log)


def test_block_diagonal_layers_are_found_and_compile_for_sm_90a():
    """A layer whose weights are zero outside equal diagonal blocks (parallel stacks read as one network) renders as
    Layer<l>::BLOCKS (the most blocks, up to 8, that hold); one nonzero outside them, a layer whose widths the count
    does not divide, or blocks that fall on padding render 1. The streamed kernel with blocks compiles for sm_90a
    without spills or serialized wgmma (its groups skip the other blocks' K pieces: fm_blocks)."""
    from fusedmlp import _api, _core

    rng = np.random.default_rng(8)

    def blocks_of(w_hidden, n_in=23):
        ws = [rng.standard_normal((w_hidden.shape[1], n_in)).astype(np.float32), w_hidden,
              rng.standard_normal((2, w_hidden.shape[0])).astype(np.float32)]
        mlp = fusedmlp.FusedMLP(ws, None, "relu", device="cpu")
        plan, source = mlp._render(90, 232448, 132, "float16", "float16", 233472)
        return [int(b) for b in re.findall(r"BLOCKS = (\d+);", source)], source

    def diagonal(n, b):
        w = np.zeros((n, n), np.float32)
        k = n // b
        for i in range(b):
            w[i * k:(i + 1) * k, i * k:(i + 1) * k] = rng.standard_normal((k, k))
        return w

    found, source = blocks_of(diagonal(512, 2))
    assert found == [1, 2, 1]  # (the first and last layers: whole; 512 -> 2's blocks would fall on its padding)
    _, log = _core.nvrtc_compile(source, _api.TEMPLATE, 90, True, ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
    assert "C7519" not in log and "serialized" not in log and "warning #" not in log, log
    assert blocks_of(diagonal(512, 4))[0][1] == 4 and blocks_of(diagonal(384, 3))[0][1] == 3
    leak = diagonal(512, 2)
    leak[0, 511] = 1e-3
    assert blocks_of(leak)[0][1] == 1 and blocks_of(diagonal(300, 2))[0][1] == 1  # (300 pads to 304)


def test_wide_loop_is_the_default_for_wide_layers_and_changes_only_its_switch():
    """wide_loop (fm_plan.wide_loop) is on by default where the streamed plan has a layer wider than 256: a plan
    without it renders the same source as wide_loop=0 and wide_loop=1, its FM_WIDE_LOOP 1, and the unrolled form
    (wide_loop=-1) differs in that switch and the plan comment only (the loop's code sits in `if constexpr` branches
    and templates that the unrolled form does not instantiate). A network without a wide layer plans as before
    (wide_loop 0, whatever form); forcing wide_loop=1 on it, or on a plan of another form, is a limit naming it; a
    value other than -1, 0 and 1 is a value error."""
    widths, act = [64, 512, 512, 512, 512, 64], "gelu"
    plan, default = render_for_h100(widths, act)
    plan0, auto = render_for_h100(widths, act, wide_loop=0)
    plan1, on = render_for_h100(widths, act, wide_loop=1)
    plan_u, unrolled = render_for_h100(widths, act, wide_loop=-1)
    assert default == auto == on and "#define FM_WIDE_LOOP 1 " in default
    assert plan.info["wide_loop"] == plan0.info["wide_loop"] == plan1.info["wide_loop"] == 1
    assert plan_u.info["wide_loop"] == 0
    assert {k: v for k, v in plan_u.info.items() if k != "wide_loop"} == {k: v for k, v in plan.info.items()
                                                                          if k != "wide_loop"}
    changed = [(a, b) for a, b in zip(unrolled.splitlines(), on.splitlines()) if a != b]
    assert len(unrolled.splitlines()) == len(on.splitlines()) and len(changed) == 2, changed
    assert changed[0][0].startswith("// Plan: ") and changed[0][1] == changed[0][0].replace(
        "wide layers' outputs in shared memory", "wide layers' outputs in shared memory, their column groups looped")
    assert changed[1] == ("#define FM_WIDE_LOOP 0  // 1: FM_STREAM's wide layers run their column groups as a loop "
                          "(fm_wide_layer)", "#define FM_WIDE_LOOP 1  // 1: FM_STREAM's wide layers run their column "
                          "groups as a loop (fm_wide_layer)")
    rng = np.random.default_rng(3)
    narrow = fusedmlp.FusedMLP([rng.standard_normal((64, 32)).astype(np.float32),
                                rng.standard_normal((16, 64)).astype(np.float32)], None, "relu", device="cpu")
    for options in ({}, {"wgmma": 1, "resident": 0}):
        for loop in (-1, 0):
            assert narrow._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, wide_loop=loop,
                                    **options).info.get("wide_loop", 0) == 0
    with pytest.raises(fusedmlp.LimitError, match=r"wide_loop=1 was asked for, but this network has no layer wider "
                                                   r"than 256"):
        narrow._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, wgmma=1, resident=0, wide_loop=1)
    with pytest.raises(fusedmlp.LimitError, match=r"wide_loop=1 was asked for, but only the streamed warpgroup "
                                                   r"kernel \(wgmma=1, resident=0\)"):
        narrow._net.plan(90, 232448, 132, "float16", "float16", smem_per_sm=233472, wide_loop=1)
    for bad in (2, -2):
        with pytest.raises(ValueError, match=rf"wide_loop={bad}: the streamed kernel's wide layers' column groups, "
                                             r"0 \(auto: a loop\), 1 \(a loop, else an error\) or -1 \(unrolled\)"):
            narrow._net.plan(90, 232448, 132, wide_loop=bad)


def test_split_plans_render_and_compile_clean_for_sm_90a():
    """split (fm_plan.split; off in the default plan, the tuner tries it for small batches): the streamed kernel's wide
    layers over clusters of 2, 4 or 8 CTAs. The default renders FM_SPLIT 1 and no cluster; a split plan is a cluster
    kernel of that size whose stage shares its wide buffer's bytes, compiling for sm_90a without serialized wgmma, warnings
    or spills. What cannot be split is a limit naming why; a size other than 0, 2, 4 and 8 is a value error."""
    from fusedmlp import _api, _core

    widths, act = [64, 512, 512, 512, 512, 64], "gelu"
    plan, default = render_for_h100(widths, act)
    assert plan.info["split"] == 0 and "#define FM_SPLIT 1 " in default and "__cluster_dims__" not in default
    for split, options in ((2, {}), (4, {"warps": 4}), (8, {"warps": 4, "n_chunk": 64})):
        plan_s, source = render_for_h100(widths, act, wgmma=1, resident=0, split=split, **options)
        assert plan_s.info["split"] == split and f"#define FM_SPLIT {split} " in source
        assert "__cluster_dims__(FM_SPLIT, 1, 1)" in source and f"split over clusters of {split}" in source
        _, log = _core.nvrtc_compile(source, _api.TEMPLATE_SM90, 90, True,
                                     ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
        assert "C7519" not in log and "serialized" not in log and "warning #" not in log, log
        assert max(int(b) for b in re.findall(r"(\d+) bytes spill stores", log)) == 0, (split, log)
    with pytest.raises(fusedmlp.LimitError, match=r"split=8: layer 0's 512 columns are 4 groups of 128, not a "
                                                   r"multiple of 8 groups"):
        render_for_h100(widths, act, wgmma=1, resident=0, split=8, warps=4)
    with pytest.raises(fusedmlp.LimitError, match=r"split=2: layer 1 has a residual"):
        render_for_h100(widths, act, {1: "add"}, wgmma=1, resident=0, split=2)
    with pytest.raises(fusedmlp.LimitError, match=r"split=2 was asked for with wide_loop=-1"):
        render_for_h100(widths, act, wgmma=1, resident=0, split=2, wide_loop=-1)
    with pytest.raises(fusedmlp.LimitError, match=r"split=2 was asked for, but this network has no layer wider"):
        render_for_h100([64, 256, 256, 64], act, wgmma=1, resident=0, split=2)
    with pytest.raises(ValueError, match=r"split=3: the streamed kernel's wide layers over clusters of 2, 4 or 8"):
        render_for_h100(widths, act, split=3)


def test_wide_loop_plans_compile_clean_and_faster_for_sm_90a():
    """wide_loop (the default; wide_loop=-1 unrolls): the streamed kernel's wide layers (and a last layer as wide) run
    their column groups as a run-time loop over one group's code (fused_mlp_sm90.cu, fm_wide_layer), the slot refills
    naming their weights from a table in constant memory. They compile for sm_90a without serialized wgmma or warnings,
    spilling no more than the unrolled form may, and NVRTC takes less time. On the dev machine (2 cores, NVRTC 13):
    wide512 8.3-8.7 s unrolled (255 registers, 44 bytes of spills) against 2.2-2.7 s looped (255, none);
    3-300-512-256-16 silu 2.5 s (12 bytes) against 1.1 s (none); 512-256-512-1 relu 2.1 s against 1.0 s (218 registers
    both). Timing on CI machines is noisy: only a looped form slower by more than 10% over the three fails."""
    import time

    from fusedmlp import _api, _core

    total = {-1: 0.0, 1: 0.0}
    for widths, act in (([64, 512, 512, 512, 512, 64], "gelu"), ([3, 300, 512, 256, 16], "silu"),
                        ([512, 256, 512, 1], "relu")):
        for loop in (-1, 1):
            plan, source = render_for_h100(widths, act, wide_loop=loop)
            assert plan.info["stream_slots"] >= 2 and plan.info["wide_loop"] == max(loop, 0)
            assert f"#define FM_WIDE_LOOP {max(loop, 0)} " in source
            start = time.perf_counter()
            cubin, log = _core.nvrtc_compile(source, _api.TEMPLATE, 90, True,
                                             ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
            seconds = time.perf_counter() - start
            total[loop] += seconds
            assert "C7519" not in log and "serialized" not in log and "warning #" not in log, log
            spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
            regs = re.findall(r"Used (\d+) registers", log)
            assert spills and max(spills) <= 64, (widths, loop, log)
            # the table of the tile's slot fills: in the looped kernel only
            assert (b"fm_next_group" in cubin) == (loop > 0), (widths, loop)
            print(f"\n{'-'.join(map(str, widths))} {act} wide_loop={loop}: NVRTC {seconds:.2f} s, {regs} registers, "
                  f"{spills} bytes of spills", end="")
    print(f"\nNVRTC, the three: {total[-1]:.2f} s unrolled, {total[1]:.2f} s looped")
    assert total[1] <= 1.1 * total[-1], total
