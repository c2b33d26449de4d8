"""The probes behind the plan's and the tuner's choices, to run again after a change:
``python -m fusedmlp.bench probe <subcommand> [options]`` (each subcommand's ``--help`` says more).

    list   (no GPU) each workload's plan for a GPU ahead of time, and what the tuner would try at a batch size
    plans  (GPU) forced plans timed against the default one, in alternating rounds; --check compares their outputs
    ab     (GPU) kernel templates A/B: baseline copies against the working tree's, all on the same plan; --check
    tune   (GPU, PyTorch) what the tuner chooses, and a cold first call's time, per batch size
    act    (GPU) a workload's kernel with its hidden activation swapped: what the activation costs
    cold   (GPU, PyTorch) where a cold first call goes: the span of each of its NVRTC compiles
    host   (GPU, PyTorch) where a small call's host time goes: microseconds per call of __call__'s pieces
    steps  (GPU, PyTorch) a segmented network's kernels timed one by one, against the whole chain's device time;
           --dtype (8-bit chains too), --gemm (a forced GEMM tile or form), --base (templates A/B, as ab), --check
    gemm   (GPU) each GEMM layer of a segmented network in every tile and form, per batch size; --dtype
    same   (no GPU) whether a template change leaves every kernel a workload compiles to as it was, byte for byte

Workloads are the benchmark's (fusedmlp.bench.WORKLOADS) and a few shapes outside it (EXTRA), with fixed random
weights (seed 0), so that runs compare. Kernel times are Kernel.time: the best of 5 launches on random rows; where
kernels are compared, they are timed in alternating rounds in one process and the median over rounds is printed.
Plan options (--plan) are those the tuner forces (PLAN_OPTIONS: wgmma, cluster, warps, m_tiles, n_chunk, resident,
kpipe, k_chunk), wide_loop (-1: the streamed kernel's wide layers' column groups unrolled, not the default loop) and
split (2, 4 or 8: the streamed kernel's wide layers split over clusters of that many CTAs, small batches), written
``warps=4,m_tiles=1``. An 8-bit network (--dtype int8 or float8) is calibrated on fixed random rows first.
"""

import argparse
import contextlib
import functools
import gc
import logging
import statistics
import struct
import sys
import tempfile
import time

import numpy as np

from . import _api, _segments, _tune, bench, bench_lowbit
from .errors import ArgumentError, LimitError

__all__ = ["EXTRA", "GPUS", "main", "plan_table", "weights", "workload"]

#: Shapes outside the benchmark's set: residual networks too wide for the register-A kernel (the cluster kernel's
#: residual epilogues), siren256 with residual hidden layers, and wide last layers.
EXTRA = {
    "res256": bench.Workload((64, 256, 256, 256, 256, 256, 64), "gelu", True, residual=True),
    "res224": bench.Workload((64, 224, 224, 224, 224, 224, 64), "relu", True, residual=True),
    "siren256res": bench.Workload((2, 256, 256, 256, 3), "sin", True, residual=True),
    # wide last layers: on clusters split over the CTAs since session 15 (before, the last layer ran whole in CTA 0
    # while the others waited, and 2-256-256-256 with 16-bit y fitted no cluster plan); in the register-A kernel its
    # 128 accumulators leave room for one warpgroup
    "wideout192": bench.Workload((64, 256, 256, 192), "relu", True),
    "wideout256": bench.Workload((64, 128, 128, 128, 256), "relu", True),
    "sirenout256": bench.Workload((2, 256, 256, 256), "sin", True),
    # sdf512's two fused stretches on sm_90 (its concat layer 4 is a GEMM between them), as networks of their own, so
    # that forced plans (wide_loop=-1) can be built for them: sdf512 itself has no whole-network plan to force
    "sdf512head": bench.Workload((259, 512, 512, 512, 512), "relu", True, output_activation="relu"),
    "sdf512tail": bench.Workload((512, 512, 512, 512, 1), "relu", True, output_activation="tanh"),
    # the first stretch as it runs in the chain, reading x's padded copy (264 columns); rec1024's fused tail
    "sdf512headpad": bench.Workload((264, 512, 512, 512, 512), "relu", True, output_activation="relu"),
    "rec1024tail": bench.Workload((512, 256, 1), "relu", True),
}

#: GPUs to plan for ahead of time (`probe list`, bench/sass_report.py): what _core.Gpu.info reports for them.
#: Shared memory: the opt-in limit per block and the total per SM (227 and 228 KB on sm_90, 163 and 164 KB on sm_80:
#: the CUDA C Programming Guide's technical specifications per compute capability).
GPUS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "arch": 90, "sm_count": 132, "smem_per_block": 232448,
             "smem_per_sm": 233472},
    "a100": {"name": "NVIDIA A100-SXM4-80GB", "arch": 80, "sm_count": 108, "smem_per_block": 166912,
             "smem_per_sm": 167936},
}

IO_DTYPES = ("float16", "float32", "bfloat16")
#: Compute dtypes of the subcommands that take 8-bit ones too (a model that runs kernels comes calibrated: model).
DTYPES = _api.PRECISIONS + _api.LOWBIT_PRECISIONS
#: check's batch size: more than a wave of tiles, and a partial last one.
CHECK_ROWS = 65536 + 37
#: The plan's options (Network.plan's keywords past the GPU's limits and the dtypes), as the tuner forces them.
PLAN_OPTIONS = ("wgmma", "cluster", "warps", "m_tiles", "n_chunk", "resident", "kpipe", "k_chunk", "wide_loop",
                "split", "norm_half", "in_shared", "x_split")


# ------------------------------------------------------------------------------------------------ shared helpers


def workload(name):
    """The benchmark's workload of that name, else EXTRA's; KeyError names the known ones."""
    if name in bench.WORKLOADS:
        return bench.WORKLOADS[name]
    if name in EXTRA:
        return EXTRA[name]
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(list(bench.WORKLOADS) + list(EXTRA))}")


def weights(wl):
    """Fixed random weights and biases for a workload.

    Args:
        wl: a bench.Workload.

    Returns:
        (weights, biases): U(-1, 1) / sqrt(fan_in) weights, (out, in) each (each stack's in turn); U(-0.1, 0.1)
        biases, or None without.
    """
    rng = np.random.default_rng(0)
    widths = wl.widths
    ws = [rng.uniform(-1, 1, (n, k)).astype(np.float32) / np.sqrt(k) for _ in range(wl.stacks)
          for k, n in zip(wl.layer_inputs(), widths[1:])]
    bs = [rng.uniform(-0.1, 0.1, n).astype(np.float32) for _ in range(wl.stacks) for n in widths[1:]] if wl.bias \
        else None
    return ws, bs


