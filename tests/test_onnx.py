"""fusedmlp.from_onnx: ONNX MLPs read into FusedMLP (the CPU path against onnxruntime on the same graph), the forms
exporters write (MatMul + Add, Gemm with its attributes, SiLU / GELU / Mish spelled out, batch norms, layer norms,
softmax heads, a flattened input), torch.onnx.export's output, and the errors that name what is not read."""

import io

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import fusedmlp  # noqa: E402
from fusedmlp.onnx import read_onnx  # noqa: E402


def graph_model(nodes, inits, in_shape, n_out, inputs=("x",)):
    """A checked opset-20 model of nodes with float32 initializers, input x of in_shape (rows None), output y."""
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, *in_shape]) for name in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n_out])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model


def check_against_onnxruntime(model, x, tol=1e-5):
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    mlp = fusedmlp.from_onnx(model, device="cpu")
    got = mlp(x)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= tol * max(1.0, float(np.max(np.abs(want)))), mlp
    return mlp


def torch_exported(torch, model, example):
    """model's ONNX graph (bytes) from torch.onnx.export's TorchScript exporter, the rows dynamic; the test skips where
    this torch has no exporter (it is optional in torch too)."""
    buf = io.BytesIO()
    try:
        torch.onnx.export(model, example, buf, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "n"}})
    except Exception as e:
        pytest.skip(f"torch.onnx.export failed: {e}")
    return buf.getvalue()


def test_matmul_add_silu_gemm_softmax(rng):
    """The exporter's forms: MatMul then Add of the bias, SiLU as x * Sigmoid(x) (read as the built-in silu), Gemm
    with transB=1, a softmax head."""
    w1, b1, w2, b2 = rng.standard_normal((16, 32)) / 4, rng.standard_normal(32), rng.standard_normal((10, 32)) / 4, \
        rng.standard_normal(10)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["z"]),
             helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["z", "s"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["o"], transB=1), helper.make_node("Softmax", ["o"], ["y"])]
    model = graph_model(nodes, {"W1": w1, "b1": b1, "W2": w2, "b2": b2}, [16], 10)
    mlp = check_against_onnxruntime(model, rng.standard_normal((50, 16)).astype(np.float32))
    assert list(mlp.activations) == ["silu(x)", "none(x)"] and "norm={1: softmax}" in repr(mlp)


def test_gelu_spelled_out_gemm_attributes_batch_and_layer_norms(rng):
    """GELU as x * 0.5 * (1 + Erf(x / 1.41421...)) reads as gelu; Gemm's alpha, beta and transB=0; a
    BatchNormalization after a Gemm folds into it; a LayerNormalization is the layer's norm; a log_softmax head."""
    sqrt2 = np.float32(np.sqrt(2.0))
    inits = {"W1": rng.standard_normal((12, 24)) / 3, "b1": rng.standard_normal(24), "sq": sqrt2, "one": 1.0,
             "half": 0.5, "W2": rng.standard_normal((24, 24)) / 5, "b2": rng.standard_normal(24),
             "g": rng.uniform(0.5, 1.5, 24), "be": rng.standard_normal(24), "mu": rng.standard_normal(24),
             "var": rng.uniform(0.5, 2, 24), "W3": rng.standard_normal((24, 24)) / 5, "ln_s": rng.uniform(0.5, 1.5, 24),
             "ln_b": rng.standard_normal(24), "W4": rng.standard_normal((7, 24)) / 5, "b4": rng.standard_normal(7)}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z"], alpha=0.75, beta=1.5),
             helper.make_node("Div", ["z", "sq"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["z", "p"], ["q"]),
             helper.make_node("Mul", ["q", "half"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["z2"]),
             helper.make_node("BatchNormalization", ["z2", "g", "be", "mu", "var"], ["n2"], epsilon=1e-3),
             helper.make_node("Tanh", ["n2"], ["a2"]),
             helper.make_node("MatMul", ["a2", "W3"], ["z3"]),
             helper.make_node("LayerNormalization", ["z3", "ln_s", "ln_b"], ["n3"], epsilon=1e-5),
             helper.make_node("Relu", ["n3"], ["a3"]),
             helper.make_node("Gemm", ["a3", "W4", "b4"], ["o"], transB=1),
             helper.make_node("LogSoftmax", ["o"], ["y"], axis=1)]
    model = graph_model(nodes, inits, [12], 7)
    mlp = check_against_onnxruntime(model, rng.standard_normal((33, 12)).astype(np.float32))
    assert list(mlp.activations) == ["gelu(x)", "tanh(x)", "relu(x)", "none(x)"]
    assert "2: layernorm(eps=1e-05, weight, bias), 3: log_softmax" in repr(mlp)


@pytest.mark.parametrize("op, attrs, extra", [
    ("LeakyRelu", {"alpha": 0.2}, {}), ("Elu", {"alpha": 0.7}, {}), ("Selu", {}, {}), ("Celu", {"alpha": 1.5}, {}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, {}), ("HardSwish", {}, {}), ("Softplus", {}, {}),
    ("Softsign", {}, {}), ("Mish", {}, {}), ("Gelu", {"approximate": "tanh"}, {}), ("Exp", {}, {}),
    ("Sin", {}, {}), ("PRelu", {}, {"slope": np.float32(0.1)}), ("Clip", {}, {"lo": np.float32(-0.5),
                                                                           "hi": np.float32(2.0)}),
    ("ThresholdedRelu", {"alpha": 0.3}, {}), ("Shrink", {"lambd": 0.4, "bias": 0.1}, {}),
    ("Shrink", {"lambd": 0.5}, {}), ("Shrink", {"lambd": 0.25, "bias": 0.25}, {}), ("Sign", {}, {}),
    ("Floor", {}, {}), ("Ceil", {}, {}), ("Atan", {}, {}), ("Sinh", {}, {}), ("Cosh", {}, {})])  # (Tan: read too; float32 ORT near its poles is no reference)
def test_each_activation_op(rng, op, attrs, extra):
    inputs = ["z"] + (["slope"] if op == "PRelu" else ["lo", "hi"] if op == "Clip" else [])
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z"], transB=1), helper.make_node(op, inputs, ["a"], **attrs),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], transB=1)]
    inits = {"W1": rng.standard_normal((20, 8)) / 2, "b1": rng.standard_normal(20), "W2": rng.standard_normal((3, 20)),
             "b2": rng.standard_normal(3), **extra}
    check_against_onnxruntime(graph_model(nodes, inits, [8], 3), rng.standard_normal((40, 8)).astype(np.float32))


@pytest.mark.parametrize("op, attrs", [("ThresholdedRelu", {"alpha": 0.3}), ("Shrink", {"lambd": 0.4, "bias": 0.1}),
                                       ("LeakyRelu", {"alpha": 0.2})])
def test_activation_ops_with_attributes_on_a_head_past_the_last_layer(rng, op, attrs):
    """The tail reads the activation ops with attributes the chain reads (onnx._WITH_ATTRS) on one head of two."""
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z"], transB=1), helper.make_node("Relu", ["z"], ["h"]),
             helper.make_node("Gemm", ["h", "Wa", "ba"], ["a"], transB=1),
             helper.make_node("Gemm", ["h", "Wb", "bb"], ["b"], transB=1), helper.make_node(op, ["a"], ["sa"], **attrs),
             helper.make_node("Concat", ["sa", "b"], ["y"], axis=-1)]
    inits = {"W1": rng.standard_normal((20, 8)) / 2, "b1": rng.standard_normal(20), "Wa": rng.standard_normal((3, 20)),
             "ba": rng.standard_normal(3), "Wb": rng.standard_normal((2, 20)), "bb": rng.standard_normal(2)}
    check_against_onnxruntime(graph_model(nodes, inits, [8], 5), rng.standard_normal((40, 8)).astype(np.float32))


