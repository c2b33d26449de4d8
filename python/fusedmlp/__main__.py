"""Command line: ``python -m fusedmlp cache list|info|clear``.

``list`` prints one line per valid kernel cache entry; ``info`` describes the cache, the NVRTC it would compile with
and the GPUs it would run on; ``clear`` removes every entry. The cache folder is ``--cache-dir`` if given, else the
one the library uses (``FUSEDMLP_CACHE_DIR``, ``$XDG_CACHE_HOME/fusedmlp``, ``~/.cache/fusedmlp``).
"""

import argparse
import os
import pathlib
import sys
import time

from . import _env
from ._cache import KernelCache


def _size(n):
    """1536 -> '1.5 KiB'; plain bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ago(seconds):
    """A duration for a table: '42s', '5m', '3h', '12d'."""
    seconds = max(0, int(seconds))
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit}"
    return f"{seconds}s"


def _entry_row(entry, now):
    """(key prefix, size, arch, NVRTC, age, last use, source) of one on-disk entry."""
    size = last_use = 0
    for path in (entry.path, entry.source_path):
        try:
            st = path.stat()
        except OSError:
            continue
        size += st.st_size
        if path == entry.path:
            last_use = st.st_mtime
    nvrtc = entry.meta.get("nvrtc")
    nvrtc = ".".join(str(part) for part in nvrtc) if isinstance(nvrtc, list) else "?"
    created = entry.meta.get("created")
    age = _ago(now - created) if isinstance(created, (int, float)) else "?"
    source = str(entry.source_path) if entry.source_path is not None and entry.source_path.exists() else "(missing)"
    return (entry.key[:12], _size(size), str(entry.meta.get("arch", "?")), nvrtc, age,
            _ago(now - last_use) + " ago" if last_use else "?", source)


def cmd_list(cache, out):
    rows = [_entry_row(entry, time.time()) for entry in cache.entries()]
    if not rows:
        print(f"no kernel cache entries in {cache.directory}", file=out)
        return 0
    header = ("KEY", "SIZE", "ARCH", "NVRTC", "AGE", "LAST USE", "SOURCE")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header) - 1)]
    for row in [header] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1], file=out)
    return 0


def _writable(directory):
    """Whether a put could write there: the folder, or the nearest existing folder above it that put would create
    it in."""
    path = pathlib.Path(directory)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _nvrtc_line():
    from . import _api
    from .errors import FusedMLPError

    try:
        path, version = _api._nvrtc_info()
    except ImportError as exc:
        return f"unavailable (the C extension does not load: {exc})"
    except FusedMLPError as exc:
        return f"not found ({exc.message})"
    return f"{version[0]}.{version[1]} at {path}"


def _gpu_lines():
    try:
        from . import _api, _core
        from .errors import FusedMLPError

        count = _core.cuda_device_count()
    except ImportError as exc:
        return [f"unknown (the C extension does not load: {exc})"]
    except FusedMLPError as exc:
        return [f"none (no CUDA driver: {exc.message})"]
    if count == 0:
        return ["none"]
    lines = []
    for ordinal in range(count):
        try:
            info = _api._gpu(ordinal).info
            lines.append(f"cuda:{ordinal} {info['name']} (sm_{info['arch']}, {info['sm_count']} SMs)")
        except FusedMLPError as exc:
            lines.append(f"cuda:{ordinal} cannot be opened ({exc.message})")
    return lines


def cmd_info(cache, out):
    try:
        limit = _env.cache_max_bytes()
        bound = f"{_size(limit)} ({limit} bytes; FUSEDMLP_CACHE_MAX_BYTES)"
    except ValueError as exc:
        bound = f"invalid: {exc}"
    entries = sum(1 for _ in cache.entries())
    total = cache.total_bytes()
    fields = [
        ("directory", str(cache.directory) + ("" if cache.directory.is_dir() else " (not created yet)")),
        ("entries", str(entries)),
        ("size", f"{_size(total)} ({total} bytes)"),
        ("bound", bound),
        ("writable", "yes" if _writable(cache.directory) else "no (kernels would be kept in memory only)"),
        ("nvrtc", _nvrtc_line()),
    ]
    gpus = _gpu_lines()
    fields += [("gpu", gpus[0])] + [("", line) for line in gpus[1:]]
    for name, value in fields:
        print(f"{name + ':' if name else '':<11} {value}", file=out)
    return 0


def cmd_clear(cache, out):
    removed = cache.clear()
    print(f"removed {removed} kernel cache entr{'y' if removed == 1 else 'ies'} from {cache.directory}", file=out)
    return 0


def main(argv=None, out=None):
    """Runs the command line; returns the exit status.

    Args:
        argv: the arguments after ``python -m fusedmlp`` (default: sys.argv[1:]).
        out: where to print (default: sys.stdout).
    """
    parser = argparse.ArgumentParser(prog="python -m fusedmlp", description="fusedmlp utilities")
    commands = parser.add_subparsers(dest="command", required=True)
    cache_parser = commands.add_parser("cache", help="inspect or clear the kernel cache")
    cache_parser.add_argument("--cache-dir", help="the cache folder (default: FUSEDMLP_CACHE_DIR or its fallbacks)")
    actions = cache_parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="one line per entry: key, size, arch, NVRTC version, age, last use, source")
    actions.add_parser("info", help="folder, entry count, size, bound, NVRTC and GPU")
    actions.add_parser("clear", help="remove every entry")
    args = parser.parse_args(argv)
    cache = KernelCache(args.cache_dir)
    run = {"list": cmd_list, "info": cmd_info, "clear": cmd_clear}[args.action]
    return run(cache, out or sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