def model(wl, device="cuda", **options):
    """A FusedMLP of the workload with weights(wl); options (activation, dtype, cache_dir) override the workload's.
    An 8-bit one that runs kernels (device not 'cpu') comes calibrated (calibrate); planning ahead of time takes none
    of its scales, and calibrating rec1024 takes ~8 s of CPU."""
    import fusedmlp

    ws, bs = bench.fused_layers(wl, *weights(wl))
    mlp = fusedmlp.FusedMLP(ws, bs, device=device, **dict(bench.fused_options(wl), **options))
    return mlp if device == "cpu" else calibrate(mlp)


def calibrate(mlp):
    """An 8-bit model calibrated as the benchmark's (bench_lowbit.models: CALIBRATION_ROWS standard normal rows
    rounded to float16), fixed rows (seed 2) so that runs compare; any other model as it is. Returns mlp."""
    if mlp._precision not in _api.LOWBIT:
        return mlp
    rng = np.random.default_rng(2)
    sample = rng.standard_normal((bench_lowbit.CALIBRATION_ROWS, mlp.in_features)).astype(np.float16)
    return mlp.calibrate(sample.astype(np.float32))


def parse_plan(text, known=PLAN_OPTIONS, what="plan", example="warps=4,m_tiles=1"):
    """'warps=4,m_tiles=1' -> {'warps': 4, 'm_tiles': 1} (an argparse type: a malformed item is a usage error);
    known: the option names taken, what: whose options they are (parse_gemm: the GEMM's)."""
    try:
        options = {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} options written as name=int[,name=int...], "
                                         f"e.g. {example}") from None
    unknown = [k for k in options if k not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} option(s) {', '.join(unknown)} in {text!r}; the {what} "
                                         f"takes {', '.join(known)}")
    return options


#: `probe steps --gemm`: forced on every GEMM of a chain (FusedMLP._gemm_options, Network.gemm_plan's keywords).
GEMM_OPTIONS = ("bm", "bn", "stages", "wgmma", "cluster", "ws", "tma", "tma_store")
parse_gemm = functools.partial(parse_plan, known=GEMM_OPTIONS, what="GEMM", example="bn=128")


def plan_text(options):
    """The inverse of parse_plan; 'default' for none."""
    return ",".join(f"{k}={v}" for k, v in options.items()) if options else "default"


def shape(info, kernel=None):
    """A plan's tile shape in one line, from plan.info (and the loaded kernel's info where there is one)."""
    text = f"{'wgmma' if info['wgmma'] else 'mma.sync'} {info['warps']}w x {info['rows_per_cta']} rows"
    if info.get("cluster", 0) > 1:
        text += f", cluster {info['cluster']}"
        if kernel is not None:
            text += f" x{kernel.info['max_clusters']}"
    weights = f"streamed ({info['stream_slots']} slots)" if info.get("stream_slots") else f"resident {info['resident']}"
    if info.get("wide_loop"):
        weights += ", wide layers' groups looped"
    if info.get("split"):
        weights += f", split over {info['split']} CTAs"
    if info.get("in_shared"):
        weights += ", x in the wide buffers"
    return (text + f", {weights}, kpipe {info['kpipe']}, {info['blocks_per_sm']} CTA/SM, {info['smem_bytes']} B")


def gemm_shape(info):
    """A GEMM plan's tile and form in one line, from plan.info."""
    text = (f"{'wgmma' if info['wgmma'] else 'mma.sync'} GEMM {info['bm']}x{info['bn']} tiles, "
            f"{info['stages']} stages, {info['blocks_per_sm']} CTA/SM, {info['smem_bytes']} B")
    if info["cluster"] > 1:
        text += f", clusters of {info['cluster']} sharing B"
    if info["ws"]:
        text += ", a producer warpgroup" + {2: ", consumers in turn", 3: ", persistent"}.get(info["ws"], "")
    if info.get("tma"):
        text += ", A by tensor maps"
    if info.get("tma_store"):
        text += ", y by TMA stores"
    return text


def segment_table(wl, gpu, io="float16", dtype="float16", rows=()):
    """How a GPU cuts a workload into segments (None where it runs one fused kernel): a line per segment, its layers,
    kernel and reason, then its plan's shape (a fused stretch's default plan, a GEMM's tile and stages); per batch size
    in rows, each GEMM's tile and form for a call of that size (_segments.gemm_tile, as the chain picks it)."""
    mlp = calibrate(model(wl, device="cpu", dtype=dtype))  # (8-bit: its plans need the activation scales)
    target = (gpu["arch"], gpu["smem_per_block"], gpu["sm_count"], gpu["smem_per_sm"])
    cut = mlp._segments_for(*target, io, io)
    if cut is None:
        return None
    lines = []
    for seg in cut:
        if seg.kind == "fused":
            info = _segments._stretch_plan(mlp, seg.first, seg.last, target, io, io,
                                           _segments.copy_row(mlp, seg, io)).info
            lines.append(f"{seg.describe()}: {shape(info)}")
            continue
        tiles = _segments.gemm_tile_plans(mlp, seg.first, target, _segments.gemm_dtypes(mlp, seg.first, io, io))
        default = next(iter(tiles))
        lines.append(f"{seg.describe()}: {gemm_shape(tiles[default])}")
        specialised = [t for t, i in tiles.items() if i["ws"]]
        n = mlp.widths[seg.first + 1]
        for r in rows:
            bm, bn = _segments.gemm_tile(r, n, default, gpu["sm_count"], specialised)
            ctas = -(-r // bm) * -(-n // bn)
            lines.append(f"layer {seg.first} at {r} rows: {gemm_shape(tiles[(bm, bn)])}, {ctas} CTAs")
    return lines


def require_gpu(command):
    """Exits with a message saying what is missing where this process sees no CUDA GPU."""
    if not _api._gpu_available():
        raise SystemExit(f"probe {command} runs kernels: it needs an NVIDIA GPU with a CUDA driver, and this machine "
                         "has none (`python -m fusedmlp.bench probe list` plans for a GPU without one)")


def alternate(kernels, rows, rounds, launches=5):
    """Each kernel timed once per round, round after round, so that a drift of clocks or temperature hits all alike.

    Returns:
        one list of times (ms, each the best of `launches`) per kernel.
    """
    return alternate_calls([functools.partial(kernel.time, rows, launches) for kernel in kernels], rounds)


def alternate_calls(timers, rounds):
    """alternate for any timers: each timer() (one time) called once per round, round after round.

    Returns:
        one list of times per timer.
    """
    times = [[] for _ in timers]
    for _ in range(rounds):
        for timer_times, timer in zip(times, timers):
            timer_times.append(timer())
    return times


def check(name, mlp, kernels, labels, dtype=np.float16, rows=CHECK_ROWS):
    """Prints whether each kernel's outputs on the same random rows (poisoned first) are the first kernel's bit for
    bit, and their relative L2 error against mlp's CPU reference (a change that only reorders work must leave the
    bits as they were).

    Args:
        dtype: x's and y's dtype.

    Returns:
        [(same bits as the first, relative error)] per kernel.
    """
    x = np.random.default_rng(1).uniform(-1, 1, (rows, mlp.in_features)).astype(dtype)
    ref = mlp._net.forward_cpu(x.astype(np.float32)).astype(np.float64)
    ys = [kernel.run(x, poison=True) for kernel in kernels]
    results, parts = [], []
    for label, y in zip(labels, ys):
        err = float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))
        same = np.array_equal(y.view(np.uint8), ys[0].view(np.uint8))
        results.append((same, err))
        parts.append(f"{label}: {f'{labels[0]} bits' if same else f'DIFFERS from {labels[0]}'}, rel err {err:.2e}")
    print(f"{name:11s} check, {rows} rows: " + "  ".join(parts), flush=True)
    return results