@pytest.mark.parametrize("reshape", ["Flatten", "Reshape0", "ReshapeK"])
def test_a_flattened_input(rng, reshape):
    if reshape == "Flatten":
        first = [helper.make_node("Flatten", ["x"], ["f"], axis=1)]
    else:
        first = [helper.make_node("Reshape", ["x", "shape"], ["f"])]
    shape = {"Reshape0": [0, -1], "ReshapeK": [-1, 12]}.get(reshape)
    inits = {"W1": rng.standard_normal((12, 6)), "b1": rng.standard_normal(6)}
    model_inits = {**inits}
    nodes = first + [helper.make_node("Gemm", ["f", "W1", "b1"], ["z"]), helper.make_node("Tanh", ["z"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 6])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in model_inits.items()] +
        ([numpy_helper.from_array(np.asarray(shape, np.int64), "shape")] if shape else []))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    mlp = check_against_onnxruntime(model, rng.standard_normal((9, 3, 4)).astype(np.float32))
    assert mlp._flatten_input == 1


def test_per_feature_affine_maps_fold_into_the_linears(rng):
    """An in-graph input normalization (x - mean) / std, a per-feature scale right after a layer's MatMul (before its
    activation), a shift and a scale of a layer's output before the next Gemm, and a scalar times the input: each is
    folded into a Linear (float64, exact), against onnxruntime."""
    inits = {"mean": rng.standard_normal(10), "std": rng.uniform(0.5, 2, 10), "two": 2.0,
             "W1": rng.standard_normal((10, 24)) / 3, "sc": rng.uniform(0.5, 1.5, 24),
             "W2": rng.standard_normal((6, 24)) / 4, "b2": rng.standard_normal(6), "sh": rng.standard_normal((1, 24)),
             "g": rng.uniform(0.5, 1.5, 24)}
    nodes = [helper.make_node("Sub", ["x", "mean"], ["c"]), helper.make_node("Div", ["c", "std"], ["n"]),
             helper.make_node("Mul", ["two", "n"], ["n2"]),
             helper.make_node("MatMul", ["n2", "W1"], ["z"]), helper.make_node("Mul", ["z", "sc"], ["zs"]),
             helper.make_node("Relu", ["zs"], ["a"]), helper.make_node("Sub", ["sh", "a"], ["d"]),
             helper.make_node("Mul", ["d", "g"], ["e"]), helper.make_node("Gemm", ["e", "W2", "b2"], ["y"], transB=1)]
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [10], 6), rng.standard_normal((30, 10)).astype(np.float32))
    assert list(mlp.activations) == ["relu(x)", "none(x)"]


def test_residuals_and_a_concat(rng):
    """A residual block reading an earlier layer's output, one reading the input with an activation after the op, and
    NeRF's concat of the hidden state with the input before a layer."""
    inits = {"W1": rng.standard_normal((16, 16)) / 4, "b1": rng.standard_normal(16),
             "W2": rng.standard_normal((16, 16)) / 4, "b2": rng.standard_normal(16),
             "W3": rng.standard_normal((16, 16)) / 4, "W4": rng.standard_normal((5, 32)) / 4}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z1"], transB=1), helper.make_node("Relu", ["z1"], ["a1"]),
             helper.make_node("Gemm", ["a1", "W2", "b2"], ["z2"], transB=1), helper.make_node("Tanh", ["z2"], ["a2"]),
             helper.make_node("Add", ["a1", "a2"], ["r2"]),  # layer 1: tanh(W h + b) + (layer 0's output)
             helper.make_node("MatMul", ["r2", "W3"], ["z3"]), helper.make_node("Sigmoid", ["z3"], ["a3"]),
             helper.make_node("Mul", ["x", "a3"], ["m3"]), helper.make_node("Relu", ["m3"], ["r3"]),  # relu(x * .)
             helper.make_node("Concat", ["r3", "x"], ["c"], axis=1),
             helper.make_node("Gemm", ["c", "W4"], ["y"], transB=1)]
    model = graph_model(nodes, inits, [16], 5)
    mlp = check_against_onnxruntime(model, rng.standard_normal((21, 16)).astype(np.float32))
    assert mlp._residual[1] is not None and mlp._residual[2] is not None and mlp._concat[3] == 1, repr(mlp)


def test_a_residual_from_the_input_through_identity_and_flatten(rng):
    """The input renamed by an Identity and flattened, then read by a residual: still the network input."""
    inits = {"W1": rng.standard_normal((12, 12)) / 3, "W2": rng.standard_normal((12, 4)) / 3}
    nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=1), helper.make_node("Identity", ["f"], ["i"]),
             helper.make_node("MatMul", ["i", "W1"], ["z"]), helper.make_node("Tanh", ["z"], ["a"]),
             helper.make_node("Add", ["a", "i"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    mlp = check_against_onnxruntime(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]),
                                    rng.standard_normal((7, 3, 4)).astype(np.float32))
    assert mlp._residual[0] is not None and mlp._residual[0][2] == -1


def test_readers_of_a_value_under_its_identity_names_count(rng):
    """A value renamed by Identity / Dropout / Cast nodes is read by its aliases' readers too: a Gemm's output reaching
    its LayerNormalization through an Identity while an Add reads the Gemm's output (a pre-norm block, as other
    exporters write it) puts the norm on a layer of its own, and the residual reads the Gemm's output by its first
    name. (Before, the Identity's name had one reader: the norm was fused into the Gemm and the Add refused.)"""
    w1, b1 = rng.standard_normal((6, 16)), rng.standard_normal(16)
    w2, b2 = rng.standard_normal((16, 32)) / 4, rng.standard_normal(32)
    w3, b3 = rng.standard_normal((32, 16)) / 6, rng.standard_normal(16)
    w4 = rng.standard_normal((16, 3)) / 4
    inits = dict(W1=w1, b1=b1, W2=w2, b2=b2, W3=w3, b3=b3, W4=w4, g=rng.uniform(0.5, 1.5, 16),
                 be=rng.uniform(-0.5, 0.5, 16))
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["h"]),
             helper.make_node("Identity", ["h"], ["hi"]),
             helper.make_node("Cast", ["hi"], ["hc"], to=TensorProto.FLOAT),
             helper.make_node("LayerNormalization", ["hc", "g", "be"], ["n"], epsilon=1e-5),
             helper.make_node("MatMul", ["n", "W2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["z2"]),
             helper.make_node("Relu", ["z2"], ["a2"]),
             helper.make_node("MatMul", ["a2", "W3"], ["m3"]), helper.make_node("Add", ["m3", "b3"], ["z3"]),
             helper.make_node("Add", ["z3", "h"], ["r"]),  # h + f(LN(h)): the Gemm's output, read a second time
             helper.make_node("Dropout", ["r"], ["rd"]), helper.make_node("MatMul", ["rd", "W4"], ["y"])]
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [6], 3), (rng.standard_normal((50, 6)) * 2 + 1)
                                    .astype(np.float32))
    assert list(mlp.widths) == [6, 16, 16, 32, 16, 3]


