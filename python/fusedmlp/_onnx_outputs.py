"""from_onnx's reading of a graph's output tail: what happens after its last layer besides one chain (a mixin of
onnx._Reader, as _torch_fx_branch is of the torch.fx tracer).

Once the last layer's output columns part ways, every value is read column by column: a list of (row, expression)
pairs, row one of the last layer's rows and the expression over that row's z (x) what the graph computes from it, and
whether the value lost its last axis (a Gather of one column). So:

- heads: a Gemm / MatMul on the value the last one read (an actor-critic's pi(h), v(h); NeRF's rgb and sigma) adds its
  rows to the last layer; an Add of a constant vector right after a MatMul head is its bias;
- Slice / Split / Gather of columns, Concat of such values over the last axis, Squeeze / Unsqueeze of that axis;
- elementwise nodes on them (the activations the chain reads, with scalar or per-column constants, or two values of the
  same rows: x * Sigmoid(x));
- several graph outputs, side by side in the model's output in the graph's order.

At the end the last layer's rows become the outputs' columns in order (a row may repeat or go, where the layer has no
norm or residual that reads them all), and their expressions its column pieces ("sigmoid:3 | none:1").
"""

import numpy as np

from ._gpu import core as _core
from ._layers import compose
from .errors import ArgumentError

_TAIL_OPS = "Slice, Split, Gather, Concat, Squeeze / Unsqueeze of the last axis, elementwise nodes, Gemm / MatMul heads"


