"""PyTorch integration: read an nn.Module into a FusedMLP, wrap it as an nn.Module, and a torch.compile custom op.

    mlp = fusedmlp.from_torch(model.mlp)                # nn.Sequential / torchvision.ops.MLP / nested Sequentials
    y = mlp(x_cuda)                                     # CUDA tensor in -> CUDA tensor out, on torch's stream
    model.mlp = fusedmlp.torch.FusedModule(model.mlp)   # an nn.Module; torch.compile(fullgraph=True) traces through it

Inference only: fusedmlp has no backward, so a call that autograd would differentiate raises instead of returning a
result without gradients (call it under torch.no_grad() / torch.inference_mode(), or freeze the parameters).
"""

import itertools
import operator
from collections import OrderedDict
import threading

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from ._api import FusedMLP
from ._layers import Layers, compose as _compose
from .errors import ArgumentError

__all__ = ["from_torch", "FusedModule", "mlp_forward"]


def _activation_text(module):
    """The expression for an activation module, or None when the module is not one fusedmlp knows."""
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.LeakyReLU):
        return f"leaky_relu(x, {module.negative_slope!r})"
    if isinstance(module, nn.ELU):
        return f"elu(x, {module.alpha!r})"
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.Softplus):
        return f"softplus(x, {float(module.beta)!r}, {float(module.threshold)!r})"
    if isinstance(module, nn.ReLU6):
        return "hardtanh(x, 0, 6)"
    if isinstance(module, nn.Hardtanh):
        return f"hardtanh(x, {float(module.min_val)!r}, {float(module.max_val)!r})"
    if isinstance(module, nn.CELU):
        return _celu_text(module.alpha)
    if isinstance(module, nn.Softshrink):
        return _shrink_text("soft", module.lambd)
    if isinstance(module, nn.Hardshrink):
        return _shrink_text("hard", module.lambd)
    if isinstance(module, nn.Threshold):
        return _threshold_text(module.threshold, module.value)
    if isinstance(module, nn.PReLU) and module.weight.numel() == 1:  # one learned slope: a leaky relu
        return f"leaky_relu(x, {float(module.weight.detach().reshape(())):.9g})"
    simple = {nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Mish: "mish", nn.SELU: "selu",
              nn.Hardsigmoid: "hardsigmoid", nn.Hardswish: "hardswish", nn.Softsign: "softsign",
              nn.LogSigmoid: "-softplus(-x)", nn.Tanhshrink: "x - tanh(x)"}
    for cls, text in simple.items():
        if type(module) is cls:
            return text
    return None


def _celu_text(alpha):
    """CELU as an expression: max(0, x) + min(0, a (exp(x / a) - 1)) = a elu(x / a)."""
    alpha = float(alpha)
    return f"{alpha!r} * elu(x / {alpha!r})"


def _shrink_text(kind, lambd):
    """Softshrink (x - clamp(x, -l, l)) or Hardshrink (x where |x| > l, else 0: the step as a ceil of a clamp) as an
    expression."""
    lam = float(lambd)
    if kind == "soft":
        return f"x - min(max(x, {-lam!r}), {lam!r})"
    return f"x * ceil(min(max(abs(x) - {lam!r}, 0), 1))"


def _threshold_text(threshold, value):
    """Threshold (x where x > t, else v) as an expression: max(x, t), then t moved to v below the step (the step as a
    ceil of a clamp, as Hardshrink's): exact where x > t, and for v = 0, including x = -inf. t and v as the float32
    values torch compares and writes (x = float32(0.1) is not above Threshold(0.1)'s threshold)."""
    t, v = float(np.float32(threshold)), float(np.float32(value))
    return f"max(x, {t!r}) + ({v!r} - {t!r}) * (1 - ceil(min(max(x - {t!r}, 0), 1)))"


#: Dropout in all its forms (Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout): the identity in eval mode.
_DROPOUTS = (nn.modules.dropout._DropoutNd,)


def _check_dropout_off(module, label):
    """Raises where a dropout module is active (its model in training mode): fusedmlp runs inference, where dropout is
    the identity."""
    if module.training and module.p > 0:
        raise ArgumentError(f"{label}: {type(module).__name__}(p={module.p}) is active because the model is in "
                            "training mode; call model.eval() first (fusedmlp runs inference)")