def test_nodes_read_a_renamed_value_by_any_of_its_names(rng):
    """Identity / Dropout / Cast nodes anywhere on the chain: silu spelled out with the Sigmoid reading the layer's
    output through an Identity and the Mul by its first name; a residual block's output read by a Tanh through a
    Dropout and by the Add after it by its first name (a post-residual expression); the graph output an Identity."""
    w1, b1 = rng.standard_normal((6, 16)), rng.standard_normal(16)
    w2, b2 = rng.standard_normal((16, 16)) / 4, rng.standard_normal(16)
    w3 = rng.standard_normal((16, 3)) / 4
    inits = dict(W1=w1, b1=b1, W2=w2, b2=b2, W3=w3, half=np.float32(0.5))
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["z"]),
             helper.make_node("Identity", ["z"], ["zi"]), helper.make_node("Sigmoid", ["zi"], ["s"]),
             helper.make_node("Mul", ["z", "s"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["z2"]),
             helper.make_node("Add", ["z2", "a"], ["r"]), helper.make_node("Dropout", ["r"], ["rd"]),
             helper.make_node("Tanh", ["rd"], ["t"]), helper.make_node("Mul", ["t", "half"], ["u"]),
             helper.make_node("Add", ["u", "r"], ["v"]),
             helper.make_node("MatMul", ["v", "W3"], ["o"]), helper.make_node("Identity", ["o"], ["y"])]
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [6], 3), rng.standard_normal((40, 6)).astype(np.float32))
    assert list(mlp.widths) == [6, 16, 16, 3]


def test_comparisons_logic_and_where_read_as_expressions(rng):
    """Greater / GreaterOrEqual / Less / LessOrEqual / Equal of the layer's output with scalars, Not / And / Or / Xor
    of their results, a Cast of one to bool, and Where choosing between expressions: onnxruntime's outputs (the
    values a comparison takes in exactly, 0.25 and -0.5, among the inputs of the activation)."""
    c = {"h": 0.25, "m": -0.5, "k": 2.0, "z": 0.0}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["t"], transB=1),
             helper.make_node("Greater", ["t", "h"], ["g"]), helper.make_node("LessOrEqual", ["t", "m"], ["l"]),
             helper.make_node("Or", ["g", "l"], ["o"]), helper.make_node("Not", ["o"], ["n"]),
             helper.make_node("GreaterOrEqual", ["t", "z"], ["p"]), helper.make_node("And", ["n", "p"], ["a"]),
             helper.make_node("Less", ["t", "k"], ["q"]), helper.make_node("Xor", ["a", "q"], ["e"]),
             helper.make_node("Cast", ["e"], ["eb"], to=TensorProto.BOOL),
             helper.make_node("Mul", ["t", "k"], ["tk"]), helper.make_node("Tanh", ["t"], ["th"]),
             helper.make_node("Where", ["eb", "tk", "th"], ["w"]),
             helper.make_node("Equal", ["t", "z"], ["eq"]), helper.make_node("Cast", ["eq"], ["eqf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["w", "eqf"], ["act"]),
             helper.make_node("Gemm", ["act", "W2", "b2"], ["y"], transB=1)]
    b1 = rng.standard_normal(20)
    b1[:4] = [0.25, -0.5, 0.0, 2.0]  # (rows of x that are 0 give the first layer these outputs: each threshold)
    inits = {"W1": rng.standard_normal((20, 8)) / 2, "b1": b1, "W2": rng.standard_normal((3, 20)),
             "b2": rng.standard_normal(3), **{k: np.float32(v) for k, v in c.items()}}
    x = rng.standard_normal((40, 8)).astype(np.float32)
    x[:4] = 0
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [8], 3), x)
    assert "where(" in mlp.activations[0] and "gt(" in mlp.activations[0]


@pytest.mark.parametrize("module", ["Softplus()", "Softplus(beta=2, threshold=10)", "Threshold(0.1, -1.0)",
                                    "Hardshrink(0.3)", "Softshrink(0.2)"])
def test_torch_dynamo_exported_thresholds_read_back(module):
    """torch.onnx.export's default (dynamo) exporter writes Softplus's threshold, Threshold and the shrinks with
    comparisons and Where; each reads back as torch computes it, at and around its thresholds too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import contextlib

    nn = torch.nn
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 16), eval(f"nn.{module}"), nn.Linear(16, 3)).eval()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exported = torch.onnx.export(model, (torch.randn(3, 6),), dynamo=True, dynamic_shapes=({0: "n"},))
    except Exception as e:  # (the exporter is optional in torch too)
        pytest.skip(f"torch.onnx.export(dynamo=True) failed: {e}")
    mlp = fusedmlp.from_onnx(exported.model_proto, device="cpu")
    x = torch.randn(64, 6)
    with torch.no_grad():
        want = model(x).numpy()
    assert np.max(np.abs(mlp(x.numpy()) - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


def _written_out_norm(kind, variant):
    """Nodes of a norm written out over value z into value n: RMSNorm as Pow (or Mul(z, z)) -> ReduceMean -> Add(eps)
    -> Sqrt -> Reciprocal -> Mul (or Div), times a scale; LayerNorm the same over z - ReduceMean(z), plus a bias."""
    axes = helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([-1], np.int64)))
    nodes, v = [axes], "z"
    if kind == "layernorm":
        nodes += [helper.make_node("ReduceMean", ["z", "axes"], ["mu"]), helper.make_node("Sub", ["z", "mu"], ["d"])]
        v = "d"
    nodes += [helper.make_node("Mul", [v, v], ["sq"]) if variant == "mul" else helper.make_node("Pow", [v, "two"], ["sq"]),
              helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["ve"]),
              helper.make_node("Sqrt", ["ve"], ["sd"])]
    if variant == "div":
        nodes.append(helper.make_node("Div", [v, "sd"], ["nn"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["sd"], ["r"]), helper.make_node("Mul", ["r", v], ["nn"])]
    nodes.append(helper.make_node("Mul", ["nn", "g"], ["ns" if kind == "layernorm" else "n"]))
    if kind == "layernorm":
        nodes.append(helper.make_node("Add", ["ns", "be"], ["n"]))
    return nodes


@pytest.mark.parametrize("kind, variant", [("rmsnorm", "recip"), ("rmsnorm", "div"), ("rmsnorm", "mul"),
                                           ("layernorm", "div"), ("layernorm", "recip")])
def test_norms_written_out_node_by_node_read_as_fused_norms(rng, kind, variant):
    """torch's dynamo exporter writes RMSNorm out node by node at its default opset, exporters below opset 17
    LayerNorm: each such run (in the forms exporters write) reads as the fused norm of the layer before it, with its
    epsilon, scale and bias: onnxruntime's outputs. A mean over another axis is no norm, and its node is named."""
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z"], transB=1)] + _written_out_norm(kind, variant) + [
        helper.make_node("Tanh", ["n"], ["a"]), helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], transB=1)]
    inits = {"W1": rng.standard_normal((24, 8)), "b1": rng.standard_normal(24), "two": 2.0, "eps": 1e-3,
             "g": rng.uniform(0.5, 1.5, 24), "be": rng.standard_normal(24), "W2": rng.standard_normal((3, 24)) / 4,
             "b2": rng.standard_normal(3)}
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [8], 3), rng.standard_normal((40, 8)).astype(np.float32))
    assert f"0: {kind}(eps=0.001, weight{', bias' if kind == 'layernorm' else ''})" in repr(mlp), repr(mlp)
    assert list(mlp.activations) == ["tanh(x)", "none(x)"]
    nodes[1] = helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0], np.int64)))
    with pytest.raises(fusedmlp.ArgumentError, match="ReduceMean"):
        fusedmlp.from_onnx(graph_model(nodes, inits, [8], 3), device="cpu")


