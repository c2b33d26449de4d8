"""Input encodings computed in the kernel as x is loaded: NeRF's positional encoding and its kin.

An encoding is a list of parts whose concat along the features is what the first layer (and a concat layer's x
part, NeRF's skip) reads: ``"x"`` (x itself) or ``(func, scale)`` with func ``"sin"``, ``"cos"`` or ``"x"`` and scale
a number or one value per feature of x, so that a part is ``sin(scale * x)`` (``("x", s)``: s * x, NeuS's input
scaling). nerf-pytorch's encoding of L frequencies
is ``["x", ("sin", 1), ("cos", 1), ("sin", 2), ("cos", 2), ..., ("sin", 2 ** (L - 1)), ("cos", 2 ** (L - 1))]``
(frequency_encoding(L)). Each part is as wide as x, so the first layer takes x's features times the parts.

The kernels form each column's argument in float32 (one fma: scale * x + phase, cos z being sin(z + pi / 2)) and take
an accurate sine of it (range reduction, then the hardware sine), then store the value in the compute dtype, so the
phase of 2^9 x is float32's and not the 16-bit rounding of a first layer's weights and inputs. x in memory stays its
own width: NeRF's 3 coordinates a row instead of 63 encoded features.
"""

import math

import numpy as np

from .errors import ArgumentError, ShapeError

_FUNCS = ("sin", "cos")


def frequency_encoding(n_frequencies, include_x=True, scale=1.0):
    """The parts of NeRF's positional encoding: x (where include_x), then sin and cos of scale * 2^k x for k < n.

    scale=1 is nerf-pytorch's (and the NeRF paper's with x already in [-pi, pi]); scale=math.pi is tiny-cuda-nn's
    "Frequency" encoding (sin(2^k pi x))."""
    if not isinstance(n_frequencies, int) or isinstance(n_frequencies, bool) or not 1 <= n_frequencies <= 24:
        raise ArgumentError(f"n_frequencies is {n_frequencies!r}; an integer 1..24 (2^23 x is float32's last "
                            "meaningful phase)")
    parts = ["x"] if include_x else []
    for k in range(n_frequencies):
        f = float(scale) * 2.0 ** k
        parts += [("sin", f), ("cos", f)]
    return parts


def parse(encoding, first_inputs):
    """(x_features, columns, parts) for FusedMLP's encoding= argument, or None; first_inputs: what layer 0 takes.
    columns: one (src, sin, scale, phase) per layer 0 input, as _core.Network's encoding takes them; parts: the
    normalised parts [("x", None) or (func, float64 scale array)] that save() writes."""
    if encoding is None:
        return None
    if isinstance(encoding, (str, bytes)) or not isinstance(encoding, (list, tuple)) or not encoding:
        raise ArgumentError(f"encoding is {encoding!r}; a list of parts, each 'x' or (func, scale) with func 'sin' or "
                            "'cos' (fusedmlp.frequency_encoding(n) gives NeRF's)")
    parts, widths = [], set()
    for i, part in enumerate(encoding):
        if isinstance(part, str) and part == "x" or (isinstance(part, (list, tuple)) and len(part) in (1, 2)
                                                     and part[0] == "x" and (len(part) == 1 or part[1] is None)):
            parts.append(("x", None))
            continue
        if not isinstance(part, (list, tuple)) or len(part) != 2 or part[0] not in _FUNCS + ("x",):
            raise ArgumentError(f"encoding[{i}] is {part!r}; a part is 'x' or (func, scale) with func 'sin', 'cos' "
                                "or 'x'")
        try:
            scale = np.asarray(part[1], dtype=np.float64)
        except (TypeError, ValueError):
            raise ArgumentError(f"encoding[{i}]'s scale is {part[1]!r}; a number or one per feature of x") from None
        if scale.ndim > 1 or scale.size == 0 or not np.all(np.isfinite(scale)):
            raise ArgumentError(f"encoding[{i}]'s scale has shape {scale.shape} or a value that is not finite; a "
                                "finite number or a 1-D array with one per feature of x")
        if scale.ndim == 1:
            widths.add(scale.size)
        parts.append((part[0], scale))
    if len(widths) > 1:
        raise ShapeError(f"encoding's scales have {sorted(widths)} values; each part is as wide as x, so every "
                         "per-feature scale has x's features")
    if widths:
        n = widths.pop()
    elif first_inputs % len(parts):
        raise ShapeError(f"encoding has {len(parts)} parts, each as wide as x, but layer 0 takes {first_inputs} "
                         f"inputs, no multiple of {len(parts)}")
    else:
        n = first_inputs // len(parts)
    if n * len(parts) != first_inputs:
        raise ShapeError(f"encoding makes {n * len(parts)} columns ({len(parts)} parts of x's {n} features) but layer "
                         f"0 takes {first_inputs} inputs")
    columns = []
    for kind, scale in parts:
        if kind == "x":
            scale = np.broadcast_to(1.0 if scale is None else scale, (n,))
            columns += [(i, 0, float(scale[i]), 0.0) for i in range(n)]
            continue
        scale = np.broadcast_to(scale, (n,))
        phase = math.pi / 2 if kind == "cos" else 0.0
        columns += [(i, 1, float(scale[i]), phase) for i in range(n)]
    parts = [(k, None if s is None else np.broadcast_to(s, (n,)).copy()) for k, s in parts]
    return n, columns, parts


def apply(parts, x):
    """The encoding of x ((rows, features) float64) in float64: what the layers read (the CPU reference's form is
    ref.c's fm_ref_x, which forms each sine's argument in float32 as the kernels do)."""
    out = []
    for kind, scale in parts:
        s = 1.0 if scale is None else scale
        out.append(s * x if kind == "x" else np.sin(s * x + (np.pi / 2 if kind == "cos" else 0.0)))
    return np.concatenate(out, axis=-1)


def to_json(parts):
    """parts as save() writes them: [["x"], ["sin", [scales]], ...] (float64 text: exact for float32 scales)."""
    return [[k] if s is None else [k, [float(v) for v in s]] for k, s in parts]


def describe(parts):
    """A short text for repr: 'x + 20 sin/cos parts'."""
    sines = sum(k != "x" for k, _ in parts)
    return ("x + " if len(parts) > sines else "") + f"{sines} sin/cos part{'s' if sines != 1 else ''}"
