"""Reads an ONNX MLP into a FusedMLP: ``fusedmlp.from_onnx("model.onnx")`` (the optional extra ``fusedmlp[onnx]``).

The graph is walked in its (topological) order as a chain, as fusedmlp.torch walks a traced module:

- ``Gemm`` (``transA`` 0; any ``transB``, ``alpha``, ``beta``) and ``MatMul`` with a constant weight start a layer; an
  ``Add`` of a constant vector right after one is its bias.
- ``BatchNormalization`` (inference), and an ``Add`` / ``Sub`` / ``Mul`` / ``Div`` of a constant vector (one value
  per feature; any constant on the input, as an in-graph ``(x - mean) / std``), fold into the Linear before or after
  it; ``LayerNormalization`` and
  ``RMSNormalization`` over the last axis right after a Linear are its fused norm, and so are ``Softmax`` and
  ``LogSoftmax`` over the last axis.
- Elementwise nodes between layers make the layer's activation: each one's expression over the layer's output ``x``
  is built from its inputs' (``Relu``, ``Sigmoid``, ``Tanh``, ``Gelu``, ``Erf``, ``Exp``, ... and ``Add`` / ``Sub`` /
  ``Mul`` / ``Div`` / ``Pow`` with scalar constants or with each other), so that the forms exporters write for SiLU
  (``x * Sigmoid(x)``), GELU (``x * 0.5 * (1 + Erf(x / sqrt 2))``) or Mish read as one fused activation.
- An ``Add`` or ``Mul`` of the chain's value with the network input or a layer's output is the layer's residual (the
  elementwise nodes after it its ``then``); a ``Concat`` of the hidden state with the network input right before a
  layer is its input concat (NeRF's skip); a ``Concat`` of ``Sin(z)`` and ``Cos(z)`` of a layer's output (Fourier
  features) is that layer's rows twice with Sin its activation, the cos copy's bias shifted by pi / 2; a ``Concat``
  of the input itself and ``Sin`` / ``Cos`` of ``Mul(x, c)`` before the first layer (NeRF's positional encoding) is a
  FusedMLP's encoding= (Layers.input_encoding: computed in the kernel as x loads); a later Concat of it NeRF's skip.
- ``Split`` / ``Slice`` of the input over its last axis (nerf-pytorch's points and view directions): a slice read by
  the first layer or an input ``Concat`` is x itself, the layer's columns for the other features zero.
- Several graph inputs (a critic's obs and act) joined by one ``Concat`` before the first layer, each through its own
  constant affine map if any: the model takes their concatenation in that order.
- ``Flatten`` (or a ``Reshape`` to ``[0, -1]`` / ``[-1, K]``) of the input before the first layer is flatten_input;
  ``Identity``, ``Dropout`` and float ``Cast`` nodes pass their input on (their readers read the value they rename);
  a closing ``Squeeze`` of the last axis of a one-column output (a value head) is the output, which the model gives
  as (rows, 1).
- Past the last layer (_onnx_outputs): heads (a Gemm / MatMul on the value the last one read), ``Slice`` / ``Split``
  / ``Gather`` of the output's columns (a ``Shape``'s width, which exporters use for chunk sizes, is a constant),
  their ``Concat`` and elementwise nodes, and several graph outputs: side by side in the model's output, the last
  layer's rows theirs and their activations its column pieces; a layer reading one head (and x: NeRF's view
  branch) with the others carried along as rows of the layers after it.
- Nodes whose inputs are all constants (an exporter's weight computations: ``weight_norm``'s ``g * v / ReduceL2(v)``)
  are evaluated while reading, in float64: arithmetic, ``Sqrt``, ``Abs``, ``Reciprocal``, ``MatMul``, ``Transpose``,
  ``Reshape``, ``Unsqueeze``, ``Squeeze``, ``ReduceL2`` / ``ReduceSum`` / ``ReduceMean``.

Anything else (a per-feature map no Linear takes, a second input used otherwise, a convolution, ...) is an error naming
the node, its op and what is read.
"""

import functools
import os
import re

import numpy as np

from ._api import FusedMLP
from ._onnx_outputs import Outputs
from ._onnx_norms import fold_norms
from ._onnx_stacks import gemm_operands, merge_stacks
from ._layers import (MODEL_FORM, Layers, affine_map, compose, graph_edges, shrink_text, slices_width, step_text,
                      then_map, threshold_text, widen_columns)
from .errors import ArgumentError, ShapeError

SUPPORTED = ("Gemm, MatMul (+ Add of a bias), BatchNormalization and Add / Sub / Mul / Div of a constant vector "
             "(folded into a Linear), LayerNormalization, RMSNormalization (either written out node by node too), "
             "Softmax, "
             "LogSoftmax (over the last axis), elementwise activations (Relu, LeakyRelu, PRelu with one slope, Elu, "
             "Celu, Selu, Sigmoid, HardSigmoid, HardSwish, Swish, Tanh, Softplus, Softsign, Mish, Gelu, "
             "ThresholdedRelu, Shrink, Erf, Exp, Log, Sqrt, Abs, Sign, Neg, Reciprocal, Floor, Ceil, Sin, Cos, Tan, "
             "Asin, Acos, Atan, Sinh, Cosh, Clip, Greater / Less / Equal (and their OrEqual forms), Not / And / Or / "
             "Xor of those, Where, and Add / Sub / Mul / Div / Pow of them with scalars or each "
             "other), residual Add / Mul with the input or a layer's output, Concat of the hidden state with the input, "
             "Flatten / Reshape of the input, Identity, Dropout, Cast to float")