def test_torch_exports_of_rmsnorm_and_opset_16_layernorm_read_back():
    """nn.RMSNorm through the default (dynamo) exporter, nn.LayerNorm through the TorchScript exporter at opset 16:
    both written out node by node, both read as fused norms that give torch's outputs."""
    torch = pytest.importorskip("torch")
    import contextlib

    nn = torch.nn
    torch.manual_seed(6)
    for norm, how in ((nn.RMSNorm(16), "dynamo"), (nn.LayerNorm(16), "opset16")):
        model = nn.Sequential(nn.Linear(6, 16), norm, nn.SiLU(), nn.Linear(16, 3)).eval()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        if how == "dynamo":
            pytest.importorskip("onnxscript")
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    data = torch.onnx.export(model, (torch.randn(3, 6),), dynamo=True,
                                             dynamic_shapes=({0: "n"},)).model_proto
            except Exception as e:  # (the exporter is optional in torch too)
                pytest.skip(f"torch.onnx.export(dynamo=True) failed: {e}")
        else:
            buf = io.BytesIO()
            try:
                torch.onnx.export(model, torch.randn(3, 6), buf, dynamo=False, input_names=["x"], output_names=["y"],
                                  dynamic_axes={"x": {0: "n"}}, opset_version=16)
            except Exception as e:
                pytest.skip(f"torch.onnx.export failed: {e}")
            data = buf.getvalue()
        mlp = fusedmlp.from_onnx(data, device="cpu")
        assert "rmsnorm" in repr(mlp) if how == "dynamo" else "layernorm" in repr(mlp)
        x = torch.randn(40, 6)
        with torch.no_grad():
            want = model(x).numpy()
        assert np.max(np.abs(mlp(x.numpy()) - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want)))), how


def test_torch_script_exported_shrinks_read_back():
    """torch's TorchScript exporter writes Hardshrink as Where(Or(Greater, Less), z, 0) and Softshrink as
    Where(Greater(z, l), z - l, 0) + Where(Less(z, -l), z + l, 0): the Add of a number to the layer's output there is
    part of the activation, not its bias (other nodes read the output too; taken as the bias, it moved their z: 0.2
    off). Both read back as torch computes them."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 24), nn.Hardshrink(0.3), nn.Linear(24, 24), nn.Softshrink(0.2),
                          nn.Linear(24, 2)).eval()
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, torch.randn(3, 6)), device="cpu")
    assert all("where(" in a for a in mlp.activations[:2]), mlp.activations
    x = torch.randn(50, 6)
    with torch.no_grad():
        want = model(x).numpy()
    assert np.max(np.abs(mlp(x.numpy()) - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


def test_torch_onnx_export_reads_back():
    """torch.onnx.export's graph of a classifier (Flatten, GELU, LayerNorm, SiLU, LogSoftmax) gives torch's outputs."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.SiLU(),
                          nn.Linear(32, 5), nn.LogSoftmax(-1)).eval()
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, torch.randn(3, 1, 4, 4)), device="cpu")
    assert list(mlp.activations) == ["gelu(x)", "silu(x)", "none(x)"] and mlp._flatten_input == 1
    x = torch.randn(7, 1, 4, 4)
    with torch.no_grad():
        want = model(x).numpy()
    assert np.max(np.abs(mlp(x.numpy()) - want)) <= 1e-5

    class Skip(nn.Module):  # a residual block and NeRF's concat
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(24, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = h + torch.tanh(self.b(h))
            return self.c(torch.cat([h, x], -1))

    skip = Skip().eval()
    mlp = fusedmlp.from_onnx(torch_exported(torch, skip, torch.randn(3, 8)), device="cpu")
    assert mlp._residual[1] is not None and mlp._concat[2] == 1
    x = torch.randn(11, 8)
    with torch.no_grad():
        assert np.max(np.abs(mlp(x.numpy()) - skip(x).numpy())) <= 1e-5


def test_weight_computations_on_initializers_are_evaluated_while_reading(rng):
    """Ops on constants only are evaluated while reading: torch.onnx.export writes a weight_norm Linear's weight as
    g * v / ReduceL2(v) of its initializers (opset 20: axes as an input), and a hand-written graph computes a weight
    from its transpose, a mean, Sqrt and Unsqueeze; each gives the reference's outputs."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)),
                          nn.ReLU(), nn.Linear(16, 3)).eval()
    data = torch_exported(torch, model, torch.randn(3, 5))
    assert "ReduceL2" in {n.op_type for n in onnx.load_from_string(data).graph.node}
    mlp = fusedmlp.from_onnx(data, device="cpu")
    x = torch.randn(20, 5)
    with torch.no_grad():
        ref = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - ref) / np.linalg.norm(ref) <= 1e-6

    inits = dict(Wt=rng.standard_normal((6, 8)), s=rng.uniform(0.5, 2, 8), axes=np.array([0], np.int64),
                 W2=rng.standard_normal((8, 2)))
    nodes = [helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]),  # (8, 6)
             helper.make_node("ReduceMean", ["W", "axes"], ["m"], keepdims=1),  # (1, 6)
             helper.make_node("Sub", ["W", "m"], ["c"]), helper.make_node("Sqrt", ["s"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "one"], ["r2"]), helper.make_node("Mul", ["c", "r2"], ["Wc"]),
             helper.make_node("Gemm", ["x", "Wc"], ["z"], transB=1), helper.make_node("Relu", ["z"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["y"])]
    inits["one"] = np.array([1], np.int64)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
                              [numpy_helper.from_array(np.asarray(v, np.float32 if v.dtype.kind == "f" else v.dtype), k)
                               for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    check_against_onnxruntime(model, rng.standard_normal((30, 6)).astype(np.float32))


def test_a_closing_squeeze_of_a_one_column_output_reads_as_the_output(rng):
    """A value head's y.squeeze(-1) as torch.onnx.export writes it (Squeeze of the last axis, the graph's output):
    the model gives the column, (rows, 1), with onnxruntime's values; a Squeeze of a wider output is named."""
    w1, w2 = rng.standard_normal((4, 16)), rng.standard_normal((16, 1)) / 4
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["v"]), helper.make_node("Squeeze", ["v", "axes"], ["y"])]
    inits = {"W1": w1, "W2": w2}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
                              + [numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    x = rng.standard_normal((25, 4)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = fusedmlp.from_onnx(model, device="cpu")(x)
    assert want.shape == (25,) and got.shape == (25, 1)
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)
    inits["W2"] = rng.standard_normal((16, 3))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
                              + [numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    with pytest.raises(fusedmlp.ArgumentError, match="a Squeeze other than of the last axis of a one-column"):
        read_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))


