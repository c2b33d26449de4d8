"""Reads a fitted scikit-learn MLP into a FusedMLP: ``fusedmlp.from_sklearn(estimator)``.

Takes ``MLPClassifier`` and ``MLPRegressor``, alone or as the last step of a ``Pipeline`` whose earlier steps are
input scalers (``StandardScaler``, ``MinMaxScaler``, ``MaxAbsScaler``; ``"passthrough"``), which fold exactly into the
first layer (float64, then float32 once). The hidden activation (identity, logistic, tanh, relu) and the output one
(identity, logistic, softmax; exp for a Poisson regressor) are the network's; the outputs are what the network
computes, so for ``MLPClassifier`` they are ``predict_proba``'s (for a binary problem, its second column: the network
has one output) and for ``MLPRegressor`` ``predict``'s.
"""

import numpy as np

from ._api import FusedMLP
from ._layers import Layers
from .errors import ArgumentError

_ACTIVATIONS = {"identity": "none", "logistic": "sigmoid", "tanh": "tanh", "relu": "relu"}
_MLPS = ("MLPClassifier", "MLPRegressor")
_SCALERS = ("StandardScaler", "MinMaxScaler", "MaxAbsScaler")


def _scaler_affine(step, label):
    """(s, t) with step.transform(x) = s * x + t, float64."""
    kind = type(step).__name__
    if kind == "StandardScaler":
        n = step.n_features_in_  # (mean_ is kept with with_mean=False too, but not subtracted)
        s = 1.0 / np.asarray(step.scale_, np.float64) if step.with_std and step.scale_ is not None else np.ones(n)
        mean = np.asarray(step.mean_, np.float64) if step.with_mean and step.mean_ is not None else np.zeros(n)
        return s, -mean * s
    if kind == "MinMaxScaler":
        if getattr(step, "clip", False):
            raise ArgumentError(f"{label}: MinMaxScaler(clip=True) clips its outputs, which no Linear folds; fit it "
                                "with clip=False")
        return np.asarray(step.scale_, np.float64), np.asarray(step.min_, np.float64)
    if kind == "MaxAbsScaler":
        return 1.0 / np.asarray(step.scale_, np.float64), np.zeros(step.n_features_in_)
    raise ArgumentError(f"{label}: {kind} is not read; a Pipeline's steps before the MLP may be {', '.join(_SCALERS)} "
                        "or 'passthrough'")


def read_sklearn(estimator):
    """A fitted MLPClassifier / MLPRegressor (or a Pipeline ending in one) as FusedMLP's arguments.

    Returns:
        (weights, biases, activations, edges) for FusedMLP(weights, biases, activation=activations, **edges).
    """
    steps = [(name, step) for name, step in estimator.steps] if hasattr(estimator, "steps") else [
        (type(estimator).__name__, estimator)]
    layers = Layers(lambda a: None if a is None else np.asarray(a, np.float64), bn="scaler")
    for name, step in steps[:-1]:
        if step is None or step == "passthrough":
            continue
        layers.batchnorm(*_scaler_affine(step, name), name)
    name, mlp = steps[-1]
    if type(mlp).__name__ not in _MLPS:
        raise ArgumentError(f"{name}: {type(mlp).__name__} is not read; fusedmlp reads {' and '.join(_MLPS)} (or a "
                            "Pipeline ending in one)")
    if not hasattr(mlp, "coefs_"):
        raise ArgumentError(f"{name}: the {type(mlp).__name__} is not fitted (it has no coefs_); call fit first")
    if mlp.activation not in _ACTIVATIONS:
        raise ArgumentError(f"{name}: activation={mlp.activation!r}; fusedmlp reads {sorted(_ACTIVATIONS)}")
    n = len(mlp.coefs_)
    for i, (w, b) in enumerate(zip(mlp.coefs_, mlp.intercepts_)):
        label = f"{name}.coefs_[{i}]"
        layers.linear(np.asarray(w, np.float64).T, b, label)
        act = mlp.activation if i < n - 1 else mlp.out_activation_
        if act == "softmax":
            layers.softmax("softmax", -1, label)
        elif act == "exp" and i == n - 1:  # MLPRegressor(loss="poisson")
            layers.activation("exp", label)
        elif act in _ACTIVATIONS and act != "identity":
            layers.activation(_ACTIVATIONS[act], label)
        elif act not in _ACTIVATIONS:
            raise ArgumentError(f"{label}: output activation {act!r}; fusedmlp reads identity, logistic, softmax and "
                                "exp")
    layers.merge_pairs()
    weights, biases, acts, norm, _ = layers.finish(type(estimator).__name__)
    return weights, biases, acts, ({"norm": norm} if norm else {})


def from_sklearn(estimator, device="auto", **kwargs):
    """Builds a FusedMLP from a fitted scikit-learn MLP (module docstring: what is read).

    Args:
        estimator: a fitted MLPClassifier or MLPRegressor, or a Pipeline of input scalers ending in one.
        device, kwargs: passed to FusedMLP (dtype, check, cache_dir).

    Returns:
        A FusedMLP whose outputs are the network's (predict_proba's for a classifier; its second column for a binary
        one; predict's for a regressor).
    """
    weights, biases, acts, edges = read_sklearn(estimator)
    return FusedMLP(weights, biases, activation=acts, device=device, **edges, **kwargs)