# Elementwise ops of one input: ONNX op -> expression over "{a}" (attributes filled in by _unary).
_UNARY = {"Relu": "relu({a})", "Sigmoid": "sigmoid({a})", "Tanh": "tanh({a})", "Exp": "exp({a})", "Log": "log({a})",
          "Sqrt": "sqrt({a})", "Abs": "abs({a})", "Erf": "erf({a})", "Sin": "sin({a})", "Cos": "cos({a})",
          "Softplus": "softplus({a})", "Softsign": "softsign({a})", "HardSwish": "hardswish({a})",
          "Mish": "({a}) * tanh(softplus({a}))", "Neg": "(-({a}))", "Reciprocal": "(1 / ({a}))",
          "Floor": "floor({a})", "Ceil": "ceil({a})", "Tan": "tan({a})", "Asin": "asin({a})", "Acos": "acos({a})",
          "Atan": "atan({a})", "Sinh": "sinh({a})", "Cosh": "cosh({a})",
          "Sign": f"({step_text('{a}')} - {step_text('-({a})')})"}  # (NaN stays NaN, as ONNX's Sign)
# Elementwise ops with attributes (_Reader.unary), as expressions over x, then over {a}.
_WITH_ATTRS = ("LeakyRelu", "Elu", "Celu", "Selu", "HardSigmoid", "Gelu", "ThresholdedRelu", "Shrink", "Swish")
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Pow": "^"}
_PASS = ("Identity", "Dropout", "Cast")
# Comparisons (1 or 0; 0 for NaN operands, as ONNX's) and logic on their results, which exporters write with Where for
# thresholds (torch's dynamo exporter: Softplus's threshold, Threshold, Hardshrink, Softshrink): expression functions
# over the 0 / 1 values (csrc/expr_internal.h).
_COMPARE = {"Greater": "gt", "GreaterOrEqual": "ge", "Less": "lt", "LessOrEqual": "le", "Equal": "eq"}
_LOGIC = {"Not": "(1 - ({a}))", "And": "min({a}, {b})", "Or": "max({a}, {b})", "Xor": "abs(({a}) - ({b}))"}
_BOOL = 9  # ONNX's BOOL element type: a Cast to it passes a comparison's or logic op's 0 / 1 through


def _axes(attrs, axes):
    """An op's axes as a tuple: its axes input (opset >= 13 / 18), else its attribute; None where it has neither."""
    axes = attrs.get("axes") if axes is None else axes
    return None if axes is None else tuple(int(i) for i in np.atleast_1d(axes))


def _reduce(f):
    """An ONNX Reduce* op over NumPy: axes (_axes), keepdims (default 1); no axes: all of them, unless
    noop_with_empty_axes."""
    def run(attrs, a, axes=None):
        axes = _axes(attrs, axes)
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return a
            axes = tuple(range(a.ndim))
        return f(a, axes, bool(attrs.get("keepdims", 1)))
    return run


def _int_div(a, b):
    """ONNX's Div of integers: the quotient truncated toward zero (an exporter's chunk sizes, (n + k - 1) / k)."""
    return np.trunc(np.true_divide(a, b)).astype(np.result_type(a, b))


# Ops on constants only, evaluated while reading (an exporter's weight computations: weight_norm's
# g * v / ||v|| as ReduceL2, Div, Mul of initializers), in float64: (attributes, *input arrays) -> output array.
_FOLD = {
    "Add": lambda attrs, a, b: a + b, "Sub": lambda attrs, a, b: a - b, "Mul": lambda attrs, a, b: a * b,
    "Div": lambda attrs, a, b: _int_div(a, b) if a.dtype.kind in "iu" and b.dtype.kind in "iu" else a / b, "Pow": lambda attrs, a, b: np.power(a, b), "Neg": lambda attrs, a: -a,
    "Sqrt": lambda attrs, a: np.sqrt(a), "Reciprocal": lambda attrs, a: 1 / a, "Abs": lambda attrs, a: np.abs(a),
    "MatMul": lambda attrs, a, b: a @ b,
    "Transpose": lambda attrs, a: np.transpose(a, attrs.get("perm")),
    "Reshape": lambda attrs, a, shape: a.reshape([a.shape[i] if d == 0 else int(d) for i, d in enumerate(shape)]),
    "Unsqueeze": lambda attrs, a, axes=None: np.expand_dims(a, _axes(attrs, axes)),
    "Squeeze": lambda attrs, a, axes=None: np.squeeze(a, _axes(attrs, axes)),
    "ReduceL2": _reduce(lambda a, axes, keep: np.sqrt(np.sum(a * a, axis=axes, keepdims=keep))),
    "ReduceSum": _reduce(lambda a, axes, keep: np.sum(a, axis=axes, keepdims=keep)),
    "ReduceMean": _reduce(lambda a, axes, keep: np.mean(a, axis=axes, keepdims=keep)),
    "Gather": lambda attrs, a, i: np.take(a, i, axis=attrs.get("axis", 0)),
}
_FLOAT_TYPES = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


#: Built-ins an activation read node by node is compared with (_canonical): exporters spell SiLU, GELU and Mish out in
#: elementary ops, and the built-ins have the kernels' fast forms.
_CANONICAL = ("relu", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh", "mish", "softplus", "softsign", "hardswish",
              "hardsigmoid", "elu", "selu")
_GRID = np.linspace(-12.0, 12.0, 4801)


def _canonical(text):
    """The built-in activation that equals expression `text` within float32 rounding on [-12, 12] (the same values
    to 1e-6 of their size), else text: x * Sigmoid(x) reads as silu, x * 0.5 * (1 + erf(x / 1.41421...)) as gelu."""
    values = _curve(text)
    for name in _CANONICAL:
        ref = _curve(name)
        if np.all(np.abs(values - ref) <= 1e-6 * np.maximum(1.0, np.abs(ref))):
            return name
    return text


@functools.lru_cache(maxsize=64)
def _curve(text):
    """Expression `text` on _GRID (the built-ins' curves are taken once, not once per layer read)."""
    from ._gpu import core

    return core().eval_expr(text, _GRID)


def _over(text, a):
    """An expression over x (threshold_text, shrink_text) with the operand a in place of x."""
    return "(" + re.sub(r"\bx\b", f"({a})", text) + ")"