def test_fourier_features_read_as_one_sine_layer(rng):
    """Concat(Sin(z), Cos(z)) (and Cos first) of a layer's output over the last axis, Fourier features: one sine layer
    of the rows twice, the cos copy's bias shifted by pi / 2; onnxruntime's outputs within float32's rounding."""
    inits = dict(B=rng.standard_normal((2, 16)) * 6, W=rng.standard_normal((32, 8)) / 4, b=rng.standard_normal(8))
    for order in (["s", "c"], ["c", "s"]):
        nodes = [helper.make_node("MatMul", ["x", "B"], ["z"]), helper.make_node("Sin", ["z"], ["s"]),
                 helper.make_node("Cos", ["z"], ["c"]), helper.make_node("Concat", order, ["f"], axis=-1),
                 helper.make_node("Gemm", ["f", "W", "b"], ["y"])]
        mlp = check_against_onnxruntime(graph_model(nodes, inits, [2], 8), rng.random((40, 2)).astype(np.float32),
                                        tol=2e-5)
        assert list(mlp.widths) == [2, 32, 8] and mlp.activations[0] == "sin(x)"


@pytest.mark.parametrize("options", [{}, {"include_input": False}, {"x_last": True}, {"per_feature": True},
                                     {"skip": True}], ids=lambda o: ",".join(o) or "nerf")
def test_torch_onnx_export_of_a_positional_encoding_reads_as_the_input_encoding(options):
    """NeRF's embedder in the exported forward, Concat(x, Sin(Mul(x, 2^k)), Cos(...), ...): FusedMLP's encoding=,
    a later Concat of it a concat of x, as from_torch reads the module; against torch in float64."""
    torch = pytest.importorskip("torch")
    from test_torch import _Encoded

    torch.manual_seed(21)
    model = _Encoded(**options).eval()
    x = torch.rand(100, 3) * 3 - 1.5
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, (x,)), device="cpu")
    assert mlp.in_features == 3 and list(mlp.widths[:2]) == [60 + 3 * options.get("include_input", True), 64]
    assert bool(mlp._concat and mlp._concat[1]) == options.get("skip", False)
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 2e-4 * np.linalg.norm(want)


def test_torch_onnx_export_of_nerf_pytorchs_nerf_splits_its_input():
    """nerf-pytorch's NeRF without view directions, exported: Split of the input into points and views, the points
    read by the first Gemm and joined again by the skip's Concat, each as x with zero weights for the view features
    (as from_torch reads the module); against torch in float64 (its view-direction branch: the test below)."""
    torch = pytest.importorskip("torch")
    from test_torch import _NerfPytorch

    torch.manual_seed(31)
    model = _NerfPytorch().eval()
    x = torch.randn(60, 90)
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, (x,)), device="cpu")
    assert mlp.in_features == 90 and mlp._concat[5] == 2
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)


def test_slices_of_the_input_read_as_x_with_zero_weights(rng):
    """Slice(x, 0, 4) into a Gemm and Slice(x, 4, 6) concatenated after its activation: x with zero weights for the
    other features; onnxruntime's outputs within float32's rounding."""
    inits = dict(W=rng.standard_normal((4, 8)), b=rng.standard_normal(8), V=rng.standard_normal((10, 3)),
                 s0=np.array([0]), e0=np.array([4]), s1=np.array([4]), e1=np.array([6]), ax=np.array([-1]))
    nodes = [helper.make_node("Slice", ["x", "s0", "e0", "ax"], ["p"]),
             helper.make_node("Slice", ["x", "s1", "e1", "ax"], ["q"]),
             helper.make_node("MatMul", ["p", "W"], ["z"]), helper.make_node("Add", ["z", "b"], ["zb"]),
             helper.make_node("Relu", ["zb"], ["h"]), helper.make_node("Concat", ["h", "q"], ["c"], axis=-1),
             helper.make_node("MatMul", ["c", "V"], ["y"])]
    ints = {k for k in inits if k[0] in "sea"}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
                              [numpy_helper.from_array(np.asarray(v, np.int64 if k in ints else np.float32), k)
                               for k, v in inits.items()])
    mlp = check_against_onnxruntime(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                    rng.standard_normal((30, 6)).astype(np.float32))
    assert list(mlp.widths) == [6, 8, 3] and mlp._concat[1] == 1


def test_a_per_feature_map_after_the_last_activation_is_a_diagonal_layer(rng):
    """Tanh(x W) * scale + shift with per-feature constants at the end (an RL actor's action scaling) folds into no
    layer: it is a layer of its own, diag(scale) and bias shift; onnxruntime's outputs within float32's rounding."""
    inits = dict(W=rng.standard_normal((5, 6)), s=rng.random(6) + 0.5, t=rng.standard_normal(6))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"]), helper.make_node("Tanh", ["z"], ["a"]),
             helper.make_node("Mul", ["a", "s"], ["m"]), helper.make_node("Add", ["m", "t"], ["y"])]
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [5], 6), rng.standard_normal((30, 5)).astype(np.float32))
    assert list(mlp.widths) == [5, 6, 6] and list(mlp.activations) == ["tanh(x)", "none(x)"]


