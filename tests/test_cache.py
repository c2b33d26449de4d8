"""The kernel cache (fusedmlp._cache) and the settings it reads (fusedmlp._env): no GPU, no C extension."""

import errno
import hashlib
import json
import multiprocessing
import os
import pathlib
import random
import stat
import struct
import sys
import time
import warnings

import pytest

from fusedmlp import _cache, _env
from fusedmlp._cache import FORMAT_VERSION, MAGIC, CacheEntry, KernelCache
from conftest import set_env

KEY_ARGS = dict(
    source="extern \"C\" __global__ void fused_mlp() {}\n// options: tile_rows=128\n",
    options=("--gpu-architecture=sm_90a", "-default-device"),
    compiler_version=(13, 0),
    arch="sm_90a",
    package_version="0.1.0",
)
PREFIX_SIZE = struct.calcsize("<8sII")


def random_cubin(size=4096, seed=0):
    return random.Random(seed).randbytes(size)


def meta_for(args=KEY_ARGS):
    return {
        "arch": args["arch"],
        "options": list(args["options"]),
        "compiler_version": list(args["compiler_version"]),
        "package_version": args["package_version"],
    }


def make_key(**changes):
    return KernelCache.key(**dict(KEY_ARGS, **changes))


@pytest.fixture
def cache(tmp_path):
    return KernelCache(tmp_path / "cache")


@pytest.fixture
def stored(cache):
    """A cache holding one entry; returns (cache, key, cubin)."""
    key = make_key()
    cubin = random_cubin()
    cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    return cache, key, cubin


def temp_files(directory):
    return [path for path in pathlib.Path(directory).rglob(".tmp-*")]


# ------------------------------------------------------------------------------------------------ keys


def test_key_is_sha256_hex_and_deterministic():
    key = make_key()
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key)
    assert make_key() == key
    assert KernelCache("/nonexistent").key(**KEY_ARGS) == key


@pytest.mark.parametrize(
    "change",
    [
        {"source": KEY_ARGS["source"] + " "},
        {"options": KEY_ARGS["options"] + ("-lineinfo",)},
        {"options": tuple(reversed(KEY_ARGS["options"]))},
        {"compiler_version": (13, 1)},
        {"compiler_version": (12, 9)},
        {"arch": "sm_90"},
        {"arch": "sm_80"},
        {"package_version": "0.1.1"},
    ],
    ids=["source", "options-added", "options-order", "nvrtc-minor", "nvrtc-major", "arch-a", "arch", "package"],
)
def test_key_changes_with_every_input(change):
    assert make_key(**change) != make_key()


def test_key_framing_is_unambiguous():
    base = dict(compiler_version=(13, 0), arch="sm_90", package_version="0.1.0")
    assert KernelCache.key("ab", ["c"], **base) != KernelCache.key("a", ["bc"], **base)
    assert KernelCache.key("s", ["a", "b"], **base) != KernelCache.key("s", ["ab"], **base)
    assert KernelCache.key("s", [], (1, 30), "sm_90", "1") != KernelCache.key("s", [], (13, 0), "sm_90", "1")
    assert KernelCache.key("s", [], (13,), "sm_90", "0.1") != KernelCache.key("s", [], (13, 0), "sm_90", ".1")


@pytest.mark.parametrize("bad", ["", "../" + "a" * 61, "A" * 64, "a" * 63, "a" * 65])
def test_malformed_key_is_a_value_error(cache, bad):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache.get(bad)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache.put(bad, "src", b"cubin", {})


# ------------------------------------------------------------------------------------------------ get and put


def test_miss_then_put_then_hit_returns_the_same_bytes(cache):
    key = make_key()
    cubin = random_cubin(10_000, seed=1)
    assert cache.get(key) is None
    stored = cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    assert isinstance(stored, CacheEntry) and stored.cubin == cubin
    hit = cache.get(key)
    assert hit is not None
    assert hit.cubin == cubin
    assert hit.key == key
    assert hit.meta["arch"] == "sm_90a"
    assert hit.meta["options"] == list(KEY_ARGS["options"])
    assert hit.meta["compiler_version"] == [13, 0]
    assert hit.meta["package_version"] == "0.1.0"
    assert hit.meta["payload_length"] == len(cubin)
    assert hit.meta["payload_sha256"] == hashlib.sha256(cubin).hexdigest()
    assert abs(hit.meta["created"] - time.time()) < 60
    # A fresh object (another process, later) finds it on disk.
    assert KernelCache(cache.directory).get(key).cubin == cubin


