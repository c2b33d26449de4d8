"""fusedmlp.ray on a local Ray cluster of 2 CPUs: the CPU path inside Ray Data actors, against evaluate_fused_mlp.

One cluster serves the module (ray.init takes ~4 s, a map_batches run 2-4 s). The tests check outputs bit for bit
(the CPU path computes each row alone, so batching does not change a bit), the library's errors for malformed
batches as they come back from the actor, and that a worker killed mid-task leaves every row exactly once.
"""

import gc
import os
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")

import fusedmlp  # noqa: E402
import fusedmlp.ray as fray  # noqa: E402
from ray.data.extensions import ArrowTensorArray  # noqa: E402
from conftest import torch_init  # noqa: E402

WIDTHS = [3, 32, 32, 2]
ACT = "silu"
ROWS = 3000
NAN_ROWS = (7, 1234)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The model's npz (PyTorch state-dict keys), its arrays, and inputs with the expected outputs."""
    rng = np.random.default_rng(27)
    ws, bs = torch_init(rng, WIDTHS, True)
    path = tmp_path_factory.mktemp("model") / "mlp.npz"
    arrays = {}
    for i, (w, b) in enumerate(zip(ws, bs)):
        arrays[f"net.{2 * i}.weight"], arrays[f"net.{2 * i}.bias"] = w, b  # Linear, activation, Linear, ...
    np.savez(path, **arrays)
    x = rng.standard_normal((ROWS, WIDTHS[0])).astype(np.float32)
    x[NAN_ROWS[0], 1] = np.nan
    x[NAN_ROWS[1], 0] = np.nan
    expected = fusedmlp.evaluate_fused_mlp(x, ws, bs, activation=ACT, device="cpu")
    return {"path": str(path), "arrays": arrays, "x": x, "expected": expected}


def table_of(x):
    """A pyarrow table: id, the features as scalar columns a, b, c and as one tensor column x."""
    return pa.table({"id": np.arange(len(x)), "a": x[:, 0], "b": x[:, 1], "c": x[:, 2],
                     "x": ArrowTensorArray.from_numpy(x)})


