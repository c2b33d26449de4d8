"""fusedmlp.from_sklearn: fitted scikit-learn MLPs (and Pipelines of scalers ending in one) read into FusedMLP, the CPU
path against the estimator's own predict_proba / predict."""

import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.neural_network import MLPClassifier, MLPRegressor  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import MaxAbsScaler, MinMaxScaler, StandardScaler  # noqa: E402

import fusedmlp  # noqa: E402


def fitted(model, x, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return model.fit(x, y)


@pytest.mark.parametrize("activation", ["relu", "tanh", "logistic", "identity"])
@pytest.mark.parametrize("classes", [2, 5])
def test_classifiers_give_predict_proba(rng, activation, classes):
    x = rng.standard_normal((400, 7)) * 3 + 1
    y = rng.integers(0, classes, 400)
    clf = fitted(make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(32, 16), activation=activation, max_iter=30,
                                                               random_state=0)), x, y)
    mlp = fusedmlp.from_sklearn(clf, device="cpu")
    got, want = mlp(x.astype(np.float32)), clf.predict_proba(x)
    want = want[:, 1:] if classes == 2 else want  # a binary network has one output: predict_proba's second column
    assert np.max(np.abs(got - want)) <= 1e-5
    assert ("softmax" in repr(mlp)) == (classes > 2)


@pytest.mark.parametrize("scaler", [None, MinMaxScaler(), MaxAbsScaler(), StandardScaler(with_mean=False)])
def test_regressors_and_scalers_give_predict(rng, scaler):
    x = rng.standard_normal((300, 5)) * 4 - 2
    y = np.sin(x[:, :2]) @ np.array([1.0, -2.0])
    steps = [scaler] if scaler is not None else []
    reg = fitted(make_pipeline(*steps, MLPRegressor(hidden_layer_sizes=(24,), max_iter=50, random_state=1)), x, y)
    mlp = fusedmlp.from_sklearn(reg, device="cpu")
    got, want = mlp(x.astype(np.float32))[:, 0], reg.predict(x)
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))


def test_a_poisson_regressor_outputs_exp(rng):
    """MLPRegressor(loss='poisson') (scikit-learn 1.7+) exponentiates its output."""
    x = rng.standard_normal((300, 3))
    y = rng.poisson(np.exp(0.5 * x[:, 0]))
    try:
        reg = fitted(MLPRegressor(hidden_layer_sizes=(16,), loss="poisson", max_iter=50, random_state=2), x, y)
    except (TypeError, ValueError):
        pytest.skip("this scikit-learn has no poisson loss")
    mlp = fusedmlp.from_sklearn(reg, device="cpu")
    assert list(mlp.activations)[-1] == "exp(x)"
    assert np.max(np.abs(mlp(x.astype(np.float32))[:, 0] - reg.predict(x))) <= 1e-4 * max(1.0, float(np.max(y)))


def test_what_is_not_read_is_named(rng):
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    x, y = rng.standard_normal((100, 4)), rng.integers(0, 2, 100)
    for est, match in [
            (MLPClassifier(), r"MLPClassifier: the MLPClassifier is not fitted \(it has no coefs_\)"),
            (fitted(LogisticRegression(), x, y), r"LogisticRegression is not read; fusedmlp reads MLPClassifier"),
            (fitted(make_pipeline(PCA(2), MLPClassifier(max_iter=5)), x, y), r"pca: PCA is not read"),
            (fitted(make_pipeline(MinMaxScaler(clip=True), MLPClassifier(max_iter=5)), x, y),
             r"minmaxscaler: MinMaxScaler\(clip=True\) clips")]:
        with pytest.raises(fusedmlp.ArgumentError, match=match):
            fusedmlp.from_sklearn(est, device="cpu")
