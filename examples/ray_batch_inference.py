"""Batch inference with Ray Data: parquet in, a fused MLP on every actor, parquet out.

    python examples/ray_batch_inference.py                     # a local Ray, CPU actors (the CPU path)
    python examples/ray_batch_inference.py --rows 16777216     # with GPUs in the cluster: one GPU actor per GPU

Needs `pip install 'fusedmlp[ray]'`. It writes its own input (no downloads): a model saved as an .npz (random
weights standing in for a trained neural field, 3 coordinates -> rgb + density) and points on a grid as parquet.
Then Ray Data reads the points, maps them through fusedmlp.ray.FusedMLPPredictor (progress bars on) and writes
the outputs as parquet. With GPUs, the driver first compiles the workers' kernels into a cache folder the actors
share, so no actor compiles (precompile; the folder must be one every worker can read, e.g. on a shared disk for a
cluster of several machines). It prints rows/s and checks a sample of the outputs against FusedMLP on the driver.
"""

import argparse
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

import fusedmlp
import fusedmlp.ray

WIDTHS = [3, 64, 64, 64, 4]
OUTPUTS = ["r", "g", "b", "sigma"]


def write_model(path, rng):
    """An MLP saved the way a PyTorch user saves one: np.savez(path, **{k: v.cpu().numpy() for k, v in sd.items()})."""
    arrays = {}
    for i, (n_in, n_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        bound = 1 / np.sqrt(n_in)  # nn.Linear's initialisation
        arrays[f"net.{2 * i}.weight"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32)
        arrays[f"net.{2 * i}.bias"] = rng.uniform(-bound, bound, n_out).astype(np.float32)
    np.savez(path, **arrays)


def write_points(folder, rows, files):
    """rows points of a cube's grid as parquet: id and the coordinates x, y, z (float32), in `files` files."""
    side = int(np.ceil(rows ** (1 / 3)))
    os.makedirs(folder, exist_ok=True)
    for k, (a, b) in enumerate(zip(np.linspace(0, rows, files + 1).astype(np.int64)[:-1],
                                   np.linspace(0, rows, files + 1).astype(np.int64)[1:])):
        ids = np.arange(a, b)
        grid = np.stack([ids // (side * side), ids // side % side, ids % side], axis=1) / (side - 1) * 2 - 1
        table = pa.table({"id": ids, "x": grid[:, 0].astype(np.float32), "y": grid[:, 1].astype(np.float32),
                          "z": grid[:, 2].astype(np.float32)})
        pq.write_table(table, os.path.join(folder, f"points-{k:03d}.parquet"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 20, help="points to evaluate (default 2^20)")
    parser.add_argument("--batch-size", type=int, default=1 << 18, help="rows per batch an actor maps")
    parser.add_argument("--actors", type=int, default=0, help="actors (default: one per GPU, else CPUs - 1)")
    parser.add_argument("--arch", default="sm_90", help="the GPU workers' arch, for the ahead-of-time compile")
    parser.add_argument("--dir", default=None, help="folder for the model, input and output (default: a temp one)")
    args = parser.parse_args()

    work = args.dir or tempfile.mkdtemp(prefix="fusedmlp-ray-")
    model, points, colors, cache = (os.path.join(work, name) for name in ("field.npz", "points", "colors", "cache"))
    rng = np.random.default_rng(0)
    write_model(model, rng)
    write_points(points, args.rows, files=8)

    ray.init()
    ray.data.DataContext.get_current().enable_progress_bars = True
    gpus = int(ray.cluster_resources().get("GPU", 0))
    # CPU actors: one CPU left for reading and writing, which would otherwise wait for an actor's CPU forever
    actors = args.actors or gpus or max(1, int(ray.cluster_resources().get("CPU", 2)) - 1)
    kwargs = dict(model=model, input_columns=["x", "y", "z"], output_columns=OUTPUTS, keep_columns=["id"],
                  activation="relu", cache_dir=cache)
    if gpus:
        t0 = time.perf_counter()
        entries = fusedmlp.ray.precompile(arch=args.arch, **kwargs)
        print(f"compiled {len(entries)} kernels for {args.arch} into {cache} in {time.perf_counter() - t0:.1f} s")
    resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}

    t0 = time.perf_counter()
    ds = ray.data.read_parquet(points).map_batches(
        fusedmlp.ray.FusedMLPPredictor, fn_constructor_kwargs=kwargs, batch_size=args.batch_size,
        # two calls in flight per actor: the next block's fetch overlaps this one's call (docs/scale-out.md)
        compute=ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=2), zero_copy_batch=True,
        **resources)
    ds.write_parquet(colors)
    seconds = time.perf_counter() - t0

    out = ray.data.read_parquet(colors).to_pandas().sort_values("id")
    assert len(out) == args.rows and (out["id"].to_numpy() == np.arange(args.rows)).all(), "rows lost or repeated"
    sample = rng.choice(args.rows, 1000, replace=False)
    x = pq.read_table(points).to_pandas().set_index("id").loc[sample, ["x", "y", "z"]].to_numpy()
    expected = fusedmlp.FusedMLP.from_npz(model, "relu", device="cpu")(x)
    err = np.abs(out.set_index("id").loc[sample, OUTPUTS].to_numpy() - expected).max()
    where = f"{actors} {'GPU' if gpus else 'CPU'} actor{'s' * (actors > 1)}"
    print(f"{args.rows} rows through {where} (parquet in, parquet out) in {seconds:.2f} s: "
          f"{args.rows / seconds:,.0f} rows/s; outputs in {colors}; max |error| vs the CPU path {err:.1e}")
    ray.shutdown()


if __name__ == "__main__":
    main()
