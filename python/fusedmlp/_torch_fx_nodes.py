"""What one node of a graph torch.fx traces stands for: its activation text, the parameter a weight argument names,
a norm, softmax, flatten or constant operand it is, and the tables of the functions and methods read
(fusedmlp.torch's tracer, _torch_fx.py, walks the graph with these)."""

import operator
import re

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._layers import shrink_text, threshold_text
from ._torch_modules import _celu_text, _effective, _norm_module, _softmax_module
from .errors import ArgumentError


F = nn.functional
_FUNCTIONS = {torch.relu: "relu", F.relu: "relu", torch.tanh: "tanh", F.tanh: "tanh", torch.sigmoid: "sigmoid",
              F.sigmoid: "sigmoid", F.silu: "silu", F.mish: "mish", F.selu: "selu", F.softsign: "softsign",
              F.hardswish: "hardswish", F.hardsigmoid: "hardsigmoid", F.relu6: "hardtanh(x, 0, 6)", torch.sin: "sin",
              torch.cos: "cos", torch.exp: "exp", torch.erf: "erf", torch.abs: "abs", F.logsigmoid: "-softplus(-x)",
              F.tanhshrink: "x - tanh(x)", torch.square: "square", torch.sqrt: "sqrt", torch.log: "log",
              torch.neg: "-(x)", operator.neg: "-(x)", torch.log1p: "log1p", torch.expm1: "expm1", torch.sinh: "sinh",
              torch.cosh: "cosh", torch.atan: "atan"}
#: The dropout functions, each with its default for `training`: F.dropout and F.dropoutNd default to True (a call that
#: does not pass training=False drops units in eval mode too, at random, which no fused network reproduces), the alpha
#: dropouts to False.
_DROPOUT_FUNCTIONS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: False,
                      F.feature_alpha_dropout: False}
_METHODS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "sin": "sin", "cos": "cos", "exp": "exp",
            "abs": "abs", "square": "square", "sqrt": "sqrt", "log": "log", "neg": "-(x)", "log1p": "log1p",
            "expm1": "expm1"}
_CLAMPS = {torch.clamp, torch.clip, "clamp", "clip", "clamp_", "clip_"}
_ADD = {operator.add, operator.iadd, torch.add}
_MUL = {operator.mul, operator.imul, torch.mul}
TRACED_SUPPORTED = ("Linear / F.linear (weight_norm / spectral_norm parametrized too), h @ W with a parameter W "
                    "(torch.matmul, torch.mm, W.T), activation modules and functions "
                    "(relu, gelu, silu, tanh, sigmoid, softplus, leaky_relu, elu, ...) and + / * of two values of "
                    "one layer's activation (z * torch.sigmoid(z)), residuals h + f(h) and "
                    "h * f(h) with the layer's own input, an earlier layer's output or the network input, "
                    "torch.cat([h, x], -1) / torch.cat([x, h], -1) of the hidden state with the network input before "
                    "a Linear, LayerNorm / RMSNorm (modules or F.layer_norm / F.rms_norm) and softmax / log_softmax "
                    "over the features (modules, functions or methods; fused into a Linear they follow directly, "
                    "elsewhere on an identity layer of their own: pre-norm blocks; softmin), + - * / with a number "
                    "or a parameter / buffer, or arithmetic of those alone (per-feature maps folded into a Linear, "
                    "numbers into the activation), a "
                    "flatten of the input, y.squeeze(-1) of the output (a value head), x.float() / .to(torch.float32) / "
                    ".contiguous() / .clone() / .detach() (the value itself), Linear heads on one value returned "
                    "together (return pi(h), v(h)) or combined linearly (a dueling head's "
                    "v + a - a.mean(-1, keepdim=True): folded into the last layer), Fourier features "
                    "torch.cat([sin(z), cos(z)], -1) of a Linear's output, a positional encoding "
                    "torch.cat([x, sin(c x), cos(c x), ...], -1) of the input, "
                    "Dropout (any form) and BatchNorm1d (folded into the Linear before or after it) in eval mode")


def _arg(node, index, name, default):
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else default)