def test_torch_onnx_export_of_norms_after_no_gemm_reads_back():
    """torch.onnx.export's graphs of SimBa (each LayerNorm of the residual stream, which the block's Add reads too), a
    post-norm block with a softmax after an activation, and a LayerNorm of the input: each such norm on an identity
    layer of its own (as fusedmlp.torch reads them), torch's outputs on inputs far from zero."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(3)

    class SimBa(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(9, 16), nn.Linear(16, 3)
            self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(3))
            self.ups = nn.ModuleList(nn.Linear(16, 64) for _ in range(2))
            self.downs = nn.ModuleList(nn.Linear(64, 16) for _ in range(2))

        def forward(self, x):
            h = self.inp(x)
            for norm, up, down in zip(self.norms, self.ups, self.downs):
                h = h + down(torch.relu(up(norm(h))))
            return self.out(self.norms[2](h))

    class Post(nn.Module):
        def __init__(self):
            super().__init__()
            self.i, self.h, self.n, self.o = nn.Linear(9, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 5)

        def forward(self, x):
            h = torch.relu(self.i(x))
            return torch.softmax(torch.tanh(self.o(self.n(h + torch.tanh(self.h(h))))), -1)

    models = [(SimBa(), [9, 16, 16, 64, 16, 16, 64, 16, 16, 3]), (Post(), [9, 32, 32, 32, 5, 5]),
              (nn.Sequential(nn.LayerNorm(9), nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 3)), [9, 9, 16, 3])]
    for model, widths in models:
        model.eval()
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
        mlp = fusedmlp.from_onnx(torch_exported(torch, model, torch.randn(3, 9)), device="cpu")
        assert list(mlp.widths) == widths
        x = torch.randn(40, 9) * 2 + 1
        with torch.no_grad():
            ref = model.double()(x.double()).numpy()
        assert np.linalg.norm(mlp(x.numpy()) - ref) / np.linalg.norm(ref) <= 1e-6


def test_what_is_not_read_is_named(rng, tmp_path):
    w = {"W1": rng.standard_normal((8, 8)), "W2": rng.standard_normal((8, 8)), "c": rng.standard_normal(8)}
    cases = [
        ([helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
          helper.make_node("MatMul", ["a", "W2"], ["h2"]), helper.make_node("Relu", ["h2"], ["a2"]),
          helper.make_node("Add", ["a2", "h"], ["y"])], r"Add\): operand h is neither the previous layer's output, a "
                                                       r"kept value"),
        ([helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("TopK", ["h", "k"], ["y", "i"])],
         r"TopK\): TopK is not read; supported: Gemm, MatMul"),
        ([helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=0)],
         r"Softmax\(dim=0\) does not run over the features"),
        ([helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Concat", ["h", "h"], ["y"], axis=1)],
         r"a Concat of \['h', 'h'\] \(axis 1\); fusedmlp reads a concat of the hidden state with the network input"),
    ]
    for nodes, match in cases:
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
                                  [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in w.items()] +
                                  [numpy_helper.from_array(np.array([2], np.int64), "k")])
        with pytest.raises(fusedmlp.ArgumentError, match=match):
            read_onnx(helper.make_model(graph))
    with pytest.raises(fusedmlp.ArgumentError, match=r"the graph has inputs \['x', 'x2'\]; fusedmlp reads several only "
                                                     r"as one Concat"):
        read_onnx(graph_model([helper.make_node("Add", ["x", "x2"], ["y"])], {}, [8], 8, inputs=("x", "x2")))
    with pytest.raises(fusedmlp.ArgumentError, match="an elementwise op on the input before the first Gemm"):
        read_onnx(graph_model([helper.make_node("Relu", ["x"], ["y"])], {}, [8], 8))
    with pytest.raises(fusedmlp.ShapeError, match="holds no Gemm or MatMul"):
        read_onnx(graph_model([helper.make_node("Identity", ["x"], ["y"])], {}, [8], 8))
    with pytest.raises(fusedmlp.ArgumentError, match="give an onnx.ModelProto, its serialized bytes or a path"):
        read_onnx(42)
    path = tmp_path / "m.onnx"
    onnx.save(graph_model([helper.make_node("MatMul", ["x", "W1"], ["y"])], {"W1": w["W1"]}, [8], 8), str(path))
    assert read_onnx(path)[0][0].shape == (8, 8)


def test_an_8bit_model_from_onnx_is_calibrated(rng):
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["z"], transB=1), helper.make_node("Relu", ["z"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], transB=1)]
    inits = {"W1": rng.standard_normal((32, 8)) / 2, "b1": rng.standard_normal(32), "W2": rng.standard_normal((4, 32)),
             "b2": rng.standard_normal(4)}
    x = rng.standard_normal((256, 8)).astype(np.float32)
    mlp = fusedmlp.from_onnx(graph_model(nodes, inits, [8], 4), device="cpu", dtype="int8", calibrate=x)
    assert mlp.act_scales is not None and mlp.calibration_error < fusedmlp.CHECK_TOLERANCES["int8"]


def test_torch_dynamo_export_reads_back():
    """torch.onnx.export's default exporter (torch.export, onnxscript) on an RL actor written with an in-graph
    observation normalization, a residual block and a scaled tanh output: the same network from_torch reads."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    nn = torch.nn

    class Actor(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("obs_mean", torch.randn(11))
            self.register_buffer("obs_std", torch.rand(11) + 0.5)
            self.l1, self.l2, self.l3 = nn.Linear(11, 32), nn.Linear(32, 32), nn.Linear(32, 3)

        def forward(self, obs):
            x = (obs - self.obs_mean) / self.obs_std
            h = torch.relu(self.l1(x))
            h = h + torch.tanh(self.l2(h))
            return 2.5 * torch.tanh(self.l3(h))

    torch.manual_seed(1)
    actor = Actor().eval()
    program = torch.onnx.export(actor, (torch.randn(3, 11),), dynamo=True, verbose=False,
                                dynamic_shapes=({0: torch.export.Dim("n")},))
    mlp = fusedmlp.from_onnx(program.model_proto, device="cpu")
    assert mlp._residual[1] is not None and list(mlp.activations)[2] == "(tanh(x) * 2.5)"
    x = torch.randn(25, 11)
    with torch.no_grad():
        want = actor(x).numpy()
    assert np.max(np.abs(mlp(x.numpy()) - want)) <= 1e-5
    assert np.max(np.abs(fusedmlp.from_torch(actor, device="cpu")(x.numpy()) - want)) <= 1e-5


def test_a_number_between_a_layer_and_its_norm_folds(rng):
    inits = {"W1": rng.standard_normal((8, 16)) / 3, "three": 3.0, "W2": rng.standard_normal((16, 4)) / 3,
             "s": rng.uniform(0.5, 1.5, 16)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["z"]), helper.make_node("Mul", ["z", "three"], ["z3"]),
             helper.make_node("LayerNormalization", ["z3", "s"], ["n"]), helper.make_node("Relu", ["n"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["y"])]
    mlp = check_against_onnxruntime(graph_model(nodes, inits, [8], 4), rng.standard_normal((9, 8)).astype(np.float32))
    assert "0: layernorm" in repr(mlp)


def test_a_critic_of_two_inputs_joined_by_a_concat(rng):
    """obs normalized by its own constants and act scaled by a number, joined by a Concat: the model of the joined
    input, the maps folded into the first layer (onnxruntime takes the two inputs; fusedmlp their concatenation)."""
    inits = {"m": rng.standard_normal(6), "sd": rng.uniform(0.5, 2, 6), "half": 0.5,
             "W1": rng.standard_normal((32, 9)) / 3, "b1": rng.standard_normal(32), "W2": rng.standard_normal((1, 32))}
    nodes = [helper.make_node("Sub", ["obs", "m"], ["c"]), helper.make_node("Div", ["c", "sd"], ["o"]),
             helper.make_node("Mul", ["act", "half"], ["a"]), helper.make_node("Concat", ["o", "a"], ["j"], axis=-1),
             helper.make_node("Gemm", ["j", "W1", "b1"], ["z"], transB=1), helper.make_node("Relu", ["z"], ["h"]),
             helper.make_node("Gemm", ["h", "W2"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "critic", [helper.make_tensor_value_info("obs", TensorProto.FLOAT, [None, 6]),
                          helper.make_tensor_value_info("act", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    obs, act = rng.standard_normal((15, 6)).astype(np.float32), rng.standard_normal((15, 3)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"obs": obs, "act": act})[0]
    mlp = fusedmlp.from_onnx(model, device="cpu")
    assert np.max(np.abs(mlp(np.concatenate([obs, act], 1)) - want)) <= 1e-5


@pytest.mark.parametrize("kind", ["heads:slices", "heads:slices_reordered", "heads:tuple", "heads:cat_reordered",
                                  "heads:cat", "split:chunk", "split:split", "split:tuple", "split:dict"])
def test_torch_onnx_export_of_heads_and_output_parts(kind):
    """Heads with activations of their own, slices / Split / chunk (Shape, Gather and arithmetic on the width) /
    Gather of the output's columns, their Concat or several graph outputs: the last layer's rows and column pieces,
    the outputs side by side in the graph's order (an indexed column as one); against torch in float64."""
    torch = pytest.importorskip("torch")
    from test_torch import _Heads, _SplitHead

    family, name = kind.split(":")
    torch.manual_seed(49)
    model = (_Heads if family == "heads" else _SplitHead)(name).eval()
    x = torch.randn(60, 6)
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, (x,)), device="cpu")
    assert "|" in mlp.activations[-1], mlp.activations
    with torch.no_grad():
        want = model.double()(x.double())
    parts = list(want.values()) if isinstance(want, dict) else list(want) if isinstance(want, tuple) else [want]
    want = torch.cat([p if p.ndim == 2 else p[:, None] for p in parts], -1).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)



def exported_by(exporter, torch, model, x):
    """model's ONNX graph as torch's TorchScript exporter writes it for x, or its dynamo exporter (a dynamic batch)."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
        return torch.onnx.export(model, (torch.randn(3, x.shape[1]),), dynamo=True, verbose=False,
                                 dynamic_shapes=({0: torch.export.Dim("n")},)).model_proto
    return torch_exported(torch, model, (x,))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("form", ["mean", "functions", "halved_softmax"])
def test_torch_onnx_export_of_a_dueling_head_folds_into_the_last_layer(form, exporter):
    """A dueling Q-network's v + a - ReduceMean(a) over two Gemm heads, as either exporter writes it: rows of the
    last layer that are the linear combination of the heads' rows, against torch in float64; the heads' own rows go
    unused. A Softmax of it (halved first) is then that layer's softmax norm."""
    torch = pytest.importorskip("torch")
    from test_torch import _Dueling

    torch.manual_seed(50)
    model = _Dueling(form).eval()
    x = torch.randn(60, 8)
    mlp = fusedmlp.from_onnx(exported_by(exporter, torch, model, x), device="cpu")
    assert list(mlp.widths) == [8, 64, 64, 6]
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)


@pytest.mark.parametrize("which", ["nerf_pl", "nerf_pytorch"])
def test_torch_onnx_export_of_a_nerf_with_its_view_branch(which):
    """nerf_pl's and nerf-pytorch's NeRF with view directions, exported: the density head rides along the view layer
    as relu(v), relu(-v) rows and leaves the last layer as one row without its activation (a piece); the feature
    layer merges into the view layer (90-256x8-130-4, as from_torch reads them); against torch in float64."""
    torch = pytest.importorskip("torch")
    from test_torch import _NerfPl, _NerfPytorch

    torch.manual_seed(55)
    model = (_NerfPl() if which == "nerf_pl" else _NerfPytorch(use_viewdirs=True)).eval()
    x = torch.randn(60, 90)
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, (x,)), device="cpu")
    assert list(mlp.widths) == [90] + [256] * 8 + [130, 4], mlp
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)
    assert np.linalg.norm(mlp(x.numpy())[:, 3] - want[:, 3]) <= 1e-6 * np.linalg.norm(want[:, 3])


