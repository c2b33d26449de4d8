"""What Ray Data costs on top of fusedmlp: 2^24 rows through one GPU actor against a loop over the same blocks.

For each workload (fusedmlp.bench.WORKLOADS) and block size (2^22 rows and up), the same float32 blocks run
  - loop: one process, ``mlp(block)`` for each block in turn (NumPy in, NumPy out: host copies and the kernel), after
    a warm-up call of the block size;
  - ray: the blocks already in Ray's object store (``ray.data.from_numpy(blocks).materialize()``), mapped by one
    ``FusedMLPPredictor`` actor (``num_gpus=1``, ``batch_size`` = the block, one tensor column in, one out) and
    materialized in the object store. The actor builds its model from the kernel cache the loop filled and makes a
    warm-up call of the block size in its constructor (``warmup_rows``); the time counted runs from the end of that
    constructor (the actor reports it) to the end of ``materialize()``: reading every block, the calls, storing
    every output. The time from the submission on (process start, import, model build) is reported too.
overhead = ray / loop - 1, best of --reps runs of each. Both sides run the same kernel (the tuning record the loop
wrote is in the shared cache), so the outputs are compared bit for bit.

Fairness: neither side counts its one-time costs (process start, import, kernel load, tuning, a warm-up call of the
block size). Both read blocks where they live (the loop: its process's memory; Ray: the object store, mapped into
the actor, whose first touch of each page is counted: a real cost of Ray's) and produce NumPy outputs (Ray's then
stored in the object store, counted). Ray's wait for the first block after the actor is ready and its time after the
last call are counted: every pipeline pays them. The printed line splits the Ray time into those parts.

Each Ray variant (--variants FORMAT/CALLS) is timed against the same loop: FORMAT is Ray Data's fixed-shape tensor
format (DataContext.arrow_fixed_shape_tensor_format: v2, Ray 2.60's default, a list array with an int64 offset per
row; native, pyarrow's fixed_shape_tensor, no offsets), CALLS is ActorPoolStrategy's
max_concurrent_calls_per_actor (2: Ray Data reads the next block and stores the last output in a second thread while
the predictor's calls stay one at a time).

    python3 bench/ray_overhead.py --out ray_overhead.json
Options: --rows (2^24), --block-rows (2^22 2^23), --workloads (pinn50 flex siren256 tcnn64), --reps (3),
--variants (v2/1 native/1 native/2), --actors (1; e.g. 1 2 4 for the scaling over a machine's GPUs), --cpu (the CPU path, no GPU: a smoke run of the script; ~5 s per 2^20 rows of
pinn50 on two cores, so give it small --rows), --stand-in (a NumPy stand-in for the model on both sides, CPU actors:
Ray's part alone, in seconds).

Ray is not in the device machine's image and its wheel (79 MB) is over what a call carries, so it travels as an
archive of the installed package without its Java jars and dashboard build (~38 MB). Here, once:
    echo /.raysite/ >> .git/info/exclude
    P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
       --platform manylinux_2_17_x86_64"
    python3 -m pip download -q --no-deps $P -d /tmp/raywhl ray==2.60.0 jsonschema jsonschema-specifications \
        referencing rpds-py
    python3 -m pip install -q --no-deps $P --target /tmp/raysite /tmp/raywhl/*.whl
    rm -rf /tmp/raysite/ray/jars /tmp/raysite/ray/dashboard/client/build /tmp/raysite/bin
    mkdir -p .raysite && tar -C /tmp/raysite -cJf .raysite/site.tar.xz .
On the device (carry .raysite):
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .raysite/site.tar.xz && export PYTHONPATH=/tmp/site &&
    source bench/device_setup.sh && python3 bench/ray_overhead.py --workloads pinn50 siren256 tcnn64 --reps 2 \
        --out $OUT/ray_overhead.json 2>&1 | grep -v INFO
The other packages Ray needs (click, msgpack, protobuf, pyyaml, requests, aiohttp, pandas, pyarrow, ...) are in the
image; the archive ran Ray Data's actors under CPython 3.12 with them.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

import fusedmlp
import fusedmlp.ray
from fusedmlp import _gpu
from fusedmlp.bench import WORKLOADS, fused_options

#: The actors' timing notes: one JSON line per event, appended by each actor process (same machine as the driver).
_NOTES = os.path.join(tempfile.gettempdir(), f"fusedmlp-ray-overhead-{os.getpid()}.jsonl")


class StandIn:
    """--stand-in's model: reads every input row (its first feature) and writes every output, in NumPy, so that a CPU
    run measures Ray's part in seconds (the CPU path takes ~5 s per 2^20 rows of pinn50 on two cores)."""

    def __init__(self, widths):
        self.widths = tuple(widths)
        self.in_features = self.widths[0]  # (FusedMLP's: x's features, which the predictor reads)
        self.devices = ["stand-in"]

    def __call__(self, x):
        y = np.empty((len(x), self.widths[-1]), dtype=np.float32)
        y[...] = x[:, :1]
        return y


