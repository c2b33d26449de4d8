"""fusedmlp: run a trained MLP as one fused, NVRTC-compiled Tensor Core kernel.

>>> import numpy as np, fusedmlp
>>> y = fusedmlp.evaluate_fused_mlp(x, weights, biases, activation="relu")   # weights: [(out, in), ...]
>>> mlp = fusedmlp.FusedMLP(weights, biases, activation="silu"); y = mlp(x)

Importing needs neither the CUDA driver nor NVRTC: they are loaded on first GPU use.
"""

from ._api import (CHECK_TOLERANCE, CHECK_TOLERANCES, LOWBIT_PRECISIONS, PRECISIONS, FusedMLP, __version__,
                   evaluate_fused_mlp, tune)
from ._encoding import frequency_encoding


def from_torch(module, activations=None, device=None, **kwargs):
    """Builds a FusedMLP from a PyTorch MLP (nn.Sequential, nested ones, torchvision.ops.MLP): see fusedmlp.torch."""
    from .torch import from_torch as _from_torch  # torch is optional: imported only here

    return _from_torch(module, activations, device, **kwargs)


def from_onnx(model, device="auto", calibrate=None, **kwargs):
    """Builds a FusedMLP from an ONNX MLP (a path, bytes or onnx.ModelProto): see fusedmlp.onnx (needs onnx)."""
    from .onnx import from_onnx as _from_onnx  # onnx is optional: imported only here

    return _from_onnx(model, device, calibrate, **kwargs)


def from_sklearn(estimator, device="auto", **kwargs):
    """Builds a FusedMLP from a fitted scikit-learn MLPClassifier / MLPRegressor (or a Pipeline of scalers ending in
    one): see fusedmlp.sklearn."""
    from .sklearn import from_sklearn as _from_sklearn

    return _from_sklearn(estimator, device, **kwargs)


from . import errors
from .errors import (
    ArgumentError,
    CompileError,
    CudaError,
    DTypeError,
    ExpressionError,
    FusedMLPError,
    LibraryNotFoundError,
    LimitError,
    ShapeError,
    TemplateError,
)

__all__ = [
    "FusedMLP",
    "evaluate_fused_mlp",
    "from_torch",
    "from_onnx",
    "from_sklearn",
    "frequency_encoding",
    "tune",
    "CHECK_TOLERANCE",
    "CHECK_TOLERANCES",
    "LOWBIT_PRECISIONS",
    "PRECISIONS",
    *errors.__all__,  # the exception classes, imported above
    "__version__",
]