@contextlib.contextmanager
def templates_from(folder):
    """Within: kernels render from the template files in folder (None: the package's kernel_templates)."""
    own = _api._template
    if folder is not None:
        _api._template = functools.partial(own, folder=folder)
    try:
        yield
    finally:
        _api._template = own


class _NamedGpu:
    """Stands in for _core.Gpu where only its info is read (planning): a named GPU's limits, no device."""

    def __init__(self, info):
        self.info = info


@contextlib.contextmanager
def planning_for(info):
    """Within: the model's GPU is the one info describes, for planning only, so the tuner's own functions answer
    (its candidates, their plans, the untuned choice), not a copy of them. Building or launching a kernel within is
    an error."""
    own = _api._gpu
    _api._gpu = lambda ordinal: _NamedGpu(info)
    try:
        yield
    finally:
        _api._gpu = own


def _workload_names(ap, names):
    unknown = [n for n in names if n not in bench.WORKLOADS and n not in EXTRA]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(list(bench.WORKLOADS) + list(EXTRA))}")
    return names or list(bench.WORKLOADS)


# ------------------------------------------------------------------------------------------------ list (no GPU)


def plan_table(wl, gpu, io="float16", dtype="float16", plans=(), rows=()):
    """What a GPU's plan and tuner make of a workload, computed ahead of time (no GPU, no compile).

    Args:
        wl: a bench.Workload.
        gpu: a GPUS entry (or any dict with _core.Gpu.info's planning keys).
        io: x's and y's dtype.
        dtype: the compute dtype (FusedMLP's dtype).
        plans: forced plan options (dicts) to plan besides the default.
        rows: batch sizes for which to list the untuned choice (FUSEDMLP_AUTOTUNE=0) and the tuner's candidates.

    Returns:
        a list of dicts: {"what": "default" | plan text, "info": plan info or None, "error": the LimitError's (or a
        forced value's ArgumentError's) message or None} per plan; then per batch size {"rows", "untuned": options
        or None (the default plan), "untuned_info", "candidates": [(label, options, info)] that the tuner compiles
        and times,
        "dominated": [label], "unfit": [label], "duplicates": [label]}, the candidates the tuner skips (dominated:
        cannot beat one warpgroup less at this batch; unfit: the network does not take them; duplicates: planned
        the same as an earlier candidate, so compiled once).
    """
    mlp = calibrate(model(wl, device="cpu", dtype=dtype))  # (8-bit: its plans need the activation scales)
    table = []
    with planning_for(gpu):
        for options in [{}] + list(plans):
            try:
                info = _tune._plan_info(mlp, io, io, **options)
                table.append({"what": plan_text(options), "info": info, "error": None})
            except (LimitError, ArgumentError) as e:  # (a forced value out of range: its rule, as a limit's reason)
                if not options:
                    raise
                table.append({"what": plan_text(options), "info": None, "error": e.message})
        for r in rows:
            untuned = _tune.untuned(mlp, io, io, r, gpu["sm_count"])
            try:
                untuned_info = _tune._plan_info(mlp, io, io, **(untuned or {}))
            except LimitError:  # as _api._kernel does: a choice the network does not take falls back to the default
                untuned, untuned_info = None, _tune._plan_info(mlp, io, io)
            every = _tune._candidates(mlp, io, io)
            dominated = [o for o in every if _tune._dominated(o, _tune.bucket(r), gpu["sm_count"])]
            kept = [o for o in every if o not in dominated]
            distinct = _tune._distinct(mlp, io, io, kept)  # as tune_bucket: dominated ones out first
            fitting = [o for o in kept if _fits(mlp, io, o)]
            table.append({
                "rows": r, "untuned": untuned, "untuned_info": untuned_info,
                "candidates": [(_tune.label(o), o, _tune._plan_info(mlp, io, io, **o)) for o in distinct],
                "dominated": [_tune.label(o) for o in dominated],
                "unfit": [_tune.label(o) for o in kept if o not in fitting],
                "duplicates": [_tune.label(o) for o in fitting if o not in distinct],
            })
    return table


def _fits(mlp, io, options):
    """Whether the network takes these plan options on the GPU planning_for names."""
    try:
        _tune._plan_info(mlp, io, io, **options)
        return True
    except LimitError:
        return False


#: Why the tuner skips a candidate, by plan_table's key.
SKIPPED = (("dominated", "cannot win at this size"), ("unfit", "not taken by the network"),
           ("duplicates", "planned as an earlier one"))


