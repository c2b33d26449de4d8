"""PyTorch integration on the GPU: CUDA tensors, streams, CUDA graphs, torch.compile, no host synchronisation."""

import statistics
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import fusedmlp  # noqa: E402
from fusedmlp import torch as ft  # noqa: E402

pytestmark = pytest.mark.gpu
FP16_TOL = 2e-3


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 64), nn.SiLU(), nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64), nn.GELU(),
                         nn.Linear(64, 10)).eval().cuda()


def rel(y, model, x):
    import copy

    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_tensors_in_and_out(dtype):
    model = make_model()
    mlp = fusedmlp.from_torch(model)
    assert mlp.device == "cuda:0"
    x = torch.randn(4099, 24, device="cuda", dtype=dtype)
    with torch.no_grad():
        y = mlp(x)
    assert y.is_cuda and y.dtype == dtype and y.shape == (4099, 10)
    # bf16 output rounds to 8 bits of mantissa: its own tolerance (2^-9 relative per element)
    assert rel(y, model, x.float()) <= (FP16_TOL if dtype != torch.bfloat16 else 6e-3)
    assert mlp(x[::3]).shape == (1367, 10)  # a strided view: made contiguous once on the device
    assert rel(mlp(x[::3]), model, x[::3].float()) <= (FP16_TOL if dtype != torch.bfloat16 else 6e-3)


