"""fusedmlp.torch's reading of a forward that slices its input or returns a value from before its last layers, as
nerf-pytorch's NeRF does: `input_pts, input_views = torch.split(x, [63, 27], -1)`, the trunk on input_pts with
input_pts joined again at a skip, then `alpha = alpha_linear(h)` and `feature = feature_linear(h)` on the trunk's
output, `torch.cat([feature, input_views], -1)` into the view layers and `torch.cat([rgb, alpha], -1)` returned.

Both become one chain of layers over the whole input, with exact rewrites of the weights:
- a slice of the input read by a Linear (the first layer, or an input concat's part) is x itself, the Linear's
  columns for the other features zero (x stays whole in the kernel, its unused features multiplied by zeros);
- Linears on one value (alpha_linear, feature_linear) are one layer of both's rows; where forward goes on with one of
  them (the lead) and returns the others beside a later layer's output, those others ride along as extra rows of
  each layer in between, which the layers' inputs meet with zero weights: through an identity layer one row of the
  value, through a relu layer the pair relu(v), relu(-v) (v = relu(v) - relu(-v) exactly, and both stay as they are
  through later relu layers), and the last layer adds the value back as one row, in the place torch.cat gives it.
  A value crossing any other activation, a norm or a residual has no exact carry and is an error naming it.
"""

import operator

import numpy as np
import torch
from torch import nn

from ._layers import activation_runs, compose, pieces_text, slices_width, widen_columns
from ._torch_fx_nodes import _ASIDE, F, _arg, _scalar_text
from .errors import ArgumentError, ShapeError