def _num(v):
    """A number as expression text (negative ones in parentheses)."""
    text = repr(float(v))
    return f"({text})" if text.startswith("-") else text


def _load(model):
    import onnx

    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, onnx.ModelProto):
        return model
    raise ArgumentError(f"model is a {type(model).__name__}; give an onnx.ModelProto, its serialized bytes or a path")


class _Reader(Outputs):
    """One walk over a graph's nodes (read_onnx)."""

    def __init__(self, graph):
        from onnx import numpy_helper

        self.to_array = numpy_helper.to_array
        self.consts = {t.name: self.to_array(t) for t in graph.initializer}
        # An Identity / Dropout / Cast gives its input a new name (passthrough): the reader works on each value's first
        # name (node renames the inputs), and counts a value's readers under all its names (Gemm -> Identity ->
        # LayerNormalization with an Add reading the Gemm's output: the norm's value is read twice)
        self.alias = {n.output[0]: n.input[0] for n in graph.node if n.op_type in _PASS and n.input and n.output}
        self.producer = {n.output[0]: n.op_type for n in graph.node if n.output}
        self.uses = {}
        for n in graph.node:
            for i, name in enumerate(n.input):
                if not (i == 0 and n.op_type in _PASS):
                    root = self.root(name)
                    self.uses[root] = self.uses.get(root, 0) + 1
        inputs = [i.name for i in graph.input if i.name not in self.consts]
        if not inputs:
            raise ArgumentError("the graph has no input; fusedmlp models take one input tensor")
        self.x = self.cur = inputs[0]
        # several inputs (a critic's obs and act): read until one Concat joins them, each through its own constant
        # affine map (heads: each input's latest value -> its index; maps: its map), as fusedmlp.torch reads them
        self.inputs = inputs
        self.heads = {name: i for i, name in enumerate(inputs)} if len(inputs) > 1 else None
        self.maps = [None] * len(inputs)
        self.input_order = None
        self.output = self.root(graph.output[0].name)
        self.layers = Layers(lambda a: None if a is None else np.asarray(a, dtype=np.float64),
                             bn="per-feature affine map (a BatchNormalization, or an Add / Sub / Mul / Div of a "
                                "constant)")
        self.exprs = {}  # the activation being read: value -> expression over the layer's output x
        self.biased = False  # the last layer's Linear may still take an Add of a bias (right after it)
        self.value_of = {self.x: -1}  # values a residual may read: -1 the input, l layer l's output (once consumed)
        self.residual = []  # per layer None or [op, then, source], FusedMLP's residual=
        self.concat = {}  # layer -> 'after' | 'before', FusedMLP's concat=
        self.pending_cat = None  # a Concat of h and x waiting for its Gemm / MatMul
        self.graph_nodes = list(graph.node)
        self.encodings, self.encoding_parts = self.encoding_candidates(graph)
        self.x_width = None  # x's features where the graph splits it (Split with its sizes)
        self.x_slices = {}  # value -> (start, stop): a slice of the network input (Split outputs, Slice)
        self.cat_slice = None  # (start, stop) of a pending Concat's x part where it is a slice
        self.init_outputs(graph)  # heads, slices of the output and several outputs (_onnx_outputs)
        self.shapes = {}  # a Shape node's output -> the width of the 2-D value it reads (shape_query)

    def encoding_candidates(self, graph):
        """Positional encodings of the network input (NeRF's embedder in the exported forward): a Concat over the
        last axis of x itself and Sin / Cos of x or of Mul(x, c), each read by that Concat alone (a Mul by both of
        one frequency's Sin and Cos). -> ({Concat output: [(kind, c's name or None)]}, the names of those nodes'
        outputs), read at the Concat (encoding), as fusedmlp.torch reads them."""
        made = {n.output[0]: n for n in graph.node if n.output}
        readers = {}
        for n in graph.node:
            for name in n.input:
                readers.setdefault(self.root(name), set()).add(n.output[0] if n.output else "")
        found, inner = {}, set()
        for node in graph.node:
            if node.op_type != "Concat" or not node.output or not any(
                    a.name == "axis" and a.i in (-1, 1) for a in node.attribute):
                continue
            parts, names = [], set()
            for name in map(self.root, node.input):
                p = made.get(name)
                if name == self.x:
                    parts.append(("x", None))
                    continue
                if p is None or p.op_type not in ("Sin", "Cos") or readers.get(name) != {node.output[0]}:
                    break
                q = self.root(p.input[0])
                scale = None
                if q != self.x:
                    m = made.get(q)
                    if (m is None or m.op_type != "Mul" or self.x not in map(self.root, m.input)
                            or not readers.get(q, set()) <= set(map(self.root, node.input))):
                        break  # (a product may feed both a Sin and a Cos part)
                    scale = next(self.root(i) for i in m.input if self.root(i) != self.x)
                    names.add(q)
                names.add(name)
                parts.append((p.op_type.lower(), scale))
            else:
                if any(k != "x" for k, _ in parts):
                    found[node.output[0]] = parts
                    inner |= names
        return found, inner

    def encoding(self, node, label):
        """A positional encoding at its Concat (encoding_candidates): FusedMLP's encoding= (Layers.input_encoding),
        its value the network input as the layers see it (a later Concat of it, NeRF's skip, is a concat of x)."""
        name = node.output[0]
        if self.cur != self.x or self.layers.weights or self.layers.pending is not None or self.heads is not None:
            raise ArgumentError(f"{label}: a positional encoding (Sin / Cos of x in a Concat) of anything but the "
                                "network input itself, before any layer or constant map, is not read")
        parts = []
        for kind, c in self.encodings[name]:
            value = None if c is None else self.const(c)
            if c is not None and value is None:
                raise ArgumentError(f"{label}: a positional encoding's scale {c} is not a constant")
            parts.append((kind, value))
        self.layers.input_encoding(parts, label)
        self.cur = self.x = name
        self.value_of[name] = -1
        return True

    def const(self, name):
        return self.consts.get(name) if name else None

    def scalar(self, name):
        c = self.const(name)
        return None if c is None or c.size != 1 else float(c.reshape(()))

    def chain_input(self, node, label):
        """The node's first input, which must be the chain's value: the current one, or the activation read so far
        (which then becomes the layer's activation)."""
        if not node.input or node.input[0] not in ({self.cur} | set(self.exprs)):
            raise ArgumentError(f"{label}: its input is not the previous layer's output; supported: {SUPPORTED}")
        self.close(node.input[0], label)

    def close(self, value, label):
        """Ends the activation being read at `value` (the layer's activation is its expression)."""
        if self.exprs:
            if value not in self.exprs:
                raise ArgumentError(f"{label}: it reads {value}, not the activation read so far; supported: "
                                    f"{SUPPORTED}")
            text = self.exprs[value]
            if text != "x" and self.layers.weights and self.residual[-1] is not None:  # after the residual op
                res = self.residual[-1]
                res[1] = _canonical(text) if res[1] == "none" else compose(_canonical(text), res[1])
            elif text != "x":
                self.layers.activation(_canonical(text), label)
            self.exprs = {}
            self.cur = value
            self.biased = False

    def operand(self, name, label):
        """An elementwise node's input as expression text: a value of the activation, or a scalar constant."""
        if name in self.exprs:
            return self.exprs[name]
        if name == self.cur and self.layers.weights:
            self.exprs[name] = "x"  # the activation starts at the layer's output
            return "x"
        if name == self.cur:
            raise ArgumentError(f"{label}: an elementwise op on the input before the first Gemm or MatMul; fusedmlp "
                                "applies activations after a layer")
        value = self.scalar(name)
        if value is None:
            raise ArgumentError(f"{label}: operand {name} is neither the previous layer's output, a kept value (the "
                                "input, a layer's output) nor a scalar constant (a per-feature constant is not read "
                                f"from ONNX); supported: {SUPPORTED}")
        return _num(value)

    def unary(self, node, op, attrs, a):
        if op == "LeakyRelu":
            return f"leaky_relu({a}, {_num(attrs.get('alpha', 0.01))})"
        if op == "Elu":
            return f"elu({a}, {_num(attrs.get('alpha', 1.0))})"
        if op == "Celu":
            alpha = attrs.get("alpha", 1.0)
            return f"(max({a}, 0) + min(0, {_num(alpha)} * (exp(({a}) / {_num(alpha)}) - 1)))"
        if op == "Selu":
            alpha, gamma = attrs.get("alpha", 1.67326319217681884765625), attrs.get("gamma", 1.05070102214813232421875)
            return f"({_num(gamma)} * (max({a}, 0) + min(0, {_num(alpha)} * (exp({a}) - 1))))"
        if op == "HardSigmoid":
            alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
            return f"max(0, min(1, {_num(alpha)} * ({a}) + {_num(beta)}))"
        if op == "Gelu":
            return f"gelu_tanh({a})" if attrs.get("approximate", b"none") in (b"tanh", "tanh") else f"gelu({a})"
        if op == "ThresholdedRelu":  # x where x > alpha, else 0 (torch's Threshold(alpha, 0))
            return _over(threshold_text(attrs.get("alpha", 1.0), 0.0), a)
        if op == "Shrink":  # torch's Softshrink (bias = lambd) and Hardshrink (bias 0) export as this
            return _over(shrink_text(attrs.get("lambd", 0.5), attrs.get("bias", 0.0)), a)
        if op == "Swish":  # (opset 24) x sigmoid(alpha x)
            return f"(({a}) * sigmoid({_num(attrs.get('alpha', 1.0))} * ({a})))"
        return _UNARY[op].format(a=a)

    def affine(self, node, op, attrs, label):
        """An Add / Sub / Mul / Div of the chain's value and a constant vector (one value per feature; or any constant
        on the input before the first layer: an in-graph input normalization such as (x - mean) / std): a per-feature
        affine map, folded exactly into the Linear before or after it as a batch norm is (Layers.batchnorm); False
        where the node is no such op (a scalar on a layer's output is part of its activation)."""
        if op not in ("Add", "Sub", "Mul", "Div") or len(node.input) != 2:
            return False
        chain = {self.cur} | set(self.exprs)
        a, b = node.input
        if (a in chain) == (b in chain):
            return False
        value, c, c_first = (a, self.const(b), False) if a in chain else (b, self.const(a), True)
        if c is None or (c_first and op == "Div") or (c.size == 1 and self.layers.weights and not (
                self.layers.open and value == self.cur and self.uses.get(value) == 1)):
            return False  # a number on a layer's activation, or on a value used again (x * 0.5 * erf(x / 1.41)): part
            # of the activation's expression
        if c.size == 1 and self.layers.weights:  # a number right after a layer: folded, so a norm may follow
            c = np.full(self.layers.weights[-1].shape[0], float(c.reshape(())))
        s, t = affine_map(op.lower(), c, c_first, label)
        self.close(value, label)
        self.layers.batchnorm(s, t, label)
        self.cur = node.output[0]
        self.biased = False
        return True

    def residual_op(self, node, op, label):
        """An Add or Mul of the chain's value and a kept value (the network input, or a layer's output that a later
        layer read): the layer's residual; False where the node is no such op."""
        if op not in ("Add", "Mul") or len(node.input) != 2 or not self.layers.weights:
            return False
        chain = {self.cur} | set(self.exprs)
        a, b = node.input
        mine, other = (a, b) if a in chain and b in self.value_of and b not in chain else (
            (b, a) if b in chain and a in self.value_of and a not in chain else (None, None))
        if mine is None:
            return False
        if self.residual[-1] is not None:
            raise ArgumentError(f"{label}: a second residual op in the same layer is not supported")
        self.close(mine, label)
        self.layers.unfoldable(label, "a residual op")
        self.residual[-1] = ["add" if op == "Add" else "mul", "none", "input" if self.value_of[other] < 0 else
                             self.value_of[other]]
        self.layers.open = False
        self.cur = node.output[0]
        return True

    def elementwise(self, node, op, attrs, label):
        out = node.output[0]
        if self.residual_op(node, op, label):
            return True
        if op in _UNARY or op in _WITH_ATTRS:
            self.exprs[out] = self.unary(node, op, attrs, self.operand(node.input[0], label))
        elif op in _BINARY:
            a, b = (self.operand(name, label) for name in node.input[:2])
            self.exprs[out] = f"(({a}) {_BINARY[op]} ({b}))"
        elif op == "PRelu":
            slope = self.const(node.input[1])
            if slope is None or slope.size != 1:
                raise ArgumentError(f"{label}: PRelu with a slope per channel; fusedmlp reads one slope")
            self.exprs[out] = f"leaky_relu({self.operand(node.input[0], label)}, {_num(slope.reshape(()))})"
        elif op in _COMPARE or op in ("And", "Or", "Xor"):
            a, b = (self.operand(name, label) for name in node.input[:2])
            self.exprs[out] = f"{_COMPARE[op]}({a}, {b})" if op in _COMPARE else _LOGIC[op].format(a=a, b=b)
        elif op == "Not":
            self.exprs[out] = _LOGIC[op].format(a=self.operand(node.input[0], label))
        elif op == "Where":
            c, a, b = (self.operand(name, label) for name in node.input[:3])
            self.exprs[out] = f"where({c}, {a}, {b})"
        elif op == "Clip":
            lo, hi = self.scalar(node.input[1] if len(node.input) > 1 else ""), self.scalar(
                node.input[2] if len(node.input) > 2 else "")
            a = self.operand(node.input[0], label)
            a = a if lo is None else f"max({a}, {_num(lo)})"
            self.exprs[out] = a if hi is None else f"min({a}, {_num(hi)})"
        else:
            return False
        return True

    def before_join(self, node, op, label):
        """A node of a graph with several inputs before one Concat joins them: an input's own constant affine map, a
        rename, or that Concat (then the network input is the joined value and the maps fold into the first Linear);
        anything else is named."""
        heads = self.heads
        if op in ("Add", "Sub", "Mul", "Div") and len(node.input) == 2 and (node.input[0] in heads) != (
                node.input[1] in heads):
            head, other = (node.input[0], node.input[1]) if node.input[0] in heads else (node.input[1], node.input[0])
            c = self.const(other)
            c_first = head == node.input[1]
            if c is not None and not (c_first and op == "Div"):
                i = heads.pop(head)
                self.maps[i] = then_map(self.maps[i], *affine_map(op.lower(), c, c_first, label), label)
                heads[node.output[0]] = i
                return
        if op in _PASS and node.input and node.input[0] in heads:
            return  # (its readers name the head by its first name: node)
        if (op == "Concat" and sorted(heads.get(name, -1) for name in node.input) == list(range(len(self.inputs)))
                and self.const_attr(node, "axis") in (-1, 1)):
            self.input_order = [heads[name] for name in node.input]
            self.layers.set_input_parts([self.maps[i] for i in self.input_order])
            self.x = self.cur = node.output[0]
            self.value_of = {self.x: -1}
            self.heads = None
            return
        raise ArgumentError(f"{label}: the graph has inputs {self.inputs}; fusedmlp reads several only as one Concat "
                            "of all of them over the last axis before the first layer (each through its own constant "
                            "affine map, if any)")

    @staticmethod
    def const_attr(node, name):
        from onnx import helper

        return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)

    def node(self, node):
        """One node: to the first handler that takes it (a layer op, through chain_input, last)."""
        from onnx import helper

        op = node.op_type
        label = f"{node.name or node.output[0]} ({op})"
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Constant":
            self.consts[node.output[0]] = self.to_array(attrs["value"]) if "value" in attrs else np.asarray(
                next(iter(attrs.values())))
            return
        if any(name in self.alias for name in node.input):  # each input by its first name (passthrough)
            renamed = type(node)()
            renamed.CopyFrom(node)
            del renamed.input[:]
            renamed.input.extend(self.root(name) for name in node.input)
            node = renamed
        if self.shape_query(node, op, attrs, label):
            return
        args = [self.const(name) for name in node.input if name] if op in _FOLD else None
        if args and all(a is not None for a in args):
            args = [np.asarray(a, np.float64) if a.dtype.kind == "f" else a for a in args]
            try:
                self.consts[node.output[0]] = np.asarray(_FOLD[op](attrs, *args))
            except (ValueError, TypeError, IndexError) as e:
                raise ArgumentError(f"{label}: {op} of constants could not be evaluated: {e}") from None
            return
        if node.output and node.output[0] in self.encoding_parts:  # (read at their Concat: encoding)
            return
        if node.output and node.output[0] in self.encodings:
            self.encoding(node, label)
            return
        if self.heads is not None:
            self.before_join(node, op, label)
            return
        if self.tail is not None or self.starts_tail(node, op):
            self.tail_node(node, op, attrs, label)
            return
        if self.input_slice(node, op, attrs, label):
            return
        for handler in (self.passthrough, self.output_squeeze, self.bias_add, self.affine, self.elementwise,
                        self.input_reshape,
                        self.input_concat):
            if handler(node, op, attrs, label):
                return
        if self.pending_cat is not None and op not in ("Gemm", "MatMul"):
            raise ArgumentError(f"{label}: the Concat of the hidden state with the input must feed a Gemm or MatMul")
        first_slice = self.x_slices.get(node.input[0]) if node.input and op in ("Gemm", "MatMul") else None
        if first_slice is not None and self.cur == self.x and not self.layers.weights:
            renamed = type(node)()  # (the layer reads x itself: its columns for the other features zero)
            renamed.CopyFrom(node)
            renamed.input[0] = self.x
            node = renamed
        self.chain_input(node, label)
        self.layer_op(node, op, attrs, label, first_slice)
        self.cur = node.output[0]

    def shape_query(self, node, op, attrs, label):
        """A Shape of a value after the first layer, and a Gather of its last entry (what an exporter writes for
        y.chunk(2, -1)'s sizes): the value's width, a constant; the rows are not known while reading."""
        if op == "Shape" and node.input and self.layers.weights and not attrs:
            name = node.input[0]
            if name in ({self.cur} | set(self.exprs)):
                self.shapes[node.output[0]] = self.layers.weights[-1].shape[0]
            elif self.tail is not None and name in self.tail and not self.tail[name][1]:
                self.shapes[node.output[0]] = len(self.tail[name][0])
            else:
                return False
            return True
        if op != "Gather" or not node.input or node.input[0] not in self.shapes:
            return False
        idx = self.const(node.input[1])
        if idx is None or attrs.get("axis", 0) != 0 or not np.all(np.isin(idx, (1, -1))):
            raise ArgumentError(f"{label}: it reads the number of rows from a Shape; fusedmlp reads only a value's "
                                "width (its last dim) there")
        self.consts[node.output[0]] = np.full(idx.shape, self.shapes[node.input[0]], np.int64)
        return True

    def input_slice(self, node, op, attrs, label):
        """Split / Slice of the network input over its last axis before the first layer (nerf-pytorch's
        torch.split(x, [63, 27], -1)): slices read by a Gemm / MatMul or an input Concat as x itself, the layer's
        columns for the other features zero (layer_op), as fusedmlp.torch reads them."""
        if op not in ("Split", "Slice") or not node.input or node.input[0] != self.x or self.layers.weights:
            return False
        if op == "Split":
            sizes = self.const(node.input[1]) if len(node.input) > 1 and node.input[1] else attrs.get("split")
            if sizes is None or attrs.get("axis", 0) not in (-1, 1):
                raise ArgumentError(f"{label}: a Split of the input; fusedmlp reads one over the last axis with its "
                                    "sizes given")
            offsets = np.cumsum([0] + [int(v) for v in np.asarray(sizes).reshape(-1)]).tolist()
            self.x_width = offsets[-1]
            for i, name in enumerate(node.output):
                self.x_slices[name] = (offsets[i], offsets[i + 1])
            return True
        starts, ends, axes, steps = (self.const(node.input[i]) if len(node.input) > i and node.input[i] else None
                                     for i in range(1, 5))
        axes = [-1] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
        if (starts is None or ends is None or axes not in ([-1], [1]) or
                (steps is not None and int(np.asarray(steps).reshape(-1)[0]) != 1)):
            raise ArgumentError(f"{label}: a Slice of the input; fusedmlp reads one of the last axis, step 1, with "
                                "constant bounds")
        start, stop = int(np.asarray(starts).reshape(-1)[0]), int(np.asarray(ends).reshape(-1)[0])
        if start < 0 or stop < 0 or stop >= 2 ** 31:
            if self.x_width is None:
                raise ArgumentError(f"{label}: a Slice of the input from {start} to {stop} leaves x's width unknown; "
                                    "fusedmlp reads slices with both ends given, or a Split, which gives it")
            start, stop, _ = slice(start, min(stop, self.x_width)).indices(self.x_width)
        self.x_slices[node.output[0]] = (start, stop)
        return True

    def passthrough(self, node, op, attrs, label):
        """Identity, Dropout (inference) and a float Cast: their input under a new name, which the nodes reading it
        see as the first name (node: the reader works on each value's first name)."""
        if op not in _PASS:
            return False
        boolean = self.producer.get(self.root(node.input[0])) in (*_COMPARE, *_LOGIC) if node.input else False
        if op == "Cast" and attrs.get("to") not in _FLOAT_TYPES and not (attrs.get("to") == _BOOL and boolean):
            raise ArgumentError(f"{label}: a Cast to ONNX type {attrs.get('to')}; fusedmlp reads float values (and "
                                "comparisons' results as booleans)")
        if op == "Dropout" and len(node.input) > 2 and self.const(node.input[2]) is not None and bool(
                self.const(node.input[2])):
            raise ArgumentError(f"{label}: Dropout in training mode; fusedmlp runs inference")
        return True

    def bias_add(self, node, op, attrs, label):
        """An Add of a constant vector right after a MatMul / Gemm, the layer output's one reader: its bias. (Where
        other nodes read the output too, the Add is part of the activation: torch's TorchScript exporter writes
        Softshrink as Where(Greater(z, l), z - l, 0) + Where(Less(z, -l), z + l, 0), and z + l taken as a bias moved
        every reader's z.)"""
        if op != "Add" or not self.biased or self.cur not in node.input[:2] or self.uses.get(self.cur, 0) != 1:
            return False
        layers = self.layers
        other = node.input[1] if node.input[0] == self.cur else node.input[0]
        b = self.const(other)
        width = layers.weights[-1].shape[0]
        if b is None or b.size not in (1, width):
            return False
        layers.biases[-1] = (layers.biases[-1] if layers.biases[-1] is not None else 0.0) + np.broadcast_to(
            np.asarray(b, np.float64).reshape(-1), (width,))
        self.cur = node.output[0]
        return True

    def output_squeeze(self, node, op, attrs, label):
        """A Squeeze of the last axis of a one-column network output, the graph's output (a value head's
        y.squeeze(-1)): read as the output itself, which the model gives as (rows, 1)."""
        if op != "Squeeze" or not node.input or node.output[0] != self.output:
            return False
        axes = _axes(attrs, self.const(node.input[1]) if len(node.input) > 1 else None)
        width = self.layers.weights[-1].shape[0] if self.layers.weights else 0
        if node.input[0] not in ({self.cur} | set(self.exprs)) or width != 1 or axes not in ((-1,), (1,)):
            raise ArgumentError(f"{label}: a Squeeze other than of the last axis of a one-column network output; "
                                f"supported: {SUPPORTED}")
        self.chain_input(node, label)
        self.cur = self.output = node.output[0]
        self.output_form["squeeze"] = (-1,)
        return True

    def input_reshape(self, node, op, attrs, label):
        """A Flatten, or a Reshape to [0, -1] / [-1, K], of the network input before the first layer: flatten_input."""
        layers = self.layers
        if op not in ("Flatten", "Reshape") or layers.weights:
            return False
        if not node.input or node.input[0] != self.cur or self.cur != self.x:
            raise ArgumentError(f"{label}: a reshape that is not of the network input")
        if op == "Flatten":
            layers.flatten_input(int(attrs.get("axis", 1)), -1, label)
        else:
            shape = self.const(node.input[1])
            shape = None if shape is None else [int(v) for v in shape.reshape(-1)]
            if shape == [0, -1]:
                layers.flatten_input(1, -1, label)
            elif shape is not None and len(shape) == 2 and shape[0] == -1 and shape[1] > 0:
                layers.flatten_input(1, -1, label)
                layers.flatten_width = shape[1]
            else:
                raise ArgumentError(f"{label}: a Reshape of the input to {shape}; fusedmlp reads [0, -1] or [-1, K]")
        self.cur = self.x = node.output[0]
        self.value_of[self.x] = -1  # the network input as the kernel takes it (a residual from x reads it)
        return True

    def fourier(self, node, attrs):
        """A Concat of Sin(z) and Cos(z) (either order) of a layer's output z over the last axis, Fourier features:
        since cos z = sin(z + pi / 2), the layer's rows twice, the cos copy's bias shifted by pi / 2, and Sin its
        activation (as fusedmlp.torch reads them)."""
        layers, exprs = self.layers, self.exprs
        parts = list(node.input)
        if (len(parts) != 2 or attrs.get("axis") not in (-1, 1) or not all(p in exprs for p in parts)
                or sorted(exprs[p] for p in parts) != ["cos(x)", "sin(x)"] or not layers.weights
                or layers.acts[-1] != "none" or layers.norms[-1] is not None or self.residual[-1] is not None):
            return False
        layers.sine_pair([exprs[p] == "cos(x)" for p in parts])
        self.exprs = {node.output[0]: "sin(x)"}  # (the activation read so far, the layer's once the next reads it)
        self.biased = False
        return True

    def input_concat(self, node, op, attrs, label):
        """A Concat of the hidden state with the network input itself (NeRF's skip): the next layer's input concat."""
        if op != "Concat":
            return False
        if self.fourier(node, attrs):
            return True
        x_part = next((n for n in node.input if n == self.x or n in self.x_slices), None)
        if not (self.layers.weights and len(node.input) == 2 and x_part is not None and attrs.get("axis") in (-1, 1)):
            raise ArgumentError(f"{label}: a Concat of {list(node.input)} (axis {attrs.get('axis')}); fusedmlp reads a "
                                "concat of the hidden state with the network input itself over the last axis (not "
                                "with a value computed from the input)")
        h = node.input[0] if node.input[1] == x_part else node.input[1]
        self.cat_slice = self.x_slices.get(x_part)
        if h not in ({self.cur} | set(self.exprs)) or h == self.x:
            raise ArgumentError(f"{label}: a Concat of {list(node.input)}; fusedmlp reads a concat of the hidden state "
                                "with the network input")
        self.close(h, label)
        self.layers.unfoldable(label, "a Concat")
        self.value_of.setdefault(h, len(self.layers.weights) - 1)
        self.pending_cat = "after" if node.input[0] == h else "before"
        self.cur = node.output[0]
        return True

    def layer_op(self, node, op, attrs, label, first_slice=None):
        """A node on the chain's value: a Gemm / MatMul layer, a batch norm, a norm or softmax; else an error.
        first_slice: (start, stop) where the first layer reads a slice of x (its columns there among x's)."""
        layers = self.layers
        if op in ("Gemm", "MatMul"):
            carried_at = self.carry(label)  # (values riding along: the layer before's rows for them first)
            if self.pending_cat is not None:
                self.concat[len(layers.weights)] = self.pending_cat
                self.pending_cat = None
            elif layers.pending is None:  # (a value a batch norm normalizes on its way in is not one the kernel keeps)
                self.value_of.setdefault(self.cur, len(layers.weights) - 1)
            self.residual.append(None)
            w, b = self.gemm_weights(node, op, attrs, label)
            w = self.slice_columns(w, first_slice, label)
            if carried_at:  # (the carried rows of the layer before meet zero weights here)
                extra = layers.weights[-1].shape[0] - carried_at
                h_end = w.shape[1] if self.concat.get(len(layers.weights)) != "after" else carried_at
                w = np.concatenate([w[:, :h_end], np.zeros((w.shape[0], extra)), w[:, h_end:]], axis=1)
            layers.linear(w, b, label)
            self.biased = True
            self.read_by_last = node.input[0]  # (a head on it joins this layer: _onnx_outputs)
            return
        self.biased = False
        if op == "BatchNormalization":
            if attrs.get("training_mode", 0):
                raise ArgumentError(f"{label}: BatchNormalization in training mode; fusedmlp folds running statistics")
            scale, beta, mean, var = (np.asarray(self.const(n), np.float64) if self.const(n) is not None else None
                                      for n in node.input[1:5])
            if any(v is None for v in (scale, beta, mean, var)):
                raise ArgumentError(f"{label}: its scale, bias, mean and variance must be constants")
            s = scale / np.sqrt(var + float(attrs.get("epsilon", 1e-5)))
            layers.batchnorm(s, beta - mean * s, label)
        elif op in ("LayerNormalization", "RMSNormalization"):
            if attrs.get("axis", -1) not in (-1, 1):
                raise ArgumentError(f"{label}: {op} over axis {attrs.get('axis')}; fusedmlp normalizes the last axis")
            kind = "layernorm" if op == "LayerNormalization" else "rmsnorm"
            scale = self.const(node.input[1]) if len(node.input) > 1 else None
            # (of the network input: as wide as its scale; elsewhere the value's width)
            width = layers.weights[-1].shape[0] if layers.weights else 0 if scale is None else scale.size
            bias = self.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            layers.norm(kind, (width,), None if scale is None else np.broadcast_to(scale.reshape(-1), (width,)),
                        None if bias is None else np.broadcast_to(bias.reshape(-1), (width,)),
                        float(attrs.get("epsilon", 1e-5)), label, own=self.own_layer())
        elif op in ("Softmax", "LogSoftmax"):
            axis = attrs.get("axis", -1)
            layers.softmax("softmax" if op == "Softmax" else "log_softmax", -1 if axis in (-1, 1) else axis, label,
                           own=self.own_layer())
        else:
            raise ArgumentError(f"{label}: {op} is not read; supported: {SUPPORTED}")

    def gemm_weights(self, node, op, attrs, label):
        """A Gemm's or MatMul's weight (out x in, float64) and bias (or None)."""
        w = self.const(node.input[1])
        if w is None or w.ndim != 2:
            raise ArgumentError(f"{label}: its weight {node.input[1]} is not a constant matrix")
        if op == "MatMul":
            return np.asarray(w.T, np.float64), None
        if attrs.get("transA", 0):
            raise ArgumentError(f"{label}: Gemm with transA=1; fusedmlp reads rows of features (transA=0)")
        return gemm_operands(w, self.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None, attrs)

    def slice_columns(self, w, first_slice, label):
        """w (out x in) with its columns for a slice of x among x's features, the others zero: the first layer's
        input, or a pending Concat's x part (cat_slice)."""
        part = first_slice or (self.cat_slice if self.concat.get(len(self.layers.weights)) else None)
        self.cat_slice = None
        if part is None:
            return w
        width, n = slices_width(self.x_width, self.x_slices, label), part[1] - part[0]
        if first_slice is not None:
            return widen_columns(w, [(0, n, part[0])], width, label)
        n_h = w.shape[1] - n  # (the concat's other part: the hidden state, before or after x's)
        pieces = ([(0, n, part[0]), (n, n_h, width)] if self.concat[len(self.layers.weights)] == "before" else
                  [(0, n_h, 0), (n_h, n, n_h + part[0])])
        return widen_columns(w, pieces, n_h + width, label)

    def root(self, name):
        """A value's first name, before the Identity / Dropout / Cast nodes that renamed it."""
        seen = set()
        while name in self.alias and name not in seen:
            seen.add(name)
            name = self.alias[name]
        return name

    def own_layer(self):
        """Whether a norm or softmax here runs on an identity layer of its own (Layers.norm): no Gemm / MatMul right
        before it, or that layer's output also read elsewhere (a pre-norm block's residual). Then the value it reads
        is kept as the previous layer's output, so that a residual may still read it, as a Gemm taking it would keep
        it (layer_op)."""
        layers = self.layers
        if layers.fusable() and self.uses.get(self.cur, 1) <= 1:
            return False
        if layers.pending is None:  # (a value a batch norm normalizes on its way in is not one the kernel keeps)
            self.value_of.setdefault(self.cur, len(layers.weights) - 1)
        self.residual.append(None)
        return True

    def finish(self):
        if not self.layers.weights:
            raise ShapeError("the ONNX graph holds no Gemm or MatMul layer")
        self.finish_outputs()
        self.close(self.output, f"the graph output {self.output}")
        if self.output != self.cur:
            raise ArgumentError(f"the graph output {self.output} is not the end of the layer chain ({self.cur})")
        self.residual, self.concat = self.layers.merge_pairs(self.residual, self.concat)
        weights, biases, acts, norm, flatten = self.layers.finish("the ONNX graph")
        edges = graph_edges([tuple(r) if r else None for r in self.residual], self.concat or None, norm, flatten,
                            len(weights), self.layers.encoding)
        if self.input_order:  # (several inputs: their order in the Concat, as fusedmlp.torch names it)
            self.output_form["inputs"] = self.input_order
        return weights, biases, acts, {**edges, **self.output_form}


