"""Scaling over the GPUs of one machine: MultiDeviceMLP at 1, 2, 4, ... GPUs, rows/s and bits against one GPU.

For each workload (fusedmlp.bench.WORKLOADS, nn.Linear's initialisation, the npz bench/ray_overhead.py writes) and
GPU count n, the same x of --rows rows runs three ways:
  - host: NumPy x in, NumPy y out (``mlp(x)``): each GPU's share copied in, run and copied out by a thread of its own;
    what a user with data in host memory gets. Bound by the host's copies where the network is light.
  - host_out: the same into a preallocated y (``mlp(x, out=y)``, y reused by every call): no fresh pages to fault in.
  - torch: x a torch tensor on cuda:0 (``mlp(x)``): the other GPUs' shares copied to them and back over the GPUs'
    link, no host synchronisation; y on cuda:0.
  - resident: each GPU's share already on that GPU, y left there (every share launched, then every GPU
    synchronised): the GPUs' compute alone, the ceiling of any split.
Every call runs the kernel a one-GPU call of the whole batch runs, so every n must give n = 1's bits (checked, for
each mode). Times: the best and the median of --reps calls after a warm-up call (the first of which tunes and
compiles), by the host's clock around the call and a synchronisation of every GPU used. Efficiency at n GPUs is
rows/s over n times one GPU's rows/s.

    python3 bench/scaling.py --out scaling.json          # every visible GPU: n = 1, 2, 4, ... up to their count
Options: --rows (2^26), --workloads (tcnn128 siren256), --gpus (1 2 4 ...), --reps (5), --io-dtype (float16),
--modes (host host_out torch resident).
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
from fusedmlp.bench import WORKLOADS, fused_options
from fusedmlp.multi_gpu import MultiDeviceMLP, _shares, visible_devices

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ray_overhead import _model  # noqa: E402  (the workload's npz, as the Ray measurement writes it)

MODES = ("host", "host_out", "torch", "resident")
HOST_REPS = 2  # the host modes move the whole batch through the host (seconds a call at 2^26 rows): fewer calls


def _timed(fn, sync, reps):
    """fn() once as a warm-up, then reps timed calls: (best s, median s, the last call's result)."""
    result = fn()
    sync()
    times = []
    for _ in range(reps):
        del result
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), float(np.median(times)), result


def _resident(torch, mlp, x_host, kind):
    """The 'resident' mode's call: each share placed on its GPU beforehand; returns (call, gather)."""
    rows = len(x_host)
    shares = _shares(rows, len(mlp.mlps))
    dtype = {"float16": torch.float16, "float32": torch.float32}[kind]
    placed = []
    for m, (a, b) in zip(mlp.mlps, shares):
        device = torch.device("cuda", m._ordinal)
        xs = torch.from_numpy(x_host[a:b]).to(device)
        ys = torch.empty((b - a, mlp.widths[-1]), device=device, dtype=dtype)
        # the kernel one GPU runs for the whole batch, as MultiDeviceMLP's split calls run it: the same bits
        placed.append((m._kernel(kind, kind, rows), xs, ys, device))

    def call():
        for kernel, xs, ys, device in placed:
            with torch.cuda.device(device):
                kernel.launch(xs.data_ptr(), ys.data_ptr(), len(xs), torch.cuda.current_stream(device).cuda_stream)
        return [ys for _, _, ys, _ in placed]

    def gather(ys):
        return np.concatenate([y.cpu().numpy() for y in ys])

    return call, gather


def measure(torch, workload, rows, gpus, reps, io_dtype, folder, cache, rng, modes=MODES):
    path, options = _model(workload, folder, rng)
    widths = WORKLOADS[workload].widths
    x = (rng.random((rows, widths[0]), dtype=np.float32) * 2 - 1).astype(io_dtype)  # (uniform: faster to draw)
    x_torch = torch.from_numpy(x).to("cuda:0")
    results, first = [], {}
    for n in gpus:
        devices = [f"cuda:{i}" for i in range(n)]
        mlp = MultiDeviceMLP.from_npz(path, devices=devices, cache_dir=cache, **options)

        def sync():
            for i in range(n):
                torch.cuda.synchronize(i)

        for mode in modes:
            if mode == "host":
                best, median, y = _timed(lambda: mlp(x), sync, min(reps, HOST_REPS))
            elif mode == "host_out":
                y_out = np.empty((rows, widths[-1]), dtype=x.dtype)
                best, median, y = _timed(lambda: mlp(x, out=y_out), sync, min(reps, HOST_REPS))
                del y_out
            elif mode == "torch":
                best, median, y = _timed(lambda: mlp(x_torch), sync, reps)
                y = y.cpu().numpy()
            else:
                call, gather = _resident(torch, mlp, x, io_dtype)
                best, median, ys = _timed(call, sync, reps)
                y = gather(ys)
                del ys, call, gather
            one = first.setdefault(mode, (best, y))
            same = bool(y.shape == one[1].shape and np.array_equal(y, one[1], equal_nan=True))
            result = {"workload": workload, "widths": list(widths), "rows": rows, "io_dtype": io_dtype, "gpus": n,
                      "mode": mode, "best_s": best, "median_s": median, "rows_per_s": rows / best,
                      "speedup": one[0] / best, "efficiency": one[0] / best / n, "bits_equal_one_gpu": same}
            results.append(result)
            print(f"{workload:9s} {mode:9s} {n} GPU: best {best * 1e3:8.2f} ms, median {median * 1e3:8.2f} ms, "
                  f"{rows / best / 1e9:6.3f} G rows/s, x{result['speedup']:.2f} one GPU (efficiency "
                  f"{result['efficiency']:.2f}), same bits as one GPU: {same}", flush=True)
            del y
        del mlp
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, default=1 << 26)
    parser.add_argument("--workloads", nargs="+", default=["tcnn128", "siren256"], choices=sorted(WORKLOADS))
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="GPU counts (default: 1, 2, 4, ... up to the visible GPUs, and their count)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--io-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    # a time limit's SIGTERM (timeout(1) on the device machine) ends the run through the finally below, which writes
    # the JSON of what was measured so far
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    import torch

    visible = len(visible_devices())
    gpus = args.gpus or sorted({1 << k for k in range(visible.bit_length()) if 1 << k <= visible} | {visible})
    if not gpus or max(gpus) > visible or min(gpus) < 1:
        parser.error(f"--gpus {gpus}: this process sees {visible} GPU(s)")
    folder = tempfile.mkdtemp(prefix="fusedmlp-scaling-")
    cache = os.environ.get("FUSEDMLP_CACHE_DIR") or os.path.join(folder, "cache")
    names = [torch.cuda.get_device_name(i) for i in range(visible)]
    report = {"argv": sys.argv, "fusedmlp": fusedmlp.__version__, "python": platform.python_version(),
              "torch": torch.__version__, "gpus_visible": names, "autotune": os.environ.get("FUSEDMLP_AUTOTUNE", "on"),
              "results": []}
    print(f"{visible} GPUs: {', '.join(names)}; counts {gpus}, {args.rows} rows of {args.io_dtype}", flush=True)
    rng = np.random.default_rng(20261126)
    try:
        for workload in args.workloads:
            report["results"].extend(measure(torch, workload, args.rows, gpus, args.reps, args.io_dtype, folder,
                                             cache, rng, args.modes))
            torch.cuda.empty_cache()
    finally:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"all bit-identical to one GPU: {all(r['bits_equal_one_gpu'] for r in report['results'])}; JSON: {args.out}")


if __name__ == "__main__":
    main()