class TimedPredictor(fusedmlp.ray.FusedMLPPredictor):
    """FusedMLPPredictor that notes when its constructor ended and how long each call took (wall clock, time.time:
    comparable with the driver's on one machine). Defined in __main__, so Ray ships it to the actor by value."""

    def __init__(self, notes, stand_in=False, warmup_rows=0, **kwargs):
        started = time.time()
        super().__init__(warmup_rows=0 if stand_in else warmup_rows, **kwargs)
        if stand_in:
            self._mlp = StandIn(self._mlp.widths)
            self._mlp(np.zeros((warmup_rows, self._mlp.widths[0]), dtype=np.float32))
        self._notes = notes
        self._note(event="ready", start=started, end=time.time(), devices=self.model.devices)

    def _note(self, **fields):
        with open(self._notes, "a") as f:
            f.write(json.dumps(fields) + "\n")

    def __call__(self, batch):
        start = time.time()
        out = super().__call__(batch)
        self._note(event="call", start=start, end=time.time(), rows=len(out["y"]), pid=os.getpid())
        return out


def _model(workload, folder, rng):
    """Saves the workload's network with nn.Linear's initialisation as npz; returns (path, FusedMLP options)."""
    wl = WORKLOADS[workload]
    arrays = {}
    for i, (n_in, n_out) in enumerate(zip(wl.layer_inputs(), wl.widths[1:])):
        bound = 1 / np.sqrt(n_in)
        arrays[f"{i}.weight"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32)
        if wl.bias:
            arrays[f"{i}.bias"] = rng.uniform(-bound, bound, n_out).astype(np.float32)
    path = os.path.join(folder, f"{workload}.npz")
    np.savez(path, **arrays)
    return path, fused_options(wl)


def _loop(mlp, blocks, reps):
    mlp(blocks[0])  # warm-up: kernel built or loaded, tuned for the block size
    best, outputs = None, None
    for _ in range(reps):
        start = time.perf_counter()
        outputs = [mlp(b) for b in blocks]
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    return best, outputs


#: DataContext.arrow_fixed_shape_tensor_format's values by the names --variants uses.
_FORMATS = {"v2": "V2", "native": "ARROW_NATIVE"}


def _variant(text):
    """'native/2' -> ('native', 2): the tensor format, and max_concurrent_calls_per_actor."""
    fmt, _, calls = text.partition("/")
    if fmt not in _FORMATS or not calls.isdigit() or int(calls) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a variant is FORMAT/CALLS, FORMAT one of {sorted(_FORMATS)}, "
                                         "CALLS >= 1 (max_concurrent_calls_per_actor)")
    return fmt, int(calls)


def _tensor_format(ray, fmt):
    """Sets the driver's DataContext (Ray Data ships it to the actors with the pipeline)."""
    from ray.data._internal.tensor_extensions.arrow import FixedShapeTensorFormat

    ray.data.DataContext.get_current().arrow_fixed_shape_tensor_format = getattr(FixedShapeTensorFormat, _FORMATS[fmt])