def test_matmul_heads_per_column_constants_and_several_outputs(rng):
    """A MatMul head whose Add of a constant vector is its bias (folded into its rows), a per-column constant on an
    activated head (each column's own expression), Gather of listed columns, and three graph outputs (one column
    indexed away): the outputs side by side against onnxruntime's; a Gather of the batch size from a Shape is named."""
    inits = dict(W=rng.standard_normal((5, 16)), b=rng.standard_normal(16), P=rng.standard_normal((16, 3)),
                 V=rng.standard_normal((16, 4)), c=rng.standard_normal(4), k=np.array([0.5, 2.0, -1.0]))
    ints = dict(g2=np.array([3, 0]), g0=np.array(1))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"]), helper.make_node("Add", ["z", "b"], ["zb"]),
             helper.make_node("Relu", ["zb"], ["h"]),
             helper.make_node("MatMul", ["h", "P"], ["p"]), helper.make_node("Tanh", ["p"], ["pt"]),
             helper.make_node("Mul", ["pt", "k"], ["y"]),
             helper.make_node("MatMul", ["h", "V"], ["v"]), helper.make_node("Add", ["v", "c"], ["vb"]),
             helper.make_node("Gather", ["vb", "g2"], ["two"], axis=-1),
             helper.make_node("Sigmoid", ["vb"], ["vs"]), helper.make_node("Gather", ["vs", "g0"], ["one"], axis=1)]
    graph = helper.make_graph(
        nodes, "heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3]),
         helper.make_tensor_value_info("two", TensorProto.FLOAT, [None, 2]),
         helper.make_tensor_value_info("one", TensorProto.FLOAT, [None])],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits.items()] +
        [numpy_helper.from_array(np.asarray(v, np.int64), n) for n, v in ints.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    want = np.concatenate([o.reshape(40, -1) for o in ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": x})], -1)
    mlp = fusedmlp.from_onnx(model, device="cpu")
    assert mlp.widths[-1] == 6 and mlp.activations[-1].count("|") == 4, mlp.activations  # 3 scaled tanh's, x, sigmoid
    assert np.max(np.abs(mlp(x) - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    nodes[-1] = helper.make_node("Shape", ["vs"], ["s"])
    nodes.append(helper.make_node("Gather", ["s", "rows"], ["n"], axis=0))
    inits = list(graph.initializer) + [numpy_helper.from_array(np.array(0, np.int64), "rows")]
    with pytest.raises(fusedmlp.ArgumentError, match="reads the number of rows from a Shape"):
        read_onnx(helper.make_model(helper.make_graph(nodes, "g", graph.input, graph.output[:1], inits),
                                    opset_imports=[helper.make_opsetid("", 20)]))


@pytest.mark.parametrize("which", ["td3", "ac", "heads"])
def test_torch_onnx_export_of_parallel_stacks_reads_as_one_chain(which):
    """Parallel stacks of layers on one value, exported (TD3's twin critics on two inputs joined by a Concat, an actor
    and a critic of their own, two-layer heads on a trunk, one weight_norm'd and joined by a Concat): one chain of
    block-diagonal Gemms, as from_torch reads the module, giving onnxruntime's outputs side by side."""
    torch = pytest.importorskip("torch")
    from test_torch import _Stacks, _TD3Critic

    torch.manual_seed(49)
    model = (_TD3Critic() if which == "td3" else _Stacks(which)).eval()
    names = ["state", "action"] if which == "td3" else ["x"]
    args = (torch.randn(2, 11), torch.randn(2, 3)) if which == "td3" else (torch.randn(2, 17 if which == "ac" else 9),)
    buf = io.BytesIO()
    try:
        torch.onnx.export(model, args, buf, dynamo=False, input_names=names, dynamic_axes={n: {0: "n"} for n in names})
    except Exception as e:
        pytest.skip(f"torch.onnx.export failed: {e}")
    mlp = fusedmlp.from_onnx(buf.getvalue(), device="cpu")
    assert list(mlp.widths) == list(fusedmlp.from_torch(model, device="cpu").widths)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((60, a.shape[1])).astype(np.float32) for a in args]
    want = np.concatenate(ort.InferenceSession(buf.getvalue()).run(None, dict(zip(names, xs))), -1)
    assert np.max(np.abs(mlp(np.concatenate(xs, -1)) - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


def test_parallel_onnx_stacks_whose_activations_differ():
    """Two stacks of two Gemms on the input, Relu between one's and Tanh between the other's: an error naming them."""
    rng = np.random.default_rng(3)
    consts = {f"W{i}": rng.standard_normal((8, 8)) for i in range(4)}
    nodes = [helper.make_node("Gemm", ["x", "W0"], ["a"]), helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Gemm", ["ar", "W1"], ["y"]), helper.make_node("Gemm", ["x", "W2"], ["b"]),
             helper.make_node("Tanh", ["b"], ["bt"]), helper.make_node("Gemm", ["bt", "W3"], ["y2"])]
    model = graph_model(nodes, consts, [8], 8)
    model.graph.output.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [None, 8]))
    with pytest.raises(fusedmlp.ArgumentError, match="layer 0 activations differ"):
        fusedmlp.from_onnx(model, device="cpu")


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("mean", [False, True])
def test_torch_onnx_export_of_an_ensembles_stack_reads_its_members_side_by_side(dim, mean):
    """An ensemble's torch.stack(members, dim) exported (each member's output Unsqueezed, one Concat): the members as
    one block-diagonal chain, its output their outputs side by side, as onnxruntime's stack gives them; with the
    stack's mean over the members (a ReduceMean of that axis), one last layer of their rows averaged."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Ensemble(nn.Module):
        def __init__(self):
            super().__init__()
            self.members = nn.ModuleList(nn.Sequential(nn.Linear(6, 24), nn.SiLU(), nn.Linear(24, 3))
                                         for _ in range(4))

        def forward(self, x):
            y = torch.stack([m(x) for m in self.members], dim)
            return y.mean(dim) if mean else y

    torch.manual_seed(52)
    data = torch_exported(torch, Ensemble().eval(), (torch.randn(2, 6),))
    x = np.random.default_rng(1).standard_normal((9, 6)).astype(np.float32)
    want = ort.InferenceSession(data).run(None, {"x": x})[0]
    mlp = fusedmlp.from_onnx(data, device="cpu")
    assert list(mlp.widths) == [6, 96, 3 if mean else 12]
    side = want if mean else np.concatenate(list(np.moveaxis(want, dim, 0)), -1)
    assert np.max(np.abs(mlp(x) - side)) <= 1e-5 * max(1.0, float(np.max(np.abs(side))))


def test_a_softmax_of_a_slice_of_the_output_is_the_last_layers_norm_and_beside_another_output_named():
    """softmax(y[..., :4]) as the graph's one output: the slice's rows, then the layer's softmax norm (against torch
    in float64); softmax(y[..., :4]) returned beside y[..., 4:] (an actor-critic sharing its last layer) is a
    softmax over some of the layer's columns, which no norm fuses: an error naming the output."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Shared(nn.Module):
        def __init__(self, both):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))
            self.both = both

        def forward(self, x):
            y = self.body(x)
            pi = torch.softmax(y[..., :4], -1)
            return (pi, y[..., 4:]) if self.both else pi

    torch.manual_seed(60)
    x = torch.randn(40, 6)
    model = Shared(False).eval()
    mlp = fusedmlp.from_onnx(torch_exported(torch, model, (x,)), device="cpu")
    assert list(mlp.widths) == [6, 32, 4]
    with torch.no_grad():
        want = model.double()(x.double()).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)
    with pytest.raises(fusedmlp.ArgumentError, match="is a softmax of some of the last layer's columns beside"):
        fusedmlp.from_onnx(torch_exported(torch, Shared(True).eval(), (x,)), device="cpu")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("form", ["mean", "halved_softmax", "tuple"])
