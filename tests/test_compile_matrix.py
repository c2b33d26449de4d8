"""Ahead-of-time compiles, no GPU needed: every supported arch x a matrix of networks through NVRTC and the cache.

mlp.compile(arch, dtype) plans for the arch's published shared-memory limits, renders the kernel, compiles it with
NVRTC (from the pip wheel) and stores it in the cache; these tests check what lands on disk: the entry, the source
beside it, and that the CUBIN is an ELF for the right GPU.
"""

import concurrent.futures
import multiprocessing
import os
import pathlib
import re
import struct
import time
import warnings

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from fusedmlp._cache import MAGIC, KernelCache
from conftest import rendered_repeats, torch_init

ARCHS = [75, 80, 86, 89, 90]

# Every built-in (min, max, pow and the comparisons need a second argument, where a third) and user expressions,
# spread over the matrix below.
SEVERAL_ARGUMENTS = ("min", "max", "pow", "gt", "ge", "lt", "le", "eq", "where")
ACTIVATIONS = [n for n in _core.expr_functions() if n not in SEVERAL_ARGUMENTS] + [
    "min(x, 0.5)", "max(x, 0.1*x)", "pow(x, 3)", "pow(abs(x), 2.5)", "x * tanh(softplus(x))", "sin(30*x)",
    "x * gt(x, 0.5) + ge(x, 1) - lt(x, -1) * le(x, -2) + eq(x, 0)", "where(gt(x * 2, 10), x, softplus(x * 2) / 2)",
    "leaky_relu(x, 0.2)", "softplus(x, 2, 10)", "elu(x, 0.5)", "hardtanh(x, -2, 2)", "x^-2 + 1", "2*cos(x) - 1",
    "x / (1 + abs(x)) - pi + e", "-x^2", "1e-3 * exp(x) + .5",
]

# (widths, bias): widths 1..256, multiples of 16 and not, depths 1..8; 2-256-256-256-3 streams its weights on every
# arch but sm_90 (its fp16 weights alone are 291 KB; sm_90 splits them over a cluster of CTAs), 1-1 and 3-17-5 are
# resident everywhere.
NETWORKS = [
    ([1, 1], True),
    ([3, 17, 5], True),
    ([32, 64, 64, 64, 64, 16], False),
    ([2, 256, 256, 256, 3], True),
    ([7, 100, 33, 250, 9], [True, False, True, True]),
    ([5, 128, 128, 128, 128, 128, 128, 128, 2], True),
    ([256, 256], False),
    ([9, 48, 1, 48, 9, 31, 200, 15, 4], True),
    ([16] * 9, [i % 2 == 0 for i in range(8)]),
    ([129, 255, 130, 3], True),
    ([4, 96, 96, 96, 96, 96, 96, 1], False),
    ([64, 80, 112, 144, 176, 208, 240], True),
]
ALWAYS_STREAMED = {(2, 256, 256, 256, 3)}
ALWAYS_RESIDENT = {(1, 1), (3, 17, 5)}


def network_activations():
    """One activation list per network, taking ACTIVATIONS in turn so that the matrix covers every one."""
    acts, i = [], 0
    for widths, _ in NETWORKS:
        layers = len(widths) - 1
        acts.append([ACTIVATIONS[(i + k) % len(ACTIVATIONS)] for k in range(layers)])
        i += layers
    return acts


def cubin_of(path):
    """The CUBIN bytes of an entry file (prefix, JSON header, payload; fusedmlp._cache documents the layout)."""
    data = pathlib.Path(path).read_bytes()
    magic, _version, header_length = struct.unpack_from("<8sII", data)
    assert magic == MAGIC
    return data[16 + header_length:]


