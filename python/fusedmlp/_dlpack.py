"""Device arrays in and out without host copies: torch tensors, CuPy arrays, and any DLPack producer (via torch).

The kernel reads the caller's memory in place and writes into an output allocated by the caller's library (torch's
caching allocator, CuPy's pool), on the caller's current stream, with no host synchronisation: the call orders with
surrounding work and can be captured in a CUDA graph (after a first, warm-up call has built the kernel).
"""

import numpy as np

from .errors import ArgumentError, DTypeError, ShapeError


def call(mlp, x, out_dtype=None):
    """Runs mlp on a device array x of shape (..., in_features); returns the same kind of array."""
    if type(x).__module__.split(".")[0] == "cupy":
        return _call_cupy(mlp, x, out_dtype)
    import torch

    if not isinstance(x, torch.Tensor):
        x = torch.from_dlpack(x)
    return call_torch(mlp, x, out_dtype)


def _bf16_native(mlp):
    """Whether the model's GPU reads and writes bfloat16 in the kernel (sm_80+; the plan refuses it below)."""
    native = mlp._bf16_io
    if native is None:
        from . import _api

        native = mlp._bf16_io = _api._gpu(mlp._ordinal).info["arch"] >= 80
    return native


def _check_shape(mlp, shape):
    n_in = mlp.widths[0]
    if len(shape) < 1 or shape[-1] != n_in:
        raise ShapeError(f"x has shape {tuple(shape)}; the network takes (..., {n_in})")


_fast = None  # torch dtype -> kernel dtype name, and the raw current-stream getter, once torch is imported


def _fast_tables(torch):
    global _fast
    if _fast is None:
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher uses
        if raw_stream is None:
            def raw_stream(index):
                return torch.cuda.current_stream(index).cuda_stream
        _fast = ({torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}, raw_stream)
    return _fast


def call_torch(mlp, x, out_dtype=None):
    """The torch path: CPU tensors through the CPU/NumPy path, CUDA tensors through the kernel on torch's stream."""
    import torch

    # The common case first, with nothing re-derived per call (36 us -> see bench call_us): a C-contiguous, aligned
    # float32/float16 CUDA tensor on the model's device, output in the same dtype, autograd not tracking it.
    kinds, raw_stream = _fast_tables(torch)
    kind = kinds.get(x.dtype)
    if kind == "bfloat16" and mlp._kind == "cuda" and not _bf16_native(mlp):
        kind = None  # the slow path converts through float32
    if (kind is not None and out_dtype is None and x.is_cuda and mlp._kind == "cuda" and not x.requires_grad
            and x.dim() == 2 and x.shape[1] == mlp._n_in and x.shape[0] > 0 and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and x.get_device() == mlp._ordinal):
        rows = x.shape[0]
        y = torch.empty((rows, mlp._n_out), device=x.device, dtype=x.dtype)
        mlp._kernel(kind, rows=rows).launch(x.data_ptr(), y.data_ptr(), rows, raw_stream(mlp._ordinal))
        if mlp._check:
            mlp._verify(x.float().cpu().numpy(), y.float().cpu().numpy())
        return y

    accepted = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in accepted:
        raise DTypeError(f"x has dtype {x.dtype}; it must be torch.float32, torch.float16 or torch.bfloat16")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in accepted:
        raise DTypeError(f"out_dtype={out_dtype}; it must be torch.float32, torch.float16 or torch.bfloat16")
    if x.requires_grad and torch.is_grad_enabled():
        raise ArgumentError("x requires grad, but fusedmlp is inference-only (it has no backward): call it under "
                            "torch.no_grad() or torch.inference_mode(), or pass x.detach()")
    _check_shape(mlp, x.shape)
    n_in, n_out = mlp.widths[0], mlp.widths[-1]
    lead = tuple(x.shape[:-1])
    if x.device.type != "cuda":
        y = mlp(x.detach().to(torch.float32).reshape(-1, n_in).numpy())
        return torch.from_numpy(y).reshape(*lead, n_out).to(out_dtype)
    if mlp._kind != "cuda" or x.device.index != mlp._ordinal:
        raise ArgumentError(f"x is on {x.device} but the model runs on {mlp.device}; move x there, or build the model "
                            f"with device='{x.device}'")
    rows = x.numel() // n_in
    if rows == 0:
        return torch.empty((*lead, n_out), device=x.device, dtype=out_dtype)
    k_in, k_out = kinds[x.dtype], kinds[out_dtype]  # the kernel converts between any of the three in registers
    xin = x.reshape(rows, n_in)
    if not _bf16_native(mlp):  # sm_75 has no bfloat16 conversions: float32 in and out instead (exact for bf16 in)
        k_in = "float32" if k_in == "bfloat16" else k_in
        k_out = "float32" if k_out == "bfloat16" else k_out
        xin = xin.to(getattr(torch, k_in))
    if not xin.is_contiguous() or xin.data_ptr() % 16:  # views: made contiguous once (a device copy, no host copy)
        xin = xin.clone(memory_format=torch.contiguous_format)
    y = torch.empty((rows, n_out), device=x.device, dtype=getattr(torch, k_out))
    kernel = mlp._kernel(k_in, k_out, rows)
    kernel.launch(xin.data_ptr(), y.data_ptr(), rows, torch.cuda.current_stream(x.device).cuda_stream)
    if mlp._check:
        mlp._verify(x.detach().reshape(rows, n_in).float().cpu().numpy(), y.float().cpu().numpy())
    return y.to(out_dtype).reshape(*lead, n_out)


def _call_cupy(mlp, x, out_dtype):
    import cupy

    if x.dtype not in (np.float32, np.float16):
        raise DTypeError(f"x has dtype {x.dtype}; CuPy arrays must be float32 or float16")
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (np.float32, np.float16):
        raise DTypeError(f"out_dtype={out_dtype}; it must be float32 or float16 for CuPy arrays")
    _check_shape(mlp, x.shape)
    if mlp._kind != "cuda" or x.device.id != mlp._ordinal:
        raise ArgumentError(f"x is on cuda:{x.device.id} but the model runs on {mlp.device}")
    n_in, n_out = mlp.widths[0], mlp.widths[-1]
    lead = tuple(x.shape[:-1])
    rows = x.size // n_in
    with x.device:
        y = cupy.empty((rows, n_out), dtype=out_dtype)
        if rows == 0:
            return y.reshape(*lead, n_out)
        xin = cupy.ascontiguousarray(x.reshape(rows, n_in))
        if xin.data.ptr % 16:
            xin = xin.copy()
        kernel = mlp._kernel(x.dtype.name, out_dtype.name, rows)
        kernel.launch(xin.data.ptr, y.data.ptr, rows, cupy.cuda.get_current_stream().ptr)
    return y.reshape(*lead, n_out)