def _functional_text(node):
    """The expression for an activation call_function / call_method node, or None."""
    target = node.target
    if target in _CLAMPS:  # torch.clamp(x, min, max) / x.clamp(...) with number bounds (one may be None)
        lo, hi = _arg(node, 1, "min", None), _arg(node, 2, "max", None)
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))) for v in (lo, hi)):
            return None
        text = "x" if lo is None else f"max(x, {float(lo)!r})"
        return text if hi is None else f"min({text}, {float(hi)!r})"
    if (target is operator.pow or target is torch.pow or target == "pow") and len(node.args) == 2 and isinstance(
            node.args[1], (int, float)) and not isinstance(node.args[1], bool):
        return f"(x)^{float(node.args[1])!r}"  # x ** c
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if target in _FUNCTIONS:
        return _FUNCTIONS[target]
    if target is F.gelu:
        return "gelu_tanh" if _arg(node, 1, "approximate", "none") == "tanh" else "gelu"
    if target is F.leaky_relu:
        return f"leaky_relu(x, {float(_arg(node, 1, 'negative_slope', 0.01))!r})"
    if target is F.elu:
        return f"elu(x, {float(_arg(node, 1, 'alpha', 1.0))!r})"
    if target is F.softplus:
        return f"softplus(x, {float(_arg(node, 1, 'beta', 1.0))!r}, {float(_arg(node, 2, 'threshold', 20.0))!r})"
    if target is F.hardtanh:
        return f"hardtanh(x, {float(_arg(node, 1, 'min_val', -1.0))!r}, {float(_arg(node, 2, 'max_val', 1.0))!r})"
    if target is F.celu:
        return _celu_text(_arg(node, 1, "alpha", 1.0))
    if target in (F.softshrink, F.hardshrink):
        lambd = _arg(node, 1, "lambd", 0.5)
        return shrink_text(lambd, lambd if target is F.softshrink else 0.0)
    if target is F.threshold:
        return threshold_text(_arg(node, 1, "threshold", None), _arg(node, 2, "value", None))
    return None


def _traced_attr(root, node, label):
    """The tensor an F.linear argument node stands for: a parameter or attribute (get_attr; an old-style weight_norm
    hook's weight is computed from its parameters), or a parametrized weight (fx calls the module's
    ParametrizationList, `<module>.parametrizations.<name>`, with no arguments), or a constant. Looked up in the
    traced module itself (root): the GraphModule holds only the leaves it calls, under bare parent modules."""
    if not isinstance(node, torch.fx.Node):
        return node
    target = node.target if isinstance(node.target, str) else ""
    owner_path, _, name = target.rpartition(".")
    if node.op == "call_module" and not node.args and ".parametrizations." in f".{target}":
        owner_path, _, name = target.rpartition(".parametrizations.")
        return _effective(root.get_submodule(owner_path), name, label)
    if node.op == "get_attr":
        return _effective(root.get_submodule(owner_path), name, label)
    raise ArgumentError(f"{label}: F.linear's weight and bias must be parameters or buffers of the module, or "
                        "computed from them alone (a weight computed from the input is not read)")


_MATMULS = (operator.matmul, torch.matmul, torch.mm)
_SAME_METHODS = ("float", "double", "contiguous", "clone", "detach")  # (tensor methods that keep the value)


