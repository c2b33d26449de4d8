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
- linear combinations of Linear outputs as they are (a dueling head's v + a - ReduceMean(a, -1)): Add / Sub of two
  (one column broadcast) and ReduceMean over the columns become rows of their own in the last layer, the combination
  of its rows (combined_rows), where the layer has no norm or residual; a Softmax / LogSoftmax over the last axis of
  such a value (or of a slice of the layer's columns) that is the graph's one output becomes the layer's softmax norm
  once its rows are the output's;
- several graph outputs, side by side in the model's output in the graph's order;
- a layer past the heads reading one of them (and x: NeRF's view layer on its feature head): the chain goes on from
  there, and the other values still read later ride along as rows of each later layer (one through an identity
  layer, relu(v) and relu(-v) through a relu one; `carry`), one row of the last layer at the end, outside its
  activation (a column piece), as fusedmlp.torch's _torch_fx_branch carries them.

At the end the last layer's rows become the outputs' columns in order (a row may repeat or go, where the layer has no
norm or residual that reads them all), and their expressions its column pieces ("sigmoid:3 | none:1").
"""

import numpy as np

from ._layers import activation_runs, affine_map, compose, pieces_text
from .errors import ArgumentError

_TAIL_OPS = ("Slice, Split, Gather, Concat, Squeeze / Unsqueeze of the last axis, elementwise nodes, ReduceMean of "
             "Linear outputs, Gemm / MatMul heads, a Softmax / LogSoftmax of Linear outputs as the one output")


class Outputs:
    """The _Reader's part that reads a graph's output tail (see the module)."""

    def init_outputs(self, graph):
        self.outputs = [self.root(o.name) for o in graph.output]
        self.tail = None  # value -> [[(row, expression), ...], squeezed] once the output's columns part ways
        self.output_form = {}  # read_onnx's edges for fusedmlp.torch: "outputs", "output_squeeze", "squeeze"
        self.read_by_last = None  # the value the last Gemm / MatMul read: another one on it is a head
        # values of the tail returned beside a later layer's output (NeRF's alpha past the view layer): [name,
        # column, terms [(row, factor)] over carried_layer's input, i.e. the layer before's outputs]; carried_layer
        # takes their rows once its activation is known (carry)
        self.carried, self.carried_layer = [], None
        self.tail_cat = {}  # Concat of a tail value and x (or a slice of it) -> (tail value, x's name, side of x)
        self.tail_softmax = {}  # a Softmax / LogSoftmax of Linear outputs past the last layer -> its norm kind

    def starts_tail(self, node, op):
        """Whether the node parts the last layer's output columns: a Slice / Split / Gather of the chain's value, or
        a Gemm / MatMul head on the value the last one read."""
        layers = self.layers
        if not layers.weights or not node.input or self.pending_cat is not None:
            return False
        if op in ("Slice", "Split", "Gather"):
            return node.input[0] in ({self.cur} | set(self.exprs))
        if any(name in {c[0] for c in self.carried} for name in node.input):  # (a carried value returned)
            return True
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
        if self.carried and self.carried_layer == len(layers.weights) - 1:  # each carried column one row of the last
            if layers.norms[-1] is not None or self.residual[-1] is not None:  # layer, outside its activation
                raise ArgumentError(f"{sorted({c[0] for c in self.carried})}, returned beside the last layer's output, "
                                    "would cross its norm or residual; fusedmlp returns such values from a last layer "
                                    "without them")
            first = self.carry_rows([(1.0, 1.0)] * len(self.carried))
            for i, (name, _, _) in enumerate(self.carried):
                self.tail.setdefault(name, [[], False])[0].append((first + i, "x"))
            self.carried, self.carried_layer = [], None

    def tail_node(self, node, op, attrs, label):
        if self.tail is None:
            self.start_tail()
        tail, out = self.tail, node.output[0] if node.output else None
        ins = [name for name in node.input if name]

        def value(name):
            if name not in tail:
                raise ArgumentError(f"{label}: it reads {name}, which is not the last layer's output or a value made "
                                    f"from its columns; past the last layer fusedmlp reads {_TAIL_OPS}")
            if name in self.tail_softmax:
                raise ArgumentError(f"{label}: it reads {name}, a {self.tail_softmax[name]} past the last layer, which "
                                    "fusedmlp fuses as the layer's norm where it is the graph's one output")
            return tail[name]

        if op in ("Identity", "Dropout", "Cast"):
            return
        x_in = [name for name in ins if name == self.x or name in self.x_slices]
        if op == "Concat" and x_in:  # (a layer past the heads reads this: NeRF's view branch, lead)
            t = [name for name in ins if name not in x_in]
            if len(ins) != 2 or len(x_in) != 1 or t[0] not in tail or attrs.get("axis") not in (-1, 1):
                raise ArgumentError(f"{label}: a Concat of {ins}; past the last layer fusedmlp reads a Concat of the "
                                    "network input (or a slice of it) with one value made from the output's columns")
            self.tail_cat[out] = (t[0], x_in[0], "before" if ins[0] == x_in[0] else "after")
            return
        if op in ("Gemm", "MatMul") and (ins[0] in self.tail_cat or (ins[0] in tail and ins[0] != self.read_by_last)):
            self.lead(node, op, attrs, label, *(self.tail_cat.get(ins[0]) or (ins[0], None, None)))
            return
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
        elif op == "ReduceMean" and ins[0] in tail:  # over the columns of Linear outputs: one row of their mean
            cols, squeezed = value(ins[0])
            axes = self.const(ins[1]) if len(ins) > 1 else attrs.get("axes")
            axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
            if axes not in ([-1], [1]) or squeezed or not self.linear_tail(tail[ins[0]]):
                raise ArgumentError(f"{label}: a ReduceMean of the output's columns other than over the last axis of "
                                    "Linear outputs as they are (no activation, no norm or residual on the layer)")
            rows = self.combined_rows([[(r, 1.0 / len(cols)) for r, _ in cols]])
            tail[out] = [[(rows[0], "x")], not attrs.get("keepdims", 1)]
        elif op in ("Softmax", "LogSoftmax") and ins[0] in tail:
            # over Linear outputs (a slice of the last layer, a combination of its rows): the layer's softmax norm once
            # its rows are the output's (finish_outputs), where that is the graph's one output
            cols, squeezed = value(ins[0])
            if attrs.get("axis", -1) not in (-1, 1) or squeezed or not self.linear_tail(tail[ins[0]]):
                raise ArgumentError(f"{label}: a {op} of the output's columns other than over the last axis of Linear "
                                    "outputs as they are (no activation, no norm or residual on the layer)")
            tail[out] = [cols, False]
            self.tail_softmax[out] = "softmax" if op == "Softmax" else "log_softmax"
        elif op in ("Squeeze", "Unsqueeze"):
            cols, squeezed = value(ins[0])
            axes = self.const(ins[1]) if len(ins) > 1 else attrs.get("axes")
            axes = [-1] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
            if axes not in ([-1], [1]) or len(cols) != 1 or squeezed != (op == "Unsqueeze"):
                raise ArgumentError(f"{label}: a {op} other than of a one-column value's last axis")
            tail[out] = [cols, op == "Squeeze"]
        else:
            self.tail_elementwise(node, op, attrs, label, value)

    def lead(self, node, op, attrs, label, name, x_name, side):
        """A layer past the heads reading one of them (with x joined: NeRF's view layer on its feature head): the
        network goes on from that head's rows, and the other outputs' columns ride along the layers after it as rows
        of their own (carried, carry), back to the tail at the end."""
        layers, tail = self.layers, self.tail
        at = next(i for i, n in enumerate(self.graph_nodes) if n.output and n.output[0] == node.output[0])
        later = {self.root(i) for n in self.graph_nodes[at + 1:] for i in n.input} | set(self.outputs)
        live = [o for o in tail if o != name and o in later]
        for n in [name] + live:
            if tail[n][1] or any(e != "x" for _, e in tail[n][0]):
                raise ArgumentError(f"{label}: a layer past the heads reads {name} while {n}, made from the last "
                                    "layer's columns, has an activation or lost its axis; fusedmlp carries values "
                                    "past later layers only as the Linear outputs themselves (NeRF's alpha)")
        rows = [r for r, _ in tail[name][0]]
        w, b = self.gemm_weights(node, op, attrs, label)
        n_x = w.shape[1] - len(rows)
        if n_x < 0 or (n_x > 0) != (x_name is not None):
            raise ArgumentError(f"{label}: a layer of {w.shape[1]} inputs on {len(rows)} columns past the heads")
        h_part = w[:, n_x:] if side == "before" else w[:, :len(rows)]
        wide = np.zeros((w.shape[0], layers.weights[-1].shape[0]))
        np.add.at(wide.T, rows, h_part.T)
        if x_name is not None:
            self.concat[len(layers.weights)] = side
            self.cat_slice = self.x_slices.get(x_name)
            x_part = w[:, :n_x] if side == "before" else w[:, len(rows):]
            wide = self.slice_columns(np.concatenate([x_part, wide] if side == "before" else [wide, x_part], axis=1),
                                      None, label)
        self.residual.append(None)
        layers.linear(wide, b, label)
        self.carried = [[o, j, [(r, 1.0)]] for o in live for j, (r, _) in enumerate(tail[o][0])]
        self.carried_layer = len(layers.weights) - 1
        self.tail, self.tail_cat, self.exprs = None, {}, {}
        self.cur, self.biased, self.read_by_last = node.output[0], True, None

    def carry(self, label):
        """The carried columns' rows in carried_layer, now that its activation is known (the next layer starts): one
        row each through an identity layer, relu(v) and relu(-v) through a relu one (v their difference after it)."""
        layers, l = self.layers, self.carried_layer
        if not self.carried or l != len(layers.weights) - 1:
            return 0
        act = layers.acts[l]
        if layers.norms[l] is not None or self.residual[l] is not None or act not in ("none", "relu", "relu(x)"):
            raise ArgumentError(f"{label}: {sorted({c[0] for c in self.carried})}, returned beside a later layer's "
                                f"output, would cross a layer with {'a norm or residual' if act in ('none', 'relu') else 'activation ' + act}; "
                                "fusedmlp carries such values exactly through identity and relu layers only")
        signs = [(1.0, 1.0)] if act == "none" else [(1.0, 1.0), (-1.0, -1.0)]  # (row sign, its term's factor)
        added = self.carry_rows([(s, f) for _ in self.carried for s, f in signs])
        for i, c in enumerate(self.carried):
            c[2] = [(added + i * len(signs) + k, f) for k, (_, f) in enumerate(signs)]
        self.carried_layer = l + 1
        return added

    def carry_rows(self, signs):
        """Rows appended to the last layer, one per (sign, _) of signs in the carried columns' order (each column's
        signs in turn): sign times the column as its terms give it over the layer's input; returns the first's
        index."""
        layers = self.layers
        l, w = len(layers.weights) - 1, layers.weights[-1]
        shift = w.shape[1] - layers.weights[l - 1].shape[0] if self.concat.get(l) == "before" else 0
        per = len(signs) // len(self.carried)
        rows = []
        for i, c in enumerate(self.carried):
            comb = np.zeros(w.shape[1])
            for r, f in c[2]:
                comb[shift + r] += f
            rows += [sign * comb for sign, _ in signs[i * per:(i + 1) * per]]
        first = w.shape[0]
        layers.weights[-1] = np.concatenate([w, np.array(rows)])
        b = layers.biases[-1]
        layers.biases[-1] = None if b is None else np.concatenate([b, np.zeros(len(rows))])
        return first

    def linear_tail(self, *values):
        """Whether tail values are the last layer's outputs as they are (no expression, the same squeeze) on a layer
        without norm or residual, so that a linear combination of them is one of the layer's rows (combined_rows)."""
        return (self.layers.norms[-1] is None and self.residual[-1] is None and len({v[1] for v in values}) == 1
                and all(e == "x" for v in values for _, e in v[0])
                and all(len(v[0]) in (1, max(len(u[0]) for u in values)) for v in values))

    def combined_rows(self, combos):
        """New rows of the last layer, row j the sum of factor times row over combos[j], pairs (row, factor)
        (float64, the bias alike); their indices."""
        layers = self.layers
        w, b = layers.weights[-1], layers.biases[-1]
        m = np.zeros((len(combos), w.shape[0]))
        for j, terms in enumerate(combos):
            for r, f in terms:
                m[j, r] += f
        first = w.shape[0]
        layers.weights[-1] = np.concatenate([w, m @ w])
        layers.biases[-1] = None if b is None else np.concatenate([b, m @ b])
        return list(range(first, first + len(combos)))

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
        from .onnx import _BINARY, _UNARY, _WITH_ATTRS, _num

        out, ins = node.output[0], [name for name in node.input if name]
        layers = self.layers
        if op in _UNARY or op in _WITH_ATTRS or op in ("PRelu", "Clip"):
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
        if a is not None and b is not None and op in ("Add", "Sub") and self.linear_tail(a, b) and (
                [r for r, _ in a[0]] != [r for r, _ in b[0]] or a[1] != b[1]):
            # a linear combination of the last layer's rows (a dueling head's v + a - mean(a)): rows of their own
            n = max(len(a[0]), len(b[0]))
            sign = 1.0 if op == "Add" else -1.0
            a_rows, b_rows = ([r for r, _ in v[0]] * (n if len(v[0]) == 1 else 1) for v in (a, b))
            rows = self.combined_rows([[(ra, 1.0), (rb, sign)] for ra, rb in zip(a_rows, b_rows)])
            self.tail[out] = [[(r, "x") for r in rows], a[1]]
            return
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
            s, t = affine_map(op.lower(), c, mine != ins[0], label)
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
            if not all(o in ({self.cur} | set(self.exprs) | {c[0] for c in self.carried}) for o in self.outputs):
                raise ArgumentError(f"the graph has outputs {self.outputs}; fusedmlp reads several where each is made "
                                    "from the last layer's output (heads, slices of its columns)")
            self.start_tail()
        missing = [o for o in self.outputs if o not in self.tail]
        if missing:
            raise ArgumentError(f"the graph output {missing[0]} is not made from the last layer's output columns")
        soft = [o for o in self.outputs if o in self.tail_softmax]
        if soft and len(self.outputs) > 1:
            raise ArgumentError(f"the graph output {soft[0]} is a {self.tail_softmax[soft[0]]} of some of the last "
                                "layer's columns beside other outputs; fusedmlp fuses one over all of them (a graph "
                                "whose one output it is)")
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
        runs = activation_runs((text, 1) for _, text in cols)  # (each over z, the layer's own activation in it)
        layers.acts[-1] = pieces_text([[_canonical(t) if t != "x" else "none", n] for t, n in runs], "none",
                                      "the graph's outputs")
        if soft:  # (its rows now the layer's, as they are: linear_tail)
            layers.norms[-1] = [self.tail_softmax[soft[0]], None, None, None]
        self.cur = self.output = self.outputs[0]
        self.tail = None
