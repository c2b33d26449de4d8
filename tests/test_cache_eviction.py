"""The kernel cache's size bound: FUSEDMLP_CACHE_MAX_BYTES and least-recently-used eviction (no GPU needed)."""

import fcntl
import multiprocessing
import os
import random
import time

import pytest

from fusedmlp import _cache
from fusedmlp._cache import KernelCache

PAYLOAD = 10_000  # bytes of CUBIN per test entry; an entry's files are this plus a header and a short source


def key_of(i):
    return KernelCache.key(f"// kernel {i}\n", ("-arch=sm_90",), (13, 0), "sm_90", "0.1.0")


def put(cache, i, size=PAYLOAD):
    return cache.put(key_of(i), f"// kernel {i}\n", random.Random(i).randbytes(size), {"arch": "sm_90"})


def files_of(cache, i):
    source, cubin = cache.paths(key_of(i))
    return source, cubin, cubin.with_suffix(".lock")


def age(cache, i, seconds_ago):
    """Sets entry i's last use (its entry file's mtime) to seconds_ago."""
    stamp = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(files_of(cache, i)[1], ns=(stamp, stamp))


def present(cache, count):
    return [i for i in range(count) if files_of(cache, i)[1].exists()]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("FUSEDMLP_CACHE_MAX_BYTES", raising=False)
    return KernelCache(tmp_path / "cache")


def fill(cache, count):
    """Puts entries 0..count-1 under the default (2 GiB) bound, entry i last used count - i minutes ago."""
    for i in range(count):
        put(cache, i)
        age(cache, i, 60 * (count - i))
    return cache.total_bytes() // count  # bytes per entry (all entries have the same size)


def test_under_the_bound_nothing_is_evicted(cache, monkeypatch):
    per_entry = fill(cache, 5)
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", str(int(6.5 * per_entry)))
    put(cache, 5)
    assert present(cache, 6) == [0, 1, 2, 3, 4, 5]


def test_past_the_bound_the_oldest_go_until_under_90_percent(cache, monkeypatch):
    per_entry = fill(cache, 10)
    bound = int(9.5 * per_entry)  # 11 entries are past it; 90% of it holds 8
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", str(bound))
    put(cache, 10)
    assert present(cache, 11) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert cache.total_bytes() <= 0.9 * bound
    for i in (0, 1, 2):  # the entry, its source and its (idle) lock all went
        assert not any(path.exists() for path in files_of(cache, i))
        assert cache.get(key_of(i)) is None
    for i in present(cache, 11):
        assert cache.get(key_of(i)).cubin == random.Random(i).randbytes(PAYLOAD)


def test_a_hit_makes_an_entry_recent(cache, monkeypatch):
    per_entry = fill(cache, 4)
    assert cache.get(key_of(0)) is not None  # touches entry 0's mtime: now the most recently used
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", str(int(4.5 * per_entry)))
    put(cache, 4)  # five entries > 4.5; 90% of the bound holds 4, so exactly the oldest, entry 1, goes
    assert present(cache, 5) == [0, 2, 3, 4]


