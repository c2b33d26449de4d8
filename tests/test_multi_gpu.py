"""fusedmlp.multi_gpu: one FusedMLP per device, a call's rows split over them, the bits of one device's call.

On the CPU the split machinery runs with the CPU path listed several times (one thread per share); the GPU tests
run the pinned-kernel shares on one GPU listed several times, and over every GPU where there are two or more.
"""

import io
import warnings

import numpy as np
import pytest

import fusedmlp
from conftest import gpu_available, torch_init
from fusedmlp.multi_gpu import TORCH_SPLIT_FLOPS_PER_BYTE, MultiDeviceMLP, _shares, visible_devices

WIDTHS = [5, 64, 64, 3]


@pytest.fixture
def net(rng):
    ws, bs = torch_init(rng, WIDTHS, True)
    return ws, bs


def test_shares_cover_every_row_once_at_64_row_boundaries():
    for rows, parts in [(1000, 3), (130, 2), (64 * 7, 7), (10**6 + 3, 8)]:
        shares = _shares(rows, parts)
        assert len(shares) == parts
        assert shares[0][0] == 0 and shares[-1][1] == rows
        assert all(b == c for (_, b), (c, _) in zip(shares, shares[1:]))
        assert all(a % 64 == 0 and b > a for a, b in shares)
        sizes = [b - a for a, b in shares]
        assert max(sizes) - min(sizes) <= 64 + rows % 64


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_a_split_call_gives_the_plain_calls_bits(net, rng, dtype):
    ws, bs = net
    split = MultiDeviceMLP(ws, bs, activation="tanh", devices=["cpu"] * 3, min_rows_per_device=100)
    plain = fusedmlp.FusedMLP(ws, bs, activation="tanh", device="cpu")
    x = rng.standard_normal((10_007, WIDTHS[0])).astype(dtype)
    y = split(x)
    assert y.dtype == dtype and y.shape == (10_007, WIDTHS[-1])
    np.testing.assert_array_equal(y, plain(x))
    out = np.full((10_007, WIDTHS[-1]), np.nan, dtype=dtype)
    assert split(x, out=out) is out
    np.testing.assert_array_equal(out, y)


def test_small_batches_and_odd_inputs_are_plain_calls(net, rng):
    ws, bs = net
    split = MultiDeviceMLP(ws, bs, devices=["cpu", "cpu"], min_rows_per_device=1000)
    plain = fusedmlp.FusedMLP(ws, bs, device="cpu")
    x = rng.standard_normal((1999, WIDTHS[0])).astype(np.float32)  # under 2 x 1000 rows: one device
    np.testing.assert_array_equal(split(x), plain(x))
    np.testing.assert_array_equal(split(x[0]), plain(x[0]))  # one row, 1-D
    np.testing.assert_array_equal(split(x.tolist()), plain(x.tolist()))
    assert split(x[:0]).shape == (0, WIDTHS[-1])


def test_malformed_inputs_raise_fusedmlps_errors(net, rng):
    ws, bs = net
    split = MultiDeviceMLP(ws, bs, devices=["cpu", "cpu"], min_rows_per_device=1)
    with pytest.raises(fusedmlp.ShapeError, match=r"x has shape \(300, 4\); the network takes \(batch, 5\)"):
        split(np.ones((300, 4), np.float32))
    with pytest.raises(fusedmlp.DTypeError, match="x has dtype int64"):
        split(np.ones((300, 5), np.int64))
    with pytest.raises(fusedmlp.ShapeError, match="out has shape"):
        split(np.ones((300, 5), np.float32), out=np.empty((300, 2), np.float32))
    with pytest.raises(fusedmlp.DTypeError, match="out has dtype float64"):
        split(np.ones((300, 5), np.float32), out=np.empty((300, 3), np.float64))


def test_devices_are_checked(net):
    ws, bs = net
    with pytest.raises(fusedmlp.ArgumentError, match="mixes the CPU path with GPUs"):
        MultiDeviceMLP(ws, bs, devices=["cpu", "cuda:0"])
    with pytest.raises(fusedmlp.ArgumentError, match="device='gpu1'"):
        MultiDeviceMLP(ws, bs, devices=["gpu1"])
    with pytest.raises(fusedmlp.ArgumentError, match="non-empty list"):
        MultiDeviceMLP(ws, bs, devices=[])
    with pytest.raises(fusedmlp.ArgumentError, match="not device="):
        MultiDeviceMLP(ws, bs, device="cuda:0")
    with pytest.raises(fusedmlp.ArgumentError, match="min_rows_per_device"):
        MultiDeviceMLP(ws, bs, devices="cpu", min_rows_per_device=0)


def test_without_a_gpu_it_is_one_fusedmlp_on_the_cpu_path(net, rng):
    if gpu_available():
        pytest.skip("this machine has a GPU")
    ws, bs = net
    assert visible_devices() == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # FusedMLP's "no CUDA GPU found" (once per process)
        split = MultiDeviceMLP(ws, bs)
    assert split.devices == ["auto"] and [m.device for m in split.mlps] == ["cpu"]
    x = rng.standard_normal((70_000, WIDTHS[0])).astype(np.float32)
    np.testing.assert_array_equal(split(x), fusedmlp.FusedMLP(ws, bs, device="cpu")(x))


