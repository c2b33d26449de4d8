"""fusedmlp.torch's reading of modules: activation modules as expressions, eval-mode weights (parametrized and
hooked ones too), batch-norm affines, norm and softmax modules, and the reader of nn.Sequentials into
fusedmlp._layers.Layers. The reader of traced forwards is fusedmlp._torch_fx."""

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from ._layers import Layers, graph_edges, shrink_text, threshold_text
from .errors import ArgumentError


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
        return shrink_text(module.lambd, module.lambd)
    if isinstance(module, nn.Hardshrink):
        return shrink_text(module.lambd, 0.0)
    if isinstance(module, nn.Threshold):
        return threshold_text(module.threshold, module.value)
    if isinstance(module, nn.RReLU):  # eval mode: a leaky relu of the mean slope; training mode samples slopes
        if module.training:
            raise ArgumentError(f"{module} is in training mode, where it samples each negative slope at random; call "
                                "model.eval() first (fusedmlp runs inference: then its slope is (lower + upper) / 2)")
        return f"leaky_relu(x, {(module.lower + module.upper) / 2!r})"
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


#: Dropout in all its forms (Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout): the identity in eval mode.
_DROPOUTS = (nn.modules.dropout._DropoutNd,)


def _check_dropout_off(module, label):
    """Raises where a dropout module is active (its model in training mode): fusedmlp runs inference, where dropout is
    the identity."""
    if module.training and module.p > 0:
        raise ArgumentError(f"{label}: {type(module).__name__}(p={module.p}) is active because the model is in "
                            "training mode; call model.eval() first (fusedmlp runs inference)")

SUPPORTED = ("Linear (weight_norm / spectral_norm parametrized too), LayerNorm and RMSNorm (fused into the Linear they "
             "follow directly; elsewhere on an identity layer of their own), Softmax, Softmin and LogSoftmax over the features, "
             "ReLU, LeakyReLU, ELU, CELU, GELU, SiLU, Sigmoid, LogSigmoid, Tanh, Tanhshrink, Softplus, Mish, SELU, "
             "ReLU6, Hardtanh, Hardsigmoid, Hardswish, Softsign, Softshrink, Hardshrink, Threshold, PReLU (one slope), "
             "RReLU (in eval mode), Identity, Dropout (any form) and BatchNorm1d (in eval mode), nested Sequential")


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
    """(kind, dim) of an nn.Softmax ('softmax'), nn.Softmin ('softmin') or nn.LogSoftmax ('log_softmax'), else
    None."""
    if isinstance(module, nn.Softmax):
        return "softmax", module.dim
    if isinstance(module, nn.Softmin):
        return "softmin", module.dim
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


def read_sequential(module, activations=None):
    """read_module's reading of an nn.Sequential (nested ones too, torchvision.ops.MLP) or one nn.Linear: its
    leaves in order (fusedmlp.torch.read_module documents what they may be)."""
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
    layers.merge_pairs()
    weights, biases, acts, norm, flatten = layers.finish(type(module).__name__)
    return weights, biases, acts, graph_edges(None, None, norm, flatten)