def check_cubin(cubin, arch):
    assert cubin[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", cubin, 18)[0] == 190  # e_machine: EM_CUDA
    # e_flags: bits 8..15 hold the SM version in the CUBINs NVRTC 12 and 13 write (cuobjdump's "arch = sm_XX").
    assert (struct.unpack_from("<I", cubin, 48)[0] >> 8) & 0xFF == arch


def temp_files(directory):
    return sorted(p.name for p in pathlib.Path(directory).rglob("*") if p.name.startswith(".tmp-"))


def test_the_matrix_covers_every_activation():
    used = {a for acts in network_activations() for a in acts}
    assert used == set(ACTIVATIONS)
    assert set(_core.expr_functions()) - set(SEVERAL_ARGUMENTS) <= used
    depths = {len(w) - 1 for w, _ in NETWORKS}
    assert depths == set(range(1, 9))
    widths = {w for ws, _ in NETWORKS for w in ws}
    assert 1 in widths and 256 in widths and any(w % 16 for w in widths) and max(widths) == 256


def test_every_arch_compiles_every_network(tmp_path):
    cache_dir = tmp_path / "cache"
    tasks = []
    for a, arch in enumerate(ARCHS):
        for n, ((widths, bias), acts) in enumerate(zip(NETWORKS, network_activations())):
            dtype = "float16" if (a + n) % 2 else "float32"  # each network sees both dtypes across the archs
            tasks.append((arch, widths, bias, acts, dtype, n))

    def compile_one(task):
        arch, widths, bias, acts, dtype, n = task
        ws, bs = torch_init(np.random.default_rng(n), widths, bias)
        mlp = fusedmlp.FusedMLP(ws, bs, activation=acts, device="cpu", cache_dir=cache_dir)
        path = mlp.compile(f"sm_{arch}", dtype)
        return mlp, path

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:  # NVRTC releases the GIL
        results = list(pool.map(compile_one, tasks))
    print(f"\ncompiled {len(tasks)} kernels in {time.perf_counter() - start:.1f} s")

    for (arch, widths, bias, acts, dtype, n), (mlp, path) in zip(tasks, results):
        label = f"{'-'.join(map(str, widths))} sm_{arch} {dtype}"
        assert path is not None and os.path.isfile(path), label
        assert path.endswith(".cubin") and mlp.cache_path == path
        source = pathlib.Path(path[: -len(".cubin")] + ".cu").read_text()
        assert source == mlp.source, label
        assert "fusedmlp_forward" in source
        resident = mlp._net.plan(arch, 0, 0, dtype, dtype).info["resident"]
        if tuple(widths) in ALWAYS_STREAMED and arch != 90:  # sm_90 holds them on a cluster of CTAs
            assert not resident, label
        if tuple(widths) in ALWAYS_RESIDENT:
            assert resident, label
        plan_line = [line for line in source.splitlines() if line.startswith("// Plan: ")]
        assert len(plan_line) == 1, label
        wgmma = mlp._net.plan(arch, 0, 0, dtype, dtype).info["wgmma"]
        assert wgmma == (arch == 90 and ("wgmma.mma_async" in source)), label  # sm_90: the warpgroup kernel
        target = f"sm_{arch}a; float16 wgmma" if wgmma else f"sm_{arch}; float16 mma.sync"
        assert plan_line[0].startswith(f"// Plan: widths {'-'.join(map(str, widths))}; {target}; "), plan_line
        assert ("resident weights" if resident else "streamed weights") in plan_line[0], plan_line
        assert plan_line[0].endswith(f"x {dtype}, y {dtype}"), plan_line
        bounds = mlp._net.preact_bounds()
        for layer, text in enumerate(acts):
            emitted = _core.parse_expr(text)[1]
            assert f"template <> struct Layer<{layer}> " in source, (label, layer)
            for form, limit in (("d", 400), ("b", 1000), (None, None)):
                rendered = emitted.replace("fm_sin(", f"fm_sin_{form}(").replace("fm_cos(", f"fm_cos_{form}(")
                if form is None:
                    assert f"float act(float x, int) {{ return {emitted}; }}" in source, (label, text)
                elif rendered != emitted and f"float act(float x, int) {{ return {rendered}; }}" in source:
                    # only where the weights keep every sin/cos argument under the form's limit (render.c)
                    assert _core.expr_range(text, -bounds[layer], bounds[layer])[2] < limit, (label, text, bounds)
                    break
        assert f"template <> struct Layer<{len(acts)}> " not in source
        check_cubin(cubin_of(path), arch)
    # One entry per (network, arch, dtype): no two collided, none went missing.
    entries = list(KernelCache(cache_dir).entries())
    assert len(entries) == len(tasks) == len({path for _, path in results})
    assert all(re.fullmatch(r"sm_\d+a?", entry.meta["arch"]) for entry in entries)
    assert "sm_90a" in {entry.meta["arch"] for entry in entries}
    assert temp_files(cache_dir) == []


def test_second_compile_is_a_cache_hit(tmp_path, rng, monkeypatch):
    ws, bs = torch_init(rng, [6, 80, 80, 2], True)
    first = fusedmlp.FusedMLP(ws, bs, activation="silu", device="cpu", cache_dir=tmp_path)
    fusedmlp._api._nvrtc_info()  # load NVRTC first, so the cold time below is the compile alone
    t0 = time.perf_counter()
    path = first.compile("sm_86")
    cold = time.perf_counter() - t0

    def no_compile(*args):
        raise AssertionError("a cache hit must not run NVRTC")

    monkeypatch.setattr(_core, "nvrtc_compile", no_compile)
    # Weights are uploaded at load time, not baked into the source: other weights of the same shapes hit too.
    other_ws, other_bs = torch_init(rng, [6, 80, 80, 2], True)
    second = fusedmlp.FusedMLP(other_ws, other_bs, activation="silu", device="cpu", cache_dir=tmp_path)
    t0 = time.perf_counter()
    again = second.compile("sm_86")
    warm = time.perf_counter() - t0
    print(f"\ncold compile {cold * 1e3:.0f} ms, cache hit {warm * 1e3:.1f} ms")
    assert again == path and os.path.isfile(path)
    assert first.compile("sm_86") == path  # the same object again
    assert warm < max(cold / 3, 0.02)
    assert len(list(KernelCache(tmp_path).entries())) == 1
    # A different arch or dtype is a different kernel: a miss, so here it reaches the refusing compiler.
    with pytest.raises(AssertionError, match="must not run NVRTC"):
        second.compile("sm_86", "float16")


def test_source_before_any_compile_is_rendered_for_sm_90(rng):
    ws, bs = torch_init(rng, [3, 20, 2], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", device="cpu")
    source = mlp.source
    assert "template <> struct Layer<0> " in source and "template <> struct Layer<1> " in source
    assert "// Plan: widths 3-20-2; sm_90a; float16 wgmma; " in source
    assert mlp.cache_path is None  # rendering is not compiling


def test_source_marks_stretches_of_layers_with_the_same_code(rng):
    """REPEAT (render.c): how many layers from each one on have its code, which the sm_90a template runs as one loop.
    Same widths, activation, bias and residual make a stretch; any difference ends it."""
    widths = [32, 64, 64, 64, 64, 64, 128, 128, 128, 128, 16]
    ws, bs = torch_init(rng, widths, True)
    bs[3] = None  # layer 3 (64 -> 64) has no bias: a stretch of its own
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["relu", "gelu", "gelu", "gelu", "gelu", "gelu", "gelu", "gelu",
                                                "tanh"], residual={6: "add", 7: "add", 8: "add"}, device="cpu")
    #  layer:                             0  1  2  3  4  5  6  7  8  9
    assert rendered_repeats(mlp.source) == [1, 2, 1, 1, 1, 1, 2, 1, 1, 1]
    res128 = fusedmlp.FusedMLP(*torch_init(rng, [64] + [128] * 5 + [64], True), activation="gelu",
                               residual={l: "add" for l in range(1, 5)}, device="cpu")
    assert rendered_repeats(res128.source) == [1, 4, 3, 2, 1, 1]
    same = fusedmlp.FusedMLP(*torch_init(rng, [48] * 5, False), activation="relu", output_activation="relu",
                             device="cpu")
    assert rendered_repeats(same.source) == [3, 2, 1, 1]  # the last layer's result is float32 output here
    post = fusedmlp.FusedMLP(*torch_init(rng, [16] * 4, True), activation="tanh",
                             residual={0: ("add", "relu"), 1: ("add", "none"), 2: ("add", "none")}, device="cpu")
    assert rendered_repeats(post.source) == [1, 1, 1]  # the post-op differs; the last layer's activation too


@pytest.mark.parametrize("text", ["x * tanh(softplus(x))", "sin(30*x)", "max(x, 0.1*x)", "leaky_relu(x, 0.2)",
                                  "softplus(x, 2, 10)", "hardtanh(x, -2, 2)", "x^-2 + 1", "1e-3 * exp(x) + .5"])
def test_source_holds_the_emitted_form_not_the_raw_text(tmp_path, rng, text):
    ws, bs = torch_init(rng, [4, 32, 3], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation=[text], output_activation="tanh", device="cpu", cache_dir=tmp_path)
    path = mlp.compile("sm_80")
    source = pathlib.Path(path[: -len(".cubin")] + ".cu").read_text()
    canonical, emitted = _core.parse_expr(text)
    assert emitted != text
    assert f"float act(float x, int) {{ return {emitted}; }}" in source
    code = "\n".join(line.split("//")[0] for line in source.splitlines())
    assert text not in code  # the user's spelling is parsed and re-emitted, never pasted into code
    assert f"activation {canonical}\n" in source  # the comment shows the canonical text
    assert text not in source or text == canonical


def test_rejected_expression_leaves_nothing_to_compile(tmp_path, rng):
    ws, bs = torch_init(rng, [4, 32, 3], True)
    for text in ['x); asm("trap"); (', "x; } __global__ void evil() {", "x\0) + 1"]:
        with pytest.raises(fusedmlp.ExpressionError):
            fusedmlp.FusedMLP(ws, bs, activation=text, device="cpu", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------------ processes


PROCESS_WIDTHS = [11, 72, 72, 5]


def _compile_in_process(cache_dir, barrier, results):
    ws, bs = torch_init(np.random.default_rng(5), PROCESS_WIDTHS, True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="mish", device="cpu", cache_dir=cache_dir)
    barrier.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to memory would warn: make it a failure
        path = mlp.compile("sm_80", "float16")
    x = np.random.default_rng(6).standard_normal((64, PROCESS_WIDTHS[0])).astype(np.float32)
    results.put((path, mlp(x).tobytes()))


def test_processes_compiling_one_new_model_share_one_entry(tmp_path):
    cache_dir = tmp_path / "shared"
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(8), context.Queue()  # 8 processes, as the reliability issue asks
    processes = [context.Process(target=_compile_in_process, args=(str(cache_dir), barrier, results))
                 for _ in range(8)]
    for process in processes:
        process.start()
    returned = [results.get(timeout=300) for _ in processes]
    paths = [path for path, _ in returned]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert len(set(paths)) == 1 and os.path.isfile(paths[0])
    entries = list(KernelCache(cache_dir).entries())
    assert [str(entry.path) for entry in entries] == paths[:1]
    assert sorted(p.suffix for p in cache_dir.rglob("*") if p.is_file()) == [".cu", ".cubin", ".lock"]
    assert temp_files(cache_dir) == []
    check_cubin(entries[0].cubin, 80)
    # The entry is the one this process would build.
    ws, bs = torch_init(np.random.default_rng(5), PROCESS_WIDTHS, True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="mish", device="cpu", cache_dir=cache_dir)
    assert mlp.compile("sm_80", "float16") == paths[0]
    x = np.random.default_rng(6).standard_normal((64, PROCESS_WIDTHS[0])).astype(np.float32)
    assert all(y == mlp(x).tobytes() for _, y in returned)  # every process computed the right result


def test_unwritable_cache_dir_falls_back_to_memory_with_one_warning(tmp_path, rng):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    ws, bs = torch_init(rng, [5, 40, 2], True)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", device="cpu", cache_dir=blocker / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = mlp.compile("sm_89")
        second = mlp.compile("sm_89")  # held in memory: no second compile, no second warning
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in caught]
    assert "cannot write the kernel cache" in str(runtime[0].message)
    assert str(blocker / "cache") in str(runtime[0].message)
    assert first is None and second is None and mlp.cache_path is None
    assert "// Plan: widths 5-40-2; sm_89; " in mlp.source
    assert blocker.read_text() == "not a folder"


def test_compile_error_shows_message_hint_then_the_log_once(tmp_path):
    from fusedmlp import _api
    from fusedmlp.errors import CompileError

    _api._nvrtc_info()
    source = 'extern "C" __global__ void k() { undefined_thing(); }'
    with pytest.raises(CompileError) as info:
        _api.compile_cubin(source, 80, _api.KernelCache(tmp_path))
    text = str(info.value)
    assert "undefined_thing" in info.value.log and text.count(info.value.log.strip()) == 1
    assert text.index("NVRTC_ERROR_COMPILATION") < text.index(info.value.log.strip())
    assert info.value.source == source and any(o.startswith("--gpu-architecture=sm_80") for o in info.value.options)
