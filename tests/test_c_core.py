"""Builds and runs the C core's own test programs (tests/c/) with AddressSanitizer and UBSan."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"), reason="needs a C compiler")


SANITIZE = ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
EXPR_SOURCES = ["expr_funcs.c", "expr_parse.c", "expr_emit.c", "expr_range.c"]
PLAN_SOURCES = ["util.c", *EXPR_SOURCES, "spec.c", "quant.c", "plan.c", "pack.c", "plan_sm90.c", "render.c", "ref.c"]


def build(tmp_path, sources, test, flags=SANITIZE):
    exe = tmp_path / test
    cmd = [CC, "-std=c11", "-Wall", "-Wextra", "-Werror", *flags, "-I", os.path.join(ROOT, "csrc")]
    cmd += [os.path.join(ROOT, "csrc", s) for s in sources] + [os.path.join(ROOT, "tests", "c", test + ".c")]
    cmd += ["-ldl", "-lpthread", "-lm", "-o", str(exe)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    return exe


def build_and_run(tmp_path, sources, test, *args, env=None):
    exe = build(tmp_path, sources, test)
    run_env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:protect_shadow_gap=0", **(env or {}))
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, env=run_env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def test_expression_parser_and_spec(tmp_path):
    out = build_and_run(tmp_path, ["util.c", *EXPR_SOURCES, "spec.c"], "test_expr")
    assert " 0 failed" in out


def test_nvrtc_and_driver_loaders(tmp_path):
    from fusedmlp import _env

    out = build_and_run(tmp_path, ["util.c", "nvrtc.c", "cuda.c"], "test_loaders", _env.nvrtc_search_path())
    assert "PASSED" in out


def test_plan_render_and_cpu_forward(tmp_path):
    out = build_and_run(tmp_path, PLAN_SOURCES, "test_plan", ROOT)
    assert " 0 failed" in out


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_plan_render_and_cpu_forward_under_valgrind(tmp_path):
    # The CPU path must be valgrind-clean: built without sanitizers (they and valgrind exclude each other), run with
    # definite and indirect leaks counted as errors. --quick shrinks the CPU-forward batches to keep this near 10 s.
    exe = build(tmp_path, PLAN_SOURCES, "test_plan", flags=["-O1", "-g"])
    cmd = ["valgrind", "--error-exitcode=1", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect",
           str(exe), ROOT, "--quick"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " 0 failed" in result.stdout
    assert "ERROR SUMMARY: 0 errors" in result.stderr