def list_plans(args):
    """(no GPU) Each workload's plan for a GPU ahead of time: the default plan, each forced --plan, and per
    --rows the plan a call of that size gets with tuning off (FUSEDMLP_AUTOTUNE=0) and the candidates the tuner
    compiles and times for it (less those that cannot win at that batch size, and those planned like an earlier one);
    for a network cut into segments, each segment's plan and per --rows each GEMM's tile and form.

        python -m fusedmlp.bench probe list [--gpu h100] [--io float32] [--dtype float8] [--plan wgmma=0] [--rows 1024]
            [workload ...]
    """
    gpu = GPUS[args.gpu]
    print(f"{gpu['name']} (sm_{gpu['arch']}, {gpu['sm_count']} SMs, {gpu['smem_per_block']} B shared memory per "
          f"block), {args.io} x and y, {args.dtype} compute", flush=True)
    for name in args.workloads:
        segments = segment_table(workload(name), gpu, args.io, args.dtype, args.rows)
        for line in segments or ():
            print(f"{name:11s} {line}")
        if segments:
            continue  # a cut network's stretches are tuned as networks of their own; list them by their widths
        for entry in plan_table(workload(name), gpu, args.io, args.dtype, args.plan, args.rows):
            if "rows" not in entry:
                what = entry["info"] and shape(entry["info"]) or f"not planned ({entry['error']})"
                print(f"{name:11s} {entry['what']:24s} {what}")
                continue
            untuned = _tune.label(entry["untuned"]) if entry["untuned"] else "default"
            print(f"{name:11s} {entry['rows']:8d} rows  untuned: {untuned} [{shape(entry['untuned_info'])}]")
            for label, _, info in entry["candidates"]:
                print(f"{name:11s} {entry['rows']:8d} rows  tuner tries {label:6s} [{shape(info)}]")
            left = [f"{', '.join(entry[k])} ({why})" for k, why in SKIPPED if entry[k]]
            if left:
                print(f"{name:11s} {entry['rows']:8d} rows  tuner skips " + "; ".join(left))
    return 0


# ------------------------------------------------------------------------------------------------ plans, ab, act


def time_plans(args):
    """(GPU) Tile plans compared: each workload's kernel built with each forced --plan and the default one, all timed
    in alternating rounds at each batch size; per workload and batch size, the median of each plan's times and its
    ratio to the default's. A plan the network does not take (LimitError) is listed once as not built. --check first
    compares each plan's outputs with the default's (bit for bit) and the CPU reference's (float16 or float32 I/O:
    NumPy has no bfloat16 to hand the kernel).

        python -m fusedmlp.bench probe plans [--rows 1024 --rows 2097152] [--rounds 5] [--io float32] [--check]
            [--dtype int8] --plan cluster=4,warps=4 [--plan ...] [workload ...]
    """
    require_gpu("plans")
    for name in args.workloads:
        mlp = model(workload(name), dtype=args.dtype)  # (8-bit: calibrated)
        built = []
        for options in [{}] + args.plan:
            try:
                kernel, plan = mlp._build(args.io, **options)[:2]
            except LimitError as e:
                print(f"{name:11s} {plan_text(options)}: not built ({e.message})", flush=True)
                continue
            built.append((f"{plan_text(options)} [{shape(plan.info, kernel)}]", kernel))
        if args.check and args.io != "bfloat16":
            check(name, mlp, [kernel for _, kernel in built], [label for label, _ in built], np.dtype(args.io))
        for rows in args.rows or [1024, 2**21]:
            medians = [statistics.median(t) for t in alternate([k for _, k in built], rows, args.rounds)]
            parts = [f"{label} {m * 1e3:.2f} us ({m / medians[0]:.3f})" for (label, _), m in zip(built, medians)]
            print(f"{name:11s} {args.io} {rows:8d} rows: " + "  ".join(parts), flush=True)
    return 0


def ab_templates(args):
    """(GPU) A/B of a kernel-template change: each workload's fp16 kernel built from one or more baseline copies of
    the templates (A, B, ...) and from the working tree's (the last letter), on the same plan (the default one, or
    the forced --plan), so only the templates differ; timed in alternating rounds. Prints each kernel's median time,
    its range and its ratio to A's. --check first compares the kernels' outputs (bit for bit with A's, and the
    relative error against the CPU reference): a change that only reorders work must leave the bits as they were.

        mkdir -p build/ab_base && for f in kernel_templates/*; do git show HEAD:$f > build/ab_base/${f##*/}; done
        python -m fusedmlp.bench probe ab --base build/ab_base [--base other] [--rows 2097152] [--rounds 7]
            [--plan warps=12] [--check] [workload ...]
    """
    require_gpu("ab")
    labels = [chr(ord("A") + i) for i in range(len(args.base) + 1)]
    for name in args.workloads:
        mlp = model(workload(name))
        builds = []
        for folder in args.base + [None]:
            with templates_from(folder):
                builds.append(mlp._build("float16", **args.plan)[:3])
        kernels = [kernel for kernel, _, _ in builds]
        if args.check:
            check(name, mlp, kernels, labels)
        times = alternate(kernels, args.rows, args.rounds)
        medians = [statistics.median(t) for t in times]
        parts = [f"{label} {m:.4f} ms ({m / medians[0]:.3f}, {min(t):.4f}-{max(t):.4f})"
                 for label, m, t in zip(labels, medians, times)]
        print(f"{name:11s} {args.rows} rows, {shape(builds[-1][1].info)}, "
              f"{len({source for _, _, source in builds})} distinct sources: " + "  ".join(parts), flush=True)
    return 0