def dataset(x, blocks=6, empty_block=True):
    """x's rows in `blocks` blocks, plus an empty one (Ray hands such blocks to a map after a filter)."""
    table = table_of(x)
    cuts = np.linspace(0, len(x), blocks + 1).astype(int)
    parts = [table.slice(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
    if empty_block:
        parts.insert(2, table.slice(0, 0))
    return ray.data.from_arrow(parts)


def run(ds, predictor=fray.FusedMLPPredictor, batch_format="numpy", batch_size=400, actors=2, remote_args=None,
        **kwargs):
    """map_batches with the predictor on `actors` CPU actors; the output as one pandas frame sorted by id. The batches
    are zero-copy, read-only views, as the documented pipeline asks for (the predictor must never write into them)."""
    kwargs.setdefault("activation", ACT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Ray 2.60 deprecates passing max_restarts this way
        out = ds.map_batches(predictor, fn_constructor_kwargs=kwargs, batch_format=batch_format, batch_size=batch_size,
                             compute=ray.data.ActorPoolStrategy(size=actors), zero_copy_batch=True,
                             **(remote_args or {}))
        frame = out.to_pandas()
    return frame.sort_values("id").reset_index(drop=True)


def outputs(frame, columns):
    if isinstance(columns, str):
        return np.stack(frame[columns].to_numpy()).astype(np.float32)
    return np.stack([frame[c].to_numpy(dtype=np.float32) for c in columns], axis=1)


def assert_rows_exact(frame, expected, columns="y"):
    assert len(frame) == len(expected)
    np.testing.assert_array_equal(frame["id"].to_numpy(), np.arange(len(expected)))
    np.testing.assert_array_equal(outputs(frame, columns), expected)  # NaN rows compare equal to NaN rows


@pytest.mark.parametrize("batch_format, inputs, output", [
    ("numpy", "x", "y"),
    ("pandas", ["a", "b", "c"], ["y0", "y1"]),
    ("pyarrow", "x", ["y0", "y1"]),
    ("numpy", ["a", "b", "c"], "y"),
])
def test_every_batch_format_gives_evaluate_fused_mlps_bits(cluster, model, batch_format, inputs, output):
    frame = run(dataset(model["x"]), batch_format=batch_format, model=model["path"], input_columns=inputs,
                output_columns=output)
    assert_rows_exact(frame, model["expected"], output)
    assert {"id", "a", "b", "c", "x"} <= set(frame.columns)  # keep_columns=True passes every column through


def test_nan_rows_give_nan_in_those_rows_only(cluster, model):
    frame = run(dataset(model["x"]), model=model["path"], input_columns="x", keep_columns=["id"])
    y = outputs(frame, "y")
    assert list(frame.columns) == ["id", "y"]
    nan_rows = np.flatnonzero(np.isnan(y).any(axis=1))
    assert tuple(nan_rows) == NAN_ROWS and np.isnan(y[list(NAN_ROWS)]).all()
    assert np.isfinite(np.delete(y, NAN_ROWS, axis=0)).all()


def test_model_from_the_object_store(cluster, model):
    ref = fray.put_model(model["arrays"])
    frame = run(dataset(model["x"][:500], blocks=2), model=ref, input_columns=["a", "b", "c"], keep_columns=["id"])
    assert_rows_exact(frame, model["expected"][:500])


@pytest.mark.parametrize("kwargs, error, words", [
    ({"input_columns": ["a", "b", "q"]}, "ArgumentError", ["'q'", "input_columns"]),
    ({"input_columns": "wide"}, "ShapeError", ["'wide'", "shape (4,)", "3 features"]),
    ({"input_columns": ["a", "name", "c"]}, "DTypeError", ["'name'", "numbers"]),
])
def test_malformed_batches_raise_the_librarys_error_naming_the_column(cluster, model, kwargs, error, words):
    x = model["x"][:200]
    table = table_of(x).append_column("wide", ArrowTensorArray.from_numpy(np.ones((200, 4), np.float32)))
    table = table.append_column("name", pa.array(["row"] * 200))
    try:
        run(ray.data.from_arrow(table), actors=1, model=model["path"], **kwargs)
    except Exception as e:  # Ray's wrapper of the actor's exception, which ends with the original's type and text
        text = str(e)
    else:
        pytest.fail("the malformed batch was mapped")
    gc.collect()  # the traceback's frames hold the failed run's actor pool, and its CPU, until they are collected
    assert f"fusedmlp.errors.{error}" in text, text[-2000:]
    for word in words:
        assert word in text, (word, text[-2000:])


def test_worker_killed_mid_task_leaves_every_row_exactly_once(cluster, model, tmp_path):
    marker = str(tmp_path / "killed-once")

    class DiesOnce(fray.FusedMLPPredictor):
        """Exits its process (no exception, no cleanup: as a crash or an OOM kill) in its third batch, once."""

        def __init__(self, marker, **kwargs):
            super().__init__(**kwargs)
            self.marker, self.calls = marker, 0

        def __call__(self, batch):
            self.calls += 1
            if self.calls == 3 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(1)
            return super().__call__(batch)

    # 6 blocks of 500 rows, batches of 100: the third batch is mid-task, after two of the task's batches were mapped
    frame = run(dataset(model["x"], empty_block=False), predictor=DiesOnce, batch_size=100, marker=marker,
                model=model["path"], input_columns="x", keep_columns=["id"],
                remote_args={"max_restarts": 2, "max_task_retries": 4})
    assert os.path.exists(marker)  # the worker did die
    assert_rows_exact(frame, model["expected"])  # count, ids once each, every output's bits
    finite = np.isfinite(model["expected"]).all(axis=1)
    checksum = outputs(frame, "y")[finite].astype(np.float64).sum() + frame["id"].sum()
    assert checksum == model["expected"][finite].astype(np.float64).sum() + ROWS * (ROWS - 1) // 2


# ------------------------------------------------------------------------------------------------ in this process


def predictor(model, **kwargs):
    kwargs.setdefault("activation", ACT)
    return fray.FusedMLPPredictor(model["path"], device="cpu", **kwargs)


@pytest.mark.parametrize("batch_format", ["numpy", "pandas", "pyarrow"])
@pytest.mark.parametrize("output", ["y", ["y0", "y1"]])
def test_empty_batch_gives_an_empty_batch_with_the_output_columns(model, batch_format, output):
    table = table_of(model["x"][:0])
    batch = {"numpy": lambda: {c: table.column(c).to_numpy() for c in ("id", "a", "b", "c")} | {
        "x": np.empty((0, 3), np.float32)}, "pandas": table.to_pandas, "pyarrow": lambda: table}[batch_format]()
    for inputs in ("x", ["a", "b", "c"]):
        out = predictor(model, input_columns=inputs, output_columns=output)(batch)
        names = list(out.column_names) if batch_format == "pyarrow" else list(out.keys())
        assert names == ["id", "a", "b", "c", "x"] + ([output] if isinstance(output, str) else output)
        assert len(out["y" if output == "y" else "y0"]) == 0
    if batch_format == "numpy" and output == "y":
        assert out["y"].shape == (0, 2) and out["y"].dtype == np.float32


def test_arrow_nulls_are_nan_and_float16_stays_float16(model):
    x = model["x"][:50]
    table = pa.table({"a": pa.array(x[:, 0].tolist()[:-1] + [None], pa.float64()), "b": x[:, 1], "c": x[:, 2]})
    out = predictor(model, input_columns=["a", "b", "c"])(table).column("y").chunk(0).to_numpy()
    assert np.isnan(out[-1]).all() and np.isfinite(out[:-1][~np.isnan(x[:-1]).any(axis=1)]).all()
    half = predictor(model, input_columns="x")({"x": x.astype(np.float16)})["y"]
    assert half.dtype == np.float16


def test_constructor_checks_the_columns_against_the_network(model):
    with pytest.raises(fusedmlp.ShapeError, match="input_columns lists 2 columns; the network has 3 in_features"):
        predictor(model, input_columns=["a", "b"])
    with pytest.raises(fusedmlp.ShapeError, match="output_columns lists 3 columns; the network has 2 out_features"):
        predictor(model, input_columns="x", output_columns=["u", "v", "w"])
    with pytest.raises(fusedmlp.ArgumentError, match="warmup_rows=-1 must be an int >= 0"):
        predictor(model, input_columns="x", warmup_rows=-1)
    warm = predictor(model, input_columns="x", warmup_rows=1000)  # one call in the constructor, then as any other
    np.testing.assert_array_equal(warm({"x": model["x"]})["y"], model["expected"])
    with pytest.raises(fusedmlp.ArgumentError, match="unknown argument activaton"):
        fray.FusedMLPPredictor(model["path"], input_columns="x", activaton="relu")
    with pytest.raises(fusedmlp.ArgumentError, match="'x' is also a column the output keeps"):
        predictor(model, input_columns=["a", "b", "c"], output_columns="x")({"a": np.ones(2), "b": np.ones(2),
                                                                               "c": np.ones(2), "x": np.ones(2)})


def test_precompile_leaves_nothing_for_an_h100_worker_to_compile(model, tmp_path, monkeypatch):
    """What a worker on an H100 builds (the default plan, every tuner candidate, so every untuned tile) is in the
    cache precompile filled: rendered from the live GPU's figures (a stand-in _gpu here), each a cache hit."""
    from fusedmlp import _api, _core, _tune

    paths = fray.precompile(arch="sm_90", cache_dir=tmp_path, model=model["path"], activation=ACT, input_columns="x")
    assert paths and all(os.path.isfile(p) for p in paths)

    info = {"name": "NVIDIA H100 80GB HBM3", "arch": 90, "sm_count": 132, "smem_per_block": 227 * 1024,
            "smem_per_sm": 228 * 1024}

    def no_compile(*args):
        raise AssertionError("a worker would compile this kernel")

    monkeypatch.setattr(_core, "nvrtc_compile", no_compile)
    mlp = fusedmlp.FusedMLP.from_npz(model["path"], ACT, device="cpu", cache_dir=tmp_path)
    monkeypatch.setattr(mlp, "_gpu_info", lambda: info)  # what the tuner reads of the model's GPU
    built = 0
    for options in [{}] + list(_tune._candidates(mlp, "float32", "float32")):
        plan, source = mlp._render(90, info["smem_per_block"], info["sm_count"], "float32", "float32",
                                   info["smem_per_sm"], **options)
        assert _api.compile_cubin(source, 90, mlp._cache, plan.info["wgmma"]).path is not None
        built += 1
    assert built >= 2


def test_a_file_fusedmlp_save_wrote_needs_no_model_options(model, tmp_path):
    """A model saved with FusedMLP.save carries its architecture: the predictor takes the file alone (no activation)
    and gives the model's outputs; the in-process predictor path, no cluster needed."""
    mlp = fusedmlp.FusedMLP.from_npz(model["path"], ACT, device="cpu")
    path = mlp.save(tmp_path / "saved")
    out = fray.FusedMLPPredictor(path, device="cpu", input_columns="x")({"x": model["x"]})
    assert np.array_equal(out["y"], model["expected"], equal_nan=True)


def native_tensor_table(x, chunks=1):
    """x as one column 'x' of pyarrow's fixed_shape_tensor (Ray's ARROW_NATIVE format), in `chunks` chunks."""
    cuts = np.linspace(0, len(x), chunks + 1).astype(int)
    parts = [pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(x[a:b])) for a, b in zip(cuts, cuts[1:])]
    return pa.table({"id": np.arange(len(x)), "x": pa.chunked_array(parts)})


@pytest.mark.parametrize("chunks", [1, 3])
def test_native_tensor_columns_give_evaluate_fused_mlps_bits(model, chunks):
    out = predictor(model, input_columns="x", keep_columns=["id"])(native_tensor_table(model["x"], chunks))
    np.testing.assert_array_equal(np.concatenate([c.to_numpy_ndarray() for c in out.column("y").chunks]),
                                  model["expected"])


def test_one_chunk_tensor_columns_are_read_in_place(model):
    # a 2^22-row block's copy cost more than the pinn50 kernel on the H100 (docs/scale-out.md, What Ray costs)
    x = np.ascontiguousarray(model["x"])
    for column in (pa.FixedShapeTensorArray.from_numpy_ndarray(x), ArrowTensorArray.from_numpy(x)):
        values = fray._arrow_column(pa.chunked_array([column]), "x")
        assert values.shape == x.shape and np.shares_memory(values, x)
        np.testing.assert_array_equal(values, x)


def test_a_native_tensor_column_of_the_wrong_width_names_the_column(model):
    table = native_tensor_table(np.ones((20, 4), np.float32))
    with pytest.raises(fusedmlp.ShapeError, match=r"column 'x' holds rows of shape \(4,\); the network takes 3"):
        predictor(model, input_columns="x")(table)


@pytest.fixture
def native_tensors():
    """Ray Data's fixed-shape tensor columns as pyarrow's fixed_shape_tensor for one test (DataContext is global)."""
    from ray.data._internal.tensor_extensions.arrow import FixedShapeTensorFormat

    context = ray.data.DataContext.get_current()
    saved = context.arrow_fixed_shape_tensor_format
    context.arrow_fixed_shape_tensor_format = FixedShapeTensorFormat.ARROW_NATIVE
    yield
    context.arrow_fixed_shape_tensor_format = saved


@pytest.mark.parametrize("batch_format", ["numpy", "pyarrow"])
def test_native_tensor_pipeline_stores_outputs_as_fixed_shape_tensors(cluster, model, native_tensors, batch_format):
    x = model["x"]
    ds = ray.data.from_arrow(pa.table({"data": pa.FixedShapeTensorArray.from_numpy_ndarray(x), "id": np.arange(len(x))}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out = ds.map_batches(fray.FusedMLPPredictor, batch_size=700, batch_format=batch_format, zero_copy_batch=True,
                             compute=ray.data.ActorPoolStrategy(size=2),
                             fn_constructor_kwargs=dict(model=model["path"], input_columns="data", keep_columns=["id"],
                                                        activation=ACT)).materialize()
    assert isinstance(out.schema().base_schema.field("y").type, pa.FixedShapeTensorType)  # stored without offsets
    frame = out.to_pandas().sort_values("id")
    np.testing.assert_array_equal(np.stack(frame["y"].to_numpy()), model["expected"])


def test_ray_overhead_script_runs_several_actors_on_the_cpu(tmp_path):
    """bench/ray_overhead.py (the device measurement) as a CPU smoke run: its NumPy stand-in for the model, one and two
    CPU actors, its JSON with one result per actor count, each the loop's bits. In a process of its own (its own Ray)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ray_overhead.json"
    run = subprocess.run([sys.executable, os.path.join(root, "bench", "ray_overhead.py"), "--stand-in", "--rows",
                          str(1 << 18), "--block-rows", str(1 << 16), "--workloads", "pinn50", "--reps", "1",
                          "--variants", "native/2", "--actors", "1", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["actors"] for r in results] == [1, 2]
    assert all(r["bit_identical"] for r in results)
    assert results[1]["efficiency_vs_one_actor"] is not None and results[1]["ray"]["ready_skew_s"] >= 0
