"""Batch inference on Ray Data: a fused MLP as the callable class of ``Dataset.map_batches``.

>>> import ray, fusedmlp.ray
>>> kwargs = dict(model="model.npz", input_columns=["x", "y", "z"], output_columns="rgb", activation="relu",
...               cache_dir="/shared/fusedmlp-cache")
>>> fusedmlp.ray.precompile(arch="sm_90", **kwargs)        # on the driver, no GPU needed: the workers start warm
>>> from ray.data._internal.tensor_extensions.arrow import FixedShapeTensorFormat   # tensor columns, no offsets
>>> ray.data.DataContext.get_current().arrow_fixed_shape_tensor_format = FixedShapeTensorFormat.ARROW_NATIVE
>>> ds = ray.data.read_parquet("points/").map_batches(
...     fusedmlp.ray.FusedMLPPredictor, fn_constructor_kwargs=kwargs, batch_size=1 << 22, num_gpus=1,
...     compute=ray.data.ActorPoolStrategy(size=8, max_concurrent_calls_per_actor=2), zero_copy_batch=True)
>>> ds.write_parquet("colors/")

Each actor builds its FusedMLP once, from the model file, its bytes, its arrays or an object-store reference to them
(put_model), and maps every batch Ray hands it: NumPy dicts, pandas DataFrames or pyarrow Tables, the input as a
list of scalar feature columns or one fixed-shape tensor column, the output as one tensor column or one scalar
column per output feature. An actor Ray gave a GPU (``num_gpus=1``; Ray sets ``CUDA_VISIBLE_DEVICES``) runs the
kernel there, one given several GPUs splits each batch over them (fusedmlp.multi_gpu), one without a GPU runs the
CPU path. Ray Data's pyarrow tensor format (ARROW_NATIVE, above) and two calls per actor (Ray reads the next block
and stores the last output beside the running call; the calls stay one at a time) cut Ray's overhead over a plain
loop on an H100 from +78-600% to +22-352% (docs/scale-out.md, "What Ray costs").
"""

import concurrent.futures
import io
import os

import numpy as np

from . import _api, _args, _tune
from .errors import ArgumentError, DTypeError, LimitError, ShapeError
from .multi_gpu import MultiDeviceMLP

__all__ = ["FusedMLPPredictor", "precompile", "put_model"]

#: FusedMLP's arguments that describe the model (the rest of a predictor's keyword arguments are about columns).
_MODEL_OPTIONS = ("activation", "output_activation", "residual", "concat", "norm", "dtype", "check")


def _ray():
    try:
        import ray  # the optional dependency: imported only where Ray is used
    except ImportError as e:
        raise ImportError(f"fusedmlp.ray needs Ray Data ({e}): pip install 'fusedmlp[ray]'") from None
    return ray


def _model_source(model):
    """Something FusedMLP.from_npz reads: a path, or a binary file object over npz bytes."""
    if type(model).__name__ == "ObjectRef" and type(model).__module__.split(".")[0] == "ray":
        model = _ray().get(model)
    if isinstance(model, (str, os.PathLike)):
        return model
    if isinstance(model, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(model))
    if isinstance(model, dict):
        buffer = io.BytesIO()
        np.savez(buffer, **model)
        buffer.seek(0)
        return buffer
    raise ArgumentError(f"model is a {type(model).__name__}; it must be an .npz path, the npz file's bytes, a dict "
                        "{name: array} laid out as FusedMLP.from_npz reads it ('0.weight', '0.bias', ...), or a Ray "
                        "ObjectRef to one of those (fusedmlp.ray.put_model)")


def put_model(model):
    """Puts a model into Ray's object store, for actors on machines that do not share the driver's files.

    Args:
        model: an .npz path, the npz file's bytes, or a dict {name: array} (a state dict as NumPy arrays).

    Returns:
        A ray.ObjectRef to the npz bytes: pass it as FusedMLPPredictor's ``model``.
    """
    source = _model_source(model)
    if isinstance(source, io.BytesIO):
        data = source.getvalue()
    else:
        with open(source, "rb") as f:
            data = f.read()
    return _ray().put(data)