def test_layout_is_sharded_with_the_source_beside_the_entry(stored):
    cache, key, _ = stored
    source_path, cubin_path = cache.paths(key)
    assert source_path == cache.directory / key[:2] / f"{key}.cu"
    assert cubin_path == cache.directory / key[:2] / f"{key}.cubin"
    assert source_path.read_text() == KEY_ARGS["source"]
    entry = cache.get(key)
    assert entry.path == cubin_path and entry.source_path == source_path
    assert cubin_path.read_bytes()[:8] == MAGIC
    assert temp_files(cache.directory) == []


def test_entry_file_format(stored):
    cache, key, cubin = stored
    data = cache.paths(key)[1].read_bytes()
    magic, version, header_length = struct.unpack_from("<8sII", data)
    assert (magic, version) == (b"FMLPCUBN", 1)
    header = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + header_length])
    assert header["key"] == key
    assert header["payload_length"] == len(cubin)
    assert data[PREFIX_SIZE + header_length :] == cubin


def test_files_and_folders_are_private(stored):
    cache, key, _ = stored
    source_path, cubin_path = cache.paths(key)
    assert stat.S_IMODE(os.stat(cache.directory).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(cubin_path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cubin_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(source_path).st_mode) == 0o600


def test_hit_touches_the_entry_mtime(stored):
    cache, key, _ = stored
    cubin_path = cache.paths(key)[1]
    os.utime(cubin_path, (1_000_000, 1_000_000))
    assert cache.get(key) is not None
    assert os.stat(cubin_path).st_mtime > time.time() - 60


def test_put_overwrites_with_new_bytes(stored):
    cache, key, _ = stored
    newer = random_cubin(300, seed=7)
    cache.put(key, "// v2\n", newer, meta_for())
    assert cache.get(key).cubin == newer
    assert cache.paths(key)[0].read_text() == "// v2\n"


def test_put_computes_bookkeeping_fields(cache):
    key = make_key()
    cubin = b"\x7fELF" + bytes(range(256))
    entry = cache.put(key, "src", cubin, {"key": "forged", "payload_length": 1, "arch": "sm_80"})
    assert entry.meta["key"] == key and entry.meta["payload_length"] == len(cubin)
    assert cache.get(key).meta["arch"] == "sm_80"


def test_default_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CACHE_DIR", str(tmp_path / "envcache"))
    assert KernelCache().directory == tmp_path / "envcache"


# ------------------------------------------------------------------------------------------------ bad entries are misses


def corrupt_then_repair(cache, key, cubin, damage):
    """Damages the entry file with damage(bytes) -> bytes, checks get misses, then that a put repairs it."""
    cubin_path = cache.paths(key)[1]
    cubin_path.write_bytes(damage(cubin_path.read_bytes()))
    assert cache.get(key) is None
    assert KernelCache(cache.directory).get(key) is None
    cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    assert cache.get(key).cubin == cubin


def flip(data, offset, bit=0):
    return data[:offset] + bytes([data[offset] ^ (1 << bit)]) + data[offset + 1 :]


@pytest.mark.parametrize("length", [0, 4, PREFIX_SIZE - 1, PREFIX_SIZE, PREFIX_SIZE + 10])
def test_entry_truncated_in_prefix_or_header_is_a_miss(stored, length):
    cache, key, cubin = stored
    corrupt_then_repair(cache, key, cubin, lambda data: data[:length])


def test_entry_truncated_in_payload_is_a_miss(stored):
    cache, key, cubin = stored
    corrupt_then_repair(cache, key, cubin, lambda data: data[:-1])


def test_entry_with_bytes_appended_is_a_miss(stored):
    cache, key, cubin = stored
    corrupt_then_repair(cache, key, cubin, lambda data: data + b"\0")


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_bit_flip_in_payload_is_a_miss(stored, where):
    cache, key, cubin = stored
    header_length = struct.unpack_from("<8sII", cache.paths(key)[1].read_bytes())[2]
    offset = PREFIX_SIZE + header_length + min(int(where * len(cubin)), len(cubin) - 1)
    corrupt_then_repair(cache, key, cubin, lambda data: flip(data, offset, bit=5))


def test_bit_flip_anywhere_in_prefix_or_header_is_a_miss(stored):
    cache, key, cubin = stored
    cubin_path = cache.paths(key)[1]
    good = cubin_path.read_bytes()
    header_end = PREFIX_SIZE + struct.unpack_from("<8sII", good)[2]
    rng = random.Random(3)
    for offset in range(header_end):
        cubin_path.write_bytes(flip(good, offset, bit=rng.randrange(8)))
        assert cache.get(key) is None, f"flip at byte {offset} went unnoticed"
    cubin_path.write_bytes(good)
    assert cache.get(key).cubin == cubin


def test_wrong_magic_is_a_miss(stored):
    cache, key, cubin = stored
    corrupt_then_repair(cache, key, cubin, lambda data: b"CUPYCACH" + data[8:])


def test_wrong_version_is_a_miss(stored):
    cache, key, cubin = stored
    corrupt_then_repair(cache, key, cubin, lambda data: data[:8] + struct.pack("<I", FORMAT_VERSION + 1) + data[12:])


def test_entry_of_another_key_is_a_miss(stored):
    cache, key, cubin = stored
    other = make_key(arch="sm_80")
    other_path = cache.paths(other)[1]
    other_path.parent.mkdir(mode=0o700, exist_ok=True)
    other_path.write_bytes(cache.paths(key)[1].read_bytes())
    os.chmod(other_path, 0o600)
    assert cache.get(other) is None
    assert cache.get(key).cubin == cubin


def test_bad_entry_miss_is_logged_at_debug(stored, caplog):
    cache, key, _ = stored
    cache.paths(key)[1].write_bytes(b"garbage")
    with caplog.at_level("DEBUG", logger="fusedmlp"):
        assert cache.get(key) is None
    assert any("truncated" in record.getMessage() for record in caplog.records)


# ------------------------------------------------------------------------------------------------ untrusted entries


def test_group_writable_entry_is_refused_with_one_warning(stored):
    cache, key, cubin = stored
    cubin_path = cache.paths(key)[1]
    os.chmod(cubin_path, 0o664)
    with pytest.warns(RuntimeWarning, match="writable by group or others") as record:
        assert cache.get(key) is None
    assert len(record) == 1 and str(cubin_path) in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(key) is None  # refused again, silently
    cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    assert stat.S_IMODE(os.stat(cubin_path).st_mode) == 0o600
    assert cache.get(key).cubin == cubin


def test_world_writable_shard_folder_is_refused_and_put_tightens_it(stored):
    cache, key, cubin = stored
    shard = cache.paths(key)[1].parent
    os.chmod(shard, 0o777)
    with pytest.warns(RuntimeWarning, match="shard folder"):
        assert cache.get(key) is None
    cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    assert stat.S_IMODE(os.stat(shard).st_mode) == 0o700
    assert cache.get(key).cubin == cubin


def test_symlinked_entry_is_refused(stored, tmp_path):
    cache, key, cubin = stored
    cubin_path = cache.paths(key)[1]
    elsewhere = tmp_path / "planted.cubin"
    elsewhere.write_bytes(cubin_path.read_bytes())
    cubin_path.unlink()
    cubin_path.symlink_to(elsewhere)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert cache.get(key) is None


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")


@needs_root
def test_entry_owned_by_another_user_is_refused(stored):
    cache, key, _ = stored
    cubin_path = cache.paths(key)[1]
    os.chown(cubin_path, 12345, 12345)
    with pytest.warns(RuntimeWarning, match="owned by uid 12345"):
        assert cache.get(key) is None
    assert list(cache.entries()) == []


@needs_root
def test_shard_folder_owned_by_another_user_is_refused_and_not_written(stored):
    cache, key, cubin = stored
    shard = cache.paths(key)[1].parent
    os.chown(shard, 12345, 12345)
    with pytest.warns(RuntimeWarning, match="owned by uid 12345"):
        assert cache.get(key) is None
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        entry = cache.put(key, KEY_ARGS["source"], cubin, meta_for())
    assert entry.path is None
    assert cache.get(key).cubin == cubin  # from memory, not from the planted folder


# ------------------------------------------------------------------------------------------------ unwritable folder


def assert_memory_fallback(cache, expected_in_message):
    key_a, key_b = make_key(), make_key(arch="sm_80")
    cubin_a, cubin_b = random_cubin(500, seed=11), random_cubin(700, seed=12)
    with pytest.warns(RuntimeWarning) as record:
        entry_a = cache.put(key_a, "a", cubin_a, meta_for())
        entry_b = cache.put(key_b, "b", cubin_b, meta_for())
    assert len(record) == 1
    message = str(record[0].message)
    assert str(cache.directory) in message and expected_in_message in message
    assert "will not persist" in message and "results still work" in message
    assert entry_a.path is None and entry_b.source_path is None
    assert cache.get(key_a).cubin == cubin_a
    assert cache.get(key_b).cubin == cubin_b
    assert sorted(entry.key for entry in cache.entries()) == sorted([key_a, key_b])
    return key_a


def test_cache_under_a_regular_file_falls_back_to_memory(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    cache = KernelCache(tmp_path / "afile" / "cache")
    key = assert_memory_fallback(cache, "Not a directory")
    assert KernelCache(cache.directory).get(key) is None  # nothing persisted
    with cache.compile_lock(key):  # no lock file possible: runs unlocked
        pass


def test_permission_denied_falls_back_to_memory(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(_cache.tempfile, "mkstemp", refuse)
    cache = KernelCache(tmp_path / "cache")
    assert_memory_fallback(cache, "Permission denied")


def test_disk_full_falls_back_to_memory_and_leaves_no_temp_file(tmp_path, monkeypatch):
    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_cache.os, "replace", full)
    cache = KernelCache(tmp_path / "cache")
    assert_memory_fallback(cache, "No space left on device")
    assert temp_files(cache.directory) == []
    assert not any(path.suffix == ".cubin" for path in cache.directory.rglob("*"))


def test_failed_write_midway_leaves_no_temp_file(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_cache.os, "fsync", failing_fsync)
    cache = KernelCache(tmp_path / "cache")
    with pytest.warns(RuntimeWarning, match="Input/output error"):
        cache.put(make_key(), "src", b"bytes", {})
    assert temp_files(cache.directory) == []
    monkeypatch.setattr(_cache.os, "fsync", real_fsync)
    cache.put(make_key(), "src", b"bytes", {})  # the disk is back: the next put persists
    assert KernelCache(cache.directory).get(make_key()).cubin == b"bytes"


def test_read_only_folder_falls_back_to_memory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    os.chmod(directory, 0o500)
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (the tests above simulate it instead)")
        assert_memory_fallback(KernelCache(directory / "cache"), "Permission denied")
    finally:
        os.chmod(directory, 0o700)


# ------------------------------------------------------------------------------------------------ listing and clearing


def test_entries_total_bytes_and_clear(cache):
    keys = [make_key(arch=f"sm_{n}") for n in (75, 80, 86, 90)]
    for n, key in enumerate(keys):
        cache.put(key, f"// kernel {n}\n", random_cubin(1000 + n, seed=n), meta_for())
    listed = list(cache.entries())
    assert [entry.key for entry in listed] == sorted(keys)
    assert {entry.key: len(entry.cubin) for entry in listed} == {key: 1000 + n for n, key in enumerate(keys)}
    on_disk = sum(path.stat().st_size for path in cache.directory.rglob("*") if path.suffix in (".cu", ".cubin"))
    assert cache.total_bytes() == on_disk
    assert on_disk > 4 * 1000
    (cache.directory / "README").write_text("not ours")
    assert cache.clear() == 4
    assert list(cache.entries()) == []
    assert cache.total_bytes() == 0
    assert all(cache.get(key) is None for key in keys)
    assert [path.name for path in cache.directory.iterdir()] == ["README"]


def test_entries_skip_corrupt_files_and_do_not_touch(cache):
    good, bad = make_key(), make_key(arch="sm_80")
    cache.put(good, "g", b"good-cubin", meta_for())
    cache.put(bad, "b", b"bad-cubin", meta_for())
    cache.paths(bad)[1].write_bytes(b"FMLPCUBN")
    os.utime(cache.paths(good)[1], (1_000_000, 1_000_000))
    assert [entry.key for entry in cache.entries()] == [good]
    assert os.stat(cache.paths(good)[1]).st_mtime == 1_000_000


def test_empty_or_missing_cache_lists_nothing(tmp_path):
    cache = KernelCache(tmp_path / "never-created")
    assert list(cache.entries()) == [] and cache.total_bytes() == 0 and cache.clear() == 0


# ------------------------------------------------------------------------------------------------ several processes

WRITERS, READERS, ROUNDS = 8, 4, 10


def _writer(directory, key, source, cubin, barrier, results):
    cache = KernelCache(directory)
    barrier.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(ROUNDS):
            entry = cache.put(key, source, cubin, {"arch": "sm_90a"})
    results.put(("writer", entry.path is not None and not caught))


def _reader(directory, key, cubin, barrier, results):
    cache = KernelCache(directory)
    barrier.wait()
    hits = wrong = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        entry = cache.get(key)
        if entry is not None:
            hits += 1
            wrong += entry.cubin != cubin
    results.put(("reader", (hits, wrong)))


def test_concurrent_puts_of_one_key_leave_one_valid_entry(tmp_path):
    directory = tmp_path / "shared-cache"
    key = make_key()
    cubin = random_cubin(512 * 1024, seed=99)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS + READERS)
    results = context.Queue()
    processes = [
        context.Process(target=_writer, args=(str(directory), key, KEY_ARGS["source"], cubin, barrier, results))
        for _ in range(WRITERS)
    ] + [context.Process(target=_reader, args=(str(directory), key, cubin, barrier, results)) for _ in range(READERS)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    writers = [ok for kind, ok in outcomes if kind == "writer"]
    readers = [counts for kind, counts in outcomes if kind == "reader"]
    assert writers == [True] * WRITERS  # every put persisted, none fell back to memory
    assert len(readers) == READERS
    assert sum(wrong for _hits, wrong in readers) == 0  # a reader never saw a half-written or mixed entry
    assert sum(hits for hits, _wrong in readers) > 0
    listed = list(KernelCache(directory).entries())
    assert [(entry.key, entry.cubin == cubin) for entry in listed] == [(key, True)]
    assert temp_files(directory) == []
    assert sorted(path.name for path in (directory / key[:2]).iterdir()) == [f"{key}.cu", f"{key}.cubin"]


def _lock_holder(directory, key, marker, held, release_after):
    cache = KernelCache(directory)
    with cache.compile_lock(key):
        with open(marker, "a") as stream:
            stream.write("first:start\n")
        held.set()
        time.sleep(release_after)
        with open(marker, "a") as stream:
            stream.write("first:end\n")


def _lock_waiter(directory, key, marker, held, results):
    cache = KernelCache(directory)
    held.wait(60)
    started = time.monotonic()
    with cache.compile_lock(key):
        waited = time.monotonic() - started
        with open(marker, "a") as stream:
            stream.write("second\n")
    results.put(waited)


def test_compile_lock_serialises_two_processes(tmp_path):
    directory, marker, key = str(tmp_path / "cache"), str(tmp_path / "marker"), make_key()
    context = multiprocessing.get_context("spawn")
    held, results = context.Event(), context.Queue()
    holder = context.Process(target=_lock_holder, args=(directory, key, marker, held, 1.5))
    waiter = context.Process(target=_lock_waiter, args=(directory, key, marker, held, results))
    holder.start()
    waiter.start()
    waited = results.get(timeout=120)
    holder.join(60)
    waiter.join(60)
    assert (holder.exitcode, waiter.exitcode) == (0, 0)
    assert pathlib.Path(marker).read_text().splitlines() == ["first:start", "first:end", "second"]
    assert waited > 0.5
    assert (pathlib.Path(directory) / key[:2] / f"{key}.lock").exists()


def test_compile_lock_does_not_block_other_keys_or_the_same_process_later(cache):
    key_a, key_b = make_key(), make_key(arch="sm_80")
    started = time.monotonic()
    with cache.compile_lock(key_a):
        with cache.compile_lock(key_b):
            pass
    with cache.compile_lock(key_a):
        pass
    assert time.monotonic() - started < 5


# ------------------------------------------------------------------------------------------------ settings (_env)


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDMLP_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _env.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("FUSEDMLP_CACHE_DIR")
    assert _env.cache_dir() == tmp_path / "xdg" / "fusedmlp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _env.cache_dir() == tmp_path / "home" / ".cache" / "fusedmlp"


@pytest.mark.parametrize(
    "value, expected",
    [(None, 2 * 1024**3), ("", 2 * 1024**3), ("0", 0), ("4096", 4096), ("512M", 512 * 1024**2), ("3GiB", 3 * 1024**3)],
)
def test_cache_max_bytes(monkeypatch, value, expected):
    set_env(monkeypatch, "FUSEDMLP_CACHE_MAX_BYTES", value)
    assert _env.cache_max_bytes() == expected


@pytest.mark.parametrize("value", ["-1", "lots", "1.5G", "12Q"])
def test_cache_max_bytes_rejects_bad_values_naming_them(monkeypatch, value):
    monkeypatch.setenv("FUSEDMLP_CACHE_MAX_BYTES", value)
    with pytest.raises(ValueError, match=f"FUSEDMLP_CACHE_MAX_BYTES='{value}'"):
        _env.cache_max_bytes()


@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("on", True), ("0", False), ("FALSE", False), ("off", False)]
)
def test_autotune_enabled(monkeypatch, value, expected):
    set_env(monkeypatch, "FUSEDMLP_AUTOTUNE", value)
    assert _env.autotune_enabled() is expected


