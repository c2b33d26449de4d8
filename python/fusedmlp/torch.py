"""PyTorch integration: read an nn.Module into a FusedMLP, wrap it as an nn.Module, and a torch.compile custom op.

    mlp = fusedmlp.from_torch(model.mlp)                # nn.Sequential / torchvision.ops.MLP / nested Sequentials
    y = mlp(x_cuda)                                     # CUDA tensor in -> CUDA tensor out, on torch's stream
    model.mlp = fusedmlp.torch.FusedModule(model.mlp)   # an nn.Module; torch.compile(fullgraph=True) traces through it

Inference only: fusedmlp has no backward, so a call that autograd would differentiate raises instead of returning a
result without gradients (call it under torch.no_grad() / torch.inference_mode(), or freeze the parameters).
"""

import itertools
import operator
import secrets
from collections import OrderedDict
import threading
import weakref

import numpy as np
import torch
from torch import nn

from ._api import FusedMLP
from ._layers import MODEL_FORM
from ._torch_fx import read_traced
from ._torch_modules import read_sequential
from .errors import ArgumentError

__all__ = ["from_torch", "FusedModule", "mlp_forward"]


def read_module(module, activations=None, in_features=None):
    """Reads an MLP module into weights, biases, one activation per layer, residual epilogues and norms.

    Args:
        module: an nn.Linear, nn.Sequential (nested ones too), torchvision.ops.MLP, or any module whose forward
            torch.fx can trace into Linear / F.linear, activations, x + f(x) / x * f(x) residuals, input concats and
            norms. Linears may carry weight_norm / spectral_norm parametrizations (their eval-mode weight is read);
            BatchNorm1d in eval mode folds into the Linear before or after it; LayerNorm / RMSNorm directly after a
            Linear becomes that layer's fused norm, and so does a Softmax / LogSoftmax over the features (a
            classifier's head). A wrapper (torch.compile's OptimizedModule, DataParallel, DistributedDataParallel)
            reads as the module it runs; a TorchScript module (torch.jit.script / trace / load) through the graph
            torch's ONNX exporter writes of it (fusedmlp.onnx; the onnx extra).
        activations: {module path: expression} for modules fusedmlp does not know (e.g. {"mlp.4": "x*tanh(x)"}).
        in_features: the features of forward's input (an int), or of each of its inputs (a tuple), where reading
            needs them: an `if` on the input's shape (default: the first Linear's in_features), a TorchScript
            module (default: one input, as wide as its first weight's columns).

    Returns:
        (weights, biases, activations, edges) ready for FusedMLP(weights, biases, activation=activations, **edges);
        edges holds the residual and concat arguments, norm where the model has LayerNorm / RMSNorm, flatten_input
        where it flattens its input, "inputs" (not FusedMLP's: pop it first) where forward joins several inputs
        by one torch.cat: their order in it, "squeeze" (not FusedMLP's either) where forward squeezes its output
        (a value head's y.squeeze(-1)): the dims, () for all, and "outputs" (nor this) where forward returns several
        Linear heads on one value (an actor-critic's pi(h), v(h)), merged into the last layer, or a tuple or dict of
        slices of its output (mu, log_std = y.chunk(2, -1)): their widths; with "output_keys" the dict's keys and
        "output_squeeze" whether each part is one column indexed away (y[..., 3]).
    """
    module = _unwrapped(module)
    widths = _widths(in_features)
    if isinstance(module, torch.jit.ScriptModule):
        return _read_scripted(module, activations, widths)
    if isinstance(module, (nn.Sequential, nn.Linear)):
        return read_sequential(module, activations)
    if widths is not None and len(widths) != 1:
        raise ArgumentError(f"in_features={in_features!r}: a traced module's `if` on its input's shape is read for "
                            "one input; give one int")
    return read_traced(module, activations, None if widths is None else widths[0])


def _widths(in_features):
    """in_features as a tuple of positive ints (or None)."""
    if in_features is None:
        return None
    widths = tuple(in_features) if isinstance(in_features, (tuple, list)) else (in_features,)
    if not widths or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths):
        raise ArgumentError(f"in_features={in_features!r} must be a positive int, or a tuple of them (one per input "
                            "of forward)")
    return widths


