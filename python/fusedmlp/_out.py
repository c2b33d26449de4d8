"""Validation of a caller's preallocated output (``mlp(x, out=y)``) for NumPy, torch and CuPy.

Each check raises the error a caller expects (ShapeError, DTypeError, ArgumentError) naming ``out``, the value and the
rule. The fast torch path in _dlpack.py does not come here: it takes out only when a few attribute reads show that
the kernel can write into it as it is, and sends everything else through these checks.
"""

import numpy as np

from .errors import ArgumentError, DTypeError, ShapeError

_OVERLAP_WHY = ("the kernel reads rows of x while other thread blocks already write rows of out, so out must be "
                "memory of its own")


def _type_name(value):
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def _span(ptr, shape, strides, itemsize):
    """[first byte, one past the last byte) an array touches, from its byte strides (negative ones too); None if
    it has no elements."""
    if any(s == 0 for s in shape):
        return None
    lo = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = ptr + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi


def _check_disjoint(x_span, out_span):
    if x_span and out_span and out_span[0] < x_span[1] and x_span[0] < out_span[1]:
        raise ArgumentError(f"out shares memory with x (out spans bytes 0x{out_span[0]:x}-0x{out_span[1]:x}, x "
                            f"0x{x_span[0]:x}-0x{x_span[1]:x}); out must not overlap x: {_OVERLAP_WHY}")


def _check_own_elements(shape, strides, itemsize):
    """Raises when two elements of out may share memory (a stride of 0 from expand/broadcast_to, or as_strided): the
    result would depend on which write lands last. Sufficient test: sorted by stride, each dimension steps past the
    whole extent of the ones before it."""
    if 0 in tuple(shape):
        return  # no elements (NumPy gives empty arrays zero strides)
    extent = itemsize
    for st, n in sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1):
        if st < extent:
            raise ArgumentError(f"out has strides {tuple(strides)} (bytes) for shape {tuple(shape)}, so some of its "
                                "elements share memory (an expand or broadcast view?); every output element needs "
                                "its own memory")
        extent = st * n


def _check_shape(out, shape, x_shape):
    if tuple(out.shape) != tuple(shape):
        raise ShapeError(f"out has shape {tuple(out.shape)}; for x of shape {tuple(x_shape)} it must be {tuple(shape)} "
                         f"(x's leading dimensions, then the network's {shape[-1]} outputs)")


# ------------------------------------------------------------------------------------------------ NumPy


def check_numpy(x, arr, out, shape):
    """Raises unless out can take the result of a host call on x (arr: x as read, in the dtype the call returns)."""
    if not isinstance(out, np.ndarray):
        raise ArgumentError(f"out is a {_type_name(out)}; for NumPy (or list) x it must be a NumPy ndarray of shape "
                            f"{tuple(shape)} and dtype {arr.dtype}, the array this call would return")
    _check_shape(out, shape, np.shape(x))
    if out.dtype != arr.dtype:
        raise DTypeError(f"out has dtype {out.dtype}; it must be {arr.dtype}, the dtype this call returns (x's dtype; "
                         "NumPy calls do not convert the output)")
    if not out.flags.writeable:
        raise ArgumentError("out is read-only (out.flags.writeable is False); it must be a writable array")
    _check_own_elements(out.shape, out.strides, out.itemsize)
    # Bounds, as on the GPU paths (an exact np.shares_memory can take exponential time on strided views).
    if np.may_share_memory(out, x if isinstance(x, np.ndarray) else arr):
        raise ArgumentError("out shares memory with x; out must not overlap x (the rule of every path: on the GPU "
                            f"{_OVERLAP_WHY})")


# ------------------------------------------------------------------------------------------------ torch


def torch_out_dtype(torch, out, out_dtype):
    """out's dtype, once out is a torch tensor of an output dtype that agrees with out_dtype (if given)."""
    if not isinstance(out, torch.Tensor):
        raise ArgumentError(f"out is a {_type_name(out)}; for a torch x it must be a torch.Tensor on x's device "
                            "(if you meant the output dtype, pass it as out_dtype=...)")
    accepted = (torch.float32, torch.float16, torch.bfloat16)
    if out.dtype not in accepted:
        raise DTypeError(f"out has dtype {out.dtype}; it must be torch.float32, torch.float16 or torch.bfloat16")
    if out_dtype is not None and out_dtype not in accepted:
        raise DTypeError(f"out_dtype={out_dtype!r}; it must be torch.float32, torch.float16 or torch.bfloat16")
    if out_dtype is not None and out_dtype != out.dtype:
        raise ArgumentError(f"out_dtype={out_dtype} but out has dtype {out.dtype}; with out given, out's dtype is the "
                            "output dtype: leave out_dtype out or make it the same")
    return out.dtype


def _torch_span(t):
    size = t.element_size()
    return _span(t.data_ptr(), t.shape, [s * size for s in t.stride()], size)


def check_torch(torch, x, out, shape):
    """Raises unless out (a torch tensor of an output dtype) can take the result for x: x's device, the shape,
    dense, no autograd, each element its own memory, no memory shared with x."""
    if out.device != x.device:
        raise ArgumentError(f"out is on {out.device} but x is on {x.device}; out must be on x's device")
    if out.layout != torch.strided:
        raise ArgumentError(f"out has layout {out.layout}; it must be a dense (torch.strided) tensor")
    _check_shape(out, shape, x.shape)
    if out.requires_grad:
        raise ArgumentError("out requires grad, but fusedmlp writes it outside autograd (it is inference-only): pass "
                            "a tensor that does not require grad (e.g. made under torch.no_grad(), or out.detach())")
    size = out.element_size()
    _check_own_elements(out.shape, [s * size for s in out.stride()], size)
    _check_disjoint(_torch_span(x), _torch_span(out))


def torch_copy_into(torch, out, y):
    """out.copy_(y) (converting the dtype) for any out check_torch accepted, made under torch.inference_mode or not:
    inside inference mode both kinds take in-place writes, outside it an inference tensor takes none."""
    with torch.inference_mode():
        out.copy_(y)
    return out


# ------------------------------------------------------------------------------------------------ CuPy


def cupy_out_dtype(cupy, out, out_dtype):
    """out's dtype, once out is a CuPy float32/float16 array whose dtype agrees with out_dtype (if given)."""
    if not isinstance(out, cupy.ndarray):
        raise ArgumentError(f"out is a {_type_name(out)}; for a CuPy x it must be a cupy.ndarray on x's device "
                            "(if you meant the output dtype, pass it as out_dtype=...)")
    if out.dtype not in (np.float32, np.float16):
        raise DTypeError(f"out has dtype {out.dtype}; it must be float32 or float16 for CuPy arrays")
    if out_dtype is not None and np.dtype(out_dtype) != out.dtype:
        raise ArgumentError(f"out_dtype={out_dtype} but out has dtype {out.dtype}; with out given, out's dtype is the "
                            "output dtype: leave out_dtype out or make it the same")
    return out.dtype


def check_cupy(x, out, shape):
    """Raises unless out can take the result for x: x's device, the shape, each element its own memory, no memory
    shared with x."""
    if out.device.id != x.device.id:
        raise ArgumentError(f"out is on cuda:{out.device.id} but x is on cuda:{x.device.id}; out must be on x's device")
    _check_shape(out, shape, x.shape)
    _check_own_elements(out.shape, out.strides, out.itemsize)
    _check_disjoint(_span(x.data.ptr, x.shape, x.strides, x.itemsize),
                    _span(out.data.ptr, out.shape, out.strides, out.itemsize))