#: FusedMLPPredictor's own arguments about batches, which precompile accepts and ignores.
_COLUMN_OPTIONS = ("input_columns", "output_columns", "keep_columns", "device", "warmup_rows")


def _split_options(kwargs):
    """kwargs, once each is one of the model's FusedMLP arguments."""
    unknown = sorted(set(kwargs) - set(_MODEL_OPTIONS))
    if unknown:
        raise ArgumentError(f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(unknown)}; a FusedMLPPredictor "
                            f"takes the model's {', '.join(_MODEL_OPTIONS)} besides its own")
    return dict(kwargs)


# ------------------------------------------------------------------------------------------------ ahead of time


def _candidate_options(mlp, arch, io_dtype):
    """The plan options a worker's first calls may build on a GPU of this arch: the default plan (None), the tuner's
    candidates for the kernel the default plan takes (what _tune._candidates picks from the live GPU's plan; the
    published limits of the arch plan the same sources: checked for sm_80 and sm_90 against an H100's figures) and
    so the untuned small-batch tiles, which are among them."""
    default = mlp._net.plan(arch, 0, 0, io_dtype, io_dtype, precision=mlp._precision).info
    if not default["wgmma"]:
        candidates = _tune.CANDIDATES
    elif not default["cluster"]:
        candidates = _tune.CANDIDATES_WGMMA
    else:
        candidates = _tune.CANDIDATES_CLUSTER + (_tune.CANDIDATES_MMA_FALLBACK if _tune._mma_fallback(default) else ())
    return (None,) + tuple(candidates)


