"""Column pieces of the last layer's activation ("sigmoid:3 | none:1": NeRF's rgb and density in one output): the
CPU path against float64, the errors, the rendered and compiled kernels (no GPU), and every kernel form on the GPU."""

import os

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _core
from conftest import rel_l2, torch_init


def reference(x, ws, bs, acts, pieces):
    """Float64 forward: hidden activations by the core's evaluator, the last layer's (expression, columns) pieces
    each on its own columns."""
    h = np.asarray(x, np.float64)
    for l, (w, b) in enumerate(zip(ws, bs)):
        h = h @ np.asarray(w, np.float64).T + (0.0 if b is None else np.asarray(b, np.float64))
        if l + 1 < len(ws):
            h = _core.eval_expr(acts[l], np.ascontiguousarray(h.ravel())).reshape(h.shape)
    out, c = np.empty_like(h), 0
    for expr, n in pieces:
        out[:, c:c + n] = _core.eval_expr(expr, np.ascontiguousarray(h[:, c:c + n].ravel())).reshape(-1, n)
        c += n
    return out


@pytest.mark.parametrize("pieces", [[("sigmoid", 3), ("none", 1)], [("x", 1), ("softplus(x, 2)", 2), ("tanh", 5)],
                                    [("relu", 1)] + [("sin(3*x)", 1), ("exp(-x^2)", 2)] * 3 + [("none", 2)]])
def test_pieces_on_the_cpu_path_match_float64(rng, pieces):
    width = sum(n for _, n in pieces)
    ws, bs = torch_init(rng, [7, 32, 24, width])
    mlp = fusedmlp.FusedMLP(ws, bs, activation="gelu", output_activation=pieces, device="cpu")
    assert mlp.activations[-1].count("|") == len(pieces) - 1 and mlp.activations[-1].endswith(f":{pieces[-1][1]}")
    x = rng.standard_normal((200, 7)).astype(np.float32)
    assert rel_l2(mlp(x), reference(x, ws, bs, ["gelu"] * 2, pieces)) < 1e-6
    text = fusedmlp.FusedMLP(ws, bs, activation="gelu", output_activation=mlp.activations[-1], device="cpu")
    assert np.array_equal(text(x), mlp(x))  # the canonical text reads back as the same network


def test_pieces_save_and_load(rng, tmp_path):
    ws, bs = torch_init(rng, [5, 16, 4])
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["relu", "sigmoid:3 | none:1"], device="cpu")
    mlp.save(tmp_path / "m.npz")
    again = fusedmlp.FusedMLP.from_npz(tmp_path / "m.npz", device="cpu")
    x = rng.standard_normal((20, 5)).astype(np.float32)
    assert again.activations == mlp.activations and np.array_equal(again(x), mlp(x))


def test_bad_pieces_are_named(rng):
    ws, bs = torch_init(rng, [5, 16, 4])

    def make(*acts):
        return fusedmlp.FusedMLP(ws, bs, activation=list(acts), device="cpu")

    with pytest.raises(fusedmlp.ArgumentError, match=r"its pieces cover 5 columns; the layer has 4 outputs"):
        make("relu", "sigmoid:3 | none:2")
    with pytest.raises(fusedmlp.ArgumentError, match=r"piece 0 is not 'expression:columns' with a column count"):
        make("relu", "sigmoid | none:1")
    with pytest.raises(fusedmlp.ArgumentError, match=r"piece 1 is not 'expression:columns'"):
        make("relu", "sigmoid:3 | none:0")
    with pytest.raises(fusedmlp.ExpressionError, match="unknown name 'nne'") as e:
        make("relu", "sigmoid:3 | nne:1")
    assert e.value.column == 13
    with pytest.raises(fusedmlp.ArgumentError, match=r"must be a positive int"):
        make("relu", [("sigmoid", 3), ("none", 1.0)])
    with pytest.raises(fusedmlp.LimitError, match="pieces are supported on the last layer only"):
        make("relu:8 | none:8", "none")
    with pytest.raises(fusedmlp.LimitError, match="more than 8 column pieces"):
        fusedmlp.FusedMLP(*torch_init(rng, [5, 16, 9]), activation=["relu", [("relu", 1)] * 9], device="cpu")
    with pytest.raises(fusedmlp.ArgumentError, match="must be a string"):
        make("relu", [("sigmoid", 3), "none"])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_pieces_render_and_compile(rng, arch):
    """The last layer's act reads its column; the hidden layers' keep their one-argument form. NVRTC compiles both
    kernel templates (mma.sync for sm_80, the warpgroup kernel for sm_90a) without a GPU."""
    ws, bs = torch_init(rng, [5, 64, 64, 4])
    mlp = fusedmlp.FusedMLP(ws, bs, activation=["relu", "relu", "sigmoid:3 | none:1"], device="cpu")
    assert os.path.exists(mlp.compile(arch))
    source = mlp._render(int(arch[3:]), 0, 0, "float16", "float16")[1]
    assert "float act(float x, int col) { return col < 3 ? (fm_sigmoid(x)) : ((x)); }" in source
    assert source.count("float act(float x, int) {") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32"])
