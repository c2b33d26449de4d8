"""Profile-then-generate tile selection, the way TVM's CUTLASS backend does it.

For a model, a dtype and a batch-size bucket: build each candidate tile shape (warps per CTA x 16-row tiles per warp;
the plan fills in chunking and weight residency), time it on the real device with the real batch size, and keep the
fastest. The choice is persisted beside the kernel cache, keyed by GPU name, compute capability, SM count, widths,
activations, biases and dtype, so a later process starts with it. The kernels are the full ones (epilogue included):
compiling the real kernel is as cheap as a skeleton here, and times what will run.
"""

import concurrent.futures
import hashlib
import json
import logging
import os
import tempfile

from . import _norm
from .errors import CompileError, LimitError

log = logging.getLogger("fusedmlp")

#: The tuning records' format, part of their key: a change to what the candidates are, or to which of them fit a
#: network, bumps it, so records chosen among other candidates are measured again. 3: the warpgroup kernel's float32 I/O
#: buffers shrank (session 14), so tcnn128 with float32 x and y fits 12 warps where 4 were all that fit (and won).
#: 4: the streamed register-A form (plan.c, fm_plan_stream) took the 256-wide networks that were on one-warpgroup
#: clusters, and with them a plain CANDIDATES_WGMMA list and warps=4 meaning that form (records chosen among cluster
#: candidates are measured again). 5: CANDIDATES_SPLIT for networks with wide layers at small batches. 6: residuals
#: from further back than the layer's own input on the warpgroup kernels (such networks were tuned over mma.sync's
#: tiles; on the H100 the benchmark's simba64 at 2^10 rows: wg4 9.39 us, mma.sync's w4m1 13.1).
FORMAT = 6
#: Tile shapes tried, as plan options. The plan picks chunk widths and residency for each.
CANDIDATES = ({"warps": 8, "m_tiles": 2}, {"warps": 8, "m_tiles": 1}, {"warps": 4, "m_tiles": 2},
              {"warps": 4, "m_tiles": 1})
#: On sm_90, for a network the warpgroup (wgmma) kernel takes: that kernel at 1-4 warpgroups per CTA instead. On the
#: H100 it beat every mma.sync tile for each benchmark workload and batch bucket from 2^10 to 2^21 rows (by 1.2x at
#: 2^10 to 2.7x at 2^21; bench/results/h100-quick/bench.json, "tile"), so compiling and timing those too only made the
#: first call slower.
CANDIDATES_WGMMA = tuple({"wgmma": 1, "warps": w} for w in (16, 12, 8, 4))
#: For a network the plan puts on clusters (hidden layers too wide for one CTA's registers or shared memory), the
#: CANDIDATES_WGMMA (each on the fewest CTAs per cluster that fit) and one warpgroup per CTA on clusters of 2 and 4:
#: more, narrower CTAs for small batches. On the H100 at 2^10 rows siren256 ran 9.7 us on clusters of 4 with one
#: warpgroup against 10.7 us on clusters of 2 (the earlier choice), and 2.6-6.5x slower than the default on clusters of
#: 4 from 2^14 rows on (bench/results/h100/plan_probe_s10.txt): the batch size decides, so the tuner does.
CANDIDATES_CLUSTER = CANDIDATES_WGMMA + tuple({"wgmma": 1, "cluster": c, "warps": 4} for c in (2, 4))
#: Added where the default cluster plan has one warpgroup per CTA on clusters of 4 (weights too large for two even
#: there; since the streamed register-A form, only networks that form does not take either, such as residuals from an
#: earlier layer's output, reach such a plan): the mma.sync kernel's default tile, weights streamed. For 64-256x5-64
#: (590 KB) it ran 1.6-2x faster than the cluster plan from 2^18 rows on and 3.4x slower at 2^10
#: (bench/results/h100/plan_probe_s11.txt). Not for siren256 (two warpgroups per CTA): 2.2-3.8x slower at every batch
#: size, and a fourth compile of its first call; nor for one warpgroup on clusters of 2 (64-256-256-192, 2-256-256-256:
#: 1.2-3.5x slower, plan_probe_s15.txt).
CANDIDATES_MMA_FALLBACK = ({"warps": 8, "m_tiles": 1},)
#: Added where the default plan is the streamed warpgroup kernel with layers wider than 256, for batches under
#: SPLIT_ROWS_PER_SM rows per SM: one warpgroup per CTA with the wide layers split over clusters of 2 and 4 CTAs
#: (fm_plan.split), so a small batch's few 64-row tiles keep 2-4x as many SMs busy. wide512 on the H100, one warpgroup
#: per CTA unsplit / split over 2 / over 4 (bench/results/h100-wide-split/plan_probe_split*.txt): 1024 rows 44.7 /
#: 31.9 / 25.6 us (over 8, 64-column groups: 40.6), 2048 rows 44.3 / 32.2 / 46.6, 4096 rows 42.8 / 31.9 / 66.6, 8192
#: rows 43.0 / 59.3 / 108.5; at 16384 rows and more 2.1-6.2x the default's time.
CANDIDATES_SPLIT = tuple({"wgmma": 1, "resident": 0, "warps": 4, "split": s} for s in (2, 4))
SPLIT_ROWS_PER_SM = 32
#: The most rows a candidate is timed on. Kernel.time stages the rows it times (random inputs drawn on the host,
#: copied to the kernel's staging buffers, freed once it is timed), and every candidate is built first: a
#: first call of 2^26 rows of tcnn128 staged 8.6 GB of x per candidate, in host memory and on the GPU beside the
#: caller's batch. From 2^18 rows on the tiles run in many waves and the choice settles: of the benchmark workloads'
#: tunings at 2^18 and 2^21 rows on the H100 (bench/results/h100*/bench.json), every choice but one (flex, 1.5% apart
#: at 2^18) was the same at both; none is measured above 2^21, where the larger buckets are now timed.
TUNE_MAX_ROWS = 1 << 21