def activation_cost(args):
    """(GPU) What an activation costs inside a workload: its kernel (the one a call of --rows rows gets) timed with
    the hidden layers' activation swapped, same network, weights and batch, so the differences are the epilogue's
    activation work (the ncu-free answer to "is it the MUFU/FMA work or the mma?"). Each --plan is timed too, with
    the first activation. float16 x and y.

        python -m fusedmlp.bench probe act res128 gelu relu none [--rows 2097152] [--dtype float16]
            [--plan resident=0,warps=8 ...]
    """
    require_gpu("act")
    wl = workload(args.workload)
    base = None
    for act in args.activations:
        ms = model(wl, activation=act, dtype=args.dtype)._kernel("float16", rows=args.rows).time(args.rows, 5)
        base = ms if base is None else base
        print(f"{args.workload} {args.dtype} {act:>24s}: {ms:.4f} ms ({ms / base:.2f}x the first)", flush=True)
    mlp = model(wl, activation=args.activations[0], dtype=args.dtype)
    for options in args.plan:
        kernel, plan = mlp._build("float16", **options)[:2]
        ms = kernel.time(args.rows, 5)
        print(f"{args.workload} {args.dtype} {plan_text(options):>24s}: {ms:.4f} ms ({ms / base:.2f}x the first; "
              f"{shape(plan.info, kernel)})", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ first calls, host


def tune_first_calls(args):
    """(GPU, PyTorch) What the tuner chooses, and what a cold first call costs, per workload and batch size: each
    workload gets a fresh cache folder, NVRTC's own cache is off (bench.never_compiled_sources), and the first call
    of each batch size on a CUDA fp16 tensor is timed on the host (render, NVRTC and tuning included where the
    bucket is new, then a sync), after the tuner's log line (its choice and every candidate's time). --templates:
    the kernel templates from that folder (as ab's --base), to compare a template change's cold first calls. With
    FUSEDMLP_AUTOTUNE=0 in the environment, the untuned choice alone.

        python -m fusedmlp.bench probe tune [--rows 1024 --rows 2097152] [--templates FOLDER] [workload ...]
    """
    require_gpu("tune")
    torch = bench._import_torch()
    logging.basicConfig(format="  %(message)s")
    logging.getLogger("fusedmlp").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="fusedmlp-probe-") as root, templates_from(args.templates):
        for name in args.workloads:
            wl = workload(name)
            mlp = model(wl, cache_dir=f"{root}/{name}")
            for rows in args.rows or [1024, 2**21]:
                x = torch.randn(rows, wl.x_features(), device="cuda", dtype=torch.float16)
                torch.cuda.synchronize()
                with bench.never_compiled_sources():
                    t = time.perf_counter()
                    mlp(x)
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - t
                print(f"{name:11s} {rows:8d} rows: first call {seconds:.3f} s", flush=True)
    return 0


def cold_first_call(args):
    """(GPU, PyTorch) Where a workload's cold first call goes: each call is the first of a new FusedMLP on an empty
    cache folder with NVRTC's own cache off, at 1024 rows, as the benchmark's cold_ms; printed with each NVRTC
    compile's span (start-end, ms from the call's start; the tuner compiles its candidates at once, so the call
    waits for the slowest). With FUSEDMLP_AUTOTUNE=0 in the environment, the untuned choice alone (one compile).

        python -m fusedmlp.bench probe cold [workload] [--calls 4]
    """
    require_gpu("cold")
    torch = bench._import_torch()
    from . import _core as core

    wl = workload(args.workload)
    x = torch.randn(1024, wl.x_features(), device="cuda", dtype=torch.float16)
    spans, compile_ = [], core.nvrtc_compile

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return compile_(*a, **k)
        finally:
            spans.append((t, time.perf_counter()))

    with tempfile.TemporaryDirectory(prefix="fusedmlp-probe-") as root, bench.never_compiled_sources():
        model(wl, cache_dir=f"{root}/warm-up")(x)  # NVRTC and the driver loaded first, as in the benchmark
        torch.cuda.synchronize()
        core.nvrtc_compile = timed
        try:
            for i in range(args.calls):
                mlp = model(wl, cache_dir=f"{root}/{i}")
                spans.clear()
                t = time.perf_counter()
                mlp(x)
                torch.cuda.synchronize()
                total = time.perf_counter() - t
                compiles = ", ".join(f"{(a - t) * 1e3:.0f}-{(b - t) * 1e3:.0f}" for a, b in sorted(spans))
                print(f"{args.workload} cold first call {total * 1e3:.1f} ms; NVRTC compiles (ms) {compiles}",
                      flush=True)
        finally:
            core.nvrtc_compile = compile_
    return 0


def _per_call_us(torch, fn, calls=2000, reps=7):
    """Median over reps of the host time per call of `calls` back-to-back calls (no sync between them)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def host_time(args):
    """(GPU, PyTorch) Where a small call's time goes on the host: microseconds per call (medians of 2000
    back-to-back calls, no sync between them, so the GPU never holds the host up) of the pieces of FusedMLP.__call__
    on a CUDA float16 tensor, of the call into a preallocated output (mlp(x, out=y), no torch.empty), and, with a
    stream synchronize after each call, what the benchmark's call_us and call_out_us measure.

        python -m fusedmlp.bench probe host [workload] [--rows 1024]
    """
    require_gpu("host")
    torch = bench._import_torch()
    wl, rows = workload(args.workload), args.rows
    mlp = model(wl)
    x = torch.randn(rows, wl.x_features(), device="cuda", dtype=torch.float16)
    mlp(x)
    torch.cuda.synchronize()
    kernel = mlp._kernel("float16", rows=rows)
    y = torch.empty((rows, wl.out_features()), device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    raw = torch._C._cuda_getCurrentRawStream
    pieces = {
        "mlp(x) (FusedMLP.__call__)": lambda: mlp(x),
        "mlp(x, out=y) (preallocated out)": lambda: mlp(x, out=y),
        "torch.empty(out)": lambda: torch.empty((rows, wl.out_features()), device="cuda", dtype=torch.float16),
        "mlp._kernel lookup": lambda: mlp._kernel("float16", rows=rows),
        "Kernel.launch (C: cuLaunchKernel)": lambda: kernel.launch(x.data_ptr(), y.data_ptr(), rows, stream),
        "raw current stream": lambda: raw(0),
        "x.data_ptr() + checks": lambda: (x.is_cuda, x.requires_grad, x.dim(), x.shape[1], x.is_contiguous(),
                                           x.data_ptr() % 16, x.get_device()),
        "torch eager x * 2 (one small kernel)": lambda: x * 2,
    }
    synced = {
        "sync round trip, empty stream": lambda: None,
        "mlp(x) + sync (bench call_us)": lambda: mlp(x),
        "mlp(x, out=y) + sync (bench call_out_us)": lambda: mlp(x, out=y),
        "Kernel.launch + sync": lambda: kernel.launch(x.data_ptr(), y.data_ptr(), rows, stream),
        "torch eager x * 2 + sync": lambda: x * 2,
    }
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  workload {args.workload}, {rows} rows")
    for label, fn in pieces.items():
        print(f"  {label:42s} {_per_call_us(torch, fn):7.2f} us per call, back to back", flush=True)
    for label, fn in synced.items():
        us = bench._time_host(torch, lambda k, fn=fn: fn(), 300)["call_us"]  # the benchmark's own measure
        print(f"  {label:42s} {us:7.2f} us", flush=True)
    return 0


def _graph_timer(torch, body, stream, replays=20):
    """body() captured `replays` times in one CUDA graph on stream, after a first run there (first launches): a timer
    that replays the graph once and returns the device microseconds per body() (the body's own time plus the gap
    between two dependent launches: launches never starve the GPU)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(replays):
            body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timer():
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / replays

    return timer