def _ray_once(ray, ds, kwargs, block_rows, resources, calls_per_actor, actors=1, strict=True):
    if os.path.exists(_NOTES):
        os.unlink(_NOTES)
    submitted = time.time()
    # max_concurrent_calls_per_actor > 1: Ray Data reads the next block and stores the last output in other threads
    # of the actor while the UDF runs one call at a time (enable_true_multi_threading stays False)
    pool = ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=calls_per_actor)
    out = ds.map_batches(TimedPredictor, fn_constructor_kwargs=dict(notes=_NOTES, warmup_rows=block_rows, **kwargs),
                         batch_size=block_rows, compute=pool, zero_copy_batch=True, **resources).materialize()
    done = time.time()
    with open(_NOTES) as f:
        notes = [json.loads(line) for line in f]
    ready = [n for n in notes if n["event"] == "ready"]
    calls = sorted((n for n in notes if n["event"] == "call"), key=lambda n: n["start"])
    # strict (the device runs): every actor of the pool took part, none restarted. The stand-in's CPU smoke run is
    # short (4 blocks): Ray Data 2.60 may finish it on the first actor before the second is up, so there it allows
    # fewer, and the result says how many were ready (actors_ready)
    assert len(ready) == actors or (not strict and 1 <= len(ready) <= actors), \
        f"expected {actors} actor(s), got {len(ready)} (restarts?)"
    # with several actors the clock starts when the first is ready (blocks flow to it from then on); ready_skew_s
    # says how much later the last one was
    first_ready = min(n["end"] for n in ready)
    return {"actors_ready": len(ready), "steady_s": done - first_ready, "from_submit_s": done - submitted,
            "actor_start_s": first_ready - submitted, "ready_skew_s": max(n["end"] for n in ready) - first_ready,
            "constructor_s": max(n["end"] - n["start"] for n in ready),
            "calls_s": sum(n["end"] - n["start"] for n in calls), "calls": len(calls),
            # where the rest of steady_s goes (one actor): before the first block reaches the actor, between calls
            # (the actor idle: its last output stored, the next block read), and after the last call (its output
            # stored, the executor's end, materialize's return); summed over actors where there are several
            "first_call_wait_s": calls[0]["start"] - first_ready,
            "between_calls_s": sum(max(0.0, b["start"] - a["end"]) for pid in {n["pid"] for n in calls}
                                   for a, b in _pairs([n for n in calls if n["pid"] == pid])),
            "after_last_call_s": done - max(n["end"] for n in calls),
            "devices": sorted({d for n in ready for d in n["devices"]})}, out


def _pairs(items):
    return zip(items, items[1:])


def _gather(out):
    """The outputs of a materialized dataset, in block order, as one array."""
    return np.concatenate([b["y"] for b in out.iter_batches(batch_size=None, batch_format="numpy")])