def label(options):
    """A candidate's short name in timings: w8m2 (mma.sync, 8 warps x 32 rows), wg16 (wgmma, 16 warps), wg4c2
    (wgmma, 4 warps per CTA, clusters of 2) or wg4s4 (wgmma, 4 warps per CTA, wide layers split over clusters of 4)."""
    if options.get("wgmma"):
        return (f"wg{options['warps']}" + (f"c{options['cluster']}" if options.get("cluster") else "") +
                (f"s{options['split']}" if options.get("split") else ""))
    return f"w{options['warps']}m{options['m_tiles']}"


def bucket(rows):
    """The batch-size bucket of rows: the power of 4 at or above it (one record covers sizes within a factor 4)."""
    b = 1
    while b < rows:
        b *= 4
    return b


def _model_key(mlp, dtype, out_dtype, gpu_info):
    desc = [FORMAT, gpu_info["name"], gpu_info["arch"], gpu_info["sm_count"], list(mlp.widths), list(mlp.activations),
            list(mlp._has_bias), dtype, out_dtype, mlp._precision, [list(r) if r else None for r in mlp._residual],
            list(mlp._concat)]
    if any(mlp._norm):  # only then: the keys of networks without norms stay as they were
        desc.append(_norm.key(mlp._norm))
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()


class TuningStore:
    """Tuning records as small JSON files under <cache dir>/tuning/, written atomically; unreadable ones are misses."""

    def __init__(self, cache_directory):
        self.directory = os.path.join(str(cache_directory), "tuning")
        self._memory = {}

    def load(self, key):
        if key in self._memory:
            return self._memory[key]
        try:
            with open(os.path.join(self.directory, key + ".json")) as f:
                data = json.load(f)
            record = data["buckets"] if data.get("format") == FORMAT else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, damaged, or not our format
            record = {}
        self._memory[key] = record
        return record

    def save(self, key, record):
        self._memory[key] = record
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT, "buckets": record}, f, indent=1)
                os.replace(tmp, os.path.join(self.directory, key + ".json"))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:  # a read-only cache: the choice lives for this process only
            log.debug("fusedmlp: tuning record not saved (%s)", e)


