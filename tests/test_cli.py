"""`python -m fusedmlp cache list|info|clear`, run as a subprocess on a cache filled by FusedMLP.compile (NVRTC, no GPU)."""

import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import fusedmlp
from fusedmlp._cache import KernelCache


def run_cli(*args, cache_dir=None, env=None):
    environ = dict(os.environ)
    environ.pop("FUSEDMLP_CACHE_MAX_BYTES", None)
    if cache_dir is not None:
        environ["FUSEDMLP_CACHE_DIR"] = str(cache_dir)
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "fusedmlp", *args], capture_output=True, text=True, env=environ,
                          timeout=120)


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return fusedmlp._api._nvrtc_info()
    except fusedmlp.LibraryNotFoundError as e:
        pytest.skip(f"NVRTC is not installed: {e}")


@pytest.fixture(scope="module")
def filled(tmp_path_factory, nvrtc):
    """A cache holding two kernels (one sm_80 float32, one sm_90 float16); returns (folder, {arch: entry path})."""
    folder = tmp_path_factory.mktemp("filled") / "cache"
    rng = np.random.default_rng(7)
    weights = [rng.uniform(-0.3, 0.3, (16, 8)).astype(np.float32), rng.uniform(-0.25, 0.25, (4, 16)).astype(np.float32)]
    mlp = fusedmlp.FusedMLP(weights, None, activation="tanh", device="cpu", cache_dir=folder)
    paths = {"sm_80": mlp.compile("sm_80"), "sm_90": mlp.compile("sm_90", io_dtype="float16")}
    return folder, paths


@pytest.fixture
def cache_dir(filled, tmp_path):
    """A private copy of the filled cache, so each test may change it."""
    folder, paths = filled
    copy = tmp_path / "cache"
    shutil.copytree(folder, copy)
    return copy, {arch: copy / os.path.relpath(path, folder) for arch, path in paths.items()}


