"""The C fast path (csrc/module_fast.c) on the GPU: after a first call, a CUDA tensor call of a known dtype and batch
bucket runs in one call into C; it must give what the checked path gives, and every call it cannot take as it is
must still get the checked path's answer or error."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import fusedmlp  # noqa: E402
from fusedmlp import _dlpack, torch as ft  # noqa: E402
from fusedmlp.errors import ArgumentError, ShapeError  # noqa: E402
from conftest import reference, rel_l2  # noqa: E402
from test_torch_gpu import rel  # noqa: E402 (y against the torch model in float64)
from test_fast_path import Producer  # noqa: E402 (a DLPack producer that is not a torch tensor)

pytestmark = pytest.mark.gpu
N_IN, N_OUT = 24, 10


@pytest.fixture
def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(N_IN, 64), nn.SiLU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, N_OUT)).eval().cuda()


def stats(mlp):
    path = mlp._calls._path
    return dict(path.stats) if path is not None else {"calls": 0, "misses": 0, "entries": 0, "graph_hits": 0,
                                                      "graph_misses": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 1024, 5000])
def test_fast_call_matches_checked_call(model, dtype, rows):
    """The second call of a shape runs in C and gives the checked path's bits; each call fresh random inputs."""
    mlp = fusedmlp.from_torch(model)
    x0 = torch.randn(rows, N_IN, device="cuda", dtype=dtype)
    with torch.no_grad():
        y0 = mlp(x0)  # the checked path: builds the kernel, adds it to the table
        before = stats(mlp)
        assert before["entries"] >= 1
        x = torch.randn(rows, N_IN, device="cuda", dtype=dtype)
        y = mlp(x)
        y_again = mlp(x)
    after = stats(mlp)
    assert after["calls"] == before["calls"] + 2, after
    assert y.dtype == dtype and y.shape == (rows, N_OUT) and y.is_cuda
    assert torch.equal(y, y_again)
    tol = 2e-3 if dtype != torch.bfloat16 else 6e-3
    assert rel(y, model, x) <= tol
    assert rel(y0, model, x0) <= tol
    with torch.no_grad():
        slow = _dlpack.call_torch(mlp, x)  # the Python launch of the same kernel on the same x: identical bits
    assert torch.equal(slow, y)


