"""FusedMLP's norm= option: LayerNorm / RMSNorm (or a softmax) of a layer's W h + b before its activation (issue 30).

The C core applies it (csrc/spec.c holds the arrays, csrc/ref.c the CPU forward, the kernel templates the fused
epilogue: the row's statistics in float32 across its columns); this module turns the user's spelling into the core's
per-layer tuples and back into text for repr and the tuning key.
"""

import math

import numpy as np

from .errors import ArgumentError, DTypeError, ShapeError

#: The kinds, as the core's FM_NORM_* codes. softmax and log_softmax (over the layer's features, as torch.softmax(z,
#: -1)) are row normalisations too: their statistics are the row's max and its sum of exp(z - max), and they take no
#: weight, bias or eps. A classifier's head is its last layer with one of them and no activation; the activation
#: names 'softmax' and 'log_softmax' are spelled that way (take_softmax).
KINDS = {"layernorm": 1, "rmsnorm": 2, "softmax": 3, "log_softmax": 4}
SOFTMAX = ("softmax", "log_softmax")
NAMES = {code: name for name, code in KINDS.items()}
#: eps where a spec gives none: torch.nn.LayerNorm's default, and for rmsnorm what torch.nn.RMSNorm's eps=None means
#: for float32 inputs, torch.finfo(torch.float32).eps (the kernels compute the statistics in float32).
DEFAULT_EPS = {"layernorm": 1e-5, "rmsnorm": float(np.finfo(np.float32).eps), "softmax": 0.0, "log_softmax": 0.0}

_SPELLINGS = ("'layernorm', 'rmsnorm', 'softmax', 'log_softmax', (kind, weight), (kind, weight, bias), (kind, weight, "
              "bias, eps) or {'kind': ..., 'weight': ..., 'bias': ..., 'eps': ...}")


def _vector(value, field, width):
    """value as a float32 C-contiguous (width,) array, or raises naming the field and the rule."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor (nn.LayerNorm.weight)
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise DTypeError(f"{field} could not be read as an array: {e}") from None
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise DTypeError(f"{field} has dtype {arr.dtype}; a norm's weight and bias are real numbers")
    if arr.shape != (width,):
        raise ShapeError(f"{field} has shape {arr.shape}; the layer has {width} outputs, so it must be ({width},)")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        at = int(np.argwhere(~np.isfinite(out))[0][0])
        raise ArgumentError(f"{field} holds a non-finite value {out[at]} at index {at} (after conversion to float32); "
                            "a norm's weight and bias must be finite")
    return out


def _one(layer, spec, width):
    """(kind code, eps, weight or None, bias or None) of one layer's spec."""
    weight = bias = eps = None
    if isinstance(spec, str):
        kind = spec
    elif isinstance(spec, dict) and "kind" in spec and set(spec) <= {"kind", "weight", "bias", "eps"}:
        kind, weight, bias, eps = spec["kind"], spec.get("weight"), spec.get("bias"), spec.get("eps")
    elif isinstance(spec, (list, tuple)) and 1 <= len(spec) <= 4:
        kind, weight, bias, eps = (*spec, None, None, None)[:4]
    else:
        raise ArgumentError(f"norm of layer {layer} is {spec!r}; write {_SPELLINGS}")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ArgumentError(f"norm kind of layer {layer} is {kind!r}; it must be 'layernorm', 'rmsnorm', 'softmax' or "
                            "'log_softmax' (a BatchNorm1d folds into the weights instead: fusedmlp.from_torch does "
                            "that)")
    if kind in SOFTMAX:
        given = [name for name, v in (("weight", weight), ("bias", bias)) if v is not None]
        if given or eps not in (None, 0, 0.0):
            what = given[0] if given else f"eps={eps!r}"
            raise ArgumentError(f"norm of layer {layer} is a {kind} with {what}; a {kind} takes no weight, bias or eps")
    if eps is None:
        eps = DEFAULT_EPS[kind]
    elif isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"norm eps of layer {layer} is {eps!r}; it must be a number >= 0")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ArgumentError(f"norm eps of layer {layer} is {eps!r}; it must be a finite number >= 0")
    weight = None if weight is None else _vector(weight, f"norm weight of layer {layer}", width)
    bias = None if bias is None else _vector(bias, f"norm bias of layer {layer}", width)
    return KINDS[kind], eps, weight, bias