def resolved(builds, rows, stream=0):
    """What a float16 call of `rows` rows launches on `stream`, for each (model, template folder or None) of builds:
    its loaded kernel, or its Chain with every kernel the call launches built now. Within templates_from(folder): a
    chain builds a smaller tile's GEMM and a fused stretch's tuned kernel at its first call of a batch size, which
    would otherwise render from the package's templates (stream: where the call will run; a chain keeps a workspace
    per stream, Chain.run's is 0)."""
    kernels = []
    for mlp, folder in builds:
        with templates_from(folder):
            kernel = mlp._kernel("float16", rows=rows)
            if isinstance(kernel, _segments.Chain):
                kernel.program(rows, stream)
            kernels.append(kernel)
    return kernels


def _step_timers(torch, kernel, x, y, rows, stream):
    """_graph_timer of each kernel a Chain launches for `rows` rows, alone (a plain launch, not a dependent one), then
    of the whole call on x and y; of a fused kernel the call alone."""
    s = stream.cuda_stream
    timers = []
    if isinstance(kernel, _segments.Chain):
        steps, base, _ = kernel.program(rows, s)
        where = {-1: x.data_ptr(), -2: 0, -3: y.data_ptr()}
        for step, *codes, _ in steps:
            a, b, a1, r = (where.get(c, base + c) for c in codes)
            timers.append(_graph_timer(torch, functools.partial(step.launch, a, b, rows, s, a1, r), stream))
    return timers + [_graph_timer(torch, lambda: kernel.launch(x.data_ptr(), y.data_ptr(), rows, s), stream)]


def _columns(values):
    """Microseconds a build, then each build's ratio to the first's."""
    return "".join(f"{v:10.2f}" for v in values) + "".join(f" ({v / values[0]:.3f})" for v in values[1:])


def chain_steps(args):
    """(GPU, PyTorch) Where a segmented network's device time goes at a batch size: each kernel of its chain alone
    (replayed back to back in a CUDA graph, so launches never starve the GPU: its own time plus the gap between two
    dependent kernels), their sum, and the whole chain in a CUDA graph; medians of --rounds alternating rounds. The
    chain's time less the sum is what the boundaries between kernels add beyond each kernel's own gap; FUSEDMLP_PDL=0
    (dependent launch off) or FUSEDMLP_GEMM_WS (a GEMM form) in the environment, for an A/B in two processes.
    --dtype: the compute dtype (an 8-bit one calibrated: model). --gemm: options forced on every GEMM of the chain,
    that tile at every batch size (bn=128: 128-column tiles; ws=2: the consumers in turn). --base: an A/B of a
    kernel-template change, as ab's: the chain built from each baseline folder (A, B, ...) and from the working tree's
    templates (the last letter), same plans, timed in the same rounds, each time with its ratio to A's. --check first
    compares the builds' outputs (bit for bit with A's; the relative error against the CPU reference, for an 8-bit
    network its emulation).

        python -m fusedmlp.bench probe steps [workloads] [--rows 1024] [--dtype float8] [--gemm bn=128]
            [--base build/ab_base] [--rounds 9] [--check]
    """
    require_gpu("steps")
    torch = bench._import_torch()
    folders = args.base + [None]
    letters = [chr(ord("A") + i) for i in range(len(folders))]
    legend = "; " + ", ".join(f"{letter}: {folder or 'the working tree'}" for letter, folder in zip(letters, folders))
    legend = legend if args.base else ""
    stream = torch.cuda.Stream()  # every warm-up and capture: a chain keeps a workspace per stream (rec1024 at 2^21
    # rows: 8.6 GB)
    for name in args.workloads:
        wl = workload(name)
        builds = [(model(wl, dtype=args.dtype), folder) for folder in folders]
        for mlp, _ in builds:
            mlp._gemm_options = dict(args.gemm)
        if args.check:
            check(name, builds[0][0], resolved(builds, CHECK_ROWS), letters)
        for rows in args.rows or [1024]:
            x = torch.randn(rows, wl.x_features(), device="cuda", dtype=torch.float16)
            y = torch.empty((rows, wl.out_features()), device="cuda", dtype=torch.float16)
            kernels = resolved(builds, rows, stream.cuda_stream)
            timers = [_step_timers(torch, kernel, x, y, rows, stream) for kernel in kernels]
            times = iter(alternate_calls([t for build in timers for t in build], args.rounds))
            us = [[statistics.median(next(times)) for _ in build] for build in timers]  # per build: steps, chain
            what = f"{name} {args.dtype}{f' GEMMs {plan_text(args.gemm)}' if args.gemm else ''} at {rows} rows"
            if not isinstance(kernels[0], _segments.Chain):
                print(f"{what}: one fused kernel, device us a launch in a CUDA graph{legend}:"
                      f"{_columns([u[0] for u in us])}", flush=True)
                continue
            chain, n_steps = kernels[0], len(us[0]) - 1
            labels = ([seg.describe() for seg in chain.segments] if n_steps == len(chain.segments) else
                      [f"step {i} (of {n_steps}: the segments' kernels and their pad or norm passes)"
                       for i in range(n_steps)])
            print(f"{what} ({n_steps} kernels; device us, CUDA graph replays, median of {args.rounds} rounds"
                  f"{legend}):", flush=True)
            for i, label in enumerate(labels):
                print(f"  {_columns([u[i] for u in us])}  {label}")
            sums, wholes = [sum(u[:-1]) for u in us], [u[-1] for u in us]
            print(f"  {_columns(sums)}  sum of the kernels alone\n  {_columns(wholes)}  the chain ("
                  + ", ".join(f"{w - s:+.2f}" for w, s in zip(wholes, sums)) + " against the sum)", flush=True)
        # a chain and its model refer to each other: only the cyclic GC frees their workspaces before the next
        # workload's (bench/results/h100-gemm-pingpong/README.md: sdf512 ran out of memory after rec1024 at 2^21 rows)
        del builds, kernels, timers
        gc.collect()
    return 0