def table(stdout):
    """The rows of `cache list` as dicts keyed by the header's column names."""
    lines = stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)?", lines[0])]  # "LAST USE" is one column
    names = [lines[0][a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    return [{name: line[a:b].strip() for name, a, b in zip(names, starts, starts[1:] + [None])} for line in lines[1:]]


def test_list_shows_one_row_per_entry_with_its_details(cache_dir, nvrtc):
    folder, paths = cache_dir
    result = run_cli("cache", "list", cache_dir=folder)
    assert result.returncode == 0, result.stderr
    rows = sorted(table(result.stdout), key=lambda row: row["ARCH"])
    assert [row["ARCH"] for row in rows] == ["sm_80", "sm_90a"]  # sm_90 builds the wgmma kernel, for sm_90a
    for row, arch in zip(rows, ("sm_80", "sm_90")):
        entry = paths[arch]
        assert entry.name.startswith(row["KEY"]) and len(row["KEY"]) == 12
        assert row["NVRTC"] == f"{nvrtc[1][0]}.{nvrtc[1][1]}"
        assert row["SOURCE"] == str(entry.with_suffix(".cu"))
        size = entry.stat().st_size + entry.with_suffix(".cu").stat().st_size
        assert row["SIZE"] == f"{size / 1024:.1f} KiB"
        assert re.fullmatch(r"\d+s", row["AGE"]) and re.fullmatch(r"\d+s ago", row["LAST USE"])


def test_list_shows_last_use_from_the_entry_mtime(cache_dir):
    folder, paths = cache_dir
    two_hours_ago = time.time() - 2 * 3600 - 30
    os.utime(paths["sm_80"], (two_hours_ago, two_hours_ago))
    rows = {row["ARCH"]: row for row in table(run_cli("cache", "list", cache_dir=folder).stdout)}
    assert rows["sm_80"]["LAST USE"] == "2h ago"
    assert re.fullmatch(r"\d+s ago", rows["sm_90a"]["LAST USE"])


def test_list_skips_a_corrupt_entry_and_does_not_touch_the_rest(cache_dir):
    folder, paths = cache_dir
    data = bytearray(paths["sm_90"].read_bytes())
    data[-1] ^= 0xFF
    paths["sm_90"].write_bytes(bytes(data))
    before = paths["sm_80"].stat().st_mtime_ns
    result = run_cli("cache", "list", cache_dir=folder)
    assert [row["ARCH"] for row in table(result.stdout)] == ["sm_80"]
    assert paths["sm_80"].stat().st_mtime_ns == before


def test_info_describes_the_cache_nvrtc_and_gpu(cache_dir, nvrtc):
    folder, _ = cache_dir
    result = run_cli("cache", "info", cache_dir=folder, env={"FUSEDMLP_CACHE_MAX_BYTES": "512M"})
    assert result.returncode == 0, result.stderr
    info = dict(line.split(":", 1) for line in result.stdout.splitlines() if not line.startswith(" "))
    info = {name: value.strip() for name, value in info.items()}
    assert info["directory"] == str(folder)
    assert info["entries"] == "2"
    assert info["size"].endswith(f"({KernelCache(folder).total_bytes()} bytes)")
    assert info["bound"] == "512.0 MiB (536870912 bytes; FUSEDMLP_CACHE_MAX_BYTES)"
    assert info["writable"] == "yes"
    assert info["nvrtc"] == f"{nvrtc[1][0]}.{nvrtc[1][1]} at {nvrtc[0]}"
    if fusedmlp._api._gpu_available():
        assert re.match(r"cuda:0 .+ \(sm_\d+, \d+ SMs\)", info["gpu"])
    else:
        assert info["gpu"].startswith("none")


def test_info_reports_a_malformed_bound_without_failing(tmp_path):
    result = run_cli("cache", "info", cache_dir=tmp_path / "new", env={"FUSEDMLP_CACHE_MAX_BYTES": "lots"})
    assert result.returncode == 0, result.stderr
    assert "bound:      invalid: FUSEDMLP_CACHE_MAX_BYTES='lots' is not a size" in result.stdout
    assert f"directory:  {tmp_path / 'new'} (not created yet)" in result.stdout
    assert "entries:    0" in result.stdout and "writable:   yes" in result.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_info_says_when_the_folder_is_not_writable(cache_dir):
    folder, _ = cache_dir
    folder.chmod(0o500)
    try:
        result = run_cli("cache", "info", cache_dir=folder)
    finally:
        folder.chmod(0o700)
    assert "writable:   no (kernels would be kept in memory only)" in result.stdout


def test_clear_removes_every_entry_and_says_how_many(cache_dir):
    folder, paths = cache_dir
    result = run_cli("cache", "clear", cache_dir=folder)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"removed 2 kernel cache entries from {folder}"
    assert not any(path.exists() or path.with_suffix(".cu").exists() for path in paths.values())
    assert run_cli("cache", "list", cache_dir=folder).stdout.strip() == f"no kernel cache entries in {folder}"
    assert run_cli("cache", "clear", cache_dir=folder).stdout.strip() == f"removed 0 kernel cache entries from {folder}"


def test_cache_dir_option_overrides_the_environment(cache_dir, tmp_path):
    folder, _ = cache_dir
    result = run_cli("cache", "--cache-dir", str(folder), "list", cache_dir=tmp_path / "elsewhere")
    assert len(table(result.stdout)) == 2


def test_list_on_a_missing_folder_says_so(tmp_path):
    result = run_cli("cache", "list", cache_dir=tmp_path / "nothing")
    assert result.returncode == 0
    assert result.stdout.strip() == f"no kernel cache entries in {tmp_path / 'nothing'}"
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize("args", [(), ("cache",), ("cache", "purge"), ("bogus",)])
def test_incomplete_or_unknown_commands_exit_2_with_usage(args, tmp_path):
    result = run_cli(*args, cache_dir=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m fusedmlp")


def test_info_says_no_for_a_folder_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = run_cli("cache", "info", cache_dir=tmp_path / "file" / "cache")
    assert result.returncode == 0, result.stderr
    assert "writable:   no (kernels would be kept in memory only)" in result.stdout