def precompile(model, arch="sm_90", io_dtypes=("float32",), cache_dir=None, tuning=True, **kwargs):
    """Compiles the workers' kernels on the driver (NVRTC, no GPU) into the cache folder the workers read.

    Takes the keyword arguments FusedMLPPredictor takes (the same dict), so the kernels are those of the model the
    workers build: a worker then loads them from ``cache_dir`` instead of compiling, and concurrent workers that
    still miss one compile it once between them (the cache's per-entry lock).

    Args:
        model: as FusedMLPPredictor's.
        arch: the workers' GPU, e.g. 'sm_90' (H100) or 'sm_80' (A100).
        io_dtypes: the kernels' input/output dtypes: 'float32' for float32 (or integer, or float64) columns,
            'float16' for float16 ones.
        cache_dir: the folder the workers get as their ``cache_dir`` (on a shared file system for several machines);
            default: this process's FUSEDMLP_CACHE_DIR (or its fallbacks).
        tuning: also compile the tuner's candidate tiles, which a worker's first call in each batch-size bucket
            builds and times (unless the workers run with FUSEDMLP_AUTOTUNE=0). Without them only the default plan's
            kernel is compiled: what a call of 128 or more rows per SM runs untuned.
        **kwargs: the predictor's other arguments; the model's (activation, ...) are used, the columns' ignored.

    Returns:
        The cache entry paths of the compiled kernels (None for each held in memory: the folder was not writable).
    """
    options = _split_options({k: v for k, v in kwargs.items() if k not in _COLUMN_OPTIONS})
    mlp = _api.FusedMLP.from_npz(_model_source(model), device="cpu", cache_dir=cache_dir, **options)
    number, _ = _args._parse_arch(arch)
    if isinstance(io_dtypes, str):
        io_dtypes = (io_dtypes,)
    jobs, paths = [], []
    for io_dtype in io_dtypes:
        io_dtype = _api._io_dtype_name(io_dtype, "io_dtypes")
        if mlp._segments_for(number, 0, 0, 0, io_dtype, io_dtype) is not None:
            paths.extend(mlp.compile(arch, io_dtype))  # a segmented network: its segments, which have no tile choice
            continue
        for plan_options in _candidate_options(mlp, number, io_dtype) if tuning else (None,):
            try:
                plan, source = mlp._render(number, 0, 0, io_dtype, io_dtype, **(plan_options or {}))
            except LimitError:  # a candidate this network does not fit: the tuner skips it too
                continue
            jobs.append((source, plan.info["wgmma"]))
    sources = list(dict.fromkeys(jobs))  # candidates planned alike render the same source: compile it once

    def compile_one(job):
        return _api._entry_path(_api.compile_cubin(job[0], number, mlp._cache, job[1]))

    if sources:
        workers = min(len(sources), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # NVRTC releases the GIL
            paths.extend(pool.map(compile_one, sources))
    return paths


# ------------------------------------------------------------------------------------------------ batches


def _batch_kind(batch):
    """'numpy' (a dict of arrays), 'pandas' or 'pyarrow', from the batch's type (no import of either library)."""
    if isinstance(batch, dict):
        return "numpy"
    module = type(batch).__module__.split(".")[0]
    if module == "pandas" and hasattr(batch, "columns"):
        return "pandas"
    if module == "pyarrow" and hasattr(batch, "column_names"):
        return "pyarrow"
    raise DTypeError(f"the batch is a {type(batch).__module__}.{type(batch).__name__}; FusedMLPPredictor takes the "
                     "formats Ray Data hands out: a dict of NumPy arrays, a pandas DataFrame or a pyarrow Table "
                     "(map_batches' batch_format 'numpy', 'pandas' or 'pyarrow')")


def _column_names(batch, kind):
    return list(batch.column_names) if kind == "pyarrow" else [str(c) for c in batch.keys()]


def _column(batch, kind, name):
    """A column's values as a NumPy array: (rows,) for a scalar column, (rows, ...) for a tensor column."""
    if kind == "numpy":
        values = batch[name]
    elif kind == "pandas":
        series = batch[name]
        dtype = series.dtype
        if isinstance(dtype, np.dtype) or dtype.kind not in "fiu":
            values = series.to_numpy()  # objects: Ray's pandas tensor columns hold one array per row
        else:  # Arrow-backed ("float[pyarrow]", Ray's default) or nullable numbers: nulls become NaN
            target = getattr(dtype, "numpy_dtype", np.dtype(np.float64))
            values = series.to_numpy(dtype=target if target.kind == "f" else np.float32, na_value=np.nan)
    else:
        values = _arrow_column(batch.column(name), name)
    values = np.asarray(values)
    if values.dtype == object:
        values = _stack_rows(values, name)
    return values


def _arrow_column(chunked, name):
    """A pyarrow column as NumPy: Ray's tensor extension, Arrow's fixed_shape_tensor and fixed_size_list become
    (rows, ...) arrays; anything else goes through pyarrow's to_numpy (nulls of numbers become NaN)."""
    import pyarrow as pa

    kind = chunked.type
    if not chunked.num_chunks:
        return np.empty((0,), dtype=np.float32)
    if isinstance(kind, pa.BaseExtensionType):
        # pyarrow's fixed_shape_tensor is a BaseExtensionType (not the Python-defined ExtensionType, which Ray's
        # ArrowTensorType is): both hand out views of the column's buffer; a one-chunk column is used in place
        parts = [np.asarray(c.to_numpy_ndarray() if hasattr(c, "to_numpy_ndarray") else c.to_numpy())
                 for c in chunked.chunks]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    if pa.types.is_fixed_size_list(kind):
        if chunked.null_count:
            raise ShapeError(f"column {name!r} has {chunked.null_count} null rows; a feature vector per row is needed")
        flat = pa.chunked_array([c.flatten() for c in chunked.chunks], kind.value_type)
        return flat.to_numpy().reshape(len(chunked), kind.list_size)
    return chunked.to_numpy()


def _stack_rows(values, name):
    """An object column of per-row arrays (Ray's pandas tensor columns) as one (rows, ...) array."""
    try:
        rows = [np.asarray(v) for v in values]
        shapes = {r.shape for r in rows}
        if len(shapes) > 1:
            raise ShapeError(f"column {name!r} holds rows of different shapes {sorted(shapes)[:3]}; a tensor column of "
                             "one shape (in_features,) is needed")
        return np.stack(rows) if rows else np.empty((0,), dtype=np.float32)
    except (TypeError, ValueError) as e:
        if isinstance(e, ShapeError):
            raise
        raise DTypeError(f"column {name!r} holds {type(values[0]).__name__} values, not numbers: {e}") from None


def _numbers(values, name):
    """values with a dtype the kernel reads: float16 stays, other numbers become float32."""
    if values.dtype.kind not in "fiu":
        raise DTypeError(f"column {name!r} has dtype {values.dtype}; the network's inputs must be numbers (float32, "
                         "float16, float64 or integers)")
    return values if values.dtype in (np.float32, np.float16) else values.astype(np.float32)


class FusedMLPPredictor:
    """The callable class for ``ray.data.Dataset.map_batches``: builds the model once per actor, maps each batch.

    Args:
        model: the saved model: an .npz path (``np.savez(path, **{k: v.cpu().numpy() for k, v in sd.items()})``,
            read by FusedMLP.from_npz), the file's bytes, a dict {name: array} of that layout, or a Ray ObjectRef to
            one of those (put_model).
        input_columns: the input features: a list of scalar columns (one feature each, in the network's input
            order), or one column name holding a fixed-shape tensor (one (in_features,) vector per row).
        output_columns: one column name (a tensor column: one (out_features,) vector per row), or a list of
            out_features names (one scalar column each). Default 'y'.
        keep_columns: True: every column of the batch passes through beside the outputs; False: only the outputs;
            a list: those columns (e.g. ['id']).
        device: 'auto' (default): in a Ray actor, the GPUs Ray assigned to it (``num_gpus``; ``CUDA_VISIBLE_DEVICES``
            numbers them from 0), one call split over several; none: the CPU path. Outside Ray, FusedMLP's 'auto'.
            Or a device string or list, as MultiDeviceMLP's devices.
        cache_dir: the kernel cache folder; point every worker at the one precompile filled. Default: the actor's
            FUSEDMLP_CACHE_DIR (e.g. from map_batches' runtime_env), or its fallbacks.
        warmup_rows: run one call of this many random rows (float32) in the constructor, so the kernel is loaded
            (and, with autotuning, the batch size's tiles timed) before the actor takes its first batch; use the
            map's batch_size. 0 (default): the first batch does it.
        **model_options: the model's FusedMLP arguments: activation, output_activation, residual, concat, dtype,
            check.

    A call takes a batch (dict of NumPy arrays, pandas DataFrame or pyarrow Table) and returns the same kind, with
    float32 outputs (float16 for float16 inputs). Integer and float64 columns are read as float32. A row with a NaN
    gives NaN in that row's outputs only (FusedMLP's rule); nulls of number columns are NaN. A missing or
    non-numeric column, or a tensor column of the wrong width, raises fusedmlp's ArgumentError, DTypeError or
    ShapeError naming the column; an empty batch gives an empty one with the output columns.
    """

    def __init__(self, model, *, input_columns, output_columns="y", keep_columns=True, device="auto", cache_dir=None,
                 warmup_rows=0, **model_options):
        options = _split_options(model_options)
        self._mlp = MultiDeviceMLP.from_npz(_model_source(model), devices=self._devices(device), cache_dir=cache_dir,
                                            **options)
        n_in, n_out = self._mlp.in_features, self._mlp.widths[-1]
        self._inputs = self._names(input_columns, "input_columns", n_in, "in_features")
        self._outputs = self._names(output_columns, "output_columns", n_out, "out_features")
        if isinstance(keep_columns, (bool, np.bool_)):
            self._keep = bool(keep_columns)
        elif isinstance(keep_columns, (list, tuple)):
            self._keep = self._names(keep_columns, "keep_columns", None, None)
        else:
            raise ArgumentError(f"keep_columns={keep_columns!r} must be True (every column), False (outputs only) or "
                                "a list of column names")
        if not _args._is_index(warmup_rows, 0, 1 << 40):
            raise ArgumentError(f"warmup_rows={warmup_rows!r} must be an int >= 0 (rows of the warm-up call)")
        if warmup_rows:
            self._mlp(np.random.default_rng(0).standard_normal((int(warmup_rows), n_in), dtype=np.float32))

    @staticmethod
    def _devices(device):
        if device != "auto":
            return device
        ray = _ray()
        if not ray.is_initialized():
            return "auto"  # a predictor called outside Ray: FusedMLP's own choice
        gpus = ray.get_gpu_ids()
        if not gpus:
            return "cpu"  # an actor without num_gpus leaves the node's GPUs to the actors that asked for them
        if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
            return [f"cuda:{int(g)}" for g in gpus]  # Ray left CUDA_VISIBLE_DEVICES alone: its ids are ordinals
        return [f"cuda:{i}" for i in range(len(gpus))]

    @staticmethod
    def _names(value, field, count, what):
        """A str, or a list of count distinct str (count None: any number)."""
        if isinstance(value, str):
            return value
        if (not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)
                or len(set(value)) != len(value)):
            raise ArgumentError(f"{field}={value!r} must be a column name or a list of distinct column names")
        if count is not None and len(value) != count:
            raise ShapeError(f"{field} lists {len(value)} columns; the network has {count} {what} (name one column "
                             "per feature, or one tensor column)")
        return list(value)

    @property
    def model(self):
        """The MultiDeviceMLP the actor runs (its .mlps: one FusedMLP per device)."""
        return self._mlp

    def __call__(self, batch):
        kind = _batch_kind(batch)
        names = _column_names(batch, kind)
        wanted = [self._inputs] if isinstance(self._inputs, str) else self._inputs
        missing = [n for n in wanted if n not in names]
        if missing:
            raise ArgumentError(f"the batch has no column {missing[0]!r} (input_columns); its columns are {names}")
        x = self._features(batch, kind)
        y = self._mlp(x)
        return self._assemble(batch, kind, names, y)

    def _features(self, batch, kind):
        n_in = self._mlp.in_features
        if isinstance(self._inputs, str):
            x = _numbers(_column(batch, kind, self._inputs), self._inputs)
            if len(x) == 0:
                return np.empty((0, n_in), dtype=x.dtype)
            if x.ndim != 2 or x.shape[1] != n_in:
                raise ShapeError(f"column {self._inputs!r} holds rows of shape {x.shape[1:]}; the network takes "
                                 f"{n_in} features per row, so a tensor column of shape ({n_in},)")
            return x
        columns = [_numbers(_column(batch, kind, n), n) for n in self._inputs]
        for name, values in zip(self._inputs, columns):
            if values.ndim != 1:
                raise ShapeError(f"column {name!r} holds rows of shape {values.shape[1:]}; input_columns lists scalar "
                                 f"columns, one feature each (name a tensor column alone: input_columns={name!r})")
        dtype = np.float16 if all(c.dtype == np.float16 for c in columns) else np.float32
        x = np.empty((len(columns[0]), n_in), dtype=dtype)
        for j, values in enumerate(columns):
            x[:, j] = values
        return x

    def _assemble(self, batch, kind, names, y):
        keep = names if self._keep is True else ([] if self._keep is False else self._keep)
        outputs = [self._outputs] if isinstance(self._outputs, str) else self._outputs
        clash = [n for n in outputs if n in keep]
        if clash:
            raise ArgumentError(f"output column {clash[0]!r} is also a column the output keeps; name the output "
                                "another column, or leave this one out of keep_columns")
        absent = [n for n in keep if n not in names]
        if absent:
            raise ArgumentError(f"the batch has no column {absent[0]!r} (keep_columns); its columns are {names}")
        if isinstance(self._outputs, str):
            new = {self._outputs: y}
        else:
            new = {name: np.ascontiguousarray(y[:, j]) for j, name in enumerate(self._outputs)}
        if kind == "numpy":
            return {**{n: batch[n] for n in keep}, **new}
        from ray.data import extensions

        if kind == "pandas":
            import pandas as pd

            columns = {n: batch[n] for n in keep}
            for name, values in new.items():
                columns[name] = extensions.TensorArray(values) if values.ndim == 2 else values
            return pd.DataFrame(columns, index=batch.index)
        import pyarrow as pa

        table = batch.select(keep)
        for name, values in new.items():
            column = extensions.ArrowTensorArray.from_numpy(values) if values.ndim == 2 else pa.array(values)
            table = table.append_column(name, column)
        return table
