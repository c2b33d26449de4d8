"""The process's handles on the C core, NVRTC and the GPUs, opened on first use and kept for the process lifetime.

A module of its own that imports nothing of the package's but _env and errors (issue 31): _api and the modules beside
it share these handles without importing each other. _dlpack and _tune, which _api imports, reach the model's GPU
through the model (FusedMLP._gpu_info), never through _api.
"""

import threading

from . import _env
from .errors import CudaError, LibraryNotFoundError

__all__ = ["core", "nvrtc_info", "nvrtc_no_cache", "gpu", "gpus", "available"]

_lock = threading.Lock()
_nvrtc = None  # (library path, (major, minor)) once loaded
#: ordinal -> _core.Gpu opened so far (each retains its primary context for the process lifetime)
gpus = {}


def core():
    """Returns the C extension, imported on first use so `import fusedmlp` works (and says what is wrong) even when
    the extension is missing."""
    from . import _core

    return _core


def nvrtc_info():
    """Loads NVRTC once (from _env.nvrtc_search_path(), then the system locations).

    Returns:
        (library path, (major, minor)).

    Raises:
        LibraryNotFoundError: no NVRTC found; the message lists where the core looked.
    """
    global _nvrtc
    with _lock:
        if _nvrtc is None:
            _nvrtc = core().nvrtc_load(_env.nvrtc_search_path())
        return _nvrtc


def nvrtc_no_cache():
    """The option that turns NVRTC's own compile cache off, where it has one (12.9 and later), else (). On the H100
    machines (NVRTC 13.0) that cache returned a source an earlier process had compiled (comments aside) in 0.1-0.25 s
    instead of ~1 s, with an empty log: what measures a cold compile, or reads ptxas's report, turns it off."""
    return ("--no-cache",) if tuple(nvrtc_info()[1]) >= (12, 9) else ()


def gpu(ordinal):
    """Returns the _core.Gpu of device `ordinal`, opening it (and retaining its primary context) on first use."""
    with _lock:
        handle = gpus.get(ordinal)
        if handle is None:
            handle = core().Gpu(ordinal)
            gpus[ordinal] = handle
        return handle


def available():
    """Tells whether a CUDA driver is installed and sees at least one GPU."""
    try:
        return core().cuda_device_count() > 0
    except (LibraryNotFoundError, CudaError):
        return False
