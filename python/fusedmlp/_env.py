"""The one place fusedmlp reads environment variables.

Every ``FUSEDMLP_*`` setting (and the standard variables the defaults derive from) is read here, at call time, so a
test can change ``os.environ`` and see the effect without reloading anything.

==========================  ==================================================================================
``FUSEDMLP_CACHE_DIR``      kernel cache folder (default ``$XDG_CACHE_HOME/fusedmlp``, else ``~/.cache/fusedmlp``)
``FUSEDMLP_NVRTC``          NVRTC library file or folder tried before any other location
``FUSEDMLP_AUTOTUNE``       ``0``/``false``/``no``/``off`` disables tile autotuning (default on)
``FUSEDMLP_CACHE_MAX_BYTES`` size the kernel cache may grow to, e.g. ``2147483648`` or ``512M`` (default 2 GiB)
``FUSEDMLP_GEMM_CLUSTER``   the sm_90a GEMM layers' form: ``1`` one CTA a tile, ``2`` CTA pairs sharing the weight tile
                            (default: the plan's choice); for A/B timing of the two forms
``FUSEDMLP_GEMM_TMA``       ``-1``/``off``: the sm_90a GEMMs' producer loads A with its threads' cp.async, not one TMA
                            copy of a tensor map a stage (default: TMA wherever the input copies as it is)
``FUSEDMLP_GEMM_TMA_STORE``  ``1``/``-1``: the persistent sm_90a GEMMs store y by TMA stores of their staged slabs, or
                            not (default: the plan's choice, TMA stores wherever y allows); for A/B timing
``FUSEDMLP_PDL``            ``0``/``off`` launches a segmented network's kernels plainly, each after the one before has
                            finished (default on: programmatic dependent launch on sm_90+); for A/B timing
``FUSEDMLP_CHAIN_GRAPHS``   ``0``/``off`` launches a segmented network's small calls (up to 65536 rows, torch / CuPy
                            arrays) kernel by kernel instead of replaying them from a CUDA graph; for A/B timing
``FUSEDMLP_HOST_PIPE``      ``1``/``-1`` moves a GPU call's host arrays always / never in pipelined pieces (default by
                            size: from 16 MiB); for A/B timing
==========================  ==================================================================================
"""

import os
import pathlib
import re
import sys

__all__ = ["cache_dir", "nvrtc_search_path", "autotune_enabled", "dependent_launch", "chain_graphs", "cache_max_bytes",
           "gemm_cluster", "gemm_ws", "gemm_tma", "gemm_tma_store", "gemm_pad", "host_pipeline", "cpu_threads"]

# Folders (relative to a site-packages entry) where NVIDIA's pip wheels put libnvrtc, newest CUDA first:
# nvidia-cuda-nvrtc 13.x installs nvidia/cu13/lib/libnvrtc.so.13; the 12.x wheels use nvidia/cuda_nvrtc/lib
# (nvidia-cuda-nvrtc-cu12) and, in their newest releases, nvidia/cu12/lib.
_NVRTC_WHEEL_DIRS = (
    ("nvidia", "cu13", "lib"),
    ("nvidia", "cuda_nvrtc", "lib"),
    ("nvidia", "cu12", "lib"),
)

_DEFAULT_CACHE_MAX_BYTES = 2 * 1024**3

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")