def _unwrapped(module):
    """The module a wrapper runs: torch.compile's OptimizedModule (_orig_mod), DataParallel and
    DistributedDataParallel (.module)."""
    while True:
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        elif isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        else:
            return module


def _read_scripted(module, activations, widths=None):
    """A TorchScript module (torch.jit.script / trace / load: a deployed policy's .pt file) has no Python forward
    for torch.fx: torch's TorchScript ONNX exporter writes its graph, which fusedmlp.onnx reads. Its inputs are
    `widths` wide, or it has one, as wide as its first 2-D weight's columns."""
    import io

    if activations:
        raise ArgumentError("activations= maps module paths of a traced module; a TorchScript module is read through "
                            "its ONNX graph, whose activations are ops")
    try:
        from .onnx import read_onnx
    except ImportError as e:
        raise ArgumentError(f"{type(module).__name__}: a TorchScript module is read through torch's ONNX exporter, "
                            f"which needs the onnx package (pip install fusedmlp[onnx]): {e}") from None
    weight = next((p for name, p in module.named_parameters() if name.endswith("weight") and p.ndim == 2), None)
    if weight is None:
        raise ArgumentError(f"{type(module).__name__}: a TorchScript module without a 2-D weight; fusedmlp reads MLPs")
    names = [f"x{i}" for i in range(len(widths or (1,)))]
    example = tuple(torch.zeros(2, w, dtype=weight.dtype, device=weight.device) for w in widths or (weight.shape[1],))
    buf = io.BytesIO()
    try:
        with torch.no_grad():
            torch.onnx.export(module, example, buf, dynamo=False, input_names=names,
                              dynamic_axes={n: {0: "n"} for n in names})
    except Exception as e:
        hint = "" if widths else "; a module with several inputs needs in_features=(one width per input)"
        raise ArgumentError(f"{type(module).__name__}: torch's ONNX exporter could not write this TorchScript module "
                            f"(read through its ONNX graph) for inputs of {[tuple(t.shape[1:]) for t in example]} "
                            f"features{hint}: {e}") from None
    return read_onnx(buf.getvalue())


def from_torch(module, activations=None, device=None, calibrate=None, in_features=None, **kwargs):
    """Builds a FusedMLP from a PyTorch MLP.

    Args:
        module: nn.Sequential (nested ones too), torchvision.ops.MLP, one nn.Linear, or a module torch.fx traces
            (read_module says what each may hold: BatchNorm1d is folded, LayerNorm / RMSNorm fused, parametrized
            Linears read as their effective weight).
        activations: {module path: expression} for activation modules fusedmlp does not know.
        device: default: the module's device ('cuda:N' for CUDA parameters, else 'auto').
        calibrate: for dtype='int8' or 'float8': a batch of typical inputs, passed to FusedMLP.calibrate.
        in_features: forward's input features where reading needs them (read_module): an int, or a tuple for a
            TorchScript module with several inputs (a scripted critic's obs and act).
        kwargs: passed to FusedMLP (dtype, check, cache_dir).

    Returns:
        A FusedMLP with the module's weights (copied: later changes to the module do not affect it). A module whose
        forward joins several inputs by torch.cat (a critic's Q(obs, act)) gives a model of their concatenation: call
        it on torch.cat([obs, act], -1), or wrap the module in FusedModule, which takes (obs, act). A forward ending
        in y.squeeze(-1) (a value head) gives y as (rows, 1); FusedModule returns it squeezed, as the module does. A
        forward returning several Linear heads of one value (pi(h), v(h)) gives them side by side in one output, in
        that order; FusedModule returns the tuple.
    """
    weights, biases, acts, edges = read_module(module, activations, in_features)
    for key in MODEL_FORM:  # the model takes several inputs' torch.cat and gives y.squeeze(-1) with its column, heads
        edges.pop(key, None)  # and a tuple or dict of parts side by side (FusedModule joins, squeezes, splits them)
    if device is None:
        params = list(module.parameters())
        device = str(params[0].device) if params and params[0].is_cuda else "auto"
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
    mlp = FusedMLP(weights, biases, activation=acts, device=device, **edges, **kwargs)
    return mlp if calibrate is None else mlp.calibrate(calibrate)


