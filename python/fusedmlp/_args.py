"""FusedMLP's arguments, checked before anything is built: each error names the field, its value and the rule.

The constructor's weights, biases, activations, residual and concat specs, dtype, device, check and cache folder;
calibration samples; architecture names (compile, the Ray predictor) and integer options (multi_gpu, ray).
"""

import os
import re

import numpy as np

from ._gpu import core as _core
from .errors import ArgumentError, DTypeError, ExpressionError, ShapeError


def _is_index(value, lo, hi):
    """Whether value is an int (NumPy's too, not bool) in [lo, hi)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and lo <= value < hi


def _parse_arch(arch):
    """Accepts 'sm_90', 'sm_90a', 'compute_90', 90 or '9.0'; returns (90, False) or (90, True)."""
    if _is_index(arch, 0, 10000):
        return int(arch), False  # the range keeps it a C int; the plan says which architectures are supported
    if isinstance(arch, str):
        m = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d{1,3})(a?)", arch.strip(), flags=re.ASCII)
        if m:
            return int(m.group(1) + m.group(2)), bool(m.group(3))
    raise ArgumentError(f"arch={arch!r} is not an architecture; write it as 'sm_90' (or 90)")


def _as_array(value, field):
    """np.asarray(value), or raises ShapeError (ragged nesting) or DTypeError (anything else) naming the field."""
    try:
        if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor: the documented export path
            value = value.detach().cpu().numpy()
        return np.asarray(value)
    except MemoryError:
        raise
    except ValueError as e:  # ragged nested lists: a shape problem
        raise ShapeError(f"{field} could not be read as an array: {e}") from None
    except Exception as e:  # objects NumPy cannot convert at all
        raise DTypeError(f"{field} could not be read as an array: {e}") from None


def _as_float_array(value, field, ndim):
    """Returns value as a float32 C-contiguous array of rank ndim, or raises naming the field and the rule."""
    arr = _as_array(value, field)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise DTypeError(f"{field} has dtype {arr.dtype}; weights and biases must be real numbers (float32 usual)")
    if arr.ndim != ndim:
        raise ShapeError(f"{field} has shape {arr.shape}; it must have {ndim} dimension{'s' * (ndim > 1)}"
                         + (" (out_features, in_features), as nn.Linear.weight" if ndim == 2 else " (out_features,)"))
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf, reported just below
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(out))[0])
        raise ArgumentError(f"{field} holds a non-finite value {out[bad]} at index {bad} (after conversion to "
                            "float32); weights and biases must be finite")
    return out


def _layer_activations(num_layers, activation, output_activation):
    """One activation text per layer from a hidden-layer activation (or list) and an output activation."""
    def text(value, field):
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(p, (list, tuple)) and len(p) == 2 for p in value):  # column pieces [("sigmoid", 3), ...]
            return " | ".join(f"{text(a, f'{field}[{i}][0]')}:{_piece_columns(n, f'{field}[{i}][1]')}"
                              for i, (a, n) in enumerate(value))
        if not isinstance(value, str):
            raise ArgumentError(f"{field}={value!r} must be a string: a built-in name such as 'relu' or an "
                                "expression over x such as 'x * tanh(softplus(x))'")
        if "\0" in value:  # the C core reads text up to the first NUL: "x\0; ..." must not pass as "x"
            at = value.index("\0") + 1
            raise ExpressionError(f"{field} holds a NUL character at column {at}; an activation is plain text",
                                  expression=value.replace("\0", "?"), column=at)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (from a mis-decoded file name, say): no text to parse
            at = e.start + 1
            raise ExpressionError(f"{field} holds the character {value[e.start]!r} at column {at}, which has no UTF-8 "
                                  "encoding", "an expression holds only numbers, x, pi, e, function names, "
                                  "+ - * / ^ ( ) , and spaces", expression=value.encode("utf-8", "replace").decode(),
                                  column=at) from None
        return value

    if isinstance(activation, (list, tuple)):
        acts = [text(a, f"activation[{i}]") for i, a in enumerate(activation)]
        if len(acts) == num_layers and output_activation is None:
            return acts
        if len(acts) != num_layers - 1:
            raise ArgumentError(f"activation has {len(acts)} entries; the network has {num_layers} layers, so give "
                                f"{num_layers - 1} (hidden layers, plus output_activation) or {num_layers} (every "
                                "layer, without output_activation)")
    else:
        hidden = text(activation, "activation")
        if num_layers == 1:  # no layer uses it, but a typo must not wait for the day the network grows a layer
            _check_expression(hidden, "activation (unused: the network has one layer)")
        acts = [hidden] * (num_layers - 1)
    out = "none" if output_activation is None else text(output_activation, "output_activation")
    return acts + [out]


def _piece_columns(n, field):
    if not _is_index(n, 1, 1 << 30):
        raise ArgumentError(f"{field}={n!r} must be a positive int: the number of columns the piece's activation "
                            "applies to")
    return int(n)


def _check_expression(text, what):
    if "|" in text:  # column pieces "expr:columns | ...": each expression checked here, the counts by the core
        start = 0
        for piece in text.split("|"):
            expr = piece.rpartition(":")[0] if ":" in piece else piece
            _check_piece(expr, what, text, start)
            start += len(piece) + 1
        return
    _check_piece(text, what, text, 0)


def _check_piece(piece, what, text, start):
    try:
        _core().parse_expr(piece)
    except ExpressionError as e:
        # The C parser counts columns in UTF-8 bytes; the caller counts characters. They differ only past a non-ASCII
        # character, which is itself an error, so only for the length limit (reported at byte 4097).
        column = len(piece.encode("utf-8")[: max(e.column - 1, 0)].decode("utf-8", "ignore")) + 1 + start
        raise ExpressionError(f"{what}: {e.message}", e.hint, expression=text, column=column) from None


_RESIDUAL_OPS = {"add": 1, "mul": 2}


def _residual_source(layer, source):
    """The value index a residual of `layer` reads: -1 the network input, k layer k's output."""
    if source is None:
        return layer - 1
    if source == "input":
        return -1
    if _is_index(source, 0, layer):
        return int(source)
    raise ArgumentError(f"residual 'from' of layer {layer} is {source!r}; it must be 'input' (the network input) or "
                        f"an earlier layer's index 0..{layer - 1} (that layer's output; {layer - 1} is this layer's "
                        "own input, the default)" if layer > 0 else
                        f"residual 'from' of layer 0 is {source!r}; layer 0 can only use its own input, 'input'")


