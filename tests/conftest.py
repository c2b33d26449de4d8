"""Shared helpers: PyTorch-default initialisation, the float64 reference forward, the GPU skip."""

import zlib

import os
import re

import numpy as np
import pytest

# The suites pin the untuned plan (and must not time kernels on every first call); test_tune*.py and the GPU tuning
# test turn autotuning on themselves. Subprocesses inherit this.
os.environ.setdefault("FUSEDMLP_AUTOTUNE", "0")


@pytest.fixture(scope="session", autouse=True)
def private_kernel_cache(tmp_path_factory):
    """Points the default kernel cache at a folder of this session's (one CPU run once left 19 kernels in
    ~/.cache/fusedmlp, issue 31). _env reads FUSEDMLP_CACHE_DIR at call time and subprocesses inherit os.environ, so
    setting it here covers every cache opened after collection. A test about the default location sets HOME or
    XDG_CACHE_HOME to a tmp_path of its own."""
    folder = tmp_path_factory.mktemp("fusedmlp-cache")
    before = os.environ.get("FUSEDMLP_CACHE_DIR")
    os.environ["FUSEDMLP_CACHE_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("FUSEDMLP_CACHE_DIR", None)
    else:
        os.environ["FUSEDMLP_CACHE_DIR"] = before


def pytest_collection_modifyitems(config, items):
    # The marker, not `"gpu" in item.keywords`: keywords also hold parameter ids, so test_x[gpu] would be skipped.
    if any(item.get_closest_marker("gpu") for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a CUDA driver")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


_gpu = None


def gpu_available():
    global _gpu
    if _gpu is None:
        from fusedmlp import _gpu as gpu_handles

        _gpu = gpu_handles.available()
    return _gpu


def rendered_repeats(source):
    """Each Layer<l>'s REPEAT in a rendered kernel source (render.c): how many layers from l on have l's code."""
    return [int(n) for n in re.findall(r"static constexpr int REPEAT = (\d+);", source)]


def torch_init(rng, widths, bias=True):
    """nn.Linear's default initialisation: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias; weights (out, in)."""
    ws, bs = [], []
    for i, o in zip(widths[:-1], widths[1:]):
        bound = 1.0 / np.sqrt(i)
        ws.append(rng.uniform(-bound, bound, (o, i)).astype(np.float32))
        has = bias if isinstance(bias, bool) else bias[len(bs)]
        bs.append(rng.uniform(-bound, bound, o).astype(np.float32) if has else None)
    return ws, bs


def reference(x, weights, biases, activations):
    """Float64 forward: x @ W.T + b, then each layer's activation evaluated by the core's float64 evaluator.

    Returns the output and the largest |value| seen in any layer (to tell draws that leave fp16's range).
    """
    from fusedmlp import _core

    h = np.asarray(x, dtype=np.float64)
    peak = float(np.max(np.abs(h))) if h.size else 0.0
    for w, b, act in zip(weights, biases, activations):
        h = h @ np.asarray(w, dtype=np.float64).T
        if b is not None:
            h = h + np.asarray(b, dtype=np.float64)
        h = _core.eval_expr(act, np.ascontiguousarray(h.ravel())).reshape(h.shape)
        peak = max(peak, float(np.max(np.abs(h))) if h.size else 0.0)
    return h, peak


def set_env(monkeypatch, name, value):
    """Sets environment variable `name` to value for the test, or removes it where value is None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def rel_l2(y, ref):
    y = np.asarray(y, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(y - ref) / denom) if denom > 0 else float(np.linalg.norm(y))


@pytest.fixture
def rng(request):
    # A fresh but reproducible stream per test: the seed comes from the test's name (crc32, not hash(): str hashes
    # are salted per process unless PYTHONHASHSEED is set, so a failure would not come back on the next run).
    seed = zlib.crc32(request.node.nodeid.encode("utf-8"))
    return np.random.default_rng(seed)


def graph_weights(rng, widths, concat, gain):
    """Uniform(+-1/sqrt(fan_in)) * gain weights for a graph whose layers in `concat` also take the network input, and
    such biases on about 70% of the layers (one rng draw per layer decides)."""
    ws, bs = [], []
    for l in range(len(widths) - 1):
        fan_in = widths[l] + (widths[0] if l in concat else 0)
        bound = 1 / np.sqrt(fan_in)
        ws.append(rng.uniform(-bound, bound, (widths[l + 1], fan_in)).astype(np.float32) * gain)
        bs.append(rng.uniform(-bound, bound, widths[l + 1]).astype(np.float32) if rng.random() < 0.7 else None)
    return ws, bs
