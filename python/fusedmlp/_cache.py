"""The on-disk kernel cache: rendered CUDA source and its CUBIN, keyed by everything that shapes the binary.

Layout, sharded by the key's first two hex digits so no folder grows past a few thousand files::

    <dir>/<key[:2]>/<key>.cubin   the entry: header + CUBIN (below)
    <dir>/<key[:2]>/<key>.cu      the rendered source, so a user can read the exact kernel that ran
    <dir>/<key[:2]>/<key>.lock    flock target while a process compiles that key (empty, never removed while in use)

An entry file is::

    b"FMLPCUBN"  u32 format version (1)  u32 header length   (little-endian)
    header: canonical JSON (sorted keys, no spaces, ASCII) of the caller's meta (arch, options, compiler version,
            package version) plus key, created, payload_length, payload_sha256 and header_sha256 (the SHA-256 of the
            canonical JSON of every other field, so a flipped bit in the header is caught as surely as one in the
            payload)
    payload: the CUBIN bytes

Anything wrong with an entry (missing, truncated, checksum, magic, version, key) is a miss, never an exception; the
caller recompiles and :meth:`KernelCache.put` replaces the bad file. Files are written to a unique temp file in the
same folder, fsync'd and renamed into place, so readers in other processes see the old file or the new one, whole.

A CUBIN is code that will run in the user's process, so an entry is refused (a miss, with one warning) when the entry
file or its shard folder is not owned by the current user or is writable by group or others: a cache that someone
else can write is a way to run their code. Folders are created 0700 and files 0600.

If the folder cannot be written (read-only, permission denied, disk full), the cache keeps entries in memory for the
life of the :class:`KernelCache` object and warns once: results stay correct, compiles just don't persist.

The cache is bounded by ``FUSEDMLP_CACHE_MAX_BYTES`` (default 2 GiB): after each :meth:`KernelCache.put` that takes it
past the bound, the least recently used entries (by the entry file's mtime, which every hit touches) are removed until
it is back under 90% of the bound (:meth:`KernelCache.evict`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import stat
import struct
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

try:
    import fcntl
except ImportError:  # not POSIX: compile_lock degrades to no lock, every other part still works
    fcntl = None

from . import _env

__all__ = ["KernelCache", "CacheEntry", "MAGIC", "FORMAT_VERSION"]

logger = logging.getLogger("fusedmlp")

MAGIC = b"FMLPCUBN"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
# A real header is a few hundred bytes; a length past this is a corrupt file, not a reason to read 4 GiB.
_MAX_HEADER_BYTES = 1 << 20

# Fields put() computes; a caller's meta cannot set them.
_COMPUTED_FIELDS = ("key", "created", "payload_length", "payload_sha256", "header_sha256")

# Eviction goes down to this fraction of the bound, not just under it, so the puts that follow do not each scan and
# evict again.
_EVICT_TO_FRACTION = 0.9
# A put renames its temp file into place within seconds of creating it; one an hour old belongs to a writer that died
# (SIGKILL, power loss) and only takes space.
_STALE_TEMP_S = 3600

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_FILE_RE = re.compile(r"([0-9a-f]{64})\.(cubin|cu|lock)")
_TEMP_RE = re.compile(r"\.tmp-[A-Za-z0-9_]+")  # tempfile.mkstemp(prefix=".tmp-") names

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# O_NONBLOCK so that a FIFO planted under an entry's name cannot hang open(); no effect on regular files.
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

# Waiting this long for another process's compile is worth a log line.
_SLOW_LOCK_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One kernel found in, or stored into, the cache.

    Attributes:
        key: the 64-hex-digit key.
        cubin: the CUBIN bytes.
        meta: the entry's header: the caller's meta plus key, created, payload_length, payload_sha256, header_sha256.
        path: the entry file, or None for an entry held in memory only.
        source_path: the rendered source beside it, or None for an entry held in memory only.
    """

    key: str
    cubin: bytes
    meta: Dict[str, Any]
    path: Optional[pathlib.Path]
    source_path: Optional[pathlib.Path]


class _Untrusted(Exception):
    """An entry or folder another user could have written (internal: becomes a miss and a warning)."""


def _canonical_json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _check_key(key):
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"cache key {key!r} is not 64 lowercase hex digits (use KernelCache.key)")


