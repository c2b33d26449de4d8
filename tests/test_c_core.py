"""Builds and runs the C core's own test programs (tests/c/) with AddressSanitizer and UBSan."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"), reason="needs a C compiler")


def build_and_run(tmp_path, sources, test, *args, env=None):
    exe = tmp_path / test
    cmd = [CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-I", os.path.join(ROOT, "csrc")]
    cmd += [os.path.join(ROOT, "csrc", s) for s in sources] + [os.path.join(ROOT, "tests", "c", test + ".c")]
    cmd += ["-ldl", "-lpthread", "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    run_env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:protect_shadow_gap=0", **(env or {}))
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, env=run_env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_expression_parser_and_spec(tmp_path):
    out = build_and_run(tmp_path, ["util.c", "expr.c", "spec.c"], "test_expr")
    assert " 0 failed" in out


def test_nvrtc_and_driver_loaders(tmp_path):
    from fusedmlp import _env

    out = build_and_run(tmp_path, ["util.c", "nvrtc.c", "cuda.c"], "test_loaders", _env.nvrtc_search_path())
    assert "PASSED" in out