def measure(ray, workload, rows, block_rows, reps, folder, cache, rng, variants, cpu=False, stand_in=False,
            actor_counts=(1,)):
    """The loop once, then each variant (tensor format, calls per actor) of the Ray pipeline with each number of
    actors: a list of results."""
    path, options = _model(workload, folder, rng)
    widths = WORKLOADS[workload].widths
    x = rng.standard_normal((rows, widths[0]), dtype=np.float32)
    blocks = [x[a:a + block_rows] for a in range(0, rows, block_rows)]
    if stand_in:
        mlp = StandIn(widths)
    else:
        mlp = fusedmlp.FusedMLP.from_npz(path, device="cpu" if cpu else "cuda", cache_dir=cache, **options)
    loop_s, loop_out = _loop(mlp, blocks, reps)
    loop_y = np.concatenate(loop_out)
    del loop_out
    kwargs = dict(model=path, input_columns="data", output_columns="y", keep_columns=False, cache_dir=cache,
                  stand_in=stand_in, **options)
    results = []
    for fmt, calls_per_actor in variants:
        _tensor_format(ray, fmt)
        ds = ray.data.from_numpy(blocks).materialize()  # in the object store, in this format, before the clock starts
        stored = str(ds.schema().base_schema.field("data").type)  # Ray falls back to V2 where pyarrow is older than 16
        one_actor_s = None
        for actors in actor_counts:
            runs, same = [], True
            for _ in range(reps):
                run, out = _ray_once(ray, ds, kwargs, block_rows,
                                     {"num_cpus": 1} if cpu or stand_in else {"num_gpus": 1}, calls_per_actor, actors,
                                     strict=not stand_in)
                y = _gather(out)
                same = same and bool(y.shape == loop_y.shape and np.array_equal(y, loop_y, equal_nan=True))
                del out, y  # the object store holds one run's outputs at a time
                runs.append(run)
            best = min(runs, key=lambda r: r["steady_s"])
            one_actor_s = one_actor_s or (best["steady_s"] if actors == 1 else None)
            result = {"workload": workload, "widths": list(widths), "rows": rows, "block_rows": block_rows,
                      "blocks": len(blocks), "tensor_format": fmt, "max_concurrent_calls_per_actor": calls_per_actor,
                      "actors": actors, "stored_as": stored,
                      "stand_in": stand_in, "loop_s": loop_s, "ray": best, "ray_runs": runs,
                      "overhead": best["steady_s"] / loop_s - 1,
                      "overhead_from_submit": best["from_submit_s"] / loop_s - 1,
                      "loop_rows_per_s": rows / loop_s, "ray_rows_per_s": rows / best["steady_s"],
                      "efficiency_vs_one_actor": one_actor_s / best["steady_s"] / actors if one_actor_s else None,
                      "bit_identical": same}
            scaling = (f", x{one_actor_s / best['steady_s']:.2f} one actor (efficiency "
                       f"{result['efficiency_vs_one_actor']:.2f}, ready skew {best['ready_skew_s'] * 1e3:.0f} ms)"
                       if one_actor_s and actors > 1 else "")
            print(f"{workload:9s} {block_rows:>9d} rows/block {fmt:>6s}/{calls_per_actor} {actors} actor(s): loop "
                  f"{loop_s * 1e3:7.1f} ms, ray {best['steady_s'] * 1e3:7.1f} ms = first wait "
                  f"{best['first_call_wait_s'] * 1e3:5.1f} + calls {best['calls_s'] * 1e3:7.1f} + between "
                  f"{best['between_calls_s'] * 1e3:6.1f} + after last {best['after_last_call_s'] * 1e3:5.1f} "
                  f"({best['from_submit_s']:.2f} s from submit), overhead {result['overhead'] * 100:+6.1f}%{scaling}, "
                  f"same bits: {same}", flush=True)
            results.append(result)
        del ds
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, default=1 << 24)
    parser.add_argument("--block-rows", type=int, nargs="+", default=[1 << 22, 1 << 23])
    parser.add_argument("--workloads", nargs="+", default=["pinn50", "flex", "siren256", "tcnn64"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--variants", nargs="+", type=_variant, default=[("v2", 1), ("native", 1), ("native", 2)],
                        help="Ray pipelines to time, each FORMAT/CALLS: the fixed-shape tensor format (v2: Ray's "
                             "default; native: pyarrow's fixed_shape_tensor) and max_concurrent_calls_per_actor")
    parser.add_argument("--actors", type=int, nargs="+", default=[1],
                        help="actor pool sizes to time (each actor one GPU, or one CPU with --cpu/--stand-in); with "
                             "several, each also against one actor: the scaling over GPUs")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU path (no GPU needed)")
    parser.add_argument("--stand-in", action="store_true",
                        help="a NumPy stand-in for the model on both sides (CPU actors): Ray's part alone")
    args = parser.parse_args(argv)
    # a time limit's SIGTERM (timeout(1) on the device machine) ends the run through the finally below, which writes
    # the JSON of what was measured so far
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    import ray

    folder = tempfile.mkdtemp(prefix="fusedmlp-ray-overhead-")
    cache = os.environ.get("FUSEDMLP_CACHE_DIR") or os.path.join(folder, "cache")
    ray.init(include_dashboard=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.execution_options.preserve_order = True  # outputs in block order, to compare with the loop's
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    import pyarrow

    report = {"argv": sys.argv, "ray": ray.__version__, "pyarrow": pyarrow.__version__, "fusedmlp": fusedmlp.__version__,
              "python": platform.python_version(), "resources": ray.cluster_resources(), "dev_shm_bytes": shm,
              "gpu": "stand-in" if args.stand_in else "cpu" if args.cpu else _gpu.gpu(0).info["name"],
              "autotune": os.environ.get("FUSEDMLP_AUTOTUNE", "on"),
              "results": []}
    print(f"{report['gpu']}, Ray {ray.__version__}, pyarrow {pyarrow.__version__}, /dev/shm {shm / 2**30:.1f} GiB, object store "
          f"{report['resources'].get('object_store_memory', 0) / 2**30:.1f} GiB", flush=True)
    rng = np.random.default_rng(20261125)
    try:
        for workload in args.workloads:
            for block_rows in args.block_rows:
                report["results"].extend(measure(ray, workload, args.rows, block_rows, args.reps, folder, cache, rng,
                                                 args.variants, args.cpu, args.stand_in, args.actors))
    finally:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.exists(_NOTES):
            os.unlink(_NOTES)
    for fmt, calls_per_actor in args.variants:
        mine = [r for r in report["results"] if (r["tensor_format"], r["max_concurrent_calls_per_actor"])
                == (fmt, calls_per_actor)]
        worst = max(mine, key=lambda r: r["overhead"])
        print(f"{fmt}/{calls_per_actor}: worst overhead {worst['overhead'] * 100:+.1f}% ({worst['workload']}, "
              f"{worst['block_rows']} rows/block) over {len(mine)} runs, all bit-identical: "
              f"{all(r['bit_identical'] for r in mine)}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