def test_out_is_written_in_place_poisoned_first(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    out = torch.full((1024, N_OUT), float("nan"), device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(x, out=out)  # warm: the checked path
        out.fill_(float("nan"))
        x2 = torch.randn_like(x)
        calls = stats(mlp)["calls"]
        version = out._version
        r = mlp(x2, out=out)
    assert r is out and stats(mlp)["calls"] == calls + 1
    assert out._version > version  # autograd sees the write, as with torch's own out= ops
    assert not torch.isnan(out).any()
    assert rel(out, model, x2) <= 2e-3


def test_out_dtype_and_leading_dims(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(4, 33, N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(x, out_dtype=torch.float32)
        calls = stats(mlp)["calls"]
        x = torch.randn_like(x)
        y = mlp(x, out_dtype=torch.float32)
        one = torch.randn(N_IN, device="cuda", dtype=torch.float16)
        mlp(one)
        y1 = mlp(one)
    assert stats(mlp)["calls"] >= calls + 2
    assert y.shape == (4, 33, N_OUT) and y.dtype == torch.float32
    assert rel(y, model, x) <= 2e-3
    assert y1.shape == (N_OUT,) and rel(y1, model, one) <= 2e-3


def test_calls_the_fast_path_cannot_take_get_the_checked_answer(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(x)
    # a strided view: the checked path copies it and gives the right values
    wide = torch.randn(1024, 2 * N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y = mlp(wide[:, ::2])
    assert rel(y, model, wide[:, ::2]) <= 2e-3
    # autograd tracking x: still the inference-only error
    g = torch.randn(1024, N_IN, device="cuda", requires_grad=True)
    with pytest.raises(ArgumentError, match="requires grad"):
        mlp(g)
    with pytest.raises(ShapeError, match=r"\(\.\.\., 24\)"):
        mlp(torch.randn(1024, N_IN + 1, device="cuda", dtype=torch.float16))
    # out overlapping x, and out of the wrong shape: the checked path's errors
    buf = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    with pytest.raises(ArgumentError), torch.no_grad():
        mlp(buf, out=buf[:, :N_OUT])
    with pytest.raises(ShapeError), torch.no_grad():
        mlp(x, out=torch.empty(1023, N_OUT, device="cuda", dtype=torch.float16))
    # a CPU tensor: the CPU path
    xc = torch.randn(7, N_IN)
    assert rel(mlp(xc), model.cpu(), xc) <= 2e-3  # the CPU path rounds as the GPU model does


def test_tuning_clears_the_table(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(x)
    assert stats(mlp)["entries"] >= 1
    fusedmlp.tune(mlp, batch_sizes=(1024,))
    assert stats(mlp)["entries"] == 0
    with torch.no_grad():
        y = mlp(x)
    assert rel(y, model, x) <= 2e-3


def test_cuda_graph_capture_of_fast_calls(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(256, N_IN, device="cuda", dtype=torch.float16)
    out = torch.empty(256, N_OUT, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(s):
        mlp(x, out=out)
        mlp(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        mlp(x, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert rel(out, model, x) <= 2e-3


def test_custom_op_and_module_take_the_fast_path(model):
    fused = ft.FusedModule(model)
    x = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        fused(x)
        mlp = ft._registry[fused._handle]
        calls = stats(mlp)["calls"]
        y = fused(x)
    assert stats(mlp)["calls"] == calls + 1
    assert rel(y, model, x) <= 2e-3


def _segmented(seed, widths):
    """A bias-free relu network of 768-wide layers, cut into segments on every GPU (GEMMs; sm_90's streamed kernel
    holds 512), and its weights (uniform-variance normals of seed)."""
    rng = np.random.default_rng(seed)
    w = [rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
    mlp = fusedmlp.FusedMLP(w, activation="relu", device="cuda")
    assert mlp.segments is not None
    return w, mlp


def _wide_reference(mlp, w, x):
    """The float64 forward of a bias-free network (conftest.reference) on a CUDA tensor's values."""
    return reference(x.double().cpu().numpy(), w, [None] * len(w), mlp.activations)[0]


def test_segmented_networks_take_the_fast_path_on_their_stream():
    """A network cut into segments (768-wide layers: GEMMs; sm_90's streamed kernel holds 512) runs its chain from C
    after a first call: the same bits as the chain launched from Python, on the stream its workspace belongs to;
    another stream, or a batch larger than the workspace, takes the checked path and stays right."""
    w, mlp = _segmented(5, [32, 768, 768, 16])
    x = torch.randn(1024, 32, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y1 = mlp(x)  # checked path: builds the chain, adds it
        calls = stats(mlp)["calls"]
        y2 = mlp(x)
        assert stats(mlp)["calls"] == calls + 1 and stats(mlp)["entries"] >= 1
        slow = _dlpack.call_torch(mlp, x)
    assert torch.equal(y1, y2) and torch.equal(y2, slow)
    ref = _wide_reference(mlp, w, x)
    assert rel_l2(y2.double().cpu().numpy(), ref) <= 2e-3
    s = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(s):
        x2 = torch.randn(1024, 32, device="cuda", dtype=torch.float16)
        y3 = mlp(x2)  # another stream: its own workspace through the checked path (which then adds this stream's)
        y4 = mlp(x2)
    torch.cuda.synchronize()
    ref2 = _wide_reference(mlp, w, x2)
    for y in (y3, y4):
        assert rel_l2(y.double().cpu().numpy(), ref2) <= 2e-3
    big = torch.randn(4000, 32, device="cuda", dtype=torch.float16)  # a workspace larger than the stream's
    with torch.no_grad():
        yb = mlp(big)
    refb = _wide_reference(mlp, w, big)
    assert rel_l2(yb.double().cpu().numpy(), refb) <= 2e-3


def test_small_segmented_calls_replay_a_graph(monkeypatch):
    """A small segmented call on the fast path captures its launches once per batch size and replays that graph, its
    x- and y-moving kernels given each call's addresses: new values in the same tensors and new tensors come out right,
    with the plain launches' bits (FUSEDMLP_CHAIN_GRAPHS=0); a batch over 65536 rows launches as before."""
    w, mlp = _segmented(7, [32, 768, 768, 16])
    x = torch.randn(1000, 32, device="cuda", dtype=torch.float16)
    out = torch.empty(1000, 16, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(x, out=out)  # checked path: builds the chain and adds it
        for _ in range(5):
            out.fill_(float("nan"))
            mlp(x, out=out)
        first = stats(mlp)
        assert first["graph_misses"] == 1 and first["graph_hits"] == 4 and "graph_error" not in first, first
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        mlp(x, out=out)  # a replay reads x's new values
        torch.cuda.synchronize()
        assert rel_l2(out.double().cpu().numpy(), _wide_reference(mlp, w, x)) <= 2e-3
        for _ in range(20):  # a new y each call
            assert torch.equal(mlp(x), out)
        others = [torch.randn(1000, 32, device="cuda", dtype=torch.float16) for _ in range(3)]
        ys = [mlp(o) for o in others]  # new x addresses too
        rotating = stats(mlp)
        assert rotating["graph_hits"] == first["graph_hits"] + 24 and rotating["graph_misses"] == 1, rotating
        assert "graph_error" not in rotating, rotating
        big = torch.randn(70000, 32, device="cuda", dtype=torch.float16)
        mlp(big)
        mlp(big)
        assert stats(mlp)["graph_misses"] == rotating["graph_misses"]  # past 65536 rows: no capture
        monkeypatch.setenv("FUSEDMLP_CHAIN_GRAPHS", "0")
        plain = fusedmlp.FusedMLP(w, activation="relu", device="cuda")
        plain(x)
        y_plain = plain(x)
        ys_plain = [plain(o) for o in others]
        assert stats(plain)["graph_misses"] == 0 and stats(plain)["calls"] >= 4
    assert torch.equal(y_plain, out) and all(torch.equal(a, b) for a, b in zip(ys, ys_plain))


def test_cuda_graph_capture_of_a_segmented_fast_call():
    """A segmented call (its kernels after the first launched as dependents on sm_90) captured from the fast path on a
    side stream replays with new inputs."""
    w, mlp = _segmented(6, [32, 768, 16])
    x = torch.randn(512, 32, device="cuda", dtype=torch.float16)
    out = torch.empty(512, 16, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(s):
        mlp(x, out=out)
        mlp(x, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g, stream=s):
        mlp(x, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = _wide_reference(mlp, w, x)
    assert rel_l2(out.double().cpu().numpy(), ref) <= 2e-3


def test_cupy_arrays_take_the_fast_path(model):
    cupy = pytest.importorskip("cupy")
    mlp = fusedmlp.from_torch(model)
    x = cupy.random.standard_normal((1024, N_IN)).astype(cupy.float16)
    mlp(x)  # the checked path: adds CuPy's pieces and the kernel
    calls = stats(mlp)["calls"]
    x = cupy.random.standard_normal((1024, N_IN)).astype(cupy.float16)
    y = mlp(x)
    out = cupy.full((1024, N_OUT), cupy.nan, dtype=cupy.float16)
    r = mlp(x, out=out)
    assert stats(mlp)["calls"] == calls + 2, (stats(mlp), mlp._calls._path.export(x))
    assert isinstance(y, cupy.ndarray) and y.dtype == cupy.float16 and y.shape == (1024, N_OUT)
    assert r is out and bool((out == y).all())
    xt = torch.as_tensor(cupy.asnumpy(x), device="cuda")
    assert rel(torch.as_tensor(cupy.asnumpy(y), device="cuda"), model, xt) <= 2e-3


def test_other_dlpack_producers_take_the_fast_path_after_the_conversion(model):
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, N_IN, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        mlp(Producer(x))  # the checked path: adds the kernel
        calls = stats(mlp)["calls"]
        x = torch.randn_like(x)
        y = mlp(Producer(x))
    assert stats(mlp)["calls"] == calls + 1
    assert isinstance(y, torch.Tensor) and rel(y, model, x) <= 2e-3