SUPPORTED = ("Linear (weight_norm / spectral_norm parametrized too), LayerNorm and RMSNorm (directly after a Linear), "
             "Softmax and LogSoftmax over the features (directly after a Linear), "
             "ReLU, LeakyReLU, ELU, CELU, GELU, SiLU, Sigmoid, LogSigmoid, Tanh, Tanhshrink, Softplus, Mish, SELU, "
             "ReLU6, Hardtanh, Hardsigmoid, Hardswish, Softsign, Softshrink, Hardshrink, Threshold, PReLU (one slope), "
             "Identity, Dropout (any form) and BatchNorm1d (in eval mode), nested Sequential")


# ------------------------------------------------------------------------------------------------ weights and folds


def _hook_weight(module, name, label):
    """The weight `name` of a module with an old-style weight_norm / spectral_norm forward pre-hook, computed from its
    parameters as the hook computes it in eval mode (the attribute itself is what the last forward left there: stale
    after load_state_dict until the next forward), or None when no such hook owns the name."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and hook.name == name:
            return hook.compute_weight(module)
        if isinstance(hook, SpectralNorm) and hook.name == name:
            if module.training:
                raise ArgumentError(f"{label}: spectral_norm runs a power iteration on each call in training mode; "
                                    "call model.eval() first (fusedmlp reads the weight the eval-mode forward uses)")
            return hook.compute_weight(module, do_power_iteration=False)
    return None


def _effective(module, name, label):
    """module.<name> as the module's eval-mode forward uses it: plain, parametrized (weight_norm, spectral_norm or
    any torch.nn.utils.parametrize parametrization) or computed by an old-style weight_norm / spectral_norm hook."""
    hooked = _hook_weight(module, name, label)
    if hooked is not None:
        return hooked
    if parametrize.is_parametrized(module, name):
        from torch.nn.utils.parametrizations import _SpectralNorm

        if any(isinstance(p, _SpectralNorm) and p.training for p in module.parametrizations[name]):
            raise ArgumentError(f"{label}: spectral_norm runs a power iteration on each call in training mode; call "
                                "model.eval() first (fusedmlp reads the weight the eval-mode forward uses)")
    return getattr(module, name)


def _edges(residual, concat, norm, flatten=None):
    """FusedMLP's graph arguments of a read model: residual and concat, norm where it has norms, flatten_input where
    it flattens its input first."""
    return {"residual": residual, "concat": concat, **({"norm": norm} if norm else {}),
            **({"flatten_input": flatten} if flatten is not None else {})}


def _norm_module(module):
    """(kind, normalized_shape, weight, bias, eps) of an nn.LayerNorm or nn.RMSNorm, else None. RMSNorm's eps=None
    (torch.finfo of the input's dtype) stays None: FusedMLP's default for rmsnorm, float32's epsilon."""
    if isinstance(module, nn.LayerNorm):
        return "layernorm", module.normalized_shape, module.weight, module.bias, module.eps
    rms = getattr(nn, "RMSNorm", None)  # torch 2.4 and later
    if rms is not None and isinstance(module, rms):
        return "rmsnorm", module.normalized_shape, module.weight, None, module.eps
    return None


def _softmax_module(module):
    """(kind, dim) of an nn.Softmax ('softmax') or nn.LogSoftmax ('log_softmax'), else None."""
    if isinstance(module, nn.Softmax):
        return "softmax", module.dim
    if isinstance(module, nn.LogSoftmax):
        return "log_softmax", module.dim
    return None


def _numpy64(tensor):
    return None if tensor is None else tensor.detach().to(torch.float64).cpu().numpy()


def _batchnorm_affine(bn, label):
    """(s, t), float64, with bn(x) = s * x + t in eval mode."""
    if bn.training:
        raise ArgumentError(f"{label}: BatchNorm1d is in training mode, where it normalizes each batch by its own "
                            "statistics; call model.eval() first (fusedmlp folds the running statistics into a Linear)")
    if bn.running_mean is None or bn.running_var is None:
        raise ArgumentError(f"{label}: BatchNorm1d(track_running_stats=False) normalizes each batch by its own "
                            "statistics, in eval mode too; fusedmlp folds running statistics into a Linear, so it needs "
                            "track_running_stats=True")
    s = 1.0 / np.sqrt(_numpy64(bn.running_var) + float(bn.eps))
    if bn.weight is not None:
        s = s * _numpy64(bn.weight)
    t = -_numpy64(bn.running_mean) * s
    if bn.bias is not None:
        t = t + _numpy64(bn.bias)
    return s, t


def _flatten(module, prefix):
    """(path, module) for every leaf in evaluation order, descending into Sequentials (torchvision's MLP is one)."""
    if isinstance(module, nn.Sequential):
        # _modules, not named_children(): the latter skips a module instance used twice (Sequential(l1, act, l2, act)),
        # while Sequential's forward runs it twice.
        for name, child in module._modules.items():
            if child is not None:
                yield from _flatten(child, f"{prefix}.{name}" if prefix else name)
    else:
        yield prefix, module


def read_module(module, activations=None):
    """Reads an MLP module into weights, biases, one activation per layer, residual epilogues and norms.

    Args:
        module: an nn.Linear, nn.Sequential (nested ones too), torchvision.ops.MLP, or any module whose forward
            torch.fx can trace into Linear / F.linear, activations, x + f(x) / x * f(x) residuals, input concats and
            norms. Linears may carry weight_norm / spectral_norm parametrizations (their eval-mode weight is read);
            BatchNorm1d in eval mode folds into the Linear before or after it; LayerNorm / RMSNorm directly after a
            Linear becomes that layer's fused norm, and so does a Softmax / LogSoftmax over the features (a
            classifier's head).
        activations: {module path: expression} for modules fusedmlp does not know (e.g. {"mlp.4": "x*tanh(x)"}).

    Returns:
        (weights, biases, activations, edges) ready for FusedMLP(weights, biases, activation=activations, **edges);
        edges holds the residual and concat arguments, norm where the model has LayerNorm / RMSNorm, flatten_input
        where it flattens its input, and "inputs" (not FusedMLP's: pop it first) where forward joins several inputs
        by one torch.cat: their order in it.
    """
    if not isinstance(module, (nn.Sequential, nn.Linear)):
        return _read_traced(module, activations)
    activations = dict(activations or {})
    layers = Layers(_numpy64)
    for path, leaf in _flatten(module, ""):
        label = path or type(module).__name__
        text = activations.pop(path, None)
        if text is None and isinstance(leaf, nn.Linear):
            layers.linear(_effective(leaf, "weight", label), _effective(leaf, "bias", label), label)
            continue
        if text is None and isinstance(leaf, nn.Identity):
            continue
        if text is None and isinstance(leaf, nn.Flatten):
            layers.flatten_input(leaf.start_dim, leaf.end_dim, label)
            continue
        if text is None and isinstance(leaf, _DROPOUTS):
            _check_dropout_off(leaf, label)
            continue
        if text is None and isinstance(leaf, nn.BatchNorm1d):
            layers.batchnorm(*_batchnorm_affine(leaf, label), label)
            continue
        if text is None and _norm_module(leaf) is not None:
            layers.norm(*_norm_module(leaf), label)
            continue
        if text is None and _softmax_module(leaf) is not None:
            layers.softmax(*_softmax_module(leaf), label)
            continue
        if text is None:
            text = _activation_text(leaf)
        if text is None:
            raise ArgumentError(f"{label}: {type(leaf).__name__} is not supported; supported: {SUPPORTED}; or map it "
                                f"to an expression with activations={{'{label}': '...'}}")
        if not layers.weights:
            raise ArgumentError(f"{label}: {type(leaf).__name__} comes before the first Linear; fusedmlp applies "
                                "activations after a layer")
        layers.activation(text, label)
    if activations:
        raise ArgumentError(f"activations names {sorted(activations)}, which are not modules of the model")
    weights, biases, acts, norm, flatten = layers.finish(type(module).__name__)
    return weights, biases, acts, _edges(None, None, norm, flatten)


# ------------------------------------------------------------------------------------------------ traced graphs

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
TRACED_SUPPORTED = ("Linear / F.linear (weight_norm / spectral_norm parametrized too), activation modules and functions "
                    "(relu, gelu, silu, tanh, sigmoid, softplus, leaky_relu, elu, ...), residuals h + f(h) and "
                    "h * f(h) with the layer's own input, an earlier layer's output or the network input, "
                    "torch.cat([h, x], -1) / torch.cat([x, h], -1) of the hidden state with the network input before "
                    "a Linear, LayerNorm / RMSNorm (modules or F.layer_norm / F.rms_norm) and softmax / log_softmax "
                    "over the features (modules, functions or methods) directly after a Linear, + - * / with a number "
                    "or a parameter / buffer (per-feature maps folded into a Linear, numbers into the activation), a "
                    "flatten of the input, "
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
        return _shrink_text("soft" if target is F.softshrink else "hard", _arg(node, 1, "lambd", 0.5))
    if target is F.threshold:
        return _threshold_text(_arg(node, 1, "threshold", None), _arg(node, 2, "value", None))
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
    raise ArgumentError(f"{label}: F.linear's weight and bias must be parameters of the module (a computed weight is "
                        "not read)")


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
                      torch.log_softmax: "log_softmax"}


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


def _traced_constant_op(root, node, cur, label, heads=None):
    """(op, c, c_first) of an add / sub / mul / div of the chain's value cur and a constant (a number, or a parameter
    or buffer as float64 NumPy), c_first where the constant is the left operand; None for any other node. heads:
    instead of cur, any of these nodes, which the result then names as a fourth item."""
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
    elif isinstance(other, torch.fx.Node) and other.op == "get_attr":
        value = _traced_attr(root, other, label)
        if isinstance(value, torch.Tensor):
            arr = value.detach().to(torch.float64).cpu().numpy()
            found = op, (float(arr.reshape(())) if arr.size == 1 else arr), c_first
    return found if found is None or heads is None else (*found, cur)


def _affine(op, c, c_first, label):
    """(s, t) with op(x, c) (or op(c, x)) = s * x + t per feature, float64 vectors (one element for a number)."""
    if c_first and op == "div":
        raise ArgumentError(f"{label}: a constant divided by the hidden state is no affine map; fusedmlp folds "
                            "x - c, c - x, x + c, x * c and x / c")
    c = np.asarray(c, np.float64)
    if not (c.ndim <= 1 or (c.ndim == 2 and c.shape[0] == 1)):
        raise ArgumentError(f"{label}: a constant of shape {c.shape}; fusedmlp folds one value per feature")
    c = c.reshape(-1)
    one, zero = np.ones_like(c), np.zeros_like(c)
    return {"mul": (c, zero), "div": (1.0 / c, zero), "add": (one, c), "sub": (-one, c) if c_first else (one, -c)}[op]


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


def _read_traced(module, activations):
    """Walks module's torch.fx graph as a chain: each Linear starts a layer, activations before a residual op are the
    layer's activation, the op with a kept value (the layer's input, an earlier layer's output, the network input) is
    its residual, activations after it the residual's; torch.cat of the hidden state with the network input right
    before a Linear is that layer's input concat; BatchNorm1d folds into the Linear before or after it (Layers)."""
    activations = dict(activations or {})
    try:
        gm = torch.fx.symbolic_trace(module)
    except Exception as e:  # data-dependent control flow and the like
        raise ArgumentError(f"{type(module).__name__} is not an nn.Sequential and torch.fx cannot trace it: {e}") from None
    layers = Layers(_numpy64)
    residual, concat = [], {}
    cur = x_node = pending_cat = None
    value_of = {}  # graph node -> value index: -1 the network input, l layer l's output (once layer l + 1 starts)
    folded = {}  # node -> label: a BatchNorm1d's output folded into the next Linear (not a value the kernel keeps)
    before_bn = None  # the node a pending BatchNorm1d normalized: the previous layer's output as the kernel keeps it
    shapes = {}  # shape-query nodes of the input (x.size(0), x.shape, ...) -> the node they query
    placeholders, input_order = [], None  # forward's inputs; with several, the order torch.cat joins them in
    heads, maps = {}, []  # several inputs before their join: each one's latest node -> its index; its affine map
    for node in gm.graph.nodes:
        label = f"{node.name} ({node.target if isinstance(node.target, str) else getattr(node.target, '__name__', node.target)})"
        if node.op == "placeholder":
            heads[node] = len(placeholders)
            maps.append(None)
            placeholders.append(node)
            if cur is None:
                cur = x_node = node
                value_of[node] = -1
            continue
        if len(placeholders) > 1 and input_order is None and not layers.weights:  # several inputs, not joined yet
            const = _traced_constant_op(module, node, None, label, heads)
            if const is not None:  # an input's own affine map ((obs - mean) / std) before the join
                op, c, c_first, head = const
                s_new, t_new = _affine(op, c, c_first, label)
                i = heads[head]
                if maps[i] is not None:
                    s_old, t_old, _ = maps[i]
                    s_new, t_new = s_new * s_old, s_new * t_old + t_new
                maps[i] = (s_new, t_new, maps[i][2] if maps[i] is not None else label)
                del heads[head]
                heads[node] = i
                continue
            if (node.op == "call_function" and node.target is torch.cat and isinstance(node.args[0], (list, tuple))
                    and sorted(heads.get(p, -1) for p in node.args[0]) == list(range(len(placeholders)))
                    and _arg(node, 1, "dim", 0) in (-1, 1)):  # a critic's torch.cat([obs, act], -1): the kernel's x
                input_order = [heads[p] for p in node.args[0]]
                layers.set_input_parts([maps[i] for i in input_order])
                cur = x_node = node
                value_of[node] = -1
                continue
        if node.op == "get_attr" or _is_parametrization_call(gm, node):
            continue
        if not layers.weights and ((node.op == "call_method" and node.target == "size") or (
                node.op == "call_function" and node.target is getattr and node.args[1] == "shape")):
            shapes[node] = node.args[0]  # a shape query of the input, for a view of it (_traced_flatten)
            continue
        if not layers.weights and node.op == "call_function" and node.target is operator.getitem and (
                node.args[0] in shapes):
            shapes[node] = shapes[node.args[0]]
            continue
        start = _traced_flatten(node, cur, shapes) if not layers.weights and cur is x_node else None
        if isinstance(start, tuple):  # x.view(-1, K)
            start, layers.flatten_width = start
        if start is not None:
            if start == -1:
                raise ArgumentError(f"{label}: a view or flatten of the input that is not x.view(x.size(0), -1) or "
                                    "torch.flatten(x, start_dim) through the last dim; fusedmlp flattens an input's "
                                    "dims from start_dim on")
            layers.flatten_input(start, -1, label)
            cur = x_node = node  # the kernel's input is the flattened x (a concat or residual of x reads it)
            value_of[node] = -1
            continue
        if node.op == "output":
            if node.args[0] is not cur or pending_cat is not None:
                raise ArgumentError(f"{label}: the output is not the end of the layer chain; supported: {TRACED_SUPPORTED}")
            break
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        leaf = gm.get_submodule(node.target) if node.op == "call_module" else None
        text = activations.pop(node.target, None) if node.op == "call_module" else None
        is_linear = (leaf is not None and isinstance(leaf, nn.Linear) and text is None) or (
            node.op == "call_function" and node.target is F.linear)
        if pending_cat is not None and not is_linear:
            raise ArgumentError(f"{label}: torch.cat of the hidden state with the input must feed a Linear directly")
        if is_linear:
            if not inputs or inputs[0] is not cur:
                raise ArgumentError(f"{label}: a Linear that does not take the previous layer's output")
            if pending_cat is not None:
                concat[len(layers.weights)] = pending_cat
                pending_cat = None
            elif layers.pending is not None:  # cur is a BatchNorm1d this Linear absorbs: the value is before it
                folded[cur] = layers.pending[2]
                value_of.setdefault(before_bn, len(layers.weights) - 1)
            else:
                value_of.setdefault(cur, len(layers.weights) - 1)
            if leaf is not None:
                w, b = _effective(leaf, "weight", node.target), _effective(leaf, "bias", node.target)
            else:
                w, b = _traced_attr(module, node.args[1], label), _traced_attr(module, _arg(node, 2, "bias", None), label)
            layers.linear(w, b, label)
            residual.append(None)
            cur = node
            continue
        if leaf is not None and text is None and isinstance(leaf, nn.BatchNorm1d):
            if not inputs or inputs[0] is not cur:
                raise ArgumentError(f"{node.target}: a BatchNorm1d that does not take the previous layer's output")
            if layers.pending is None and not layers.open:
                before_bn = cur
            layers.batchnorm(*_batchnorm_affine(leaf, node.target), node.target)
            cur = node
            continue
        if node.op == "call_function" and node.target is F.normalize:  # an embedding head's L2 normalization
            if not inputs or inputs[0] is not cur or _arg(node, 1, "p", 2.0) != 2 or _arg(node, 2, "dim", 1) not in (
                    -1, 1):
                raise ArgumentError(f"{label}: F.normalize of another value, p or dim; fusedmlp fuses "
                                    "F.normalize(z, p=2, dim=-1) of a Linear's output z")
            layers.l2_normalize(_arg(node, 3, "eps", 1e-12), label)
            cur = node
            continue
        norm = _traced_norm(module, node, leaf if text is None else None, label)
        soft = None if norm is not None else _traced_softmax(node, leaf if text is None else None)
        if norm is not None or soft is not None:  # the layer's fused norm (a softmax is one too)
            if not inputs or inputs[0] is not cur:
                raise ArgumentError(f"{label}: a {'norm' if soft is None else 'softmax'} that does not take the "
                                    "previous layer's output")
            where = node.target if leaf is not None else label
            if soft is None:
                layers.norm(*norm, where)
            else:
                layers.softmax(*soft, where)
            cur = node
            continue
        if node.op == "call_function" and node.target is torch.cat:
            parts, dim = node.args[0], _arg(node, 1, "dim", 0)
            if (not isinstance(parts, (list, tuple)) or len(parts) != 2 or set(parts) != {cur, x_node}
                    or cur is x_node or dim not in (-1, 1)):
                raise ArgumentError(f"{label}: only torch.cat([h, x], -1) or torch.cat([x, h], -1) of the hidden state "
                                    "h with the network input x is supported")
            layers.unfoldable(label, "torch.cat")
            value_of.setdefault(cur, len(layers.weights) - 1)
            pending_cat = "after" if parts[0] is cur else "before"
            cur = node
            continue
        if leaf is not None and text is None and isinstance(leaf, (nn.Identity, *_DROPOUTS)):
            if isinstance(leaf, _DROPOUTS):
                _check_dropout_off(leaf, node.target)
            cur = node
            continue
        if node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            if _arg(node, 2, "training", _DROPOUT_FUNCTIONS[node.target]) and _arg(node, 1, "p", 0.5) > 0:
                raise ArgumentError(f"{label}: dropout with training=True is active; fusedmlp runs inference")
            cur = node
            continue
        const = _traced_constant_op(module, node, cur, label) if text is None else None
        if const is not None:  # an arithmetic op of the chain's value and a constant
            op, c, c_first = const
            if (np.ndim(c) == 0 and layers.weights and layers.open and len(cur.users) == 1
                    and not (c_first and op == "div")):  # right after a Linear, its only use: folded into it (so
                c = np.full(layers.weights[-1].shape[0], c)  # that a norm or softmax may still follow)
            if np.ndim(c) == 0 and layers.weights:  # a number, after a layer: part of its activation (or residual's)
                expr = _scalar_text(op, c, c_first)
                if residual[-1] is None:
                    layers.activation(expr, label)
                else:
                    residual[-1][1] = expr if residual[-1][1] == "none" else _compose(expr, residual[-1][1])
            else:  # one value per feature (or any on the input): folded into a Linear, as a batch norm
                if layers.pending is None and not layers.open:
                    before_bn = cur
                layers.batchnorm(*_affine(op, c, c_first, label), label)
            cur = node
            continue
        if node.op in ("call_function", "call_method") and (node.target in _ADD or node.target in _MUL
                                                            or node.target in ("add", "mul", "add_", "mul_")):
            if not layers.weights or len(inputs) != 2 or cur not in inputs:
                raise ArgumentError(f"{label}: only a residual of the current layer with a kept value is supported")
            other = inputs[0] if inputs[1] is cur else inputs[1]
            if other in folded:
                raise ArgumentError(f"{label}: the residual operand {other.name} is the output of {folded[other]} "
                                    "(BatchNorm1d), which was folded into the next Linear's weights; the kernel keeps "
                                    "no such value")
            if other not in value_of:
                raise ArgumentError(f"{label}: the residual operand {other.name} is neither the network input nor a "
                                    "layer's output (the tensor a Linear or torch.cat consumed)")
            if residual[-1] is not None:
                raise ArgumentError(f"{label}: a second residual op in the same layer is not supported")
            layers.unfoldable(label, "a residual op")
            is_add = node.target in _ADD or node.target in ("add", "add_")
            src = value_of[other]
            residual[-1] = ["add" if is_add else "mul", "none", "input" if src < 0 else src]
            layers.open = False
            cur = node
            continue
        if text is None:
            text = _activation_text(leaf) if leaf is not None else (
                _functional_text(node) if node.op in ("call_function", "call_method") else None)
        if text is None or not inputs or inputs[0] is not cur:
            what = type(leaf).__name__ if leaf is not None else label
            raise ArgumentError(f"{node.target if leaf is not None else label}: {what} is not supported; supported: "
                                f"{TRACED_SUPPORTED}" + (f"; or map it with activations={{'{node.target}': '...'}}"
                                                          if leaf is not None else ""))
        if not layers.weights:
            raise ArgumentError(f"{label}: an activation before the first Linear; fusedmlp applies activations after a "
                                "layer")
        if residual[-1] is None:
            layers.activation(text, label)
        else:
            layers.unfoldable(label, "an activation")
            residual[-1][1] = text if residual[-1][1] == "none" else _compose(text, residual[-1][1])
        cur = node
    if activations:
        raise ArgumentError(f"activations names {sorted(activations)}, which are not modules of the model")
    if len(placeholders) > 1 and input_order is None:
        raise ArgumentError(f"{type(module).__name__}.forward takes {len(placeholders)} inputs; fusedmlp reads several "
                            "only as one torch.cat of all of them along the last dim before the first Linear (a "
                            "critic's torch.cat([obs, act], -1))")
    weights, biases, acts, norm, flatten = layers.finish(type(module).__name__)
    edges = _edges([tuple(r) if r else None for r in residual], concat or None, norm, flatten)
    return weights, biases, acts, {**edges, "inputs": input_order} if input_order else edges


def from_torch(module, activations=None, device=None, calibrate=None, **kwargs):
    """Builds a FusedMLP from a PyTorch MLP.

    Args:
        module: nn.Sequential (nested ones too), torchvision.ops.MLP, one nn.Linear, or a module torch.fx traces
            (read_module says what each may hold: BatchNorm1d is folded, LayerNorm / RMSNorm fused, parametrized
            Linears read as their effective weight).
        activations: {module path: expression} for activation modules fusedmlp does not know.
        device: default: the module's device ('cuda:N' for CUDA parameters, else 'auto').
        calibrate: for dtype='int8' or 'float8': a batch of typical inputs, passed to FusedMLP.calibrate.
        kwargs: passed to FusedMLP (dtype, check, cache_dir).

    Returns:
        A FusedMLP with the module's weights (copied: later changes to the module do not affect it). A module whose
        forward joins several inputs by torch.cat (a critic's Q(obs, act)) gives a model of their concatenation: call
        it on torch.cat([obs, act], -1), or wrap the module in FusedModule, which takes (obs, act).
    """
    weights, biases, acts, edges = read_module(module, activations)
    edges.pop("inputs", None)  # several inputs: the model takes their torch.cat (FusedModule joins them itself)
    if device is None:
        params = list(module.parameters())
        device = str(params[0].device) if params and params[0].is_cuda else "auto"
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
    mlp = FusedMLP(weights, biases, activation=acts, device=device, **edges, **kwargs)
    return mlp if calibrate is None else mlp.calibrate(calibrate)


# ------------------------------------------------------------------------------------------------ the custom op

_registry = {}  # handle -> FusedMLP; handles are what traced graphs carry
_handles = itertools.count(1)
_registry_lock = threading.Lock()


def _register(mlp):
    with _registry_lock:
        handle = next(_handles)
        _registry[handle] = mlp
    return handle


# The op is defined through torch.library.Library, not the custom_op decorator: the decorator's layers (an autograd
# wrapper, redispatch, dynamo-disable wrappers around the kernel; cProfile of a compiled call) cost 6.5 us more an
# eager call and 17-19 us more a compiled FusedModule call than this on the CPU machine's torch 2.13 (a 4-row CPU
# call: op 24.5 -> 18.0 us against the model's own 15.9; compiled module 77 -> 58). The op has no autograd formula
# either way (FusedModule refuses tracked inputs first).
_library = torch.library.Library("fusedmlp", "DEF")
_library.define("mlp_forward(Tensor x, int handle) -> Tensor")


def _forward_impl(x, handle):
    return _registry[handle](x)  # FusedMLP.__call__: its C fast path once the shape is known


_library.impl("mlp_forward", _forward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fusedmlp::mlp_forward")
def _(x, handle):
    mlp = _registry[handle]
    return x.new_empty((*x.shape[:-1], mlp.widths[-1]))


def mlp_forward(x, handle):
    """The fused forward of the registered model `handle` on x (..., in) -> (..., out), x's dtype and device: the op
    torch.ops.fusedmlp.mlp_forward, which graphs record."""
    return torch.ops.fusedmlp.mlp_forward.default(x, handle)


class FusedModule(nn.Module):
    """An nn.Module running a PyTorch MLP through fusedmlp's fused kernel.

    It holds the wrapped module's own submodules under the same names, so ``state_dict`` keys are unchanged and a
    state dict saved from the original loads into it (and back). The fused model is rebuilt eagerly whenever the
    weights may have changed (construction, load_state_dict, .to()/.cuda()/.half()), never inside forward, so
    forward stays a single custom-op call that torch.compile(fullgraph=True) traces without a break. Inference
    only: forward raises if autograd would track it.

    Args:
        module: what from_torch accepts.
        activations: {module path: expression} for activation modules fusedmlp does not know.
        kwargs: passed to FusedMLP (check, cache_dir).
    """

    def __init__(self, module, activations=None, **kwargs):
        super().__init__()
        self._wraps_sequential = isinstance(module, nn.Sequential)
        if self._wraps_sequential:
            for name, child in module._modules.items():
                self.add_module(name, child)
        else:
            self.add_module("module", module)
        self._activations = activations
        self._kwargs = kwargs
        self._handle = None
        self._rebuild()
        self.register_load_state_dict_post_hook(lambda mod, keys: mod._rebuild())

    def _wrapped(self):
        return nn.Sequential(OrderedDict(self._modules)) if self._wraps_sequential else self.module

    def _rebuild(self):
        self._release()
        weights, biases, texts, edges = read_module(self._wrapped(), self._activations)
        self._input_order = edges.pop("inputs", None)  # forward's inputs, joined by torch.cat in this order
        params = list(self.parameters())
        device = f"cuda:{params[0].device.index}" if params and params[0].is_cuda else "cpu"
        self._handle = _register(FusedMLP(weights, biases, activation=texts, device=device, **edges, **self._kwargs))

    def _release(self):
        if self._handle is not None:
            with _registry_lock:
                _registry.pop(self._handle, None)
            self._handle = None

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(): the weights moved or changed
        out = super()._apply(fn, *args, **kwargs)
        self._rebuild()
        return out

    def forward(self, *inputs):
        if self._input_order is not None:  # a critic's (obs, act): joined as the module's forward joins them
            if len(inputs) != len(self._input_order):
                raise ArgumentError(f"FusedModule takes {len(self._input_order)} inputs, as the module does; got "
                                    f"{len(inputs)}")
            x = torch.cat([inputs[i] for i in self._input_order], -1)
        elif len(inputs) != 1:
            raise ArgumentError(f"FusedModule takes one input, as the module does; got {len(inputs)}")
        else:
            x = inputs[0]
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise ArgumentError("FusedModule is inference-only (no backward): call it under torch.no_grad() or "
                                "torch.inference_mode(), or freeze the parameters with requires_grad_(False)")
        start = _registry[self._handle]._flatten_input
        if start is not None and x.ndim > start + 1:  # here, so that the op's fake shape is its real one
            x = x.flatten(start)
        if torch.compiler.is_compiling():
            return mlp_forward(x, self._handle)  # the op the graph records
        return _registry[self._handle](x)  # eager: straight to the model's call, without the op's dispatch

    def extra_repr(self):
        return repr(_registry.get(self._handle))

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown
            pass