def _weight_view(node):
    """(base, transposed) where node is a parameter's node (get_attr, a parametrized weight's call) or its transpose
    (W.T, W.t(), W.transpose(0, 1), W.mT); else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "get_attr" or (node.op == "call_module" and not node.args and ".parametrizations." in
                                 f".{node.target}"):
        return node, False
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        inner = _weight_view(node.args[0])
    elif node.op == "call_method" and (node.target == "t" or (node.target == "transpose" and set(node.args[1:]) in (
            {0, 1}, {-1, -2}))):
        inner = _weight_view(node.args[0])
    else:
        return None
    return None if inner is None else (inner[0], not inner[1])


def _traced_matmul_weight(root, node, label, consts=None):
    """h @ W (torch.matmul, torch.mm, the method) with W a parameter of the module, (in, out), or its transpose, or a
    constant folded while reading (consts: node -> float64 tensor): the Linear weight (out, in) it multiplies by; None
    where node is no such product."""
    if not ((node.op == "call_function" and node.target in _MATMULS) or
            (node.op == "call_method" and node.target == "matmul")) or len(node.args) != 2:
        return None
    view = _weight_view(node.args[1])
    if view is None and node.args[1] in (consts or {}):
        view = node.args[1], False
    if view is None:
        return None
    w = consts[view[0]] if view[0] in (consts or {}) else _traced_attr(root, view[0], label)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ArgumentError(f"{label}: a product with a {tuple(getattr(w, 'shape', ()))} tensor; fusedmlp reads h @ W "
                            "with a 2-D weight W as a Linear")
    return w if view[1] else w.t()


def _traced_norm(root, node, leaf, label):
    """(kind, normalized_shape, weight, bias, eps) of a LayerNorm / RMSNorm graph node (a module, or F.layer_norm /
    F.rms_norm with the module's parameters), else None."""
    if leaf is not None:
        return _norm_module(leaf)
    rms_norm = getattr(F, "rms_norm", None)  # torch 2.4 and later
    if node.op != "call_function" or node.target not in (F.layer_norm, rms_norm) or node.target is None:
        return None
    shape = _arg(node, 1, "normalized_shape", None)
    shape = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, (list, tuple)) else shape
    if node.target is F.layer_norm:
        return ("layernorm", shape, _traced_attr(root, _arg(node, 2, "weight", None), label),
                _traced_attr(root, _arg(node, 3, "bias", None), label), float(_arg(node, 4, "eps", 1e-5)))
    eps = _arg(node, 3, "eps", None)
    return "rmsnorm", shape, _traced_attr(root, _arg(node, 2, "weight", None), label), None, eps


_SOFTMAX_FUNCTIONS = {F.softmax: "softmax", torch.softmax: "softmax", F.log_softmax: "log_softmax",
                      torch.log_softmax: "log_softmax", F.softmin: "softmin"}


def _traced_softmax(node, leaf):
    """(kind, dim) of a softmax / log_softmax graph node (an nn.Softmax / nn.LogSoftmax, F.softmax, torch.softmax or
    the tensor method, and their log forms), else None. A dtype argument only picks the precision torch computes in;
    the kernels compute in float32."""
    if leaf is not None:
        return _softmax_module(leaf)
    if node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS:
        return _SOFTMAX_FUNCTIONS[node.target], _arg(node, 1, "dim", None)
    if node.op == "call_method" and node.target in ("softmax", "log_softmax"):
        return node.target, _arg(node, 1, "dim", None)
    return None