def read_onnx(model):
    """Reads an ONNX MLP (an onnx.ModelProto, its bytes or a path) into FusedMLP's arguments.

    Returns:
        (weights, biases, activations, edges) for FusedMLP(weights, biases, activation=activations, **edges), once
        the MODEL_FORM keys are popped (where the graph has several outputs, or squeezes its one: their widths,
        which are squeezed, as read_module's edges name them).
    """
    # norms written out node by node: one norm node each; then parallel stacks of layers on one value: one chain
    graph = merge_stacks(fold_norms(_load(model).graph, _FOLD), _FOLD)
    reader = _Reader(graph)
    for node in graph.node:
        reader.node(node)
    return reader.finish()


def from_onnx(model, device="auto", calibrate=None, **kwargs):
    """Builds a FusedMLP from an ONNX MLP (module docstring: what is read).

    Args:
        model: an onnx.ModelProto, its serialized bytes, or the path of a .onnx file.
        device: passed to FusedMLP.
        calibrate: for dtype='int8' or 'float8': a batch of typical inputs, passed to FusedMLP.calibrate.
        kwargs: passed to FusedMLP (dtype, check, cache_dir).

    Returns:
        A FusedMLP with the graph's weights (float32).
    """
    weights, biases, acts, edges = read_onnx(model)
    for key in MODEL_FORM:  # (the outputs side by side, a squeezed one as its column)
        edges.pop(key, None)
    mlp = FusedMLP(weights, biases, activation=acts, device=device, **edges, **kwargs)
    return mlp if calibrate is None else mlp.calibrate(calibrate)