def _trust_problem(st, what):
    """Returns why a file or folder with this stat result must not be trusted, or None."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"{what} is owned by uid {st.st_uid}, not by the current user (uid {euid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} has mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others"
    return None


def _encode_entry(key, cubin, meta):
    """Builds an entry file's bytes and its header dict."""
    header = {name: value for name, value in dict(meta or {}).items() if name not in _COMPUTED_FIELDS}
    header.update(
        key=key,
        created=time.time(),
        payload_length=len(cubin),
        payload_sha256=hashlib.sha256(cubin).hexdigest(),
    )
    header["header_sha256"] = hashlib.sha256(_canonical_json(header)).hexdigest()
    header_bytes = _canonical_json(header)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes)) + header_bytes + cubin, header


def _decode_entry(data, key):
    """Returns (header, payload) of an entry file's bytes, or a string saying why they are not a valid entry."""
    if len(data) < _PREFIX.size:
        return f"truncated: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix"
    magic, version, header_length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        return f"wrong magic {magic!r}"
    if version != FORMAT_VERSION:
        return f"format version {version}, this fusedmlp reads {FORMAT_VERSION}"
    if header_length > _MAX_HEADER_BYTES or _PREFIX.size + header_length > len(data):
        return f"truncated or corrupt: header length {header_length}, file length {len(data)}"
    header_bytes = data[_PREFIX.size : _PREFIX.size + header_length]
    try:
        header = json.loads(header_bytes.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"header is not JSON ({exc})"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    try:
        canonical = _canonical_json(header)
    except ValueError as exc:
        return f"header does not re-encode ({exc})"
    if canonical != header_bytes:
        return "header is not in canonical form (corrupt)"
    claimed = header.get("header_sha256")
    rest = {name: value for name, value in header.items() if name != "header_sha256"}
    if claimed != hashlib.sha256(_canonical_json(rest)).hexdigest():
        return "header checksum mismatch"
    if header.get("key") != key:
        return f"entry is for key {header.get('key')!r}"
    payload = data[_PREFIX.size + header_length :]
    if header.get("payload_length") != len(payload):
        return f"payload is {len(payload)} bytes, header says {header.get('payload_length')!r}"
    if header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        return "payload checksum mismatch"
    return header, payload


class KernelCache:
    """Compiled kernels on disk (with an in-memory fallback), keyed by :meth:`key`.

    Safe to share between threads and between processes: writers never expose a partial file, and
    :meth:`compile_lock` lets concurrent processes that need the same new kernel compile it once.

    Args:
        directory: the cache folder; None means :func:`fusedmlp._env.cache_dir` (``FUSEDMLP_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/fusedmlp``, else ``~/.cache/fusedmlp``). Created (0700) on the first :meth:`put`.
    """

    def __init__(self, directory=None):
        self.directory = pathlib.Path(directory) if directory is not None else _env.cache_dir()
        self._memory: Dict[str, CacheEntry] = {}
        self._lock = threading.Lock()
        self._warned_fallback = False
        self._warned_untrusted = set()

    def __repr__(self):
        return f"KernelCache({str(self.directory)!r})"

    # ------------------------------------------------------------------------------------------------ keys and paths

    @staticmethod
    def key(source: str, options: Sequence[str], compiler_version: tuple, arch: str, package_version: str) -> str:
        """Returns the cache key of a kernel: the SHA-256 of everything that shapes its CUBIN.

        Each field is length-prefixed, so no two different inputs frame to the same bytes
        (``("ab", ["c"])`` and ``("a", ["bc"])`` get different keys).

        Args:
            source: the rendered CUDA source.
            options: the NVRTC options, in order.
            compiler_version: NVRTC's version, e.g. ``(13, 0)``.
            arch: the target, e.g. ``"sm_90a"``.
            package_version: fusedmlp's version.

        Returns:
            64 lowercase hex digits.
        """
        digest = hashlib.sha256()

        def field(text):
            data = str(text).encode("utf-8")
            digest.update(struct.pack("<Q", len(data)))
            digest.update(data)

        field(f"fusedmlp-kernel-cache-key/{FORMAT_VERSION}")
        field(source)
        options = [str(option) for option in options]
        field(len(options))
        for option in options:
            field(option)
        compiler_version = tuple(compiler_version)
        field(len(compiler_version))
        for part in compiler_version:
            field(part)
        field(arch)
        field(package_version)
        return digest.hexdigest()

    def paths(self, key: str) -> Tuple[pathlib.Path, pathlib.Path]:
        """Returns where a key's files live (whether or not they exist).

        Args:
            key: a key from :meth:`key`.

        Returns:
            ``(source_path, cubin_path)``: ``<dir>/<key[:2]>/<key>.cu`` and ``<dir>/<key[:2]>/<key>.cubin``.

        Raises:
            ValueError: a key that is not 64 lowercase hex digits (it would name a path outside the cache).
        """
        _check_key(key)
        shard = self.directory / key[:2]
        return shard / f"{key}.cu", shard / f"{key}.cubin"

    # ------------------------------------------------------------------------------------------------ reading

    def get(self, key: str) -> Optional[CacheEntry]:
        """Looks a kernel up, in memory first, then on disk; on a disk hit, touches the entry's mtime (for LRU).

        Args:
            key: a key from :meth:`key`.

        Returns:
            The entry, or None on a miss. A missing, truncated, corrupt, wrong-magic, wrong-version or wrong-key entry
            is a miss (logged at debug level); so is an untrusted one (not owned by the user, or writable by group or
            others), which also warns once per file.
        """
        _check_key(key)
        with self._lock:
            held = self._memory.get(key)
        if held is not None:
            return held
        return self._load(key, touch=True)

    def _load(self, key, touch):
        source_path, cubin_path = self.paths(key)
        try:
            data = self._read_trusted(cubin_path, touch)
        except FileNotFoundError:
            return None
        except _Untrusted as exc:
            self._warn_untrusted(cubin_path, str(exc))
            return None
        except OSError as exc:
            logger.debug("kernel cache miss for %s: cannot read %s: %s", key, cubin_path, exc)
            return None
        decoded = _decode_entry(data, key)
        if isinstance(decoded, str):
            logger.debug("kernel cache miss for %s: %s is not a valid entry: %s", key, cubin_path, decoded)
            return None
        header, payload = decoded
        return CacheEntry(key=key, cubin=payload, meta=header, path=cubin_path, source_path=source_path)

    def _read_trusted(self, path, touch):
        """Reads a file after checking that its folder and the file itself are the user's own; returns its bytes."""
        try:
            dir_fd = os.open(path.parent, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.lexists(path.parent):
                raise _Untrusted(f"shard folder {path.parent} is a symbolic link or not a folder") from None
            raise
        try:
            problem = _trust_problem(os.fstat(dir_fd), f"shard folder {path.parent}")
            if problem:
                raise _Untrusted(problem)
            try:
                fd = os.open(path.name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _Untrusted(f"{path} is a symbolic link") from None
                raise
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as stream:
            st = os.fstat(stream.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _Untrusted(f"{path} is not a regular file")
            problem = _trust_problem(st, f"entry {path}")
            if problem:
                raise _Untrusted(problem)
            data = stream.read()
            if touch:
                try:
                    os.utime(stream.fileno() if os.utime in os.supports_fd else path)
                except OSError as exc:  # a read-only cache still serves hits; eviction order just goes stale
                    logger.debug("cannot touch %s: %s", path, exc)
        return data

    def _warn_untrusted(self, path, reason):
        logger.debug("kernel cache refuses %s: %s", path, reason)
        with self._lock:
            if path in self._warned_untrusted:
                return
            self._warned_untrusted.add(path)
        warnings.warn(
            f"fusedmlp: ignoring kernel cache entry {path}: {reason}; a cache file another user can write could run "
            f"their code. The kernel is compiled afresh; remove the file or folder, or fix its owner and mode (0700 "
            f"folders, 0600 files)",
            RuntimeWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------------------------------------ writing

    def put(self, key: str, source: str, cubin: bytes, meta: Optional[Dict[str, Any]] = None) -> CacheEntry:
        """Stores a kernel: its source beside it first, then the entry, each written to a temp file and renamed.

        If the folder cannot be written (any OSError: read-only, permission denied, disk full, a path through a
        file), the entry is kept in memory for this cache object instead, with one RuntimeWarning per object.

        Args:
            key: a key from :meth:`key`.
            source: the rendered CUDA source the CUBIN was compiled from.
            cubin: the CUBIN bytes.
            meta: JSON-serialisable header fields, normally ``arch``, ``options``, ``compiler_version`` and
                ``package_version`` (the inputs of :meth:`key`); ``key``, ``created``, ``payload_length``,
                ``payload_sha256`` and ``header_sha256`` are computed here and override any given.

        Once the entry is on disk, older entries are evicted if the cache has outgrown ``FUSEDMLP_CACHE_MAX_BYTES``
        (:meth:`evict`); the entry just written is never one of them.

        Returns:
            The stored entry (``path`` and ``source_path`` None if it went to memory only).

        Raises:
            ValueError: a malformed key, meta with NaN or infinity, or a malformed ``FUSEDMLP_CACHE_MAX_BYTES``.
            TypeError: meta that is not JSON-serialisable.
        """
        _check_key(key)
        max_bytes = _env.cache_max_bytes()  # a malformed FUSEDMLP_CACHE_MAX_BYTES fails here, before anything is written
        cubin = bytes(cubin)
        blob, header = _encode_entry(key, cubin, meta)
        source_path, cubin_path = self.paths(key)
        try:
            shard = self._make_shard(key)
            self._write_atomically(shard, source_path.name, source.encode("utf-8"))
            self._write_atomically(shard, cubin_path.name, blob)
        except OSError as exc:
            entry = CacheEntry(key=key, cubin=cubin, meta=header, path=None, source_path=None)
            with self._lock:
                self._memory[key] = entry
                first = not self._warned_fallback
                self._warned_fallback = True
            if first:
                warnings.warn(
                    f"fusedmlp: cannot write the kernel cache at {self.directory} ({exc}); results still work, but "
                    f"compiled kernels will not persist past this process. Set FUSEDMLP_CACHE_DIR to a writable folder",
                    RuntimeWarning,
                    stacklevel=2,
                )
            logger.debug("kernel %s kept in memory: %s", key, exc)
            return entry
        with self._lock:
            self._memory.pop(key, None)
        self.evict(max_bytes, keep=key)
        return CacheEntry(key=key, cubin=cubin, meta=header, path=cubin_path, source_path=source_path)

    def _make_shard(self, key):
        """Creates (0700) and returns the key's shard folder; raises OSError if it is not the user's own."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        shard = self.directory / key[:2]
        try:
            os.mkdir(shard, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(shard)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "shard is not a folder", str(shard))
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"shard folder is owned by uid {st.st_uid}", str(shard))
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            # Ours but loose (made by hand or under another umask): tighten it, or get() would refuse what we write.
            os.chmod(shard, 0o700)
        return shard

    @staticmethod
    def _write_atomically(folder, name, data):
        """Writes data to folder/name through a unique temp file in the same folder; never leaves the temp file."""
        fd, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as stream:
                fd = -1  # the stream owns it now
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temp, os.path.join(folder, name))
            temp = None
        finally:
            if fd >= 0:
                os.close(fd)
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)

    # ------------------------------------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def compile_lock(self, key: str) -> Iterator[None]:
        """Holds an exclusive lock on a key while compiling it, so concurrent processes compile a kernel once.

        Use as ``with cache.compile_lock(key): entry = cache.get(key) or compile_and_put()``: the second process
        waits here, then finds the first one's entry. The lock is ``fcntl.flock`` on ``<shard>/<key>.lock``, released
        when the block exits (or the process dies). If the lock file cannot be created (read-only cache), the block
        runs unlocked: at worst two processes compile the same kernel.

        Args:
            key: a key from :meth:`key`.

        Returns:
            A context manager yielding None.
        """
        _check_key(key)
        fd = -1
        if fcntl is not None:
            try:
                shard = self._make_shard(key)
                fd = os.open(shard / f"{key}.lock", os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
            except OSError as exc:
                logger.debug("compiling %s without a lock: %s", key, exc)
        if fd < 0:
            yield
            return
        try:
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            if waited > _SLOW_LOCK_WAIT_S:
                logger.info("waited %.1f s for another process compiling kernel %s", waited, key)
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    # ------------------------------------------------------------------------------------------------ listing

    def _shards(self):
        try:
            listing = list(os.scandir(self.directory))
        except OSError:
            return []
        return sorted(
            (item for item in listing if _SHARD_RE.fullmatch(item.name) and item.is_dir(follow_symlinks=False)),
            key=lambda item: item.name,
        )

    def _files(self):
        """Yields (DirEntry, key, kind) for every cache-named file in the shard folders."""
        for shard in self._shards():
            try:
                listing = sorted(os.scandir(shard.path), key=lambda item: item.name)
            except OSError:
                continue
            for item in listing:
                match = _FILE_RE.fullmatch(item.name)
                if match and match.group(1)[:2] == shard.name and item.is_file(follow_symlinks=False):
                    yield item, match.group(1), match.group(2)

    def entries(self) -> Iterator[CacheEntry]:
        """Iterates over the valid entries: those on disk (in key order, without touching them), then memory-only ones.

        Returns:
            An iterator of :class:`CacheEntry`; invalid and untrusted files are skipped as :meth:`get` would.
        """
        seen = set()
        for _item, key, kind in list(self._files()):
            if kind != "cubin":
                continue
            entry = self._load(key, touch=False)
            if entry is not None:
                seen.add(key)
                yield entry
        with self._lock:
            held = [entry for key, entry in sorted(self._memory.items()) if key not in seen]
        yield from held

    def total_bytes(self) -> int:
        """Returns the disk space the cache's files take.

        Returns:
            The summed sizes of every ``.cubin`` and ``.cu`` file in the shard folders, valid or not (what an
            eviction can free); memory-only entries are not counted.
        """
        total = 0
        for item, _key, kind in self._files():
            if kind == "lock":
                continue
            with contextlib.suppress(OSError):
                total += item.stat(follow_symlinks=False).st_size
        return total

    def clear(self) -> int:
        """Removes every entry, source and lock file, the emptied shard folders, and the memory-only entries.

        Only names the cache itself makes are touched (and temp files only when a dead writer left them, an hour
        old); anything else in the folder stays.

        Returns:
            How many entry (``.cubin``) files were removed.
        """
        self._remove_stale_temps()
        removed = 0
        for item, _key, kind in list(self._files()):
            try:
                os.unlink(item.path)
            except OSError as exc:
                logger.debug("cannot remove %s: %s", item.path, exc)
                continue
            if kind == "cubin":
                removed += 1
        for shard in self._shards():
            with contextlib.suppress(OSError):
                os.rmdir(shard.path)  # fails, harmlessly, while it holds anything else
        with self._lock:
            self._memory.clear()
        return removed

    # ------------------------------------------------------------------------------------------------ eviction

    def evict(self, max_bytes: Optional[int] = None, keep: Optional[str] = None) -> int:
        """Removes least recently used entries while the cache is larger than its bound.

        Nothing is removed while the ``.cubin`` and ``.cu`` files total at most max_bytes (:meth:`total_bytes`). Past
        it, keys go oldest first, by the entry file's mtime (every hit touches it; a key with no entry file goes by
        its newest file), until the total is at most 90% of max_bytes. A key goes with its entry, source and lock
        file; a lock that another process holds (it is compiling that key) stays. Files that another process removes
        meanwhile are skipped, and shard folders stay (removing one could fail another process's put in it). Temp
        files older than an hour, left by a writer that died, are removed whatever the total.

        Args:
            max_bytes: the bound; None reads ``FUSEDMLP_CACHE_MAX_BYTES`` (default 2 GiB).
            keep: a key never to evict: :meth:`put` passes the one it just wrote, even if that alone is past the bound.

        Returns:
            How many entries (``.cubin`` files) were removed.
        """
        limit = _env.cache_max_bytes() if max_bytes is None else int(max_bytes)
        self._remove_stale_temps()
        keys: Dict[str, list] = {}  # key -> [last use (ns), bytes, {kind: path}]
        for item, key, kind in list(self._files()):
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            record = keys.setdefault(key, [0, 0, {}])
            record[2][kind] = item.path
            if kind != "lock":
                record[1] += st.st_size
            if kind == "cubin":
                record[0] = st.st_mtime_ns
            elif "cubin" not in record[2]:
                record[0] = max(record[0], st.st_mtime_ns)
        total = sum(record[1] for record in keys.values())
        if total <= limit:
            return 0
        target = int(limit * _EVICT_TO_FRACTION)
        removed = freed = 0
        for key, (_used, size, paths) in sorted(keys.items(), key=lambda pair: (pair[1][0], pair[0])):
            if total <= target:
                break
            if key == keep:
                continue
            gone = True
            for kind in ("cubin", "cu"):  # the entry first: a reader then misses rather than finds half a key
                if kind in paths:
                    gone = self._remove(paths[kind]) and gone
            if "lock" in paths:
                self._remove_idle_lock(paths["lock"])
            if gone:
                total -= size
                freed += size
                removed += int("cubin" in paths)
        logger.debug("kernel cache %s: evicted %d entries (%d bytes) to stay under %d bytes", self.directory,
                     removed, freed, limit)
        return removed

    @staticmethod
    def _remove(path):
        """Unlinks a file; returns False only if it is still there (another process removing it first is fine)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.debug("cannot remove %s: %s", path, exc)
            return False
        return True

    @staticmethod
    def _remove_idle_lock(path):
        """Removes a key's lock file unless a process holds it, that is, is compiling that key right now."""
        try:
            fd = os.open(path, os.O_RDWR | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
        except OSError:
            return
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return
            with contextlib.suppress(OSError):
                os.unlink(path)
        finally:
            os.close(fd)

    def _remove_stale_temps(self):
        """Removes the temp files of writers that died before renaming them into place."""
        cutoff = time.time() - _STALE_TEMP_S
        for shard in self._shards():
            try:
                listing = list(os.scandir(shard.path))
            except OSError:
                continue
            for item in listing:
                if not _TEMP_RE.fullmatch(item.name):
                    continue
                with contextlib.suppress(OSError):
                    st = item.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                        os.unlink(item.path)