# ------------------------------------------------------------------------------------------------ the custom op

_registry = {}  # handle -> FusedMLP (FusedModule._handle: a name for the model in logs and tests)
# Each process counts from a random start of its own (handles were once the constant a traced graph recorded, and
# inductor's FX graph cache is on disk and shared between processes: counting from 1 in every process gave two
# processes' different models one key).
_handles = itertools.count(secrets.randbits(40) << 20)
_registry_lock = threading.Lock()
# What a traced graph carries instead of a handle: a FusedModule's first parameter, a graph input like any parameter
# (its data_ptr finds the module at run time), and two ints equal across modules of one architecture (the output
# width, for the op's fake shape; which of the FusedModules on that parameter, 0 but where one module is wrapped
# twice). A handle in the graph was a constant that differed for every module: dynamo guarded on it, so every new
# model recompiled the code that called it, and after torch._dynamo.config.recompile_limit (8) such models a compiled
# caller ran eager whole (an agent class built 9 times and compiled each time: its 9th forward, Linears and all).
# A copy of the parameter (opcheck's clones of the op's inputs) finds the registered one equal to it, so the op is a
# function of its inputs' values, as the op contract asks; that search compares tensors and is for such callers only.
_by_key = {}  # (device, data_ptr, dup) -> (the parameter, weakref to its FusedModule)
# Rebuilds (FusedModule._rebuild) one at a time: a module found stale by two threads at once is rebuilt once.
_rebuild_lock = threading.RLock()


def _register(mlp):
    with _registry_lock:
        handle = next(_handles)
        _registry[handle] = mlp
    return handle


def _lookup(key, dup):
    """The FusedModule whose op arguments are (key, dup)."""
    hit = _by_key.get((key.device, key.data_ptr(), dup))
    if hit is None:
        with _registry_lock:
            entries = list(_by_key.items())
        same = [m for (device, _, d), (p, m) in entries if d == dup and device == key.device and p.shape == key.shape
                and p.dtype == key.dtype and torch.equal(p, key)]
        if len(same) == 1:
            hit = (None, same[0])
        else:
            raise ArgumentError(f"fusedmlp::mlp_forward: its key tensor ({tuple(key.shape)} {key.dtype} on "
                                f"{key.device}) is {'no' if not same else 'more than one'} live FusedModule's first "
                                f"parameter{'' if not same else ' (equal values)'}; the op is what "
                                "FusedModule.forward records")
    module = hit[1]()
    if module is None:
        raise ArgumentError("fusedmlp::mlp_forward: the FusedModule of its key tensor is gone")
    return module


# The op is defined through torch.library.Library, not the custom_op decorator: the decorator's layers (an autograd
# wrapper, redispatch, dynamo-disable wrappers around the kernel; cProfile of a compiled call) cost 6.5 us more an
# eager call and 17-19 us more a compiled FusedModule call than this on the CPU machine's torch 2.13 (a 4-row CPU
# call: op 24.5 -> 18.0 us against the model's own 15.9; compiled module 77 -> 58). The op has no autograd formula
# either way (FusedModule refuses tracked inputs first).
_library = torch.library.Library("fusedmlp", "DEF")
_library.define("mlp_forward(Tensor x, Tensor key, int width, int dup) -> Tensor")


def _forward_impl(x, key, width, dup):
    return _lookup(key, dup)._call(x)