def tune_bucket(mlp, dtype, out_dtype, rows, reps=5, bucket_rows=None, sm_count=0):
    """Times every candidate for rows (less those _dominated for batches up to bucket_rows on sm_count SMs) and
    returns (best options, {candidate: ms})."""
    def build(options):
        try:
            return options, mlp._build(dtype, out_dtype, **options)[0]
        except LimitError:  # planned, but the GPU runs no block (or cluster) of it: occupancy 0 at load
            return options, None
        except CompileError as e:  # a candidate the compiler refuses is skipped, not the call's failure
            log.warning("fusedmlp: tuning candidate %s did not compile: %s", label(options), e.message)
            return options, None

    # dominated ones out before _distinct: else a dominated candidate could stand for a plan a kept one shares
    kept = [o for o in _candidates(mlp, dtype, out_dtype) if not _dominated(o, bucket_rows or rows, sm_count)]
    candidates = _distinct(mlp, dtype, out_dtype, kept)
    if not candidates:
        return None, {}
    with concurrent.futures.ThreadPoolExecutor(len(candidates)) as pool:  # NVRTC releases the GIL
        built = list(pool.map(build, candidates))
    timings = {}
    for options, kernel in built:
        if kernel is not None:
            timings[label(options)] = kernel.time(rows, reps)
    if not timings:
        return None, timings
    best = min(timings, key=timings.get)
    return next(o for o, _ in built if label(o) == best), timings


def _plan_info(mlp, dtype, out_dtype, **options):
    """The info of the model's plan on its GPU with these options; LimitError where they do not fit the network."""
    info = mlp._gpu_info()
    return mlp._net.plan(info["arch"], info["smem_per_block"], info["sm_count"], dtype, out_dtype,
                         smem_per_sm=info["smem_per_sm"], precision=mlp._precision, **options).info


def _takes_wgmma(mlp, dtype, out_dtype):
    """Whether this GPU's default plan for the model is the warpgroup kernel (sm_90 and a network it fits)."""
    return bool(_plan_info(mlp, dtype, out_dtype)["wgmma"])


def _candidates(mlp, dtype, out_dtype):
    """The tile shapes to try for the model on its GPU, by the kernel its default plan takes."""
    default = _plan_info(mlp, dtype, out_dtype)
    if not default["wgmma"]:
        return CANDIDATES
    if not default["cluster"]:
        return CANDIDATES_WGMMA + (CANDIDATES_SPLIT if default.get("wide_layers") else ())
    return CANDIDATES_CLUSTER + (CANDIDATES_MMA_FALLBACK if _mma_fallback(default) else ())


def _dominated(options, rows, sm_count):
    """Whether a warpgroup candidate cannot beat the one with a warpgroup less per CTA at batches up to rows: w warps
    take 16 w rows per CTA, and where w - 4 warps already give each SM at most one CTA, w only stacks the same rows on
    fewer SMs. On the H100 one warpgroup per CTA beat two, three and four at 1024 rows for every benchmark workload
    (by 1-40%), and two beat three and four at 16384 (bench/results/h100/bench.json, 'tile'); skipping them saves
    their compiles on a first call (flex at 1024 rows compiled three kernels for a 1.04 s first call)."""
    warps = options.get("warps", 0)
    if options.get("split"):  # (not a tile shape: wide layers over a cluster, for small batches only)
        return rows >= SPLIT_ROWS_PER_SM * max(sm_count, 1)
    return bool(options.get("wgmma")) and warps > 4 and sm_count > 0 and rows <= 16 * (warps - 4) * sm_count


def _mma_fallback(default):
    """Whether a default cluster plan (its info) is one warpgroup per CTA on clusters of 4: where mma.sync's default
    tile is also worth a try (CANDIDATES_MMA_FALLBACK)."""
    return (default["warps"], default["cluster"]) == (4, 4)


def size_class(rows, sm_count):
    """What untuned() asks of a batch size: 0 below 16 rows per SM, 1 below 64, 2 below 128, else 3."""
    per_sm = rows / max(sm_count, 1)
    return sum(per_sm >= limit for limit in (16, 64, 128))