def test_pieces_in_every_kernel_form_on_the_gpu(rng, dtype):
    """Random networks whose last layer has column pieces, in the forms the planner picks for their widths: resident
    (register-A), 256-wide (cluster or streamed), 512-wide stretches (streamed), a 1024-wide last layer (a GEMM), a
    layernorm on the pieced layer, against float64."""
    import fusedmlp._api as api

    arch = api._gpu(0).info["arch"]
    cases = [([9, 64, 64, 4], [("sigmoid", 3), ("none", 1)]),
             ([3, 256, 256, 256, 6], [("x", 1), ("sigmoid", 3), ("softplus", 2)]),
             ([63, 512, 512, 512, 4], [("sigmoid", 3), ("relu", 1)]),
             ([64, 256, 1024], [("tanh", 500), ("none", 12), ("sigmoid", 512)]),
             ([17, 96, 40], [("silu", 20), ("x", 20)])]
    tol = fusedmlp.CHECK_TOLERANCES[dtype]
    for widths, pieces in cases:
        ws, bs = torch_init(rng, widths)
        mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation=pieces, dtype=dtype)
        for batch in (1, 333, 4099):
            x = rng.standard_normal((batch, widths[0])).astype(np.float32)
            y = mlp(x)
            want = reference(x, ws, bs, ["relu"] * (len(ws) - 1), pieces)
            assert not np.isnan(y).any() and rel_l2(y, want) <= tol, (widths, dtype, batch, rel_l2(y, want), arch)
    ws, bs = torch_init(rng, [12, 128, 128, 8])
    g, b = rng.uniform(0.5, 2, 8).astype(np.float32), rng.uniform(-1, 1, 8).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation=[("sigmoid", 3), ("none", 5)],
                            norm={2: ("layernorm", g, b, 1e-5)}, dtype=dtype)
    x = rng.standard_normal((777, 12)).astype(np.float32)
    cpu = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation=[("sigmoid", 3), ("none", 5)],
                            norm={2: ("layernorm", g, b, 1e-5)}, device="cpu")
    assert rel_l2(mlp(x), cpu._net.forward_cpu(x)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float8", "int8"])
def test_pieces_in_8bit_networks_on_the_gpu(rng, dtype):
    if fusedmlp._api._gpu(0).info["arch"] < (89 if dtype == "float8" else 80):
        pytest.skip(f"{dtype} needs a newer GPU")
    ws, bs = torch_init(rng, [32, 128, 128, 4])
    pieces = [("sigmoid", 3), ("none", 1)]
    x = rng.standard_normal((4099, 32)).astype(np.float32)
    mlp = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation=pieces, dtype=dtype).calibrate(x[:1024])
    cpu = fusedmlp.FusedMLP(ws, bs, activation="relu", output_activation=pieces, dtype=dtype, device="cpu")
    cpu.calibrate(x[:1024])
    want = reference(x, ws, bs, ["relu", "relu"], pieces)
    assert rel_l2(mlp(x), want) <= fusedmlp.CHECK_TOLERANCES[dtype]
    assert rel_l2(mlp(x), cpu(x)) <= 1e-2  # the GPU's rounding against the CPU path's emulation of it