def test_the_entry_just_written_stays_even_alone_past_the_bound(cache, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", "1000")  # smaller than any one entry
    first = put(cache, 0)
    assert first.path.exists() and cache.get(key_of(0)).cubin == first.cubin
    age(cache, 0, 60)
    second = put(cache, 1)
    assert present(cache, 2) == [1]
    assert cache.get(key_of(1)).cubin == second.cubin


def test_zero_bound_keeps_only_the_newest_entry(cache, monkeypatch):
    fill(cache, 3)
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", "0")
    put(cache, 3)
    assert present(cache, 4) == [3]


def test_evict_called_directly_with_a_bound(cache):
    per_entry = fill(cache, 6)
    assert cache.evict(max_bytes=100 * per_entry) == 0
    assert cache.evict(max_bytes=int(3.2 * per_entry), keep=key_of(0)) == 4  # to <= 2.88 entries: 0 (kept) and 5
    assert present(cache, 6) == [0, 5]


def test_a_held_lock_file_survives_eviction(cache, monkeypatch):
    per_entry = fill(cache, 3)
    lock = files_of(cache, 0)[2]
    with cache.compile_lock(key_of(0)):  # this process is "compiling" key 0
        assert lock.exists()
        assert cache.evict(max_bytes=int(1.5 * per_entry)) == 2
        assert lock.exists()
        assert not files_of(cache, 0)[1].exists() and not files_of(cache, 0)[0].exists()
        fd = os.open(lock, os.O_RDWR)  # and it is still the file that the holder's flock is on
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert present(cache, 3) == [2]


def test_orphan_sources_go_by_their_own_age(cache):
    per_entry = fill(cache, 3)
    files_of(cache, 0)[1].unlink()  # a writer died between the source and the entry: the source alone is left
    source = files_of(cache, 0)[0]
    source.write_text("// " + "x" * 2 * per_entry)  # as large as two entries
    old = time.time_ns() - 3600 * 10**9
    os.utime(source, ns=(old, old))
    assert cache.evict(max_bytes=int(3.5 * per_entry)) == 0  # the orphan went first, and that was enough
    assert not source.exists()
    assert present(cache, 3) == [1, 2]


def test_files_removed_by_another_process_meanwhile_are_tolerated(cache, monkeypatch):
    per_entry = fill(cache, 6)
    real_unlink = os.unlink
    raced = []

    def unlink_after_a_rival(path, *args, **kwargs):
        # Another process removes the file just before we do: our unlink finds nothing there.
        if str(path).endswith(".cubin") and not raced:
            raced.append(path)
            real_unlink(path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(_cache.os, "unlink", unlink_after_a_rival)
    removed = cache.evict(max_bytes=4 * per_entry)
    assert raced and removed == 3  # the entry the rival removed counts as gone: no fourth entry is evicted for it
    assert present(cache, 6) == [3, 4, 5]


def test_entries_listed_then_gone_before_stat_are_skipped(cache, monkeypatch):
    per_entry = fill(cache, 4)
    listing = list(cache._files())
    for path in files_of(cache, 0)[:2]:
        path.unlink()  # gone between the listing and the stat
    monkeypatch.setattr(cache, "_files", lambda: iter(listing))
    assert cache.evict(max_bytes=int(2.5 * per_entry)) == 1
    assert present(cache, 4) == [2, 3]


def test_stale_temp_files_are_removed_and_fresh_ones_kept(cache):
    fill(cache, 1)
    shard = files_of(cache, 0)[1].parent
    stale, fresh = shard / ".tmp-deadwriter", shard / ".tmp-liveone1"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 100)
    old = time.time() - 2 * _cache._STALE_TEMP_S
    os.utime(stale, (old, old))
    assert cache.evict(max_bytes=10**9) == 0
    assert not stale.exists() and fresh.exists()
    assert present(cache, 1) == [0]


def test_malformed_bound_fails_the_put_before_writing(cache, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", "two gigs")
    with pytest.raises(ValueError, match="FUSEDMLP_CACHE_MAX_BYTES='two gigs' is not a size"):
        put(cache, 0)
    assert not cache.directory.exists() or cache.total_bytes() == 0


def test_suffixed_bound_is_honoured(cache, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", "32K")  # 32768 bytes: three entries of ~10.3 kB fit, four do not
    for i in range(4):
        put(cache, i)
        age(cache, i, 60 * (4 - i))
    # three entries (~31 kB) fit; the fourth takes the cache past 32 KiB, and 90% of it (29.5 kB) holds two
    assert present(cache, 4) == [2, 3]


def _put_many(directory, first, count, bound):
    os.environ["FUSEDMLP_CACHE_MAX_BYTES"] = str(bound)
    cache = KernelCache(directory)
    for i in range(first, first + count):
        put(cache, i)
        entry = cache.get(key_of(i))  # the rival may have evicted it already: then a miss, never an error
        assert entry is None or entry.cubin == random.Random(i).randbytes(PAYLOAD)


def test_two_processes_putting_and_evicting_at_once_stay_consistent(tmp_path):
    directory = tmp_path / "cache"
    per_entry = 10_400
    bound = 8 * per_entry
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_put_many, args=(directory, 100 * w, 40, bound)) for w in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    cache = KernelCache(directory)
    assert cache.total_bytes() <= bound + 2 * per_entry  # each process may keep its own newest entry past the bound
    entries = list(cache.entries())
    assert 1 <= len(entries) <= 10
    for entry in entries:  # every survivor is whole, with the bytes its writer put
        i = int(entry.source_path.read_text().split()[-1])
        assert entry.cubin == random.Random(i).randbytes(PAYLOAD)
    assert not list(directory.rglob(".tmp-*"))