@pytest.mark.parametrize("compute", fusedmlp.PRECISIONS)
def test_compute_dtypes_on_bf16_tensors(compute):
    """bf16 tensors in and out without a float32 detour, in each compute dtype; the error is the dtype's."""
    model = make_model(2)
    mlp = fusedmlp.from_torch(model, dtype=compute)
    x = torch.randn(5000, 24, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x)
        y32 = mlp(x, out_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert rel(y32, model, x.float()) <= fusedmlp.CHECK_TOLERANCES[compute]
    assert rel(y, model, x.float()) <= max(fusedmlp.CHECK_TOLERANCES[compute], 6e-3)
    assert f"compute={compute} mma" in repr(mlp)


def test_non_default_stream_orders_with_surrounding_work():
    model = make_model(1)
    mlp = fusedmlp.from_torch(model)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randn(100_000, 24, device="cuda")
        x = x * 2 - 1  # pending work on s that the kernel must wait for
        y = mlp(x)
        z = y * 3  # consumes the kernel's output on s
    s.synchronize()
    assert rel(z / 3, model, x) <= FP16_TOL


def test_cuda_graph_capture_and_replay():
    model = make_model(2)
    mlp = fusedmlp.from_torch(model)
    static_x = torch.randn(2048, 24, device="cuda")
    mlp(static_x)  # warm-up: builds and loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mlp(static_x)
    for seed in range(3):
        static_x.copy_(torch.randn(2048, 24, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(static_y, model, static_x) <= FP16_TOL


def test_torch_compile_fullgraph_with_fused_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(24, 24)
            self.mlp = ft.FusedModule(make_model(3))

        def forward(self, x):
            return torch.sigmoid(self.mlp(torch.relu(self.pre(x))))

    net = Net().cuda().eval()
    x = torch.randn(3000, 24, device="cuda")
    with torch.no_grad():
        eager = net(x)
        compiled = torch.compile(net, fullgraph=True)(x)
    # Inductor fuses the Linear+relu before the op differently from eager cuBLAS (float32 rounding), and the kernel's
    # fp16 rounding can turn that into a one-ulp fp16 difference: ~4e-6 after the sigmoid here.
    assert (compiled - eager).abs().max().item() <= 1e-4


def test_compiled_agents_share_a_graph_and_see_their_optimizer_steps_on_cuda():
    """On the GPU: agents of one class compiled one after another share one graph (the op carries each one's first
    parameter, a CUDA tensor, not a handle), and an optimizer step on a wrapped module's parameters is seen at the
    next compiled call (the fused model rebuilt from them; fusedmlp.torch.FusedModule._call)."""
    from torch._dynamo.utils import counters

    class Agent(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.pre = nn.Linear(24, 24)
            self.mlp = ft.FusedModule(make_model(seed))

        def forward(self, x):
            return self.mlp(torch.relu(self.pre(x)))

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(1000, 24, device="cuda")
    agents = [Agent(20 + i).cuda().eval() for i in range(10)]
    with torch.no_grad():
        for a in agents:
            want = a.mlp._wrapped()(torch.relu(a.pre(x)))
            assert (torch.compile(a, fullgraph=True)(x) - want).abs().max().item() <= 2e-2
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    agent, inner = agents[0], agents[0].mlp._wrapped()
    compiled = torch.compile(agent, fullgraph=True)
    with torch.no_grad():
        before = compiled(x)
    opt = torch.optim.SGD(inner.parameters(), lr=0.5)
    for p in inner.parameters():
        p.requires_grad_(True)
    inner(x).square().mean().backward()
    opt.step()
    for p in inner.parameters():
        p.requires_grad_(False)

    def off(y, want):
        return float((y.double() - want.double()).norm() / want.double().norm())

    with torch.no_grad():
        want = inner(torch.relu(agent.pre(x)))
        after = compiled(x)
    assert off(after, want) <= 5e-3 and off(before, want) > 10 * off(after, want), (off(after, want),
                                                                                    off(before, want))
    torch._dynamo.reset()


def test_fp16_module_and_tensor_on_wrong_device_error():
    model = make_model(4).half()
    fused = ft.FusedModule(model)
    x = torch.randn(512, 24, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert rel(fused(x), model.float(), x.float()) <= FP16_TOL
    mlp = fusedmlp.from_torch(make_model(5), device="cpu")
    with pytest.raises(fusedmlp.ArgumentError, match="cuda:0.*runs on cpu"):
        mlp(x)


def test_no_host_synchronisation_on_the_call_path():
    # Queue a long sleep on the stream, then call: if the call synchronised, it would take as long as the sleep.
    mlp = fusedmlp.from_torch(make_model(6))
    x = torch.randn(1024, 24, device="cuda")
    mlp(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the current stream
    start = time.perf_counter()
    y = mlp(x)
    call = time.perf_counter() - start
    assert not torch.cuda.current_stream().query()  # the sleep is still running: nothing waited for it
    torch.cuda.synchronize()
    assert call < 0.05, f"the call took {call * 1e3:.1f} ms behind a pending 1 s kernel: it synchronised"
    assert y.shape == (1024, 10)


def test_per_call_host_overhead_at_batch_1024():
    model = make_model(7)
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, 24, device="cuda")

    def per_call(fn, n=1000):
        times = []
        with torch.no_grad():
            for _ in range(50):
                fn(x)
            torch.cuda.synchronize()
            for _ in range(n):
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    ours, theirs = per_call(mlp), per_call(model)
    y = torch.empty(1024, 10, device="cuda")
    into = per_call(lambda x: mlp(x, out=y))
    fused_module = ft.FusedModule(model)
    module = per_call(fused_module)
    print(f"\nhost time per call at batch 1024 (median of 1000): fusedmlp {ours:.1f} us, with out= {into:.1f} us, "
          f"FusedModule {module:.1f} us, PyTorch module {theirs:.1f} us")
    assert ours > 0 and theirs > 0 and into > 0


def test_cupy_arrays_if_available():
    cupy = pytest.importorskip("cupy")
    model = make_model(8)
    mlp = fusedmlp.from_torch(model)
    x = cupy.random.standard_normal((777, 24), dtype=cupy.float32)
    y = mlp(x)
    assert isinstance(y, cupy.ndarray) and y.shape == (777, 10)
    assert rel(torch.from_dlpack(y), model, torch.from_dlpack(x)) <= FP16_TOL


def test_capture_after_a_warm_up_of_the_same_size_builds_nothing():
    # The warm-up must build exactly the kernel the captured call uses (small batches get a small-tile variant).
    mlp = fusedmlp.from_torch(make_model(9))
    for rows in (100, 20_000):
        x = torch.randn(rows, 24, device="cuda")
        mlp(x)
        torch.cuda.synchronize()
        built = dict(mlp._kernels)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mlp(x)
        graph.replay()
        torch.cuda.synchronize()
        assert mlp._kernels == built
        assert rel(y, make_model(9), x) <= FP16_TOL


def test_bf16_tensors_go_through_float32_where_the_gpu_lacks_bf16_io():
    """On sm_75 the kernel cannot convert bfloat16; the tensor path then reads and writes float32 instead. Simulated
    here by marking the H100 model as such: the results must be those of the float32 kernel."""
    model = make_model(3)
    mlp = fusedmlp.from_torch(model)
    mlp._bf16_io = False
    x = torch.randn(3000, 24, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x)
    assert y.dtype == torch.bfloat16 and mlp._kernels
    assert all(key[:2] == ("float32", "float32") for key in mlp._kernels), list(mlp._kernels)
    assert rel(y, model, x.float()) <= 6e-3


# ------------------------------------------------------------------------------------------------ out=


def nan_tensor(*shape, dtype=torch.float16):
    """An output buffer poisoned with NaN: an element the kernel failed to write cannot pass."""
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                (torch.float32, torch.bfloat16)])
def test_out_fast_path_writes_in_place_bit_for_bit(x_dtype, out_dtype):
    model = make_model(20)
    mlp = fusedmlp.from_torch(model)
    x = torch.randn(1024, 24, device="cuda", dtype=x_dtype)
    with torch.no_grad():
        expected = mlp(x, out_dtype=out_dtype)
        out = nan_tensor(1024, 10, dtype=out_dtype)
        torch.cuda.synchronize()
        allocated, version = torch.cuda.memory_allocated(), out._version
        result = mlp(x, out=out)
        assert torch.cuda.memory_allocated() == allocated  # the kernel wrote into out: nothing was allocated
    assert result is out and out._version > version
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert rel(out, model, x.float()) <= (FP16_TOL if out_dtype != torch.bfloat16 else 6e-3)


def test_out_is_written_under_cuda_graph_capture():
    model = make_model(21)
    mlp = fusedmlp.from_torch(model)
    static_x = torch.randn(2048, 24, device="cuda", dtype=torch.float16)
    static_y = nan_tensor(2048, 10)
    mlp(static_x, out=static_y)  # warm-up: builds and loads the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mlp(static_x, out=static_y)
    assert captured is static_y
    for seed in range(3):
        static_x.copy_(torch.randn(2048, 24, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, mlp(static_x))


def test_out_that_the_kernel_cannot_write_gets_a_copy():
    mlp = fusedmlp.from_torch(make_model(22))
    x = torch.randn(1024, 24, device="cuda", dtype=torch.float16)
    expected = mlp(x)
    transposed = nan_tensor(10, 1024).t()  # non-contiguous
    assert mlp(x, out=transposed) is transposed and torch.equal(transposed, expected)
    wide = nan_tensor(1024, 16)
    view = wide[:, 3:13]  # strided, into a wider buffer: only its own columns are written
    assert mlp(x, out=view) is view and torch.equal(view, expected)
    assert torch.isnan(wide[:, :3]).all() and torch.isnan(wide[:, 13:]).all()
    raw = nan_tensor(1024 * 10 + 1)
    unaligned = raw[1:].view(1024, 10)  # contiguous, 2 bytes past a 16-byte boundary
    assert unaligned.data_ptr() % 16 and mlp(x, out=unaligned) is unaligned and torch.equal(unaligned, expected)
    x3 = x.view(4, 256, 24)  # leading dimensions: the checked path, writing into a contiguous out directly
    out3 = nan_tensor(4, 256, 10)
    assert mlp(x3, out=out3) is out3 and torch.equal(out3.view(1024, 10), expected)
    xs = x[::2]  # a strided x (copied once on the device) into a contiguous out
    outs = nan_tensor(512, 10)
    assert mlp(xs, out=outs) is outs and torch.equal(outs, mlp(xs))


@pytest.mark.parametrize("native", [True, False])
def test_bf16_out_with_and_without_bf16_kernel_io(native):
    """Without bf16 I/O (sm_75, simulated), the kernel writes float32 and the result is copied into the bf16 out."""
    model = make_model(23)
    mlp = fusedmlp.from_torch(model)
    mlp._bf16_io = native
    for x_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3000, 24, device="cuda", dtype=x_dtype)
        with torch.no_grad():
            out = nan_tensor(3000, 10, dtype=torch.bfloat16)
            assert mlp(x, out=out) is out
            assert torch.equal(out, mlp(x, out_dtype=torch.bfloat16))
        assert rel(out, model, x.float()) <= 6e-3
    if not native:
        assert all("bfloat16" not in key[:2] for key in mlp._kernels), list(mlp._kernels)


def test_bad_out_on_cuda_is_an_error_naming_out():
    mlp = fusedmlp.from_torch(make_model(24))
    x = torch.randn(256, 24, device="cuda", dtype=torch.float16)
    with pytest.raises(fusedmlp.ArgumentError, match=r"out is on cpu but x is on cuda:0"):
        mlp(x, out=torch.empty(256, 10, dtype=torch.float16))
    with pytest.raises(fusedmlp.ShapeError, match=r"out has shape \(256, 11\).*must be \(256, 10\)"):
        mlp(x, out=torch.empty(256, 11, device="cuda", dtype=torch.float16))
    with pytest.raises(fusedmlp.DTypeError, match=r"out has dtype torch\.float64"):
        mlp(x, out=torch.empty(256, 10, device="cuda", dtype=torch.float64))
    with pytest.raises(fusedmlp.ArgumentError, match=r"out_dtype=torch\.float32 but out has dtype torch\.float16"):
        mlp(x, out=torch.empty(256, 10, device="cuda", dtype=torch.float16), out_dtype=torch.float32)
    with pytest.raises(fusedmlp.ArgumentError, match=r"out requires grad"):
        mlp(x, out=torch.empty(256, 10, device="cuda", requires_grad=True))
    with pytest.raises(fusedmlp.ArgumentError, match=r"out is a numpy\.ndarray"):
        mlp(x, out=x.cpu().numpy()[:, :10])
    # overlap: x and out in one buffer, both contiguous and aligned (what the fast path sees), out starting 64 bytes
    # before x ends
    buf = torch.randn(256 * 24 + 256 * 10, device="cuda", dtype=torch.float16)
    xa = buf[: 256 * 24].view(256, 24)
    over = buf[256 * 24 - 32: 256 * 24 - 32 + 2560].view(256, 10)
    assert over.data_ptr() % 16 == 0
    before = buf.clone()
    with pytest.raises(fusedmlp.ArgumentError, match=r"out shares memory with x"):
        mlp(xa, out=over)
    torch.cuda.synchronize()
    assert torch.equal(buf, before)  # refused before any launch
    apart = buf[256 * 24:].view(256, 10)  # the same buffer, right after x: no overlap
    assert mlp(xa, out=apart) is apart and torch.equal(apart, mlp(xa))
    empty = torch.empty(0, 10, device="cuda", dtype=torch.float16)
    assert mlp(x[:0], out=empty) is empty


def test_numpy_out_on_the_gpu_path():
    rng = np.random.default_rng(25)
    mlp = fusedmlp.from_torch(make_model(25))
    for dtype in (np.float32, np.float16, np.float64):
        x = rng.standard_normal((777, 24)).astype(dtype)
        out = np.full((777, 10), np.nan, dtype)
        assert mlp(x, out=out) is out
        np.testing.assert_array_equal(out, mlp(x))
    xt = torch.randn(300, 24)  # a CPU tensor through the GPU model
    outt = torch.full((300, 10), float("nan"), dtype=torch.bfloat16)
    assert mlp(xt, out=outt) is outt and torch.equal(outt, mlp(xt, out_dtype=torch.bfloat16))


def test_cupy_out_if_available():
    cupy = pytest.importorskip("cupy")
    model = make_model(26)
    mlp = fusedmlp.from_torch(model)
    x = cupy.random.standard_normal((777, 24), dtype=cupy.float32)
    expected = mlp(x)
    out = cupy.full((777, 10), cupy.nan, dtype=cupy.float32)
    assert mlp(x, out=out) is out and bool((out == expected).all())
    strided = cupy.full((10, 777), cupy.nan, dtype=cupy.float16).T
    assert mlp(x, out=strided) is strided and bool((strided == mlp(x, out_dtype=cupy.float16)).all())
    with pytest.raises(fusedmlp.ArgumentError, match=r"out is a torch\.Tensor; for a CuPy x"):
        mlp(x, out=torch.empty(777, 10, device="cuda"))
    with pytest.raises(fusedmlp.ShapeError, match=r"out has shape \(777, 9\)"):
        mlp(x, out=cupy.empty((777, 9), dtype=cupy.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_tensors_into_a_gpu_model_give_the_cuda_calls_results(dtype):
    """A CPU tensor into a GPU model runs through the host call in x's own dtype (float32, float16) or through float32
    (bfloat16): the CUDA tensor call's bits for the first two, its values within bfloat16's rounding for the third;
    out= on the CPU too."""
    mlp = fusedmlp.from_torch(make_model(9))
    x = torch.randn(3001, 24).to(dtype)
    with torch.no_grad():
        y = mlp(x)
        y_cuda = mlp(x.cuda()).cpu()
        out = torch.full((3001, 10), float("nan"), dtype=dtype)
        assert mlp(x, out=out) is out
    assert y.device.type == "cpu" and y.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.allclose(y.float(), y_cuda.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(y, y_cuda)
    assert torch.equal(out, y)
