"""The C fast path's table and its refusals, without a GPU (test_fast_path_gpu.py runs its calls)."""

import numpy as np
import pytest

from fusedmlp import _core, _dlpack
from conftest import set_env


def test_fast_path_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_in=0"):
        _core.FastPath(0, 4, 0)
    path = _core.FastPath(3, 4, 0)
    with pytest.raises(TypeError):
        path.add(1, 1, 1024, 132, object())  # only a loaded fusedmlp._core.Kernel
    with pytest.raises(TypeError, match="x, out_dtype, out"):
        path.call(np.zeros(3))
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        path.set_library(0, object, len, len, (), len, False, (), None, True, (1, 2))
    with pytest.raises(ValueError, match="index 0-1"):
        path.set_library(2, object, len, len, (), len, False, (), None, True, (1, 2, 3))
    with pytest.raises(ValueError, match="keyword, value"):
        path.set_library(0, object, len, len, (), len, False, (("device",),), None, True, (1, 2, 3))


def test_fast_path_sends_calls_it_cannot_take_back():
    """With no kernel known, or for anything not a CUDA tensor, the answer is NotImplemented (the checked path)."""
    path = _core.FastPath(3, 4, 0)
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    assert path.call(x, None, None) is NotImplemented
    assert path.stats == {"calls": 0, "misses": 1, "entries": 0, "graph_hits": 0, "graph_misses": 0}


def test_fast_path_sends_cpu_tensors_back():
    torch = pytest.importorskip("torch")
    path = _core.FastPath(3, 4, 0)
    path.set_library(0, torch.Tensor, torch._C._to_dlpack, lambda i: 0, (0,), torch.empty, False,
                     (("device", torch.device("cpu")),), None, True, (torch.float32, torch.float16, torch.bfloat16))
    x = torch.randn(5, 3)
    assert path.call(x, None, None) is NotImplemented
    assert path.call(x, torch.float16, None) is NotImplemented
    assert path.call(x, torch.int8, None) is NotImplemented


def test_call_table_clears_its_mirror():
    cleared = []

    class Path:
        def clear(self):
            cleared.append(True)

    table = _dlpack.CallTable()
    table[("float16", "float16", 1024, 0, None)] = "kernel"
    table.clear()
    assert not table and not cleared  # no mirror yet
    table._path = Path()
    table["k"] = "kernel"
    table.clear()
    assert not table and cleared == [True]


def test_export_says_what_the_fast_path_reads():
    torch = pytest.importorskip("torch")
    path = _core.FastPath(3, 4, 0)
    path.set_library(0, torch.Tensor, torch._C._to_dlpack, lambda i: 0, (0,), torch.empty, False,
                     (("device", torch.device("cpu")),), None, True, (torch.float32, torch.float16, torch.bfloat16))
    x = torch.randn(5, 3, dtype=torch.float16)[:, :2]
    info = path.export(x)
    assert info["capsule"] == "dltensor" and info["device"] == (1, 0)  # kDLCPU: a call the fast path sends back
    assert info["dtype"] == (2, 16, 1) and info["shape"] == (5, 2) and info["strides"] == (3, 1)
    assert info["data"] + info["byte_offset"] == x.data_ptr()
    assert path.export(np.zeros(3)) is None  # not an array of a library it knows


class Producer:
    """A DLPack producer that is not a torch tensor (as a JAX array is to fusedmlp): converted by torch.from_dlpack,
    then the usual paths. tests/test_fast_path_gpu.py takes it too."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_a_dlpack_producer_on_the_cpu_gets_the_cpu_paths_answer():
    torch = pytest.importorskip("torch")
    import fusedmlp

    rng = np.random.default_rng(3)
    w = [rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)]
    mlp = fusedmlp.FusedMLP(w, device="cpu")
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = mlp(Producer(x))
    assert isinstance(y, torch.Tensor) and np.array_equal(y.numpy(), mlp(x))


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), ("0", False), ("off", False)])
def test_chain_graphs_switch(monkeypatch, value, on):
    """FUSEDMLP_CHAIN_GRAPHS=0 turns off the graph replay of a segmented network's small calls (module_fast.c)."""
    from fusedmlp import _env
    set_env(monkeypatch, "FUSEDMLP_CHAIN_GRAPHS", value)
    assert _env.chain_graphs() is on
