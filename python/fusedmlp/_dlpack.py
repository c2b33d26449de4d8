"""Device arrays in and out without host copies: torch tensors, CuPy arrays, and any DLPack producer (via torch).

The kernel reads the caller's memory in place and writes into an output allocated by the caller's library (torch's
caching allocator, CuPy's pool), on the caller's current stream, with no host synchronisation: the call orders with
surrounding work and can be captured in a CUDA graph (after a first, warm-up call has built the kernel).
"""

import numpy as np

from . import _core, _env, _out, _segments
from .errors import ArgumentError, DTypeError, ShapeError


class CallTable(dict):
    """FusedMLP._kernel's answers for calls ((dtypes, batch bucket, size class, FUSEDMLP_AUTOTUNE) -> kernel), and
    their mirror in C: `fast` is the model's _core.FastPath.call once a CUDA tensor call has gone through the checked
    path (remember() makes it), which then answers the same calls in one call into C. Clearing the table (a tuning,
    new scales) clears the mirror, so the two cannot disagree."""

    fast = None
    _path = None
    _libraries = ()

    def clear(self):
        super().clear()
        if self._path is not None:
            self._path.clear()


_KIND_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}  # csrc/module_fast.c's kinds
_TORCH, _CUPY = 0, 1  # its libraries


def _torch_library(torch, mlp):
    """FastPath.set_library's arguments for torch tensors, or None where this torch exports no DLPack in C."""
    export = getattr(torch._C, "_to_dlpack", None)
    if export is None:
        return None
    _, raw_stream, bump = _fast_tables(torch)
    return (_TORCH, torch.Tensor, export, raw_stream, (mlp._ordinal,), torch.empty, False,
            (("device", torch.device("cuda", mlp._ordinal)),), bump, True,
            (torch.float32, torch.float16, torch.bfloat16))


def _cupy_library(cupy, mlp):
    """FastPath.set_library's arguments for CuPy arrays (float32 and float16: CuPy has no bfloat16), or None."""
    export = getattr(cupy.ndarray, "toDlpack", None)
    if export is None:
        return None
    return (_CUPY, cupy.ndarray, export, cupy.cuda.get_current_stream, (), cupy.empty, True, (), None, False,
            (np.dtype(np.float32), np.dtype(np.float16), None))


def remember(mlp, library, k_in, k_out, rows, kernel, stream):
    """Adds what a call just launched to the model's C fast path, so the next calls in its batch bucket skip Python
    (csrc/module_fast.c): a fused kernel, or a segmented network's chain with its workspace on `stream` (calls on
    other streams, or larger than that workspace, stay here). Not for calls with check=True.

    Args:
        library: (_TORCH or _CUPY, a function of no arguments giving FastPath.set_library's arguments or None)."""
    table = mlp._calls
    if mlp._check or not isinstance(table, CallTable):
        return
    program = None
    if isinstance(kernel, _segments.Chain):
        program = kernel.program(rows, stream)
        if any(type(step[0]) is not _core.Kernel for step in program[0]):
            return
    elif type(kernel) is not _core.Kernel:
        return
    index, make = library
    path = table._path
    if path is None:
        path = _core.FastPath(mlp._n_in, mlp._n_out, mlp._ordinal)
        table._path, table._libraries = path, set()
    if index not in table._libraries:
        arguments = make()
        if arguments is None:
            return
        path.set_library(*arguments)
        table._libraries.add(index)
    table.fast = path.call
    if program is None:
        path.add(_KIND_CODES[k_in], _KIND_CODES[k_out], rows, mlp._sm_count, kernel)
    else:
        steps, base, cap = program
        path.add_chain(_KIND_CODES[k_in], _KIND_CODES[k_out], rows, mlp._sm_count, kernel, kernel._launch_lock,
                       stream, base, cap, steps, _env.chain_graphs())


def call(mlp, x, out_dtype=None, out=None):
    """Runs mlp on a device array x of shape (..., in_features); returns the same kind of array (out, if given)."""
    if type(x).__module__.split(".")[0] == "cupy":
        return _call_cupy(mlp, x, out_dtype, out)
    import torch

    if not isinstance(x, torch.Tensor):  # another DLPack producer (JAX, ...): a torch view of the same memory, then
        x = torch.from_dlpack(x)         # the C fast path as for any tensor (the checked path if it declines)
        fast = mlp._calls.fast
        if fast is not None:
            y = fast(x, out_dtype, out)
            if y is not NotImplemented:
                return y
    return call_torch(mlp, x, out_dtype, out)


def _bf16_native(mlp):
    """Whether the model's GPU reads and writes bfloat16 in the kernel (sm_80+; the plan refuses it below)."""
    native = mlp._bf16_io
    if native is None:
        native = mlp._bf16_io = mlp._gpu_info()["arch"] >= 80
    return native


def _check_shape(mlp, shape):
    n_in = mlp.in_features
    if len(shape) < 1 or shape[-1] != n_in:
        raise ShapeError(f"x has shape {tuple(shape)}; the network takes (..., {n_in})")