def test_from_npz_reads_the_file_once_for_every_device(net, rng, tmp_path):
    ws, bs = net
    path = tmp_path / "m.npz"
    np.savez(path, **{f"{i}.weight": w for i, w in enumerate(ws)}, **{f"{i}.bias": b for i, b in enumerate(bs)})
    x = rng.standard_normal((500, WIDTHS[0])).astype(np.float32)
    expected = fusedmlp.FusedMLP.from_npz(path, "silu", device="cpu")(x)
    from_path = MultiDeviceMLP.from_npz(path, "silu", devices=["cpu", "cpu"], min_rows_per_device=64)
    from_file = MultiDeviceMLP.from_npz(io.BytesIO(path.read_bytes()), "silu", devices="cpu")
    np.testing.assert_array_equal(from_path(x), expected)
    np.testing.assert_array_equal(from_file(x), expected)
    assert list(from_path.widths) == WIDTHS and "cpu" in repr(from_path)


# ------------------------------------------------------------------------------------------------ GPU


def test_a_torch_x_is_split_only_for_networks_of_enough_flops_per_byte(rng):
    """FLOPs per byte of a row's inputs and outputs: 2 x the weights' elements over (in + out) x itemsize; a torch x
    on one GPU is split over the others only at TORCH_SPLIT_FLOPS_PER_BYTE or more (tcnn128's 512 ran 3.2x slower
    split over two H200s than on one)."""
    ws, bs = torch_init(rng, [64, 128, 128, 128, 128, 64], False)
    tcnn128 = MultiDeviceMLP(ws, bs, devices=["cpu"] * 2)
    assert tcnn128._flops_per_byte(2) == 2 * (64 * 128 * 2 + 128 * 128 * 3) / (128 * 2) == 512
    ws, bs = torch_init(rng, [2, 256, 256, 256, 3], True)
    siren = MultiDeviceMLP(ws, bs, devices=["cpu"] * 2)
    assert siren._flops_per_byte(2) > 10 * TORCH_SPLIT_FLOPS_PER_BYTE > 10 * tcnn128._flops_per_byte(2)


def _gpu_cases(rng):
    ws, bs = torch_init(rng, [3, 64, 128, 64, 4], True)
    # 20000 rows: 151 rows per SM on an H100 (the default plan untuned), while a third of them would get the small
    # tile: shares must run the whole batch's kernel to give its bits
    x = rng.standard_normal((20_000, 3)).astype(np.float32)
    return ws, bs, x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_shares_on_one_gpu_give_one_calls_bits(rng, dtype):
    ws, bs, x = _gpu_cases(rng)
    x = x.astype(dtype)
    whole = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cuda:0")(x)
    split = MultiDeviceMLP(ws, bs, activation="silu", devices=["cuda:0"] * 3, min_rows_per_device=1)
    np.testing.assert_array_equal(split(x), whole)


@pytest.mark.gpu
def test_torch_shares_on_one_gpu_give_one_calls_bits(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    ws, bs, x = _gpu_cases(rng)
    xt = torch.from_numpy(x).to("cuda:0", torch.float16)
    whole = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cuda:0")(xt)
    split = MultiDeviceMLP(ws, bs, activation="silu", devices=["cuda:0"] * 3, min_rows_per_device=1)
    assert torch.equal(split(xt), whole)


@pytest.mark.gpu
def test_every_gpu_gives_one_gpus_bits(rng):
    devices = visible_devices()
    if len(devices) < 2:
        pytest.skip(f"needs 2 or more GPUs; this machine has {len(devices)}")
    ws, bs, _ = _gpu_cases(rng)
    x = rng.standard_normal((3_000_017, 3)).astype(np.float32)
    whole = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cuda:0")(x)
    split = MultiDeviceMLP(ws, bs, activation="silu")
    assert split.devices == devices
    np.testing.assert_array_equal(split(x), whole)
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.device_count() >= 2:
        # x on another device than the first share's; float16, so the network does enough FLOPs per byte of a row's
        # inputs and outputs to be split (TORCH_SPLIT_FLOPS_PER_BYTE)
        x16 = x.astype(np.float16)
        assert split._flops_per_byte(2) >= TORCH_SPLIT_FLOPS_PER_BYTE
        xt = torch.from_numpy(x16).to("cuda:1")
        whole16 = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cuda:0")(x16)
        assert torch.equal(split(xt).cpu(), torch.from_numpy(whole16))


def test_import_fusedmlp_needs_numpy_alone():
    import subprocess
    import sys

    code = ("import sys, fusedmlp, fusedmlp.multi_gpu, fusedmlp.ray; "
            "print(sorted(m for m in ('ray', 'pandas', 'pyarrow', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_flattening_model_splits_its_flattened_rows(rng):
    """flatten_input merges x's dims before the rows are split over the devices (CPU devices here)."""
    ws = [rng.standard_normal((8, 12)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)]
    split = MultiDeviceMLP(ws, activation="tanh", flatten_input=1, devices=["cpu"] * 2, min_rows_per_device=100)
    plain = fusedmlp.FusedMLP(ws, activation="tanh", device="cpu")
    x = rng.standard_normal((500, 3, 4)).astype(np.float32)
    assert np.array_equal(split(x), plain(x.reshape(500, 12)))