_library.impl("mlp_forward", _forward_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("fusedmlp::mlp_forward")
def _(x, key, width, dup):
    return x.new_empty((*x.shape[:-1], width))


def mlp_forward(x, module):
    """The fused forward of FusedModule `module` on x (..., in) -> (..., out), x's dtype and device, through the op
    torch.ops.fusedmlp.mlp_forward, which graphs record (its arguments: x, the module's first parameter, its output
    width and an index that is 0 unless one module is wrapped twice)."""
    return torch.ops.fusedmlp.mlp_forward.default(x, next(module.parameters()), module._width, module._dup)


_VERSION = operator.attrgetter("_version")


def _architecture(weights, biases, texts, edges, device):
    """What a FusedModule's fused model is built for but for the arrays FusedMLP.set_weights takes: the device, the
    activations, the weights' and biases' shapes, and read_module's edges with each norm's gamma and beta as their
    shapes (every other array, e.g. an encoding's scales, by value)."""
    def frozen(v, arrays_as_shapes=False):
        if isinstance(v, np.ndarray):
            return ("array", v.shape, v.dtype.str) + (() if arrays_as_shapes else (v.tobytes(),))
        if isinstance(v, dict):
            return ("dict",) + tuple((k, frozen(x, arrays_as_shapes)) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return (type(v).__name__,) + tuple(frozen(x, arrays_as_shapes) for x in v)
        return v

    return (device, tuple(texts), tuple(w.shape for w in weights), tuple(None if b is None else b.shape for b in biases),
            frozen({k: v for k, v in edges.items() if k != "norm"}), frozen(edges.get("norm"), True))


def _rebuild_after_load(module, keys):  # (a function of the module, not a lambda: a FusedModule pickles)
    module._rebuild()


class FusedModule(nn.Module):
    """An nn.Module running a PyTorch MLP through fusedmlp's fused kernel.

    It holds the wrapped module's own submodules under the same names, so ``state_dict`` keys are unchanged and a
    state dict saved from the original loads into it (and back). The fused model is rebuilt eagerly whenever the
    weights may have changed (construction, load_state_dict, .to()/.cuda()/.half(), a copy or an unpickled one),
    never traced, so forward stays a single custom-op call that torch.compile(fullgraph=True) traces without a
    break; and before a call whose parameters were changed in place since (an optimizer's step on the wrapped
    module, ``p.mul_()`` under no_grad: their version counters moved), eager or compiled. Where only the arrays
    changed (the same shapes, activations and graph), the rebuild is FusedMLP.set_weights on the model it has: its
    kernels stay and take the new weights in their own device buffers, so a CUDA graph captured over calls before
    runs the new weights too. A write through ``p.data``
    moves no counter, and parameters made under torch.inference_mode() have none: call :meth:`refresh` after such
    a change. Inference only: forward raises if autograd would track it.

    Args:
        module: what from_torch accepts.
        activations: {module path: expression} for activation modules fusedmlp does not know.
        in_features: as from_torch's (a TorchScript module's inputs; a traced `if` on the input's shape).
        kwargs: passed to FusedMLP (check, cache_dir).
    """

    def __init__(self, module, activations=None, in_features=None, **kwargs):
        super().__init__()
        self._wraps_sequential = isinstance(module, nn.Sequential)
        if self._wraps_sequential:
            for name, child in module._modules.items():
                self.add_module(name, child)
        else:
            self.add_module("module", module)
        self._activations, self._in_features = activations, in_features
        self._kwargs = kwargs
        self._handle = None
        self._form = None  # _architecture of the fused model's network
        self._rebuild()
        self.register_load_state_dict_post_hook(_rebuild_after_load)

    def _wrapped(self):
        return nn.Sequential(OrderedDict(self._modules)) if self._wraps_sequential else self.module

    def _rebuild(self):
        """Builds the fused model from the parameters as they are, then puts it in place of the one before (a call
        on another thread meanwhile runs the one before; FusedModule._call)."""
        with _rebuild_lock:
            params = list(self.parameters())
            # (parameters made under torch.inference_mode track no version: refresh() after changing one)
            tracked = [p for p in params if not p.is_inference()]
            versions = sum(map(_VERSION, tracked))  # before the read: a change during it leaves the model stale
            weights, biases, texts, edges = read_module(self._wrapped(), self._activations, self._in_features)
            device = f"cuda:{params[0].device.index}" if params and params[0].is_cuda else "cpu"
            form = _architecture(weights, biases, texts, edges, device)
            if self._handle is not None and form == self._form:
                # the same network but for its arrays (an optimizer step, a loaded state dict): the same fused model,
                # its weights rewritten in place (FusedMLP.set_weights: no plan, compile or load; 5.8-110 ms a step
                # before on an H100, bench/results/h100-set-weights/)
                self._mlp.set_weights(weights, biases, norm=edges.get("norm"))
                self._params, self._versions = tracked, versions
                return
            self._input_order = edges.pop("inputs", None)  # forward's inputs, joined by torch.cat in this order
            self._squeeze = edges.pop("squeeze", None)  # forward's y.squeeze(dims) of its output
            self._outputs = edges.pop("outputs", None)  # forward's heads' widths: the output split into a tuple
            self._output_keys = edges.pop("output_keys", None)  # or a dict of these keys
            self._output_squeeze = edges.pop("output_squeeze", None)  # per part: forward indexed its column
            self._output_stack = edges.pop("output_stack", None)  # (dim, parts): forward's torch.stack of its parts
            mlp = FusedMLP(weights, biases, activation=texts, device=device, **edges, **self._kwargs)
            self._width, self._flatten_start = mlp.widths[-1], mlp._flatten_input  # (forward reads them compiled)
            handle, old, key = _register(mlp), self._handle, params[0]
            with _registry_lock:
                if old is not None and self._key[:2] == (key.device, key.data_ptr()):
                    at = self._key  # the same parameter: its entry (and index) stays this module's
                else:
                    if old is not None:
                        _by_key.pop(self._key, None)
                    dup = 0
                    while (key.device, key.data_ptr(), dup) in _by_key:
                        dup += 1
                    at = (key.device, key.data_ptr(), dup)
                _by_key[at] = (key, weakref.ref(self))
                self._params, self._versions = tracked, versions
                self._mlp, self._handle, self._key, self._dup = mlp, handle, at, at[2]
                self._form = form
                _registry.pop(old, None)

    def _stale(self):
        """Whether a parameter was changed in place since the fused model was built: the version counters only
        grow, so their sum moved (0.6 us for six parameters on the CPU machine; comparing each, 1.0)."""
        return sum(map(_VERSION, self._params)) != self._versions

    def _call(self, x):
        """The fused model on x, rebuilt first where a parameter changed in place (eager calls and the op's)."""
        if self._stale():
            with _rebuild_lock:
                if self._stale():  # (not rebuilt by another thread meanwhile)
                    self._rebuild()
        return self._mlp(x)  # FusedMLP.__call__: its C fast path once the shape is known

    def refresh(self):
        """Rebuilds the fused model from the parameters as they are now: after writes the version counters do not
        see (through ``p.data``); other changes are seen by themselves. Returns self."""
        self._rebuild()
        return self

    def __getstate__(self):  # the fused model is not copied: the copy builds its own (__setstate__)
        return {k: v for k, v in self.__dict__.items() if k != "_mlp"}

    def __setstate__(self, state):  # copy.deepcopy (a target network) or unpickling: a model of its own
        super().__setstate__(state)
        self._handle = None
        self._rebuild()

    def _release(self):
        if self._handle is not None:
            with _registry_lock:
                _registry.pop(self._handle, None)
                entry = _by_key.get(self._key)
                if entry is not None and entry[1]() in (self, None):  # (None: cleared before __del__, in a gc cycle)
                    del _by_key[self._key]
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
        start = self._flatten_start
        if start is not None and x.ndim > start + 1:  # here, so that the op's fake shape is its real one
            x = x.flatten(start)
        if torch.compiler.is_compiling():
            y = mlp_forward(x, self)  # the op the graph records
        else:
            y = self._call(x)  # eager: straight to the model's call, without the op's dispatch
        if self._outputs is not None:
            parts = torch.split(y, self._outputs, -1)
            if self._output_squeeze is not None:
                parts = [p.squeeze(-1) if s else p for p, s in zip(parts, self._output_squeeze)]
            return dict(zip(self._output_keys, parts)) if self._output_keys is not None else tuple(parts)
        if self._output_stack is not None:  # (an ensemble's members side by side -> torch.stack(members, dim))
            dim, parts = self._output_stack
            return y.unflatten(-1, (parts, -1)).movedim(-2, dim)
        return y if self._squeeze is None else y.squeeze(*self._squeeze)

    def extra_repr(self):
        return repr(self._mlp)

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown
            pass