class Outputs:
    """The _Reader's part that reads a graph's output tail (see the module)."""

    def init_outputs(self, graph):
        self.outputs = [self.root(o.name) for o in graph.output]
        self.tail = None  # value -> [[(row, expression), ...], squeezed] once the output's columns part ways
        self.output_form = {}  # read_onnx's edges for fusedmlp.torch: "outputs", "output_squeeze", "squeeze"
        self.read_by_last = None  # the value the last Gemm / MatMul read: another one on it is a head

    def starts_tail(self, node, op):
        """Whether the node parts the last layer's output columns: a Slice / Split / Gather of the chain's value, or
        a Gemm / MatMul head on the value the last one read."""
        layers = self.layers
        if not layers.weights or not node.input or self.pending_cat is not None:
            return False
        if op in ("Slice", "Split", "Gather"):
            return node.input[0] in ({self.cur} | set(self.exprs))
        return op in ("Gemm", "MatMul") and node.input[0] == self.read_by_last and node.input[0] != self.cur and \
            self.residual[-1] is None and layers.norms[-1] is None

    def start_tail(self):
        """The chain's value and the activation's values read so far become the tail's, column by column, each
        expression over the layer's z: the layer's activation so far in them (it is only these rows': a head's rows
        join later), and a per-feature map after it that waited for a next layer (tanh(pi(h)) * scale) too."""
        from .onnx import _num

        layers = self.layers
        rows = range(layers.weights[-1].shape[0])
        base = layers.acts[-1]
        act = "x" if base == "none" else base if "(" in base else f"{base}(x)"
        if layers.pending is not None:  # (after the activation: diag(s) act + t)
            s, t, _ = layers.pending
            s, t = (np.broadcast_to(np.asarray(v, np.float64).reshape(-1), (len(rows),)) for v in (s, t))
            exprs = [f"(({act}) * {_num(s[r])} + {_num(t[r])})" for r in rows]
            layers.pending = None
        else:
            exprs = [act] * len(rows)
        self.tail = {self.cur: [[(r, exprs[r]) for r in rows], False]}
        for name, text in self.exprs.items():
            self.tail[name] = [[(r, compose(text, exprs[r]) if exprs[r] != "x" else text) for r in rows], False]
        self.exprs = {}
        layers.acts[-1] = "none"

    def tail_node(self, node, op, attrs, label):
        if self.tail is None:
            self.start_tail()
        tail, out = self.tail, node.output[0] if node.output else None
        ins = [name for name in node.input if name]

        def value(name):
            if name not in tail:
                raise ArgumentError(f"{label}: it reads {name}, which is not the last layer's output or a value made "
                                    f"from its columns; past the last layer fusedmlp reads {_TAIL_OPS}")
            return tail[name]

        if op in ("Identity", "Dropout", "Cast"):
            return
        if op == "Concat" and any(name == self.x or name in self.x_slices for name in ins):
            raise ArgumentError(f"{label}: the network input joins a value past the last layer, as a layer after "
                                "heads or slices of the output would read it (NeRF's view branch); from_onnx reads "
                                "heads and the output's columns only as the network's outputs (fusedmlp.from_torch "
                                "reads such branches in PyTorch models)")
        if op in ("Gemm", "MatMul") and ins[0] == self.read_by_last:
            self.head(node, op, attrs, label)
        elif op == "Slice":
            cols, squeezed = value(ins[0])
            starts, ends, axes, steps = (self.const(node.input[i]) if len(node.input) > i and node.input[i] else None
                                         for i in range(1, 5))
            axes = [-1] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
            if starts is None or ends is None or axes not in ([-1], [1]) or squeezed:
                raise ArgumentError(f"{label}: a Slice of the output's columns over another axis, or with bounds not "
                                    "constant")
            step = 1 if steps is None else int(np.asarray(steps).reshape(-1)[0])
            start, stop = (int(np.asarray(v).reshape(-1)[0]) for v in (starts, ends))
            tail[out] = [cols[slice(*slice(start, stop, step).indices(len(cols)))], False]
        elif op == "Split":
            cols, squeezed = value(ins[0])
            sizes = self.const(ins[1]) if len(ins) > 1 else attrs.get("split")
            if sizes is None:
                n = attrs.get("num_outputs", len(node.output))
                size = -(-len(cols) // n)
                sizes = [min(size, len(cols) - s) for s in range(0, len(cols), size)]
            sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
            if attrs.get("axis", 0) not in (-1, 1) or squeezed or sum(sizes) != len(cols) or len(sizes) != len(
                    node.output):
                raise ArgumentError(f"{label}: a Split of the output's columns other than over the last axis into "
                                    "parts covering them")
            at = np.cumsum([0] + sizes)
            for i, name in enumerate(node.output):
                tail[name] = [cols[at[i]:at[i + 1]], False]
        elif op == "Gather":
            cols, squeezed = value(ins[0])
            idx = self.const(ins[1])
            if idx is None or attrs.get("axis", 0) not in (-1, 1) or squeezed or idx.ndim > 1:
                raise ArgumentError(f"{label}: a Gather of the output's columns other than by constant indices over "
                                    "the last axis")
            tail[out] = [[cols[int(i)] for i in idx.reshape(-1)], idx.ndim == 0]
        elif op == "Concat":
            parts = [value(name) for name in ins]
            if attrs.get("axis") not in (-1, 1) or any(squeezed for _, squeezed in parts):
                raise ArgumentError(f"{label}: a Concat of the output's columns other than over the last axis")
            tail[out] = [[c for cols, _ in parts for c in cols], False]
        elif op in ("Squeeze", "Unsqueeze"):
            cols, squeezed = value(ins[0])
            axes = self.const(ins[1]) if len(ins) > 1 else attrs.get("axes")
            axes = [-1] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
            if axes not in ([-1], [1]) or len(cols) != 1 or squeezed != (op == "Unsqueeze"):
                raise ArgumentError(f"{label}: a {op} other than of a one-column value's last axis")
            tail[out] = [cols, op == "Squeeze"]
        else:
            self.tail_elementwise(node, op, attrs, label, value)

    def head(self, node, op, attrs, label):
        """A Gemm / MatMul on the value the last one read: its rows join the last layer's."""
        layers = self.layers
        w, b = self.gemm_weights(node, op, attrs, label)
        last_w = layers.weights[-1]
        if w.shape[1] != last_w.shape[1]:
            raise ArgumentError(f"{label}: a head of {w.shape} beside a layer of {last_w.shape} on the same value")
        first = last_w.shape[0]
        layers.stack_rows([(last_w, layers.biases[-1]), (w, b)])
        self.tail[node.output[0]] = [[(first + r, "x") for r in range(w.shape[0])], False]

    def tail_elementwise(self, node, op, attrs, label, value):
        """An elementwise node on tail values: each column's expression; an Add / Sub / Mul / Div of a constant on
        a head's raw output read only here (a MatMul head's bias) folds into its rows instead."""
        from .onnx import _BINARY, _UNARY, _num

        out, ins = node.output[0], [name for name in node.input if name]
        layers = self.layers
        if op in _UNARY or op in ("LeakyRelu", "Elu", "Celu", "Selu", "HardSigmoid", "Gelu", "PRelu", "Clip"):
            cols, squeezed = value(ins[0])
            if op == "PRelu":
                slope = self.const(ins[1])
                if slope is None or slope.size != 1:
                    raise ArgumentError(f"{label}: PRelu with a slope per channel; fusedmlp reads one slope")
                texts = [f"leaky_relu({e}, {_num(slope.reshape(()))})" for _, e in cols]
            elif op == "Clip":
                lo, hi = (self.scalar(ins[i]) if len(ins) > i else None for i in (1, 2))
                texts = [e if lo is None else f"max({e}, {_num(lo)})" for _, e in cols]
                texts = [t if hi is None else f"min({t}, {_num(hi)})" for t in texts]
            else:
                texts = [self.unary(node, op, attrs, e) for _, e in cols]
            self.tail[out] = [[(r, t) for (r, _), t in zip(cols, texts)], squeezed]
            return
        if op not in _BINARY or len(ins) != 2:
            raise ArgumentError(f"{label}: {op} past the last layer; fusedmlp reads {_TAIL_OPS} there")
        a, b = (self.tail.get(name) for name in ins)
        if a is not None and b is not None:  # two values of the same columns: x * Sigmoid(x)
            if [r for r, _ in a[0]] != [r for r, _ in b[0]] or a[1] != b[1]:
                raise ArgumentError(f"{label}: {op} of two values of different columns of the last layer's output")
            self.tail[out] = [[(r, f"(({ea}) {_BINARY[op]} ({eb}))") for (r, ea), (_, eb) in zip(a[0], b[0])], a[1]]
            return
        mine, const = (ins[0], ins[1]) if a is not None else (ins[1], ins[0])
        cols, squeezed = value(mine)
        c = self.const(const)
        if c is None or c.size not in (1, len(cols)):
            raise ArgumentError(f"{label}: {op} of the output's columns with {const}, which is neither a scalar nor a "
                                "constant per column")
        c = np.broadcast_to(np.asarray(c, np.float64).reshape(-1), (len(cols),))
        rows = [r for r, _ in cols]
        if (op in ("Add", "Sub", "Mul", "Div") and all(e == "x" for _, e in cols) and self.uses.get(mine, 1) == 1
                and len(set(rows)) == len(rows) and self.residual[-1] is None and layers.norms[-1] is None
                and not (op == "Div" and mine != ins[0])):
            w, bias = layers.weights[-1].copy(), layers.biases[-1]
            bias = np.zeros(w.shape[0]) if bias is None else bias.copy()
            one, zero = np.ones(len(cols)), np.zeros(len(cols))
            s, t = {"Add": (one, c), "Mul": (c, zero), "Div": (1.0 / c, zero),
                    "Sub": (one, -c) if mine == ins[0] else (-one, c)}[op]  # (z - c, or c - z)
            w[rows] *= s[:, None]
            bias[rows] = bias[rows] * s + t
            layers.weights[-1], layers.biases[-1] = w, bias
            self.tail[out] = [cols, squeezed]
            return
        sym = _BINARY[op]
        texts = [f"(({e}) {sym} ({_num(k)}))" if mine == ins[0] else f"(({_num(k)}) {sym} ({e}))"
                 for (_, e), k in zip(cols, c)]
        self.tail[out] = [[(r, t) for (r, _), t in zip(cols, texts)], squeezed]

    def finish_outputs(self):
        """The last layer's rows and column pieces from the graph's outputs (several: side by side, in order)."""
        from .onnx import _canonical

        if self.tail is None:
            if len(self.outputs) == 1:
                return
            if not all(o in ({self.cur} | set(self.exprs)) for o in self.outputs):
                raise ArgumentError(f"the graph has outputs {self.outputs}; fusedmlp reads several where each is made "
                                    "from the last layer's output (heads, slices of its columns)")
            self.start_tail()
        missing = [o for o in self.outputs if o not in self.tail]
        if missing:
            raise ArgumentError(f"the graph output {missing[0]} is not made from the last layer's output columns")
        cols = [c for o in self.outputs for c in self.tail[o][0]]
        squeezed = [self.tail[o][1] for o in self.outputs]
        if len(self.outputs) > 1:  # (how a TorchScript module read through its graph hands them back: FusedModule)
            self.output_form["outputs"] = [len(self.tail[o][0]) for o in self.outputs]
            if any(squeezed):
                self.output_form["output_squeeze"] = squeezed
        elif squeezed[0]:
            self.output_form["squeeze"] = (-1,)
        rows, layers = [r for r, _ in cols], self.layers
        width = layers.weights[-1].shape[0]
        if (self.residual[-1] is not None and (rows != list(range(width)) or any(e != "x" for _, e in cols))) or (
                layers.norms[-1] is not None and sorted(rows) != list(range(width))):
            raise ArgumentError("the graph's outputs take the last layer's columns in another order, not each once, or "
                                "with activations of their own, after its residual or norm, which reads them all")
        layers.weights[-1] = layers.weights[-1][rows]
        layers.biases[-1] = None if layers.biases[-1] is None else layers.biases[-1][rows]
        runs = []
        for _, text in cols:
            if runs and runs[-1][0] == text:
                runs[-1][1] += 1
            else:
                runs.append([text, 1])
        if len(runs) > _core().ACT_PIECES:
            raise ArgumentError(f"the graph's outputs take {len(runs)} runs of activations over the last layer's "
                                f"columns; fusedmlp gives a layer at most {_core().ACT_PIECES} column pieces")
        texts = [_canonical(t) if t != "x" else "none" for t, _ in runs]  # (over z: start_tail)
        layers.acts[-1] = texts[0] if len(runs) == 1 else " | ".join(f"{t}:{n}" for t, (_, n) in zip(texts, runs))
        self.cur = self.output = self.outputs[0]
        self.tail = None