_SIZE_SUFFIXES = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def cache_dir():
    """Returns the kernel cache folder (it may not exist yet).

    Returns:
        ``$FUSEDMLP_CACHE_DIR`` if set and non-empty, else ``$XDG_CACHE_HOME/fusedmlp`` if ``XDG_CACHE_HOME`` is set
        and non-empty, else ``~/.cache/fusedmlp``; as an absolute, user-expanded :class:`pathlib.Path`.
    """
    explicit = os.environ.get("FUSEDMLP_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return (pathlib.Path(xdg).expanduser() / "fusedmlp").absolute()
    return (pathlib.Path.home() / ".cache" / "fusedmlp").absolute()


def nvrtc_search_path():
    """Returns the NVRTC locations the C loader tries, in order, before the system ones.

    The C core (``fm_nvrtc_load``) tries each entry as a library file, or as a folder holding ``libnvrtc.so.*``,
    and then falls back to ``CUDA_PATH``/``CUDA_HOME``, ``/usr/local/cuda/lib64`` and the plain sonames.

    Returns:
        A colon-separated string: the value of ``FUSEDMLP_NVRTC`` if set and non-empty, then every existing
        ``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib`` and ``nvidia/cu12/lib`` folder under the entries of
        ``sys.path`` (all ``cu13`` folders first, so CUDA 13 wins over 12; within a kind, ``sys.path`` order).
        Duplicates (the same folder reached twice) are dropped. Empty if nothing was found.
    """
    entries = []
    explicit = os.environ.get("FUSEDMLP_NVRTC")
    if explicit:
        entries.append(explicit)
    seen = set()
    for parts in _NVRTC_WHEEL_DIRS:
        for base in sys.path:
            if not base:
                continue  # "" is the current folder: never load a library from wherever the user happens to be
            candidate = os.path.join(base, *parts)
            if os.pathsep in candidate or not os.path.isdir(candidate):
                continue  # a folder with ':' in its name cannot be represented in the list
            real = os.path.realpath(candidate)
            if real in seen:
                continue
            seen.add(real)
            entries.append(candidate)
    return os.pathsep.join(entries)


def _switch(name):
    """A boolean switch that is on by default: ``False`` if variable `name` is ``0``, ``false``, ``no`` or ``off`` (any
    case); ``True`` if it is unset, empty, ``1``, ``true``, ``yes`` or ``on``; else ValueError naming the variable and
    the value."""
    raw = os.environ.get(name)
    if raw is None:
        return True
    word = raw.strip().lower()
    if word == "" or word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def autotune_enabled():
    """Tells whether tile autotuning is on.

    Returns:
        ``False`` if ``FUSEDMLP_AUTOTUNE`` is ``0``, ``false``, ``no`` or ``off`` (any case); ``True`` if it is unset,
        empty, ``1``, ``true``, ``yes`` or ``on``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _switch("FUSEDMLP_AUTOTUNE")


def dependent_launch():
    """Tells whether a segmented network's kernels after its first are launched as programmatic dependents of the one
    before them (sm_90+: each starts while the one before finishes; csrc/cuda.c, fm_kernel_launch).

    Returns:
        ``False`` if ``FUSEDMLP_PDL`` is ``0``, ``false``, ``no`` or ``off`` (any case), for A/B timing; ``True``
        otherwise (unset, empty, ``1``, ...). Read when a chain is made.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _switch("FUSEDMLP_PDL")


def chain_graphs():
    """Tells whether a segmented network's small calls on the C fast path replay their launches from a CUDA graph
    captured once per batch size and x / y addresses (csrc/module_fast.c, Fast_chain_graph).

    Returns:
        ``False`` if ``FUSEDMLP_CHAIN_GRAPHS`` is ``0``, ``false``, ``no`` or ``off`` (any case), for A/B timing;
        ``True`` otherwise. Read when a chain joins the fast path.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _switch("FUSEDMLP_CHAIN_GRAPHS")


def cache_max_bytes():
    """Returns how large the kernel cache may grow, in bytes.

    Returns:
        The value of ``FUSEDMLP_CACHE_MAX_BYTES``: a non-negative integer, optionally followed by a binary suffix
        ``K``, ``M``, ``G`` or ``T`` (with or without ``iB``/``B``; ``512M`` is 512 * 2**20). 2 GiB if unset or empty.

    Raises:
        ValueError: a value that is not such a size, naming the variable and the value.
    """
    raw = os.environ.get("FUSEDMLP_CACHE_MAX_BYTES")
    if raw is None or raw.strip() == "":
        return _DEFAULT_CACHE_MAX_BYTES
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", raw, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"FUSEDMLP_CACHE_MAX_BYTES={raw!r} is not a size; use a non-negative byte count such as 2147483648 or 512M"
        )
    return int(match.group(1)) * _SIZE_SUFFIXES[match.group(2).lower()]


def gemm_cluster():
    """Tells which form the wgmma GEMM layers of a segmented network take (csrc/gemm.c, fm_gemm_opts.cluster).

    Returns:
        ``1`` (one CTA a tile) or ``2`` (clusters of two CTAs sharing each stage's weight tile) as
        ``FUSEDMLP_GEMM_CLUSTER`` says; ``0`` (the plan's choice) if it is unset, empty, ``0`` or ``auto``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _gemm_form("FUSEDMLP_GEMM_CLUSTER", {"1": 1, "2": 2}, "1 (one CTA a tile), 2 (CTA pairs) or auto")


def _gemm_form(name, words, hint, what="a GEMM form"):
    """The value `words` maps environment variable `name`'s (trimmed, lowercase) word to; 0 where it is unset, empty,
    ``0`` or ``auto``; else ValueError naming the variable, the value, `what` it should be and `hint`."""
    raw = os.environ.get(name)
    word = "" if raw is None else raw.strip().lower()
    if word in ("", "0", "auto"):
        return 0
    if word in words:
        return words[word]
    raise ValueError(f"{name}={raw!r} is not {what}; use {hint}")


def gemm_ws():
    """Tells whether the wgmma GEMM layers of a segmented network are warp-specialised (csrc/gemm.c, fm_gemm_opts.ws).

    Returns:
        ``1`` (a producer warpgroup loads the stages), ``2`` (as 1, its two consumer warpgroups in turn on tiles of
        their own: the ping-pong form), ``3`` (as 1 on a persistent grid: the producer loads the next tile's stages
        under the consumers' epilogue) or ``-1`` (every thread loads and multiplies) as ``FUSEDMLP_GEMM_WS`` says
        (``1``/``on``, ``2``/``pingpong``, ``3``/``persistent``, ``-1``/``off``); ``0`` (the plan's choice) if it is
        unset, empty, ``0`` or ``auto``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _gemm_form("FUSEDMLP_GEMM_WS", {"1": 1, "on": 1, "2": 2, "pingpong": 2, "3": 3, "persistent": 3, "-1": -1,
                                           "off": -1},
                      "1 (warp-specialised), 2 (its consumers in turn), 3 (persistent), -1 (not) or auto")


def gemm_tma():
    """Tells whether the warp-specialised GEMMs' producer may load A by TMA tensor maps (fm_gemm_opts.tma).

    Returns:
        ``-1`` (never: its 128 threads' cp.async, as before tensor maps) as ``FUSEDMLP_GEMM_TMA`` says (``-1``/``off``);
        ``0`` (the plan's choice: tensor maps wherever the input parts copy as they are) if it is unset, empty, ``0``
        or ``auto``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _gemm_form("FUSEDMLP_GEMM_TMA", {"-1": -1, "off": -1}, "-1 (cp.async) or auto", "a way to load A")


def gemm_tma_store():
    """Tells whether the persistent GEMMs store y by TMA stores of their staged slabs (fm_gemm_opts.tma_store).

    Returns:
        ``1`` (wherever y's rows and the tile allow) or ``-1`` (never) as ``FUSEDMLP_GEMM_TMA_STORE`` says
        (``1``/``on``, ``-1``/``off``); ``0`` (the plan's choice) if it is unset, empty, ``0`` or ``auto``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _gemm_form("FUSEDMLP_GEMM_TMA_STORE", {"1": 1, "on": 1, "-1": -1, "off": -1}, "1 (TMA stores), -1 (not) or auto",
                      "a way to store y")


def gemm_pad():
    """Tells whether a segmented network's GEMMs read x from its padded copy (the pad pass, python/fusedmlp/_segments.py,
    pad_row) where x is not read as it is.

    Returns:
        ``1`` (wherever x is not read as it is), ``-1`` (never: the GEMMs convert x on the way in) as
        ``FUSEDMLP_GEMM_PAD`` says (``1``/``on``, ``-1``/``off``); ``0`` (the plan's rule) if it is unset, empty,
        ``0`` or ``auto``.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    return _gemm_form("FUSEDMLP_GEMM_PAD", {"1": 1, "on": 1, "-1": -1, "off": -1},
                      "1 (x's padded copy wherever x is not read as it is), -1 (never) or auto")


def host_pipeline():
    """Tells how a GPU call on host (NumPy) arrays moves them: in pieces through page-locked staging, each piece's
    copies and kernel under the others' (csrc/host_pipe.c), or as one copy each way.

    Returns:
        ``1`` (always in pieces) or ``0`` (always one copy each way) as ``FUSEDMLP_HOST_PIPE`` says (``1``/``on``,
        ``-1``/``off``); ``-1`` (by size: in pieces from 16 MiB of x and y) if it is unset, empty, ``0`` or ``auto``.
        For A/B timing and tests.

    Raises:
        ValueError: any other value, naming the variable and the value.
    """
    form = _gemm_form("FUSEDMLP_HOST_PIPE", {"1": 1, "on": 1, "-1": -1, "off": -1},
                      "1 (in pieces), -1 (one copy each way) or auto", what="a host copy form")
    return {0: -1, 1: 1, -1: 0}[form]


def cpu_threads():
    """Tells how many threads the CPU path may split a call's rows over.

    Returns:
        ``FUSEDMLP_CPU_THREADS`` if set, else ``OMP_NUM_THREADS`` (what Ray sets for a worker of ``num_cpus=N``, and
        what NumPy's BLAS obeys), else the CPUs this process may run on; at least 1.

    Raises:
        ValueError: a value that is not a positive integer, naming the variable and the value.
    """
    for name in ("FUSEDMLP_CPU_THREADS", "OMP_NUM_THREADS"):
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"{name}={raw!r} is not a thread count; use a positive integer such as 4")
        return int(raw)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (not Linux)
        return max(1, os.cpu_count() or 1)