def parse(num_layers, out_widths, norm):
    """Per layer None or (kind code, eps, weight float32 array or None, bias or None) from FusedMLP's norm argument.

    norm: None; a dict {layer index: spec}; or a list with one spec or None per layer, as residual= takes them. A spec
    is 'layernorm' or 'rmsnorm' (no affine: weight ones, bias zeros; eps DEFAULT_EPS), a tuple (kind, weight, bias,
    eps) cut short anywhere after kind, or a dict {'kind': ..., 'weight': ..., 'bias': ..., 'eps': ...} with kind
    required; weight and bias are (out_features,) arrays or None. out_widths: each layer's out_features.
    """
    if norm is None:
        return [None] * num_layers
    if isinstance(norm, dict):
        entries = [None] * num_layers
        for layer, spec in norm.items():
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < num_layers:
                raise ArgumentError(f"norm names layer {layer!r}; the network has layers 0..{num_layers - 1}")
            entries[int(layer)] = spec
    elif isinstance(norm, list):
        if len(norm) != num_layers:
            raise ArgumentError(f"norm has {len(norm)} entries; the network has {num_layers} layers (give one per "
                                "layer, None where there is none, or a dict {layer: spec})")
        entries = norm
    else:
        raise ArgumentError(f"norm={norm!r} must be None, a dict {{layer: spec}} or a list with one spec per layer; a "
                            f"spec is {_SPELLINGS}")
    return [None if spec is None else _one(layer, spec, out_widths[layer]) for layer, spec in enumerate(entries)]


def take_softmax(acts, norms):
    """The activations and norms with each 'softmax' / 'log_softmax' activation (a classifier's output_activation)
    moved into norms: that layer's norm, and the identity activation. norms: parse's list (changed in place)."""
    out = list(acts)
    for layer, act in enumerate(acts):
        name = act.strip().lower().replace("logsoftmax", "log_softmax")
        if name not in SOFTMAX:
            continue
        if norms[layer] is not None:
            raise ArgumentError(f"layer {layer} has the activation {act!r} and the norm {NAMES[norms[layer][0]]}; a "
                                f"{name} is that layer's norm itself (give one of the two)")
        norms[layer] = (KINDS[name], 0.0, None, None)
        out[layer] = "none"
    return out


def describe(norms):
    """The repr fragment ', norm={1: layernorm(eps=1e-05, affine), ...}', or '' without norms."""
    parts = []
    for layer, entry in enumerate(norms):
        if entry is not None:
            kind, eps, weight, bias = entry
            if NAMES[kind] in SOFTMAX:
                parts.append(f"{layer}: {NAMES[kind]}")
                continue
            extra = "".join(f", {name}" for name, arr in (("weight", weight), ("bias", bias)) if arr is not None)
            parts.append(f"{layer}: {NAMES[kind]}(eps={eps:g}{extra})")
    return f", norm={{{', '.join(parts)}}}" if parts else ""


def key(norms):
    """What of the norms decides a plan (kinds and eps, not the arrays), JSON-ready, for the tuning record's key."""
    return [None if entry is None else [entry[0], entry[1]] for entry in norms]


def option(norms, first, last):
    """The norm= argument of layers [first, last] as a network of their own (a segmented network's stretch)."""
    return {j - first: {"kind": NAMES[e[0]], "eps": e[1], "weight": e[2], "bias": e[3]}
            for j, e in enumerate(norms[first:last + 1], start=first) if e is not None} or None