def test_autotune_rejects_bad_value(monkeypatch):
    monkeypatch.setenv("FUSEDMLP_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="FUSEDMLP_AUTOTUNE='maybe'"):
        _env.autotune_enabled()


def test_nvrtc_search_path_lists_override_then_wheel_folders(tmp_path, monkeypatch):
    site_a, site_b = tmp_path / "site-a", tmp_path / "site-b"
    for folder in (site_a / "nvidia" / "cu12" / "lib", site_b / "nvidia" / "cu13" / "lib", site_b / "nvidia" / "x"):
        folder.mkdir(parents=True)
    (site_a / "nvidia" / "cuda_nvrtc").mkdir()  # no lib/ inside: not listed
    monkeypatch.setattr(sys, "path", ["", str(site_a), str(site_b), str(site_b), str(tmp_path / "missing")])
    monkeypatch.setenv("FUSEDMLP_NVRTC", "/opt/nvrtc/libnvrtc.so.13")
    assert _env.nvrtc_search_path().split(":") == [
        "/opt/nvrtc/libnvrtc.so.13",
        str(site_b / "nvidia" / "cu13" / "lib"),
        str(site_a / "nvidia" / "cu12" / "lib"),
    ]
    monkeypatch.delenv("FUSEDMLP_NVRTC")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing")])
    assert _env.nvrtc_search_path() == ""


def test_a_template_is_expanded_once_and_again_after_one_of_its_files_changes(tmp_path):
    from fusedmlp import _api

    (tmp_path / "main.cu").write_text('// main\n#include "part.cuh"\nint after;\n')
    part = tmp_path / "part.cuh"
    part.write_text("int one;\n")
    first = _api._template("main.cu", tmp_path)
    assert first == "// main\nint one;\nint after;\n"
    assert _api._template("main.cu", tmp_path) is first  # kept, not read again
    part.write_text("int two;\n")
    stat = part.stat()
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # (a later time, whatever the clock's grain)
    assert _api._template("main.cu", tmp_path) == "// main\nint two;\nint after;\n"
