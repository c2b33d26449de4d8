"""Several GPUs in one process: one FusedMLP per device, each call's rows split over them.

>>> from fusedmlp.multi_gpu import MultiDeviceMLP
>>> mlp = MultiDeviceMLP(weights, biases, activation="silu")      # one FusedMLP per visible GPU ("cuda:0", ...)
>>> y = mlp(x)                                                    # x's rows in one contiguous share per GPU

Every share runs the kernel that one GPU would run for the whole batch (the kernel a call picks depends on the batch
size: the tuner's choice per batch-size bucket, or the untuned tile per rows per SM), and a row's outputs depend only
on that row and the kernel, so the result is the same bits as ``FusedMLP(..., device="cuda:0")(x)`` on identical
GPUs. With one device (one GPU, or the CPU path) a call is the plain FusedMLP call.
"""

import concurrent.futures
import io

import numpy as np

from . import _api, _args, _out
from ._api import FusedMLP
from .errors import ArgumentError, CudaError, LibraryNotFoundError

__all__ = ["MultiDeviceMLP", "visible_devices"]

#: Rows a device gets at least before a call is split: below 2^16 rows a share's transfer and launch (tens of us) is
#: a large part of its kernel time (an H100 runs 2^16 rows of tcnn64 in ~5 us), so fewer devices do as well.
MIN_ROWS_PER_DEVICE = 1 << 16

#: A torch x on one GPU is split over the others only where the network does at least this many FLOPs per byte of
#: the rows' inputs and outputs, which the other shares copy between the GPUs and back. On two H200s (NVLink),
#: 2^26 rows of tcnn128 (512 FLOP a byte) took 10.25 ms on one GPU and 32.41 ms split over two
#: (bench/results/h200x2-scaling/): the other share's 8.6 GB of copies, ~22 ms, is twice one GPU's whole time. At the
#: kernels' ~650 TFLOP/s and that ~390 GB/s, a split pays from ~1700 FLOP a byte on.
TORCH_SPLIT_FLOPS_PER_BYTE = 2048

#: Shares start at multiples of this many rows: 16-byte aligned rows for every dtype and width (8 rows of 2-byte
#: values), and whole 64-row warpgroup tiles.
_ROW_STEP = 64

_HOST_DTYPES = (np.float32, np.float16, np.float64)


def visible_devices():
    """The GPUs this process sees, as device strings.

    Returns:
        ``["cuda:0", ..., "cuda:<n-1>"]`` for the n GPUs the driver reports (``CUDA_VISIBLE_DEVICES`` applies, so in
        a Ray actor these are the GPUs Ray assigned to it); ``[]`` without a driver or a GPU.
    """
    try:
        count = _api._core().cuda_device_count()
    except (LibraryNotFoundError, CudaError):
        count = 0
    return [f"cuda:{i}" for i in range(count)]


def _device_list(devices):
    """devices as a non-empty list of device strings; None: every visible GPU, else ['auto'] (FusedMLP's CPU
    fallback and its one-time warning)."""
    if devices is None:
        return visible_devices() or ["auto"]
    if isinstance(devices, str):
        devices = [devices]
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ArgumentError(f"devices={devices!r} must be None (every visible GPU), a device string or a non-empty "
                            "list of them, e.g. ['cuda:0', 'cuda:1']")
    kinds = {_args._parse_device(d)[0] for d in devices}  # raises ArgumentError naming a bad one
    if len(kinds) > 1 and kinds & {"cpu", "auto"}:
        raise ArgumentError(f"devices={list(devices)!r} mixes the CPU path with GPUs; the CPU path computes in "
                            "float64, so its rows would not match the GPUs' bits: list GPUs only, or 'cpu' alone",
                            "a device named twice is allowed: 'cpu', 'cpu' splits a call over two CPU threads")
    return [str(d) for d in devices]


