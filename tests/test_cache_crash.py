"""Crash safety of the kernel cache: a process SIGKILLed in the middle of put() leaves nothing that get() accepts with
wrong contents. A later get() misses or returns exactly a payload some put() wrote in full; temp files are never read."""

import hashlib
import multiprocessing
import os
import random
import signal
import time

import pytest

from fusedmlp import _cache
from fusedmlp._cache import KernelCache

KEY = KernelCache.key("// crash test\n", ("-arch=sm_90",), (13, 0), "sm_90", "0.1.0")
BIG = 4 << 20  # 4 MiB payloads: writing and fsyncing one takes long enough for a kill to land inside it

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL") or "fork" not in multiprocessing.get_all_start_methods(),
                                reason="needs fork and SIGKILL")


def payload(i, size=BIG):
    return random.Random(i).randbytes(size)


def put(cache, i, size=BIG):
    return cache.put(KEY, f"// version {i}\n", payload(i, size), {"arch": "sm_90", "version": i})


def assert_whole_or_missing(directory, allowed):
    """get() misses or returns exactly the payload of one of the allowed versions; returns that version or None."""
    entry = KernelCache(directory).get(KEY)
    if entry is None:
        return None
    version = entry.meta["version"]
    assert version in allowed
    assert len(entry.cubin) == len(payload(version, len(entry.cubin)))
    assert hashlib.sha256(entry.cubin).digest() == hashlib.sha256(payload(version, len(entry.cubin))).digest()
    assert not entry.path.name.startswith(".tmp-")
    return version


def _put_forever(directory, first, ready):
    os.environ.pop("FUSEDMLP_CACHE_MAX_BYTES", None)
    cache = KernelCache(directory)
    i = first
    while True:
        put(cache, i)
        ready.set()
        i += 1


def test_kill_at_random_moments_during_a_loop_of_puts(tmp_path):
    ctx = multiprocessing.get_context("fork")
    directory = tmp_path / "cache"
    seen, versions = set(), set()
    timing = random.Random(2024)
    for trial in range(8):
        ready = ctx.Event()
        first = 1000 * trial
        child = ctx.Process(target=_put_forever, args=(directory, first, ready))
        child.start()
        if trial % 2:
            ready.wait(30)  # at least one put of this child finished: the kill lands in a later one
        time.sleep(timing.uniform(0.0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        versions.update(range(first, first + 1000))
        seen.add(assert_whole_or_missing(directory, versions))
    # the kills left temp files behind; none of them is read as the entry, listed, or counted
    entries = list(KernelCache(directory).entries())
    assert len(entries) <= 1 and all(not e.path.name.startswith(".tmp-") for e in entries)
    cache = KernelCache(directory)
    put(cache, 99, size=1000)  # and the cache works on: a new put replaces whatever is there
    assert cache.get(KEY).cubin == payload(99, 1000)
    assert seen - {None}, "no trial ever found a finished entry: the test did not test replacement"


def _put_slowly(directory, version, stage, inside):
    """Puts version, stopping forever at a chosen stage of the write (the parent kills it there)."""
    real_write = _cache.KernelCache._write_atomically
    real_fsync = os.fsync

    def stall():
        inside.set()
        time.sleep(3600)

    def write(folder, name, data):
        if stage == "between-files" and name.endswith(".cubin"):
            stall()  # the source is in place, the entry not yet begun
        return real_write(folder, name, data)

    def fsync(fd):
        size = os.fstat(fd).st_size
        if stage == "before-rename" and size > 1000:
            stall()  # the whole entry is in its temp file, not yet renamed into place
        return real_fsync(fd)

    def half_write(folder, name, data):
        if stage == "half-written" and name.endswith(".cubin"):
            fd, _temp = _cache.tempfile.mkstemp(dir=folder, prefix=".tmp-")
            os.write(fd, data[: len(data) // 2])  # half the entry is on disk, under the temp name
            stall()
        return write(folder, name, data)

    _cache.KernelCache._write_atomically = staticmethod(half_write)
    _cache.os.fsync = fsync
    try:
        put(KernelCache(directory), version)
    finally:
        _cache.os.fsync = real_fsync
        _cache.KernelCache._write_atomically = staticmethod(real_write)


@pytest.mark.parametrize("stage", ["half-written", "before-rename", "between-files"])
@pytest.mark.parametrize("existing", [False, True], ids=["empty", "over-an-old-entry"])
def test_kill_inside_a_put_leaves_the_old_entry_or_none(tmp_path, stage, existing):
    directory = tmp_path / "cache"
    if existing:
        put(KernelCache(directory), 1)
    ctx = multiprocessing.get_context("fork")
    inside = ctx.Event()
    child = ctx.Process(target=_put_slowly, args=(directory, 2, stage, inside))
    child.start()
    assert inside.wait(60), "the child never reached the stage"
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    version = assert_whole_or_missing(directory, {1, 2})
    assert version == (1 if existing else None)  # the interrupted put never shows, not even in part
    shard = KernelCache(directory).paths(KEY)[1].parent
    temps = [name for name in os.listdir(shard) if name.startswith(".tmp-")]
    assert temps if stage != "between-files" else not temps  # the dead writer's temp file is there, and ignored
    if stage == "between-files":  # the new source went in, the entry did not: the old entry (or a miss) stands
        assert (shard / f"{KEY}.cu").read_text() == "// version 2\n"
    # nothing lists or counts the temp file as an entry; a later put repairs the key
    assert [e.meta["version"] for e in KernelCache(directory).entries()] == ([1] if existing else [])
    cache = KernelCache(directory)
    put(cache, 3, size=5000)
    assert cache.get(KEY).cubin == payload(3, 5000)


def test_a_temp_file_holding_a_valid_entry_is_never_read(tmp_path):
    cache = KernelCache(tmp_path / "cache")
    entry = put(cache, 5, size=2000)
    data = entry.path.read_bytes()
    os.unlink(entry.path)
    (entry.path.parent / ".tmp-k1ll3d").write_bytes(data)  # a finished write whose rename never happened
    (entry.path.parent / f".tmp-{KEY}.cubin").write_bytes(data)
    os.chmod(entry.path.parent / ".tmp-k1ll3d", 0o600)
    assert cache.get(KEY) is None
    assert list(cache.entries()) == []
    assert cache.clear() == 0  # and clear() counts entries, not temp files