class Branches:
    """The _Tracer's part that reads slices of the input and values carried to the output (see the module)."""

    def init_branches(self):
        self.x_width = None  # x's features where forward splits it with listed sizes (torch.split(x, [a, b], -1))
        self.splits = {}  # torch.split node of x -> the parts' start offsets (and the end)
        self.x_slices = {}  # node -> (start, stop): a slice of the network input
        self.x_maps = {}  # node -> x's column for each of its columns: a torch.cat of slices of x before any Linear
        self.cat_slice = None  # (start, stop) of a pending input concat's x part where it is a slice
        self.lead = None  # (offset, width): the chain's value among the last layer's outputs, where values ride along
        self.carried = []  # [node, terms [(output column, sign)], nonneg]: values returned beside a later output,
        # each the sum of its terms over the last layer's outputs (nonneg: every term a relu's, never negative)
        self.settled = True  # whether the last layer's rows already hold the carried values (settle)
        self.out_slices = {}  # node -> [start, stop, factor]: columns of the last layer's output, times a number
        self.row_acts = None  # the last layer's activation per row where carried rows skip it (settle: pieces)
        self.out_splits = {}  # node -> [(start, stop)]: y.split / y.chunk of the last layer's output (output_split)
        self.part_widths = None  # the widths of the output's parts where forward returns a tuple (dict) of slices
        self.part_keys = self.part_squeeze = None  # that dict's keys; whether each part was indexed (y[..., 3])

    # -------------------------------------------------------------------------------------------- input slices

    def input_slice(self, node, label):
        """torch.split(x, [sizes], -1) and its parts, x[..., a:b] / x[:, a:b]: slices of the network input, read by
        a Linear or an input concat as x itself with zero weights for the other features (place_columns)."""
        x = self.x_node
        if not self.layers.weights and self.inputs and (self.inputs[0] in self.x_slices or self.inputs[0] in
                                                        self.x_maps) and self.keeps_value(node, label):
            src = self.inputs[0]  # (DeepSDF's F.dropout(input[:, :-3], training=False): the slice itself)
            (self.x_slices if src in self.x_slices else self.x_maps)[node] = (self.x_slices.get(src) or
                                                                              self.x_maps[src])
            return _ASIDE
        if (node.op == "call_function" and node.target is torch.cat and not self.layers.weights and node.args
                and isinstance(node.args[0], (list, tuple)) and node.args[0]
                and all(p is x or p in self.x_slices for p in node.args[0]) and _arg(node, 1, "dim", 0) in (-1, 1)
                and any(p is not x for p in node.args[0])):
            if x in node.args[0] and self.x_width is None:
                raise ArgumentError(f"{label}: a torch.cat of the input and slices of it leaves x's width unknown; "
                                    "fusedmlp reads slices with both ends given, or torch.split(x, [sizes], -1)")
            cols = []  # (DeepSDF's torch.cat([latent_vecs, xyz], 1): x's columns in another order, or repeated)
            for p in node.args[0]:
                cols += range(self.x_width) if p is x else range(*self.x_slices[p])
            self.x_maps[node] = cols
            return _ASIDE
        if node.op in ("call_function", "call_method") and node.target in (torch.split, "split") and node.args and \
                node.args[0] is x and not self.layers.weights:
            sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
            if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s > 0 for s in sizes) or \
                    _arg(node, 2, "dim", 0) not in (-1, 1):
                raise ArgumentError(f"{label}: a split of the input; fusedmlp reads torch.split(x, [sizes], dim=-1) "
                                    "with every part's size listed (x's features are then their sum)")
            self.splits[node] = np.cumsum([0] + list(sizes)).tolist()
            self.x_width = self.splits[node][-1]
            return _ASIDE
        if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
            return False
        src, idx = node.args
        if src in self.splits and isinstance(idx, int):
            offsets = self.splits[src]
            self.x_slices[node] = (offsets[idx], offsets[idx + 1])
            return _ASIDE
        if src is not x or self.layers.weights:
            return False
        last = idx[-1] if isinstance(idx, tuple) and len(idx) == 2 and (idx[0] is Ellipsis or idx[0] == slice(None)) \
            else None
        if not isinstance(last, slice) or last.step not in (None, 1):
            raise ArgumentError(f"{label}: an index of the input; fusedmlp reads slices of its features, x[..., a:b] "
                                "or x[:, a:b], and torch.split(x, [sizes], -1)")
        start, stop = last.start or 0, last.stop
        if stop is None or start < 0 or stop < 0:
            if self.x_width is None:
                raise ArgumentError(f"{label}: x[..., {start}:{'' if stop is None else stop}] leaves x's width "
                                    "unknown; fusedmlp reads slices with both ends given, or torch.split(x, [sizes], "
                                    "-1), which gives it")
            start, stop, _ = last.indices(self.x_width)
        self.x_slices[node] = (start, stop)
        return _ASIDE

    # -------------------------------------------------------------------------------------------- columns

    def place_columns(self, w, label):
        """A Linear's weight (float64, out x in) with its columns where the kernel's input holds them: a slice of x
        (the first layer's input, or a pending concat's x part) at its features among x's, the others zero; the chain
        value's part at the lead's columns of the last layer's outputs, where values ride along (zeros for theirs)."""
        first = self.inputs[0] if self.inputs else None
        if first in self.x_maps and not self.layers.weights and self.cur is self.x_node:
            self.inputs[0] = self.cur  # (the Linear takes x: each of its columns where x holds that value)
            cols = self.x_maps[first]
            width = self.x_width if self.x_width is not None else slices_width(None, self.x_slices, label)
            if w.shape[1] != len(cols):
                raise ShapeError(f"{label}: a Linear of {w.shape[1]} inputs on {len(cols)} columns of x")
            out = np.zeros((w.shape[0], max(width, max(cols) + 1)))
            np.add.at(out.T, cols, w.T)
            return out
        if first in self.x_slices and not self.layers.weights and self.cur is self.x_node:
            self.inputs[0] = self.cur  # (the Linear takes the chain's value: x)
            width = slices_width(self.x_width, self.x_slices, label)
            return widen_columns(w, [(0, w.shape[1], self.x_slices[first][0])], width, label)
        if self.pending_cat is None and self.lead is None:
            return w
        width_x = self.layers.weights[0].shape[1]  # x as the layers read it
        x_part = (self.cat_slice or (0, width_x)) if self.pending_cat else (0, 0)
        n_x = x_part[1] - x_part[0]
        n_h = w.shape[1] - n_x
        lead_at, lead_n = self.lead or (0, n_h)
        width_h = self.layers.weights[-1].shape[0] if self.lead else n_h
        if lead_n != n_h:
            raise ShapeError(f"{label}: a Linear of {n_h} inputs besides x's on a value of {lead_n} features")
        before = self.pending_cat == "before"
        h_src, x_src, h_dst, x_dst = (n_x, 0, width_x, 0) if before else (0, n_h, 0, width_h)
        pieces = [(h_src, n_h, h_dst + lead_at)] + ([(x_src, n_x, x_dst + x_part[0])] if n_x else [])
        self.cat_slice = None
        return widen_columns(w, pieces, width_h + (width_x if self.pending_cat else 0), label)

    # -------------------------------------------------------------------------------------------- carried values

    def lead_head(self, node, label):
        """forward goes on from one of the Linear heads merged on one value (head): that one leads the chain, the
        others ride along to be returned later (carried_output)."""
        heads = [h for h, _ in self.out_heads]
        read = [h for h in heads if h in node.all_input_nodes]
        layers = self.layers
        goes_on = (node.op == "call_function" and node.target in (torch.cat, F.linear)) or (
            node.op == "call_module" and isinstance(self.gm.get_submodule(node.target), nn.Linear))
        if len(read) != 1 or not goes_on or layers.acts[-1] != "none" or layers.norms[-1] is not None or any(
                a != "none" for a in self.head_acts):
            raise ArgumentError(f"{label}: it reads a head of Linears merged on one value (an actor-critic's pi(h), "
                                "v(h)); fusedmlp reads such heads as the network's outputs (return pi(h), v(h)), or "
                                "goes on from one of them into a Linear or an input concat and returns the others "
                                "beside the output (NeRF's torch.cat([rgb, alpha], -1))")
        offsets = np.cumsum([0] + [n for _, n in self.out_heads]).tolist()
        for i, (h, n) in enumerate(self.out_heads):
            if h is read[0]:
                self.lead = (offsets[i], n)
            else:
                self.carried.append([h, [(offsets[i] + j, 1.0) for j in range(n)], False])
        self.out_heads, self.cur, self.settled = [], read[0], True

    def settle(self, label, output=False):
        """The last layer's rows for the carried values, now that its activation is known: one row of each value
        through an identity layer (its value as a sum of the input columns' terms), through relu the pair relu(v),
        relu(-v), or each term's own row where the terms are already relu's (never negative). output: the last layer,
        where each value must come out as one row of itself."""
        if self.settled or not self.carried:
            self.settled = True
            return
        layers, last = self.layers, len(self.layers.weights) - 1
        act = layers.acts[last]
        names = ", ".join(str(c[0].name) for c in self.carried)
        plain = layers.norms[last] is None and self.residual[last] is None
        if output and plain and act != "none":  # (the carried rows without it: the last layer's column pieces)
            act = "none"
            self.row_acts = [layers.acts[last]] * layers.weights[-1].shape[0]
        if not plain or act not in ("none", "relu(x)", "relu"):
            what = ("a norm" if layers.norms[last] is not None else "a residual" if self.residual[last] is not None
                    else f"activation {act}")
            raise ArgumentError(f"{label}: {names}, returned beside a later layer's output, would cross a layer with "
                                f"{what}; fusedmlp carries such a value exactly through identity and relu layers only")
        w = layers.weights[-1]
        shift = self.layers_input_shift(last)
        rows, row = [], w.shape[0]
        for c in self.carried:
            _, terms, nonneg = c
            comb = np.zeros(w.shape[1])
            for col, sign in terms:
                comb[shift + col] += sign
            if act == "none" or (nonneg and not output):
                new = [comb] if act == "none" else [np.eye(1, w.shape[1], shift + col)[0] for col, _ in terms]
                c[1] = [(row + i, 1.0 if act == "none" else terms[i][1]) for i in range(len(new))]
                c[2] = act != "none" and nonneg
            elif output:
                raise ArgumentError(f"{label}: {c[0].name} is returned after a relu layer that would change it; "
                                    "fusedmlp returns a carried value from a last layer without an activation")
            else:
                new = [comb, -comb]
                c[1], c[2] = [(row, 1.0), (row + 1, -1.0)], True
            rows += new
            row += len(new)
        if self.row_acts is not None:
            self.row_acts += ["none"] * len(rows)
        b = layers.biases[-1]
        layers.weights[-1] = np.concatenate([w, np.array(rows)])
        layers.biases[-1] = None if b is None else np.concatenate([b, np.zeros(len(rows))])
        self.lead, self.settled = (0, w.shape[0]), True

    def layers_input_shift(self, layer):
        """Where the last layer's input columns for the previous layer's outputs start: after x's for a concat of x
        before them."""
        if self.concat.get(layer) == "before":
            return self.layers.weights[layer].shape[1] - self.layers.weights[layer - 1].shape[0]
        return 0

    def carried_output(self, node, label):
        """torch.cat of the chain's value and carried values, returned: the last layer's rows in the cat's order."""
        if not self.carried or node.op != "call_function" or node.target is not torch.cat:
            return False
        parts, nodes = node.args[0], {c[0]: c for c in self.carried}
        if (not isinstance(parts, (list, tuple)) or _arg(node, 1, "dim", 0) not in (-1, 1) or self.cur not in parts
                or not all(p is self.cur or p in nodes for p in parts) or len(set(parts)) != len(parts)):
            return False
        self.settle(label, output=True)
        layers = self.layers
        w, b = layers.weights[-1], layers.biases[-1]
        n = self.lead[1]
        order = []
        for p in parts:
            order += range(n) if p is self.cur else [col for col, _ in nodes[p][1]]
        layers.weights[-1] = w[order]
        layers.biases[-1] = None if b is None else b[order]
        if self.row_acts is not None:  # the layer's activation on its own rows, none on the carried ones
            layers.acts[-1] = pieces_text(activation_runs((self.row_acts[i], 1) for i in order), "none", label)
        self.carried, self.lead, self.row_acts = [], None, None
        return True

    def branch_linear(self, label):
        """A Linear arrives while values ride along: the last layer's carry rows first (settle)."""
        if self.carried:
            self.settle(label)
            self.settled = False

    # -------------------------------------------------------------------------------------------- output columns

    def output_slice(self, node, label):
        """Columns of the last layer's output put back together in another order or scaled by numbers, then
        returned (NeuS's torch.cat([x[:, :1] / self.scale, x[:, 1:]], -1)): x[..., a:b] / x[:, a:b] of the chain's
        value, a number times or over such a slice, and the torch.cat of slices covering every column once; the
        last layer's rows take the order and the factors (an identity activation and no norm where a factor is not
        1, so that it commutes)."""
        layers = self.layers
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 and \
                node.args[0] is self.cur and layers.weights and not self.carried:
            idx = node.args[1]
            last = idx[-1] if isinstance(idx, tuple) and len(idx) == 2 and (
                idx[0] is Ellipsis or idx[0] == slice(None)) else None
            width = layers.weights[-1].shape[0]
            if isinstance(last, int) and -width <= last < width:  # y[..., 3]: one column, its dim squeezed
                self.out_slices[node] = [last % width, last % width + 1, 1.0, "none", True]
                return _ASIDE
            if not isinstance(last, slice) or last.step not in (None, 1):
                return False
            start, stop, _ = last.indices(width)
            self.out_slices[node] = [start, stop, 1.0, "none", False]
            return _ASIDE
        if self.heads_combination(node, label):  # (a sum, difference or mean of slices as they are: slice_matrix)
            return _ASIDE
        src = next((a for a in node.all_input_nodes if a in self.out_slices), None)
        text = self.activation_text(node, self.text) if src is not None and node.op != "placeholder" else None
        if text is not None and node.all_input_nodes == [src]:  # sigmoid(y[..., :3]): that slice's piece
            start, stop, f, act, squeezed = self.out_slices[src]
            self.out_slices[node] = [start, stop, f, text if act == "none" else compose(text, act), squeezed]
            return _ASIDE
        if src is not None and node.op in ("call_function", "call_method") and node.target is not torch.cat:
            from ._torch_fx_nodes import _traced_constant_op

            const = _traced_constant_op(self.module, node, src, label, consts=self.consts)
            if const is None or np.ndim(const[1]) != 0:
                raise ArgumentError(f"{label}: an op on a slice of the last layer's output; fusedmlp reads an "
                                    "activation or arithmetic with a number there, then a torch.cat or a return of "
                                    "the slices")
            start, stop, f, act, squeezed = self.out_slices[src]
            if act == "none" and const[0] in ("mul", "div") and not (const[0] == "div" and const[2]):
                f *= float(const[1]) if const[0] == "mul" else 1.0 / float(const[1])  # (into the rows: select_rows)
            else:  # the slice's piece
                act = _scalar_text(*const) if act == "none" else compose(_scalar_text(*const), act)
            self.out_slices[node] = [start, stop, f, act, squeezed]
            return _ASIDE
        if node.op != "call_function" or node.target is not torch.cat or not node.args or not isinstance(
                node.args[0], (list, tuple)) or not all(p in self.out_slices for p in node.args[0]):
            return False
        if _arg(node, 1, "dim", 0) not in (-1, 1) or any(self.out_slices[p][4] for p in node.args[0]):
            raise ArgumentError(f"{label}: a torch.cat of slices of the last layer's output over a dim other than "
                                "the features, or of a column indexed away (y[..., 3]; y[..., 3:4] keeps its dim)")
        self.select_rows(node.args[0], label)
        return True

    def slice_matrix(self, node):
        """A slice of the last layer's output as it is (no activation, its dim kept) as rows over the layer's outputs
        (times its factor), or None: what heads_combination combines of slices as of heads (parallel stacks' outputs
        are such slices once merged: a two-layer dueling head's v + a - a.mean(-1, keepdim=True))."""
        if node not in self.out_slices:
            return None
        start, stop, f, act, squeezed = self.out_slices[node]
        return None if act != "none" or squeezed else f * np.eye(self.layers.weights[-1].shape[0])[start:stop]

    def output_split(self, node, label):
        """y.split(sizes, -1), torch.split(y, sizes, -1), y.chunk(n, -1) of the last layer's output: its parts are
        slices (out_slices) where getitem takes them."""
        layers = self.layers
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.out_splits:
            start, stop = self.out_splits[node.args[0]][node.args[1]]
            self.out_slices[node] = [start, stop, 1.0, "none", False]
            return _ASIDE
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None) if \
            node.op == "call_function" and node.target in (torch.split, torch.chunk) else None
        if name not in ("split", "chunk") or not node.args or node.args[0] is not self.cur or not layers.weights \
                or self.carried:
            return False
        width = layers.weights[-1].shape[0]
        what = _arg(node, 1, "split_size_or_sections" if name == "split" else "chunks", None)
        if name == "split" and "split_size" in node.kwargs:
            what = node.kwargs["split_size"]
        if _arg(node, 2, "dim", 0) not in (-1, 1) or not (
                isinstance(what, int) and what > 0 or isinstance(what, (list, tuple)) and all(
                    isinstance(s, int) and s >= 0 for s in what) and sum(what) == width and name == "split"):
            raise ArgumentError(f"{label}: a {name} of the last layer's output; fusedmlp reads y.split(sizes, -1) "
                                f"(sizes adding up to its {width} columns, or one size) and y.chunk(n, -1)")
        if isinstance(what, int):
            size = what if name == "split" else -(-width // what)
            what = [min(size, width - s) for s in range(0, width, size)]
        ends = np.cumsum([0] + list(what)).tolist()
        self.out_splits[node] = list(zip(ends[:-1], ends[1:]))
        return _ASIDE

    def output_parts(self, node, label):
        """The network's output: slices of the last layer's output (out_slices), one or a tuple of them
        (y.chunk(2, -1)'s tanh(mu), log_std.clamp(...)); the last layer's rows become theirs, and FusedModule splits
        a tuple again (read_module's edges: "outputs", their widths)."""
        out = node.args[0]
        keys = list(out) if isinstance(out, dict) else None
        parts = list(out.values()) if keys else list(out) if isinstance(out, (tuple, list)) else [out]
        if not parts or not all(isinstance(p, torch.fx.Node) and p in self.out_slices for p in parts) or (
                keys and not all(isinstance(k, str) for k in keys)):
            return False
        widths = [self.out_slices[p][1] - self.out_slices[p][0] for p in parts]
        squeezed = [self.out_slices[p][4] for p in parts]
        self.select_rows(parts, f"{node.name} (output)")
        if keys or isinstance(out, (tuple, list)):
            self.part_widths, self.part_keys = widths, keys
            self.part_squeeze = squeezed if any(squeezed) else None
        elif squeezed[0]:
            self.squeeze = (-1,)
        return True

    def select_rows(self, parts, label):
        """The last layer's rows become those of parts, slices of its output in order (out_slices): each with its
        factor and its activation (the layer's column pieces). Columns may go or repeat (a permutation only where
        the layer has a norm, the identity order where it has a residual: those read every column as it is)."""
        layers = self.layers
        order, factors = [], []
        for p in parts:
            start, stop, f, _, _ = self.out_slices[p]
            order += range(start, stop)
            factors += [f] * (stop - start)
        runs = activation_runs((self.out_slices[p][3], self.out_slices[p][1] - self.out_slices[p][0]) for p in parts)
        width = layers.weights[-1].shape[0]
        if (self.residual[-1] is not None and order != list(range(width))) or (
                layers.norms[-1] is not None and sorted(order) != list(range(width))):
            raise ArgumentError(f"{label}: the last layer's output columns taken in another order, or not each once, "
                                f"after its {'residual' if self.residual[-1] is not None else 'norm'}, which reads "
                                "them as they are")
        factors = np.asarray(factors)
        if np.any(factors != 1.0) and (layers.acts[-1] != "none" or layers.norms[-1] is not None
                                       or self.residual[-1] is not None):
            raise ArgumentError(f"{label}: slices of the last layer's output scaled after its activation, norm or "
                                "residual; fusedmlp folds the factors into a last layer without them")
        if len(runs) > 1 or runs[0][0] != "none":  # the slices' activations: the last layer's column pieces
            if self.residual[-1] is not None:
                raise ArgumentError(f"{label}: slices of the last layer's output with activations of their own after "
                                    "its residual; fusedmlp applies them as the layer's activation, before the residual")
            layers.acts[-1] = pieces_text(runs, layers.acts[-1], label)
        b = layers.biases[-1]
        layers.weights[-1] = layers.weights[-1][order] * factors[:, None]
        layers.biases[-1] = None if b is None else b[order] * factors
        self.out_slices, self.out_splits = {}, {}