def _shares(rows, parts):
    """[(start, stop)] of `parts` contiguous shares of rows, boundaries at multiples of _ROW_STEP."""
    steps = -(-rows // _ROW_STEP)
    cuts = [min(rows, (steps * i // parts) * _ROW_STEP) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


class MultiDeviceMLP:
    """One FusedMLP per device; a call splits its rows into one contiguous share per device, each on its own stream.

    Args:
        weights, biases, activation, output_activation: as FusedMLP.
        devices: None (every GPU this process sees; without one, the CPU path with FusedMLP's warning), one device
            string, or a list of them: 'cuda:N' (any number of GPUs), or 'cpu'. A device listed twice gets two shares
            (for the CPU path: a call on two threads).
        min_rows_per_device: a call gives each device at least this many rows, so a smaller batch uses fewer
            devices; one below 2 * min_rows_per_device is a plain call on the first device.
        **options: FusedMLP's other keyword arguments (residual, concat, dtype, check, cache_dir).

    NumPy inputs: each share runs in its own thread (the C core releases the GIL) on its device's stream; the
    outputs land in one array (``out=`` too). Torch CUDA tensors: the share of x's own device is launched on torch's
    current stream, every other share is copied to its GPU, launched on a stream of that GPU and copied back, and
    the current stream waits for them (no host synchronisation); only for a network of TORCH_SPLIT_FLOPS_PER_BYTE or
    more FLOPs per byte of a row's inputs and outputs (a lighter one runs faster on x's GPU alone than its copies
    between the GPUs take). Anything else (CuPy, 1-D x, ``out=`` with a torch x, a small batch) is a plain call on
    one device, which also raises FusedMLP's errors for malformed input.
    """

    def __init__(self, weights, biases=None, activation="relu", output_activation=None, *, devices=None,
                 min_rows_per_device=MIN_ROWS_PER_DEVICE, **options):
        self._setup(devices, min_rows_per_device, options,
                    lambda device: FusedMLP(weights, biases, activation, output_activation, device=device, **options))

    @classmethod
    def from_npz(cls, path, activation=None, output_activation=None, *, devices=None,
                 min_rows_per_device=MIN_ROWS_PER_DEVICE, **options):
        """Loads a model as FusedMLP.from_npz does (from a path or a binary file object), the file read once."""
        if hasattr(path, "read"):
            data = path.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
        self = cls.__new__(cls)
        self._setup(devices, min_rows_per_device, options, lambda device: FusedMLP.from_npz(
            io.BytesIO(data), activation, output_activation, device=device, **options))
        return self

    def _setup(self, devices, min_rows_per_device, options, build):
        if "device" in options:
            raise ArgumentError("MultiDeviceMLP takes devices=[...] (a list), not device=")
        if not _args._is_index(min_rows_per_device, 1, 1 << 62):
            raise ArgumentError(f"min_rows_per_device={min_rows_per_device!r} must be a positive int")
        self.devices = _device_list(devices)
        self.min_rows_per_device = int(min_rows_per_device)
        #: The FusedMLP of each device, in the order of devices.
        self.mlps = [build(device) for device in self.devices]
        self._streams = {}  # GPU ordinal -> torch.cuda.Stream, made at the first torch call that splits

    @property
    def widths(self):
        """Feature counts: the input as layer 0 reads it, then each layer's output (FusedMLP.widths)."""
        return self.mlps[0].widths

    @property
    def in_features(self):
        """x's features (FusedMLP.in_features)."""
        return self.mlps[0].in_features

    def __repr__(self):
        return f"MultiDeviceMLP(devices={self.devices}, widths={'-'.join(map(str, self.widths))})"

    def compile(self, arch="sm_90", io_dtype="float32"):
        """Compiles the kernel ahead of time (FusedMLP.compile); the devices share the cache, so once serves all."""
        return self.mlps[0].compile(arch, io_dtype)

    def set_weights(self, weights, biases=None, norm=None):
        """FusedMLP.set_weights on every device's model, one after another (each validates the arrays the same way,
        so the first refuses bad ones before any model changes). Returns True where every model took them in place."""
        return all([mlp.set_weights(weights, biases, norm=norm) for mlp in self.mlps])

    # ------------------------------------------------------------------------------------------------ calls

    def __call__(self, x, out=None):
        """Runs the network on x, its rows split over the devices; returns what FusedMLP would (out, if given)."""
        if self.mlps[0]._flatten_input is not None:  # the rows the network takes, before they are split
            x = _args._merge_dims(x, self.mlps[0]._flatten_input, "x")
        if len(self.mlps) > 1:
            if type(x).__module__.split(".")[0] == "torch":
                return self._call_torch(x, out)
            if isinstance(x, np.ndarray) or not _api._is_device_array(x):
                arr = self._splittable(x)
                if arr is not None:
                    return self._call_host(x, arr, out)
        return self.mlps[0](x, out=out)

    def _flops_per_byte(self, itemsize):
        """The network's FLOPs per byte of a row's inputs and outputs of `itemsize` bytes an element."""
        flops = 2 * sum(w.size for w in self.mlps[0]._w)
        return flops / ((self.in_features + self.widths[-1]) * itemsize)

    def _parts(self, rows):
        """How many devices a call of `rows` rows uses: each gets min_rows_per_device rows or more, and a share
        at least one _ROW_STEP."""
        return min(len(self.mlps), rows // self.min_rows_per_device, rows // _ROW_STEP)

    def _splittable(self, x):
        """x as the 2-D host array a split call takes, or None where the plain call answers (or raises) instead."""
        try:
            arr = np.asarray(x)
        except Exception:  # the plain call says what is wrong with it
            return None
        accepted = arr.dtype in _HOST_DTYPES or arr.dtype.name == "bfloat16"
        if (not accepted or not arr.dtype.isnative or arr.ndim != 2 or arr.shape[1] != self.in_features
                or self._parts(arr.shape[0]) < 2):
            return None
        return arr

    def _call_host(self, x, arr, out):
        rows, n_out = arr.shape[0], self.widths[-1]
        if out is not None:
            _out.check_numpy(x, arr, out, (rows, n_out))
        y = out if out is not None else np.empty((rows, n_out), dtype=arr.dtype)
        shares = _shares(rows, self._parts(rows))  # two or more: _splittable asked for 2 * min_rows_per_device rows
        mlps = self.mlps[: len(shares)]
        bf16 = arr.dtype.name == "bfloat16"
        kind = "bfloat16" if bf16 else ("float16" if arr.dtype == np.float16 else "float32")
        for mlp in mlps:  # in order: the first device tunes (if it must) and the others read its record
            if mlp._kind == "cuda":
                mlp._kernel(kind, rows=rows)

        direct = all(m._kind == "cuda" for m in mlps) and mlps[0]._writes_into(arr, bf16, y)

        def run(mlp, a, b):
            if direct:  # each device's copy lands in its rows of y
                mlp._host_forward(arr[a:b], bf16, y[a:b], rows)
            elif mlp._kind == "cpu":  # a row's result does not depend on the batch
                np.copyto(y[a:b], mlp(arr[a:b]), casting="unsafe")
            else:  # the kernel a call of all rows picks: one call's bits
                np.copyto(y[a:b], mlp._host_forward(arr[a:b], bf16, rows=rows), casting="unsafe")

        with concurrent.futures.ThreadPoolExecutor(len(shares) - 1) as pool:
            futures = [pool.submit(run, m, a, b) for m, (a, b) in zip(mlps[1:], shares[1:])]
            run(mlps[0], *shares[0])
            for f in futures:
                f.result()  # the first failure, after every share has finished
        return y

    def _call_torch(self, x, out):
        import torch

        from . import _dlpack

        kinds = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        kind = kinds.get(x.dtype)
        mlps = [m for m in self.mlps if m._kind == "cuda"]
        rows = x.shape[0] if x.dim() == 2 else 0
        plain = next((m for m in mlps if x.is_cuda and m._ordinal == x.device.index), self.mlps[0])
        if (out is not None or kind is None or not x.is_cuda or len(mlps) < len(self.mlps) or x.dim() != 2
                or x.shape[1] != self.in_features
                or (x.requires_grad and torch.is_grad_enabled()) or self._parts(rows) < 2
                or self._flops_per_byte(x.element_size()) < TORCH_SPLIT_FLOPS_PER_BYTE
                or (kind == "bfloat16" and not all(_dlpack._bf16_native(m) for m in mlps))):
            return plain(x, out=out)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        shares = _shares(rows, self._parts(rows))
        y = torch.empty((rows, self.widths[-1]), device=x.device, dtype=x.dtype)
        main = torch.cuda.current_stream(x.device)
        local, backs = [], []
        for mlp, (a, b) in zip(mlps, shares):
            kernel = mlp._kernel(kind, kind, rows)  # the kernel of the whole batch: a one-GPU call's bits
            if mlp._ordinal == x.device.index:
                local.append((kernel, a, b))  # launched on main after the other shares' copies, which run there
                continue
            device = torch.device("cuda", mlp._ordinal)
            stream = self._streams.get(mlp._ordinal)
            if stream is None:
                stream = self._streams[mlp._ordinal] = torch.cuda.Stream(device=device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                # torch runs a copy between GPUs on the source's current stream, after both devices' current streams,
                # and makes the destination's current stream wait for it
                xs = torch.empty((b - a, x.shape[1]), device=device, dtype=x.dtype)
                xs.copy_(x[a:b], non_blocking=True)
                ys = torch.empty((b - a, y.shape[1]), device=device, dtype=y.dtype)
                kernel.launch(xs.data_ptr(), ys.data_ptr(), b - a, stream.cuda_stream)
            backs.append((device, stream, ys, a, b))
        for kernel, a, b in local:
            kernel.launch(x[a:b].data_ptr(), y[a:b].data_ptr(), b - a, main.cuda_stream)
        # the copies back only now: each makes main wait for it (and so for its share's kernel), so main's own share,
        # launched above, runs beside the other GPUs' (enqueued before its launch, main's share waited for theirs:
        # siren256 split over two H200s took 43.2 ms against one GPU's 42.1)
        for device, stream, ys, a, b in backs:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                y[a:b].copy_(ys, non_blocking=True)
        for _, stream, *_ in backs:
            main.wait_stream(stream)
        return y

