"""Where Ray Data's per-block time goes around a FusedMLPPredictor call, part by part, on the CPU (no GPU, no model).

For one block of each workload's shape (float32, fusedmlp.bench.WORKLOADS' in and out widths), in each of Ray
Data's fixed-shape tensor formats (DataContext.arrow_fixed_shape_tensor_format: 'v2', Ray's default, an extension
type over a list array with an int64 offset per row; 'native', pyarrow's fixed_shape_tensor over a fixed-size list,
no offsets), the median of --reps times of:
  - in_to_numpy: the stored input block (Arrow) to the batch the UDF gets (batch_format 'numpy', zero-copy);
  - out_to_arrow: the UDF's output dict {'y': (rows, out) array} to the Arrow block Ray stores;
  - put_out: that block into the object store (ray.put: one copy into shared memory);
  - first_touch_in: in a fresh worker process, one pass over the input block's pages mapped from the object store
    (page faults on the first pass; the second pass, touch_again_in, is the memory's own speed). The loop's blocks
    are pages its process touched already, so this part is the object store's and Ray's.

    python3 bench/ray_parts.py --out ray_parts.json [--block-rows 4194304] [--workloads pinn50 siren256 tcnn64]
"""

import argparse
import json
import sys
import time

import numpy as np

from fusedmlp.bench import WORKLOADS


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def _touch(x):
    """One read of every page of a (rows, n) float32 block: the first column, strided."""
    return float(x[:, 0].sum(dtype=np.float64))


def _first_touch(block):
    import ray

    @ray.remote(num_cpus=1)
    def touch(b):
        from ray.data.block import BlockAccessor

        x = BlockAccessor.for_block(b).to_batch_format("numpy")["data"]
        times = []
        for _ in range(2):
            start = time.perf_counter()
            _touch(x)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    return ray.get(touch.remote(ray.put(block)))


def measure(workload, rows, fmt, reps):
    import ray
    from ray.data._internal.tensor_extensions.arrow import FixedShapeTensorFormat
    from ray.data.block import BlockAccessor

    ray.data.DataContext.get_current().arrow_fixed_shape_tensor_format = {
        "v2": FixedShapeTensorFormat.V2, "native": FixedShapeTensorFormat.ARROW_NATIVE}[fmt]
    n_in, n_out = WORKLOADS[workload].widths[0], WORKLOADS[workload].widths[-1]
    rng = np.random.default_rng(0)
    block = BlockAccessor.batch_to_block({"data": rng.standard_normal((rows, n_in), dtype=np.float32)})
    y = rng.standard_normal((rows, n_out), dtype=np.float32)
    out = BlockAccessor.batch_to_block({"y": y})
    first, again = _first_touch(block)
    result = {"workload": workload, "rows": rows, "format": fmt, "in": n_in, "out": n_out,
              "in_to_numpy_ms": _median_ms(lambda: BlockAccessor.for_block(block).to_batch_format("numpy"), reps),
              "out_to_arrow_ms": _median_ms(lambda: BlockAccessor.batch_to_block({"y": y}), reps),
              "put_out_ms": _median_ms(lambda: ray.put(out), reps),
              "first_touch_in_ms": first, "touch_again_in_ms": again,
              "out_block_bytes": out.nbytes, "out_array_bytes": y.nbytes}
    print(f"{workload:9s} {fmt:6s} {rows} rows ({n_in} in, {n_out} out): in->numpy {result['in_to_numpy_ms']:6.2f} ms, "
          f"out->arrow {result['out_to_arrow_ms']:6.2f} ms, put out {result['put_out_ms']:6.1f} ms "
          f"({out.nbytes / 2**20:.0f} MiB for {y.nbytes / 2**20:.0f} MiB of outputs), input pages first touch "
          f"{first:6.1f} ms (again {again:5.1f})", flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--block-rows", type=int, default=1 << 22)
    parser.add_argument("--workloads", nargs="+", default=["pinn50", "siren256", "tcnn64"], choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        results = [measure(w, args.block_rows, fmt, args.reps) for w in args.workloads for fmt in ("v2", "native")]
    finally:
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "ray": ray.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