def _layer_residuals(num_layers, residual):
    """Per layer None or (op code, then-activation text, source value index), from FusedMLP's residual argument.

    residual: None; a dict {layer index: spec}; or a list with one spec or None per layer. A spec is "add" or "mul"
    (y = act(W h + b) op h, h the layer's input), (op, then), (op, then, from) or {"op": op, "then": activation,
    "from": source} for y = then(act(W h + b) op r), e.g. ("add", "relu") for relu(h + f(h)). r is the layer's own
    input h unless "from" names an earlier layer (its output) or "input" (the network input).
    """
    if residual is None:
        return [None] * num_layers
    if isinstance(residual, dict):
        entries = [None] * num_layers
        for layer, spec in residual.items():
            if not _is_index(layer, 0, num_layers):
                raise ArgumentError(f"residual names layer {layer!r}; the network has layers 0..{num_layers - 1}")
            entries[int(layer)] = spec
    elif isinstance(residual, (list, tuple)):
        if len(residual) != num_layers:
            raise ArgumentError(f"residual has {len(residual)} entries; the network has {num_layers} layers (give "
                                "one per layer, None where there is none, or a dict {layer: spec})")
        entries = list(residual)
    else:
        raise ArgumentError(f"residual={residual!r} must be None, a dict {{layer: spec}} or a list with one spec per "
                            "layer")
    out = []
    for layer, spec in enumerate(entries):
        if spec is None:
            out.append(None)
            continue
        source = None
        if isinstance(spec, str):
            op, then = spec, "none"
        elif isinstance(spec, dict) and set(spec) <= {"op", "then", "from"}:
            op, then, source = spec.get("op", "add"), spec.get("then", "none"), spec.get("from")
        elif isinstance(spec, (list, tuple)) and len(spec) in (2, 3):
            op, then, source = (*spec, None) if len(spec) == 2 else spec
        else:
            raise ArgumentError(f"residual of layer {layer} is {spec!r}; write 'add', 'mul', (op, then), "
                                "(op, then, from) or {'op': ..., 'then': ..., 'from': ...}")
        if op not in _RESIDUAL_OPS:
            raise ArgumentError(f"residual op of layer {layer} is {op!r}; it must be 'add' or 'mul'")
        if not isinstance(then, str):
            raise ArgumentError(f"residual 'then' of layer {layer} is {then!r}; it must be an activation string")
        _check_expression(then, f"residual activation of layer {layer}")
        out.append((_RESIDUAL_OPS[op], then, _residual_source(layer, source)))
    return out


_CONCAT_MODES = {"after": 1, "before": 2}


def _layer_concat(num_layers, concat):
    """Per layer 0 (none), 1 (input torch.cat([h, x])) or 2 (torch.cat([x, h])) from FusedMLP's concat argument:
    None or a dict {layer index: 'after' | 'before'} saying where the network input x goes beside h."""
    if concat is None:
        return [0] * num_layers
    if not isinstance(concat, dict):
        raise ArgumentError(f"concat={concat!r} must be None or a dict {{layer: 'after' | 'before'}}: the layer's input "
                            "is torch.cat([h, x]) ('after') or torch.cat([x, h]) ('before'), x the network input")
    out = [0] * num_layers
    for layer, mode in concat.items():
        if not _is_index(layer, 1, num_layers):
            raise ArgumentError(f"concat names layer {layer!r}; it must be one of the layers 1..{num_layers - 1} "
                                "(layer 0's input is the network input already)")
        if mode not in _CONCAT_MODES:
            raise ArgumentError(f"concat mode of layer {layer} is {mode!r}; it must be 'after' (torch.cat([h, x])) or "
                                "'before' (torch.cat([x, h]))")
        out[int(layer)] = _CONCAT_MODES[mode]
    return out