def kernel_plans(mlp, gpu, io):
    """Every kernel plan a call of mlp with io in and out builds on a named GPU (GPUS) by default (untuned): its one
    fused kernel's, or a chain's (fused stretches, GEMMs, norm and pad passes: _segments.plans)."""
    target = (gpu["arch"], gpu["smem_per_block"], gpu["sm_count"], gpu["smem_per_sm"])
    if mlp._segments_for(*target, io, io) is None:
        return [mlp._net.plan(gpu["arch"], gpu["smem_per_block"], gpu["sm_count"], io, io,
                              smem_per_sm=gpu["smem_per_sm"], precision=mlp._precision)]
    return _segments.plans(mlp, gpu["arch"], io, io, target)


def same_cubins(args):
    """(no GPU) Whether a kernel-template change leaves what runs as it was: each workload's kernels for a named GPU
    (kernel_plans) rendered from the baseline folder's templates and from the working tree's, compiled by NVRTC (its
    own cache off) and compared byte for byte. A change meant to move code without changing it (a refactor, a
    comment) shows "same" for every kernel, and needs no device time to prove it; one that differs says which kernels
    a GPU must run again. "same code": every code section (.text.*) byte for byte, the rest not (a new namespace-scope
    constexpr is a symbol and a constant of its own in the cubin, which no instruction reads). Exit status 1 where any
    kernel's code differs.

        mkdir -p build/base && for f in kernel_templates/*; do git show HEAD:$f > build/base/${f##*/}; done
        python -m fusedmlp.bench probe same --base build/base [--gpu h100] [--dtype float16] [--io float16]
            [workload ...]
    """
    gpu = GPUS[args.gpu]
    _api._nvrtc_info()  # (NVRTC missing: the error that says how to get it)
    options = _api.nvrtc_no_cache()
    differs = 0
    for name in args.workloads:
        mlp = model(workload(name), device="cpu", dtype=args.dtype)
        if args.dtype in _api.LOWBIT:
            calibrate(mlp)
        verdicts = []
        for plan in kernel_plans(mlp, gpu, args.io):
            cubins = []
            for folder in (args.base, None):
                with templates_from(folder):
                    source = _api._source_of(plan)
                cubins.append(_api._core().nvrtc_compile(source, _api.KERNEL_NAME, gpu["arch"], gpu["arch"] == 90,
                                                         options)[0])
            same = cubins[0] == cubins[1]
            same_code = same or code_sections(cubins[0]) == code_sections(cubins[1])
            differs += not same_code
            info = plan.info
            what = ("norm pass" if info.get("norm_pass") else "pad pass" if info.get("pad_pass") else
                    "GEMM" if info.get("gemm") else "fused")
            verdicts.append(f"{what} {'same' if same else 'same code' if same_code else 'DIFFERS'}")
        print(f"{name:11s} {args.dtype} sm_{gpu['arch']}: " + ", ".join(verdicts), flush=True)
    return 1 if differs else 0


