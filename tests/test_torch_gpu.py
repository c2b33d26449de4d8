"""PyTorch integration on the GPU: CUDA tensors, streams, CUDA graphs, torch.compile, no host synchronisation."""

import statistics
import time

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
    fused_module = ft.FusedModule(model)
    module = per_call(fused_module)
    print(f"\nhost time per call at batch 1024 (median of 1000): fusedmlp {ours:.1f} us, FusedModule {module:.1f} us, "
          f"PyTorch module {theirs:.1f} us")
    assert ours > 0 and theirs > 0


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