#: Tensor Core compute dtypes: what weights and activations are stored as on chip (float32 accumulation always).
PRECISIONS = ("float16", "bfloat16", "tf32")

#: The 8-bit compute dtypes (issue 26), which need calibrate() before use: per-output-channel weight scales, one
#: activation scale per layer input; the largest code of each (int8 symmetric, float8 e4m3's largest finite value).
#: int8 accumulates in int32, exactly, scaled to float32 in the epilogue; float8 in float32.
LOWBIT = {"int8": 127.0, "float8": 448.0}
LOWBIT_PRECISIONS = tuple(LOWBIT)


def _parse_precision(dtype):
    text = str(dtype) if dtype is not None else ""
    text = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "half": "float16", "bf16": "bfloat16",
            "fp16": "float16", "torch.int8": "int8", "fp8": "float8", "e4m3": "float8", "float8_e4m3fn": "float8",
            "torch.float8_e4m3fn": "float8"}.get(text, text)
    if text not in PRECISIONS + LOWBIT_PRECISIONS:
        raise DTypeError(f"dtype={dtype!r} is not a compute dtype; it must be one of "
                         f"{', '.join(PRECISIONS + LOWBIT_PRECISIONS)} (the Tensor Core inputs; accumulation is float32 "
                         "in each, int32 for int8)")
    return text


def _check_expressions(acts):
    for i, a in enumerate(acts):
        _check_expression(a, f"activation of layer {i}")


def _parse_device(device):
    text = device
    if not isinstance(device, str) and hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        text = str(device)
    if isinstance(text, str):  # first: `in` or `==` on an array compares elementwise
        if text in ("auto", "cpu", "cuda"):
            return str(text), 0
        m = re.fullmatch(r"cuda:(\d{1,9})", text, flags=re.ASCII)  # an ordinal the C int holds
        if m:
            return "cuda", int(m.group(1))
    raise ArgumentError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda' or 'cuda:N'")


def _parse_check(check):
    if isinstance(check, (bool, np.bool_)):
        return bool(check)
    raise ArgumentError(f"check={check!r} must be True or False")


def _parse_cache_dir(cache_dir):
    """None, or cache_dir (str, bytes or os.PathLike) as a str; raises ArgumentError naming it otherwise."""
    if cache_dir is None:
        return None
    try:
        path = os.fsdecode(os.fspath(cache_dir))
    except TypeError:
        raise ArgumentError(f"cache_dir={cache_dir!r} must be a folder path (str or os.PathLike) or None") from None
    if path == "" or "\0" in path:
        raise ArgumentError(f"cache_dir={cache_dir!r} is not a folder path: it is empty or holds a NUL character",
                            "pass None to use FUSEDMLP_CACHE_DIR (or its fallbacks)")
    return path


def _parse_flatten_input(flatten_input):
    """FusedMLP's flatten_input: None, or the first dim of x a call merges with the ones after it (an int >= 1)."""
    if flatten_input is None:
        return None
    if isinstance(flatten_input, bool) or not isinstance(flatten_input, (int, np.integer)) or flatten_input < 1:
        raise ArgumentError(f"flatten_input={flatten_input!r}; it must be None or the first dim of x to merge, an int "
                            ">= 1 (dim 0 holds the rows)")
    return int(flatten_input)


def _merge_dims(x, start, field):
    """x with its dims from `start` on merged into one (nn.Flatten(start_dim=start)): a view where x's layout allows.
    Arrays (NumPy, torch, CuPy) of `start` + 1 dims or fewer are as they are; anything else is read as an array first
    (_as_array, naming the field)."""
    if not hasattr(x, "ndim") or not hasattr(x, "reshape"):
        x = _as_array(x, field)
    return x.reshape(*x.shape[:start], -1) if x.ndim > start + 1 else x


def _calibration_input(x_sample, n_in):
    """x_sample as a C-contiguous float32 (rows >= 1, n_in) array of finite values, or the error naming what is off."""
    arr = _as_array(x_sample, "x_sample")
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16" or arr.dtype == np.bool_:
        raise DTypeError(f"x_sample has dtype {arr.dtype}; calibration takes real numbers (float32 usual)")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != n_in or arr.shape[0] == 0:
        raise ShapeError(f"x_sample has shape {np.shape(x_sample)}; calibration takes (rows >= 1, {n_in}) inputs")
    with np.errstate(over="ignore"):
        x = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        row, col = (int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise ArgumentError(f"x_sample[{row}, {col}] is {x[row, col]} (as float32); a scale is max |value| over the "
                            "sample, so every sample value must be finite", "drop or clip the rows that are not")
    return x