def _dim0_of(node, x, shapes):
    """Whether node is x.size(0), x.shape[0] or x.size()[0] (shapes: the shape-query nodes seen so far)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method" and node.target == "size" and node.args[:2] == (x, 0):
        return True
    return (node.op == "call_function" and node.target is operator.getitem and node.args[0] in shapes and
            shapes[node.args[0]] is x and node.args[1] == 0)


def _traced_flatten(node, x, shapes):
    """The start dim of a flatten of x through its last dim (torch.flatten(x, s), x.flatten(s), x.view(x.size(0), -1),
    x.reshape(x.shape[0], -1)); (1, K) for x.view(-1, K); None for any other node; -1 for a flatten not through the
    last dim (or a view of another form)."""
    if node.op == "call_function" and node.target is torch.flatten or (
            node.op == "call_method" and node.target == "flatten"):
        if not node.args or node.args[0] is not x:
            return None
        start, end = _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1)
        return start if end == -1 and isinstance(start, int) else -1
    if node.op == "call_method" and node.target in ("view", "reshape") or (
            node.op == "call_function" and node.target is torch.reshape):
        if not node.args or node.args[0] is not x:
            return None
        shape = node.args[1:] if node.op == "call_method" else node.args[1:2]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if len(shape) == 2 and _dim0_of(shape[0], x, shapes) and shape[1] == -1:
            return 1
        # x.view(-1, K): the same as a flatten from dim 1 wherever the first Linear takes K (checked there) and x's
        # dims from 1 on hold K values; where they do not (rows of several samples), fusedmlp's call refuses x's shape
        return (1, shape[1]) if len(shape) == 2 and shape[0] == -1 and isinstance(shape[1], int) else -1
    return None


_ARITH = {operator.add: "add", operator.iadd: "add", torch.add: "add", operator.sub: "sub", operator.isub: "sub",
          torch.sub: "sub", operator.mul: "mul", operator.imul: "mul", torch.mul: "mul", operator.truediv: "div",
          operator.itruediv: "div", torch.div: "div"}
_ARITH_METHODS = {"add": "add", "add_": "add", "sub": "sub", "sub_": "sub", "mul": "mul", "mul_": "mul", "div": "div",
                  "div_": "div"}


#: Functions and tensor methods of constants alone that the tracer evaluates while reading (Tracer.fold_constant):
#: deterministic arithmetic and views, as a PINN's input scaling 2 (x - lb) / (ub - lb) - 1 spells its constants.
_FOLD_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, torch.add,
                   torch.sub, torch.mul, torch.div, torch.neg, torch.reciprocal, torch.sqrt, torch.rsqrt, torch.exp,
                   torch.log, torch.abs, torch.square, torch.pow, torch.clamp, torch.clip, torch.maximum,
                   torch.minimum, torch.matmul, torch.mm, torch.t, torch.transpose, torch.reshape, torch.squeeze,
                   torch.unsqueeze, torch.cat, torch.stack, torch.sum, torch.mean, torch.norm, torch.exp2,
                   torch.diag, torch.sin, torch.cos, torch.tanh, torch.sigmoid, F.softplus, operator.getitem}
_FOLD_METHODS = {"add", "sub", "mul", "div", "neg", "reciprocal", "sqrt", "rsqrt", "exp", "log", "abs", "square",
                 "pow", "clamp", "clip", "t", "transpose", "reshape", "view", "squeeze", "unsqueeze", "sum", "mean",
                 "norm", "float", "double", "to", "detach", "clone", "contiguous", "flatten", "expand", "sin", "cos",
                 "tanh", "sigmoid"}


def _traced_constant_op(root, node, cur, label, heads=None, consts=None):
    """(op, c, c_first) of an add / sub / mul / div of the chain's value cur and a constant (a number, or a parameter
    or buffer as float64 NumPy, or a node of constants alone folded before: consts, node -> float64 tensor), c_first
    where the constant is the left operand; None for any other node. heads: instead of cur, any of these nodes, which
    the result then names as a fourth item."""
    if node.op == "call_function":
        op = _ARITH.get(node.target)
    elif node.op == "call_method":
        op = _ARITH_METHODS.get(node.target)
    else:
        op = None
    if op is None or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode"):
        return None
    a, b = node.args
    if heads is not None:
        cur = a if a in heads else b if b in heads else None
    if cur is None or (a is cur) == (b is cur):
        return None
    other, c_first = (b, False) if a is cur else (a, True)
    found = None
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        found = op, float(other), c_first
    elif isinstance(other, torch.fx.Node) and (other.op == "get_attr" or other in (consts or {})):
        value = consts[other] if other.op != "get_attr" else _traced_attr(root, other, label)
        if isinstance(value, torch.Tensor):
            arr = value.detach().to(torch.float64).cpu().numpy()
            found = op, (float(arr.reshape(())) if arr.size == 1 else arr), c_first
    return found if found is None or heads is None else (*found, cur)


def _scalar_text(op, c, c_first):
    """The expression over x of op(x, c) (or op(c, x)) for a number c."""
    n = repr(float(c))
    n = f"({n})" if n.startswith("-") else n
    return {"add": f"(x) + {n}", "mul": f"{n} * (x)", "sub": f"{n} - (x)" if c_first else f"(x) - {n}",
            "div": f"{n} / (x)" if c_first else f"(x) / {n}"}[op]  # (parentheses: compose reads it as an expression)


def _is_parametrization_call(gm, node):
    """Whether node is fx's call of a ParametrizationList (a parametrized weight F.linear reads): not a layer op."""
    return (node.op == "call_module" and not node.args and isinstance(node.target, str) and
            isinstance(gm.get_submodule(node.target), parametrize.ParametrizationList))


_ASIDE = "aside"  # a handler's answer for a node it took that the chain does not go on from (_Tracer.run)


def _expression(act):
    """A layer's activation text (Layers.acts: "none", a function's name, or an expression in x) as an expression."""
    return "x" if act == "none" else act if "(" in act else f"{act}(x)"


def _over(outer, inner):
    """outer (an activation's text) of inner (an expression in x): every whole-word x of outer becomes (inner)."""
    return re.sub(r"\bx\b", lambda _: "x" if inner == "x" else f"({inner})", _expression(outer))