def code_sections(cubin):
    """A cubin's code sections (an ELF64's sections named .text.*): {name: bytes}."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3a)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]  # (name offset, type, flags, address, file offset, size)
    name = lambda h: cubin[names_at + h[0]:cubin.index(b"\0", names_at + h[0])].decode()  # noqa: E731
    return {name(h): cubin[h[4]:h[4] + h[5]] for h in headers if name(h).startswith(".text.")}


#: The GEMM forms `probe gemm` times beside the plan's auto form at each tile: the plain one, clusters of 2 sharing
#: B, the producer warpgroup, the consumers in turn, the producer's form on a persistent grid (each where the plan
#: takes it).
GEMM_FORMS = ({}, {"ws": -1}, {"cluster": 2}, {"ws": 1}, {"ws": 2}, {"ws": 3})


def gemm_forms(args):
    """(GPU) Each GEMM layer of a segmented network timed in every tile (_segments.SMALL_TILES and the plan's
    default) and form (the plan's auto form, the plain one, clusters of 2 sharing B, a producer warpgroup, consumers
    in turn; tma=-1 / tma_store=-1 in --form: A by cp.async, y by the warps' stores), per batch size, in alternating
    rounds (Kernel.time: the best of 5 launches a round, the median over rounds). What _segments.gemm_tile picks is
    marked with *, the fastest with <. Only the GEMMs are built, not the chain around them. --dtype: the compute
    dtype (an 8-bit one calibrated: model). --form (repeat): only these forms beside the auto one (e.g. ws=3,
    cluster=2; a tile in it, bn=256, replaces the tile's); --default-tile: only the plan's default tile (a large
    batch's).

        python -m fusedmlp.bench probe gemm [workloads] [--rows 1024] [--rows 16384] [--dtype float8]
            [--form ws=1 --form ws=3] [--default-tile]
    """
    require_gpu("gemm")
    io = args.io
    for name in args.workloads:
        mlp = model(workload(name), dtype=args.dtype)
        target = mlp._target()
        segments = mlp._segments_for(*target, io, io)
        if segments is None:
            print(f"{name}: one fused kernel, no GEMM", flush=True)
            continue
        for seg in segments:
            if seg.kind != "gemm":
                continue
            layer = seg.first
            dtypes = _segments.gemm_dtypes(mlp, layer, io, io)
            default = mlp._gemm_plan(layer, *target, *dtypes).info
            default = (default["bm"], default["bn"])
            tiles = [default] + ([] if args.default_tile else [t for t in _segments.SMALL_TILES if t != default])
            kernels, labels, seen, specialised = [], [], set(), []
            for bm, bn in tiles:
                for form in [{}] + args.form if args.form else GEMM_FORMS:
                    try:
                        info = mlp._gemm_plan(layer, *target, *dtypes, **{"bm": bm, "bn": bn, **form}).info
                    except (LimitError, ArgumentError):  # a form this tile does not take
                        continue
                    shape = (info["bm"], info["bn"], info["cluster"], info["ws"], info["tma"], info["tma_store"])
                    if shape in seen:  # the form is the auto one here, or the plan kept another
                        continue
                    seen.add(shape)
                    kernels.append(mlp._build_gemm(layer, *dtypes, **{"bm": bm, "bn": bn, **form}))
                    what = (" c2" if info["cluster"] == 2 else "") + (f" ws{info['ws']}" if info["ws"] else "") + (
                        " tma" if info["tma"] else "") + (" ts" if info["tma_store"] else "")
                    labels.append((bm, bn, f"{info['bm']}x{info['bn']}{what}", not form))
                    if not form and info["ws"]:
                        specialised.append((bm, bn))
            print(f"{name} layer {layer} ({mlp.widths[layer]} -> {mlp.widths[layer + 1]}), {args.dtype} compute, {io} "
                  "I/O; kernel us, median of rounds:", flush=True)
            for rows in args.rows or [1024, 16384]:
                times = alternate(kernels, rows, args.rounds)
                med = [statistics.median(t) * 1e3 for t in times]
                picked = _segments.gemm_tile(rows, mlp.widths[layer + 1], default, target[2], specialised)
                best = min(range(len(med)), key=med.__getitem__)
                cells = [f"{lab}{'*' if (bm, bn) == picked and auto else ''}{'<' if i == best else ''} {us:.2f}"
                         for i, ((bm, bn, lab, auto), us) in enumerate(zip(labels, med))]
                print(f"  {rows:>8} rows: " + "; ".join(cells), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ entry


def _parser():
    ap = argparse.ArgumentParser(prog="python -m fusedmlp.bench probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="subcommand")

    def command(name, fn, summary):
        p = sub.add_parser(name, help=summary, description=fn.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=fn, parser=p)
        return p

    known = f"workload names (default: the benchmark's); besides them: {', '.join(EXTRA)}"
    rows_help = "a batch size; repeat for more"

    p = command("list", list_plans, "(no GPU) each workload's plan for a GPU, ahead of time; the tuner's candidates")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the GPU to plan for (default h100)")
    p.add_argument("--io", choices=IO_DTYPES, default="float16", help="x's and y's dtype (default float16)")
    p.add_argument("--dtype", choices=DTYPES, default="float16",
                   help="the compute dtype (default float16; an 8-bit one calibrated on fixed rows first)")
    p.add_argument("--plan", type=parse_plan, action="append", default=[], help="forced plan options to plan too")
    p.add_argument("--rows", type=int, action="append", default=[],
                   help=f"{rows_help}: the untuned choice and the tuner's candidates for it")

    p = command("plans", time_plans, "(GPU) forced plans timed against the default one; --check")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--plan", type=parse_plan, action="append", default=[], help="forced plan options; repeat")
    p.add_argument("--rows", type=int, action="append", help=f"{rows_help} (default 1024 and 2097152)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--io", choices=IO_DTYPES, default="float16", help="x's and y's dtype (default float16)")
    p.add_argument("--check", action="store_true", help="first compare each plan's outputs with the default's")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="the compute dtype (default float16)")

    p = command("ab", ab_templates, "(GPU) baseline kernel templates against the working tree's; --check")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--base", action="append", required=True, help="a folder of baseline template files; repeat")
    p.add_argument("--rows", type=int, default=2**21, help="batch size (default 2097152)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    p.add_argument("--plan", type=parse_plan, default={}, help="forced plan options for every kernel")
    p.add_argument("--check", action="store_true", help="first compare the kernels' outputs")

    p = command("tune", tune_first_calls, "(GPU, PyTorch) the tuner's choice and a cold first call, per batch size")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--rows", type=int, action="append", help=f"{rows_help} (default 1024 and 2097152)")
    p.add_argument("--templates", help="a folder of kernel template files to use instead of the package's")

    p = command("act", activation_cost, "(GPU) a workload's kernel timed with its hidden activation swapped")
    p.add_argument("workload", help="a workload name")
    p.add_argument("activations", nargs="+", help="hidden-layer activations (names or expressions) to compare")
    p.add_argument("--rows", type=int, default=2**21, help="batch size (default 2097152)")
    p.add_argument("--dtype", choices=_api.PRECISIONS, default="float16", help="the compute dtype (default float16)")
    p.add_argument("--plan", type=parse_plan, action="append", default=[],
                   help="forced plan options, timed with the first activation; repeat")

    p = command("cold", cold_first_call, "(GPU, PyTorch) a cold first call's NVRTC compiles, timed")
    p.add_argument("workload", nargs="?", default="siren256", help="a workload name (default siren256)")
    p.add_argument("--calls", type=int, default=4, help="cold first calls, each of a new model (default 4)")

    p = command("host", host_time, "(GPU, PyTorch) host microseconds per call of a small call's pieces")
    p.add_argument("workload", nargs="?", default="tcnn64", help="a workload name (default tcnn64)")
    p.add_argument("--rows", type=int, default=1024, help="batch size (default 1024)")

    p = command("steps", chain_steps, "(GPU, PyTorch) a segmented network's kernels timed one by one")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--rows", type=int, action="append", help=f"{rows_help} (default 1024)")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="the compute dtype (default float16)")
    p.add_argument("--gemm", type=parse_gemm, default={}, help="GEMM options forced on every GEMM, e.g. bn=128")
    p.add_argument("--base", action="append", default=[],
                   help="a folder of baseline template files to time against the working tree's; repeat")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    p.add_argument("--check", action="store_true", help="first compare the builds' outputs")

    p = command("gemm", gemm_forms, "(GPU) each GEMM layer of a segmented network in every tile and form")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--rows", type=int, action="append", help=f"{rows_help} (default 1024 and 16384)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--io", choices=("float16", "float32"), default="float16", help="x's and y's dtype")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="the compute dtype (default float16)")
    p.add_argument("--form", type=parse_gemm, action="append", default=[],
                   help="a form to time beside the auto one (e.g. ws=3); repeat (default: every form)")
    p.add_argument("--default-tile", action="store_true", help="only the plan's default tile")

    p = command("same", same_cubins, "(no GPU) a template change's kernels against the baseline's, byte for byte")
    p.add_argument("workloads", nargs="*", help=known)
    p.add_argument("--base", required=True, help="a folder of baseline template files")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the GPU to plan for (default h100)")
    p.add_argument("--io", choices=IO_DTYPES, default="float16", help="x's and y's dtype (default float16)")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="the compute dtype (default float16)")
    return ap


def main(argv=None):
    """Runs one probe subcommand; returns its exit status (0), or exits 2 on a usage error and 1 where the GPU (or
    PyTorch) a subcommand needs is missing."""
    ap = _parser()
    args = ap.parse_args(argv)
    if hasattr(args, "workloads"):
        args.workloads = _workload_names(args.parser, args.workloads)
    else:
        _workload_names(args.parser, [args.workload])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