def untuned(mlp, dtype, out_dtype, rows, sm_count):
    """The plan options of a call with tuning off (FUSEDMLP_AUTOTUNE=0), after what the tuner and plan_probe measured
    on the H100 (bench/results/h100/plan_probe_s12.txt); None is the default plan, which suits large batches.
    - The mma.sync kernel: 4 warps x 16 rows below 128 rows per SM (at 2^10 rows the default 256-row tiles ran on 4
      of 132 SMs).
    - The warpgroup kernel's register-A form: one warpgroup per CTA below 64 rows per SM (at 1024 and 8192 rows
      0.6-0.86x the default's time; the tuner took two warpgroups at 2^14). Before, these calls got mma.sync's small
      tile: tcnn64 4.3 -> 3.6 us, flex 6.6 -> 5.2, res128 13.4 -> 8.5 at 1024 rows. Its streamed form the same
      (warps=4 plans it with one warpgroup): r256 10.2 us and nerf 22.0 at 1024 rows against PyTorch's CUDA graph
      17.7 and 48.1 (bench/results/h100-stream/bench.txt).
    - On clusters: one warpgroup per CTA on clusters of 4 below 16 rows per SM (siren256 at 1024 rows 9.8 us, the
      default 12.0, mma.sync's small tile 36.4; at 8192 rows 2.4x the default's time). Where the default cluster plan
      has one warpgroup per CTA on clusters of 4 (weights too large for two even there: since the streamed form,
      networks that form does not take either, CANDIDATES_MMA_FALLBACK), mma.sync's default tile from
      64 rows per SM on: 0.47-0.65x the cluster plan's time at 16384 rows for 64-224x5-64 and 64-256x5-64, 1.25-1.56x
      at 4096. Not for one warpgroup on clusters of 2 (plan.c prefers it to two on clusters of 4): 64-256-256-192 and
      2-256-256-256 ran there at 0.61-0.81x mma.sync's time from 2^18 rows on (plan_probe_s15.txt).
    - The streamed form with layers wider than 256: one warpgroup per CTA with its wide layers split over clusters of
      4 CTAs below 16 rows per SM, of 2 below 32 (CANDIDATES_SPLIT).
    A choice the network does not take falls back to the default plan (the caller's LimitError)."""
    default = _plan_info(mlp, dtype, out_dtype)
    size = size_class(rows, sm_count)
    if not default["wgmma"]:
        return {"warps": 4, "m_tiles": 1} if size < 3 else None
    if not default["cluster"]:
        if default.get("wide_layers") and not _dominated(CANDIDATES_SPLIT[0], rows, sm_count):
            return dict(CANDIDATES_SPLIT[-1 if size == 0 else 0])  # clusters of 4 below 16 rows per SM, else of 2
        return {"wgmma": 1, "warps": 4} if size < 2 else None
    if size == 0:
        return {"wgmma": 1, "cluster": 4, "warps": 4}
    return dict(CANDIDATES_MMA_FALLBACK[0]) if _mma_fallback(default) and size >= 2 else None


def _distinct(mlp, dtype, out_dtype, candidates):
    """The candidates that fit the network, without those planned the same as an earlier one (so compiled once):
    planning costs microseconds, a compile up to a second."""
    seen, kept = set(), []
    for options in candidates:
        try:
            shape = tuple(sorted(_plan_info(mlp, dtype, out_dtype, **options).items()))
        except LimitError:
            continue
        if shape not in seen:
            seen.add(shape)
            kept.append(options)
    return kept


def choose(mlp, dtype, out_dtype, rows, gpu_info, store, force=False):
    """The tuned options for this call's bucket: from the store, else measured now (and stored)."""
    key = _model_key(mlp, dtype, out_dtype, gpu_info)
    record = store.load(key)
    b = str(bucket(rows))
    if b not in record or force:
        options, timings = tune_bucket(mlp, dtype, out_dtype, min(rows, int(b), TUNE_MAX_ROWS), bucket_rows=int(b),
                                       sm_count=gpu_info["sm_count"])
        if options is None:
            return None
        record = dict(record)
        record[b] = {"options": options, "ms": timings}
        store.save(key, record)
        log.info("fusedmlp: tuned %s for %s rows (%s): %s; candidates %s ms", "-".join(map(str, mlp.widths)), b,
                 dtype, options, {k: round(v, 5) for k, v in timings.items()})
    return record[b]["options"]