_fast = None  # torch dtype -> kernel dtype name, the raw current-stream getter and the version bump, once torch is in


def _fast_tables(torch):
    global _fast
    if _fast is None:
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher uses
        if raw_stream is None:
            def raw_stream(index):
                return torch.cuda.current_stream(index).cuda_stream
        # A kernel writing into out behind torch's back must bump out's version counter, as torch's own out= ops do:
        # autograd then refuses a backward through an op that saved out's old values (0.3 us a call; torch >= 2.1).
        bump = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
        _fast = ({torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}, raw_stream, bump)
    return _fast


def call_torch(mlp, x, out_dtype=None, out=None):
    """The torch path: CPU tensors through the CPU/NumPy path, CUDA tensors through the kernel on torch's stream."""
    import torch

    # The common case first, with nothing re-derived per call (36 us -> see bench call_us): a C-contiguous, aligned
    # float32/float16 CUDA tensor on the model's device, output in the same dtype (or into an out the kernel can write
    # as it is: no torch.empty; at batch 1024 on the H100 machine such calls took 9.8-17 us to mlp(x)'s 12.5-22 us,
    # `python -m fusedmlp.bench probe host`), autograd not tracking it.
    kinds, raw_stream, bump = _fast_tables(torch)
    kind = kinds.get(x.dtype)
    if kind == "bfloat16" and mlp._kind == "cuda" and not _bf16_native(mlp):
        kind = None  # the slow path converts through float32
    if (kind is not None and x.is_cuda and mlp._kind == "cuda" and not x.requires_grad
            and x.dim() == 2 and x.shape[1] == mlp._n_in and x.shape[0] > 0 and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and x.get_device() == mlp._ordinal):
        rows = x.shape[0]
        if out is None:
            if out_dtype is None:
                y = torch.empty((rows, mlp._n_out), device=x.device, dtype=x.dtype)
                return _launch(torch, mlp, kind, kind, x, y, rows, raw_stream)
        else:
            out_kind = _direct_out_kind(torch, mlp, x, out, out_dtype)
            if out_kind is not None:
                if bump is not None:
                    bump(out)
                return _launch(torch, mlp, kind, out_kind, x, out, rows, raw_stream)
    return _call_torch_checked(torch, mlp, x, out_dtype, out)


def _launch(torch, mlp, k_in, k_out, x, y, rows, raw_stream):
    kernel = mlp._kernel(k_in, k_out, rows)
    stream = raw_stream(mlp._ordinal)
    kernel.launch(x.data_ptr(), y.data_ptr(), rows, stream)
    remember(mlp, (_TORCH, lambda: _torch_library(torch, mlp)), k_in, k_out, rows, kernel, stream)
    if mlp._check:
        mlp._verify(x.float().cpu().numpy(), y.float().cpu().numpy())
    return y


def _direct_out_kind(torch, mlp, x, out, out_dtype):
    """The kernel output dtype name when the fast path may launch straight into out, else None: then the checked path
    says what is wrong with out, or computes into a temporary and copies. x passed the fast path's tests.

    Each attribute read costs 0.1-0.2 us on the H100 machine, so the shape is one comparison and get_device() (-1 off
    the GPU) stands for is_cuda too: 1.8-2.5 us for all of it, against 6.3-8.7 us for the torch.empty it replaces in
    the same run (a read per condition: 1.4 against 3.6 us on a faster run)."""
    if not isinstance(out, torch.Tensor) or (out_dtype is not None and out_dtype != out.dtype):
        return None
    kind = _fast[0].get(out.dtype)
    if (kind is None or out.get_device() != mlp._ordinal or out.requires_grad
            or out.shape != (x.shape[0], mlp._n_out) or not out.is_contiguous()):
        return None
    if kind == "bfloat16" and not _bf16_native(mlp):
        return None
    xp, yp = x.data_ptr(), out.data_ptr()
    if yp % 16 or (yp < xp + x.nbytes and xp < yp + out.nbytes):  # both contiguous: nbytes is their extent
        return None  # unaligned, or out overlaps x (the checked path says so)
    return kind