def test_dueling_streams_of_two_layers_merge_and_fold_through_onnx(form, exporter):
    """Wang et al.'s dueling network with two-layer value and advantage streams, exported: the streams merge as
    parallel stacks, and their ends' Add / Sub / ReduceMean become rows of the merged last layer (the tail's linear
    combination; with a Softmax its norm; returned beside the value stream, both outputs side by side), against
    torch in float64; a ReduceMax there is named."""
    torch = pytest.importorskip("torch")
    from test_torch import _DuelingStreams

    torch.manual_seed(61)
    model = _DuelingStreams(form).eval()
    x = torch.randn(50, 8)
    mlp = fusedmlp.from_onnx(exported_by(exporter, torch, model, x), device="cpu")
    assert list(mlp.widths) == [8, 64, 64, 7 if form == "tuple" else 6]
    with torch.no_grad():
        want = model.double()(x.double())
    want = (torch.cat(want, -1) if isinstance(want, tuple) else want).numpy()
    assert np.linalg.norm(mlp(x.numpy()) - want) <= 1e-6 * np.linalg.norm(want)
    if exporter == "torchscript" and form == "mean":
        with pytest.raises(fusedmlp.ArgumentError, match="ReduceMax.*reads the end of one of the parallel stacks"):
            fusedmlp.from_onnx(torch_exported(torch, _DuelingStreams("max").eval(), (x,)), device="cpu")
