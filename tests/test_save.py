"""FusedMLP.save and from_npz: a model's file carries its whole architecture, and reads back to the same function."""

import io

import numpy as np
import pytest

import fusedmlp
from conftest import graph_weights


def graph_model(rng, **kwargs):
    widths = [7, 32, 32, 32, 5]
    ws, bs = graph_weights(rng, widths, {2: "before"}, 1.0)
    norm = {0: "layernorm", 1: ("rmsnorm", rng.uniform(0.5, 1.5, 32).astype(np.float32), None, 1e-6),
            3: {"kind": "layernorm", "bias": rng.uniform(-0.2, 0.2, 5).astype(np.float32)}}
    return fusedmlp.FusedMLP(ws, bs, activation=["gelu", "sin(2*x)", "silu", "tanh"], concat={2: "before"},
                             residual={1: ("add", "relu"), 2: ("mul", "none", 0), 3: None}, norm=norm,
                             dtype="bfloat16", device="cpu", **kwargs)


def test_a_saved_model_reads_back_with_its_whole_architecture(rng, tmp_path):
    mlp = graph_model(rng)
    path = mlp.save(tmp_path / "model")
    assert path == str(tmp_path / "model.npz")
    back = fusedmlp.FusedMLP.from_npz(path, device="cpu")
    x = rng.standard_normal((40, 7)).astype(np.float32)
    assert np.array_equal(back(x), mlp(x))
    assert repr(back) == repr(mlp) and back.widths == mlp.widths and back._precision == "bfloat16"
    # a file object too, and the arrays a state-dict reader sees are the layers' weights in PyTorch's layout
    buf = io.BytesIO()
    mlp.save(buf)
    buf.seek(0)
    with np.load(buf) as data:
        assert data["2.weight"].shape == (32, 32 + 7) and "1.norm.weight" in data.files and "3.norm.bias" in data.files
    buf.seek(0)
    assert np.array_equal(fusedmlp.FusedMLP.from_npz(buf, device="cpu")(x), mlp(x))


def test_a_saved_file_refuses_architecture_arguments_naming_them(rng, tmp_path):
    path = graph_model(rng).save(tmp_path / "m.npz")
    with pytest.raises(fusedmlp.ArgumentError, match="carries its architecture; dtype, activation cannot be given"):
        fusedmlp.FusedMLP.from_npz(path, activation="relu", dtype="float16", device="cpu")


def test_a_file_of_another_format_is_refused_with_what_to_do(rng, tmp_path):
    mlp = graph_model(rng)
    path = tmp_path / "m.npz"
    with np.load(mlp.save(path)) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["__fusedmlp__"] = np.array('{"format": 99}')
    np.savez(path, **arrays)
    with pytest.raises(fusedmlp.ArgumentError, match="has format 99; this fusedmlp reads format 1"):
        fusedmlp.FusedMLP.from_npz(path, device="cpu")


def test_a_state_dict_file_still_takes_its_architecture_from_the_arguments(rng, tmp_path):
    ws, bs = graph_weights(rng, [4, 8, 3], {}, 1.0)
    np.savez(tmp_path / "sd.npz", **{"0.weight": ws[0], "2.weight": ws[1], "2.bias": np.ones(3, np.float32)})
    relu = fusedmlp.FusedMLP.from_npz(tmp_path / "sd.npz", device="cpu")
    tanh = fusedmlp.FusedMLP.from_npz(tmp_path / "sd.npz", "tanh", device="cpu")
    assert relu.activations[0] == "relu(x)" and tanh.activations[0] == "tanh(x)"