def _call_torch_checked(torch, mlp, x, out_dtype, out):
    """Every torch call the fast path does not take: checks x (and out), then the CPU path or the kernel."""
    accepted = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in accepted:
        raise DTypeError(f"x has dtype {x.dtype}; it must be torch.float32, torch.float16 or torch.bfloat16")
    if out is not None:
        out_dtype = _out.torch_out_dtype(torch, out, out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in accepted:
        raise DTypeError(f"out_dtype={out_dtype}; it must be torch.float32, torch.float16 or torch.bfloat16")
    if x.requires_grad and torch.is_grad_enabled():
        raise ArgumentError("x requires grad, but fusedmlp is inference-only (it has no backward): call it under "
                            "torch.no_grad() or torch.inference_mode(), or pass x.detach()")
    _check_shape(mlp, x.shape)
    n_in, n_out = mlp.in_features, mlp.widths[-1]
    lead = tuple(x.shape[:-1])
    if out is not None:
        _out.check_torch(torch, x, out, (*lead, n_out))
    if x.device.type != "cuda":
        # NumPy's own call on a view of x: float32 and float16 as they are (the kernel reads and writes them, and a GPU
        # call's host copies move half the bytes for float16), bfloat16 (no NumPy dtype) or another output dtype
        # through float32
        same = x.dtype in (torch.float32, torch.float16) and out_dtype == x.dtype
        xs = x.detach() if same else x.detach().to(torch.float32)
        y = torch.from_numpy(mlp(xs.reshape(-1, n_in).numpy())).reshape(*lead, n_out)
        if out is not None:
            return _out.torch_copy_into(torch, out, y)
        return y if same else y.to(out_dtype)
    if mlp._kind != "cuda" or x.device.index != mlp._ordinal:
        raise ArgumentError(f"x is on {x.device} but the model runs on {mlp.device}; move x there, or build the model "
                            f"with device='{x.device}'")
    rows = x.numel() // n_in
    if rows == 0:
        return torch.empty((*lead, n_out), device=x.device, dtype=out_dtype) if out is None else out
    return _run_cuda(torch, mlp, x, out_dtype, out, rows)


def _run_cuda(torch, mlp, x, out_dtype, out, rows):
    """The kernel on a checked CUDA tensor x of `rows` rows (> 0); writes into out where it can, else copies there."""
    kinds, _, bump = _fast
    n_in, n_out = mlp.in_features, mlp.widths[-1]
    k_in, k_out = kinds[x.dtype], kinds[out_dtype]  # the kernel converts between any of the three in registers
    xin = x.reshape(rows, n_in)
    if not _bf16_native(mlp):  # sm_75 has no bfloat16 conversions: float32 in and out instead (exact for bf16 in)
        k_in = "float32" if k_in == "bfloat16" else k_in
        k_out = "float32" if k_out == "bfloat16" else k_out
        xin = xin.to(getattr(torch, k_in))
    if not xin.is_contiguous() or xin.data_ptr() % 16:  # views: made contiguous once (a device copy, no host copy)
        xin = xin.clone(memory_format=torch.contiguous_format)
    # out takes the kernel's writes if it has the kernel's output dtype and layout; else a temporary, copied into it
    direct = (out is not None and out.dtype == getattr(torch, k_out) and out.is_contiguous()
              and out.data_ptr() % 16 == 0)
    if direct:
        y = out.view(rows, n_out)
        if bump is not None:
            bump(out)
    else:
        y = torch.empty((rows, n_out), device=x.device, dtype=getattr(torch, k_out))
    kernel = mlp._kernel(k_in, k_out, rows)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernel.launch(xin.data_ptr(), y.data_ptr(), rows, stream)
    remember(mlp, (_TORCH, lambda: _torch_library(torch, mlp)), k_in, k_out, rows, kernel, stream)
    if mlp._check:
        mlp._verify(x.detach().reshape(rows, n_in).float().cpu().numpy(), y.float().cpu().numpy())
    if out is None:
        return y.to(out_dtype).reshape(*x.shape[:-1], n_out)
    return out if direct else _out.torch_copy_into(torch, out, y.view(out.shape))


def _call_cupy(mlp, x, out_dtype, out=None):
    import cupy

    if x.dtype not in (np.float32, np.float16):
        raise DTypeError(f"x has dtype {x.dtype}; CuPy arrays must be float32 or float16")
    if out is not None:
        out_dtype = _out.cupy_out_dtype(cupy, out, out_dtype)
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (np.float32, np.float16):
        raise DTypeError(f"out_dtype={out_dtype}; it must be float32 or float16 for CuPy arrays")
    _check_shape(mlp, x.shape)
    if mlp._kind != "cuda" or x.device.id != mlp._ordinal:
        raise ArgumentError(f"x is on cuda:{x.device.id} but the model runs on {mlp.device}")
    n_in, n_out = mlp.in_features, mlp.widths[-1]
    lead = tuple(x.shape[:-1])
    rows = x.size // n_in
    if out is not None:
        _out.check_cupy(x, out, (*lead, n_out))
    with x.device:
        if rows == 0:
            return cupy.empty((*lead, n_out), dtype=out_dtype) if out is None else out
        xin = cupy.ascontiguousarray(x.reshape(rows, n_in))
        if xin.data.ptr % 16:
            xin = xin.copy()
        # as for torch: the kernel writes into out where its layout allows, else into a temporary copied there
        direct = out is not None and out.flags.c_contiguous and out.data.ptr % 16 == 0
        y = out.reshape(rows, n_out) if direct else cupy.empty((rows, n_out), dtype=out_dtype)
        kernel = mlp._kernel(x.dtype.name, out_dtype.name, rows)
        stream = cupy.cuda.get_current_stream().ptr
        kernel.launch(xin.data.ptr, y.data.ptr, rows, stream)
        remember(mlp, (_CUPY, lambda: _cupy_library(cupy, mlp)), x.dtype.name, out_dtype.name, rows, kernel, stream)
        if out is None:
            return y.reshape(*lead, n_out)
        if not direct:
            cupy.copyto(out, y.reshape(out.shape))
    return out
