"""fusedmlp.onnx's reading of parallel stacks of layers on one value (an exported TD3 / SAC critic's twin Q stacks, an
actor and a critic of their own on one input), as fusedmlp.torch reads them (_torch_fx_trunks): before the walk, the
stacks become one chain of Gemms, the first one their rows on the value they all read, each later one block-diagonal,
and each stack's end a Slice of the chain's last output (with the stack's own nodes after its last layer), so the walker
reads several outputs or a Concat of them as it reads any slices of the output.

A stack is a Gemm (transA 0) or MatMul (+ an Add of a constant bias) with a constant weight, then nodes each on the
value before alone, through more such layers. Stacks merge where two or more start on one value, each of two layers or
more (a one-layer head beside them is the walker's); then each must have as many layers, the same nodes between them at
each depth (an activation: the region of elementwise nodes on the layer's output), and ends that are graph outputs or
joined by one Concat (or an ensemble's stack, Unsqueeze + Concat, and its ReduceMean, folded); else an error names
them. Weights computed by nodes on constants (an exported weight_norm) are evaluated first, as the reader does."""

import numpy as np

from ._layers import check_stack_depths, stacked_layer
from .errors import ArgumentError

# elementwise ops an activation between two layers may be made of, on the layer's output and each other (with
# constants): x * Sigmoid(x), GELU's x * 0.5 * (1 + Erf(x / sqrt 2)), a clamp, a scale
_ELEMENTWISE = {"Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Abs", "Erf", "Sin", "Cos", "Softplus", "Softsign",
                "HardSwish", "Mish", "Neg", "Reciprocal", "LeakyRelu", "Elu", "Celu", "Selu", "HardSigmoid", "Gelu",
                "Clip", "ThresholdedRelu", "Shrink", "Identity", "Dropout", "Cast", "Add", "Sub", "Mul", "Div", "Pow"}


def gemm_operands(w, c, attrs):
    """A Gemm's (transA 0) weight as a layer's (out x in, float64) and its bias (or None): B or B' by transB, times
    alpha; C times beta, broadcast over the outputs. The reader's Gemm layers and the stacks' read the same."""
    w = np.asarray(w if attrs.get("transB", 0) else w.T, np.float64) * float(attrs.get("alpha", 1.0))
    b = None if c is None else np.broadcast_to(np.asarray(c, np.float64).reshape(-1) * float(
        attrs.get("beta", 1.0)), (w.shape[0],)).copy()
    return w, b


class _Graph:
    """The graph's nodes, constants (initializers and Constant nodes) and readers of each value."""

    def __init__(self, graph, fold):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes = list(graph.node)
        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for n in self.nodes:  # (and nodes on constants alone, as the reader evaluates them: fold)
            attrs = self.attrs(n)
            if n.op_type == "Constant" and "value" in attrs:
                self.consts[n.output[0]] = numpy_helper.to_array(attrs["value"])
            elif n.op_type in fold and n.input and all(not i or i in self.consts for i in n.input):
                args = [np.asarray(self.consts[i], np.float64) if self.consts[i].dtype.kind == "f" else self.consts[i]
                        for i in n.input if i]
                try:
                    self.consts[n.output[0]] = np.asarray(fold[n.op_type](attrs, *args))
                except (ValueError, TypeError, IndexError):
                    pass  # (the reader names it)
        self.outputs = {o.name for o in graph.output}
        self.readers = {}
        for n in self.nodes:
            for name in n.input:
                if name and name not in self.consts:
                    self.readers.setdefault(name, []).append(n)

    def attrs(self, node):
        return {a.name: self.helper.get_attribute_value(a) for a in node.attribute}

    def values(self, node):
        """The node's inputs that are not constants."""
        return [name for name in node.input if name and name not in self.consts]

    def only_reader(self, value):
        """The one node reading value and nothing else but constants (None: the value is an output, read twice, or
        read with another value)."""
        users = self.readers.get(value, [])
        if value in self.outputs or len(users) != 1 or self.values(users[0]) != [value] or len(users[0].output) != 1:
            return None
        return users[0]

    def layer(self, node):
        """(weight (out x in, float64), bias or None, its nodes) where node starts a layer: a Gemm (transA 0) or
        MatMul with a constant 2-D weight, a MatMul's bias the Add of a constant vector reading it alone; else None."""
        if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in self.consts:
            return None
        w = np.asarray(self.consts[node.input[1]], np.float64)
        if w.ndim != 2:
            return None
        if node.op_type == "MatMul":
            w, b, nodes = w.T, None, [node]
            add = self.only_reader(node.output[0])
            if add is not None and add.op_type == "Add":
                c = next((self.consts[i] for i in add.input if i in self.consts), None)
                if c is not None and np.size(c) == w.shape[0]:
                    b, nodes = np.asarray(c, np.float64).reshape(-1), [node, add]
            return w, b, nodes
        attrs = self.attrs(node)
        if attrs.get("transA", 0):
            return None
        c = self.consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        return (*gemm_operands(w, c, attrs), [node])

    def region(self, value):
        """(the nodes after a layer that compute an elementwise function of its output `value` alone, in graph order;
        the one value of theirs read past them, or value itself where there are none): an activation, as exporters
        write SiLU, x * Sigmoid(x), or GELU's Erf form. Where their values are read past them more than once, only the
        nodes up to the first such value (the stack ends there)."""
        nodes, made = [], {value}
        for n in self.nodes:
            vals = self.values(n)
            if n.op_type in _ELEMENTWISE and len(n.output) == 1 and vals and all(v in made for v in vals):
                nodes.append(n)
                made.add(n.output[0])
        inside = {id(n) for n in nodes}
        exits = [v for v in [value] + [n.output[0] for n in nodes]
                 if v in self.outputs or any(id(r) not in inside for r in self.readers.get(v, []))]
        if len(exits) != 1:  # (a value of the activation read twice past it: none of it is the stacks')
            return [], value
        keep = {exits[0]}  # (the nodes the exit depends on)
        for n in reversed(nodes):
            if n.output[0] in keep:
                keep |= set(self.values(n))
        return [n for n in nodes if n.output[0] in keep], exits[0]

    def signature(self, ops, value):
        """What the nodes of a region do to its input `value`, comparable across stacks: each one's op, attributes
        and inputs (the input, an earlier node's output by its place, or a constant's values)."""
        at = {n.output[0]: i for i, n in enumerate(ops)}

        def ref(name):
            if name == value:
                return "x"
            if name in at:
                return at[name]
            return repr(np.asarray(self.consts[name]).tolist()) if name in self.consts else name

        return tuple((n.op_type, tuple(sorted((k, repr(v)) for k, v in self.attrs(n).items())),
                      tuple(ref(i) for i in n.input)) for n in ops)


class _Stack:
    """A stack from its first layer: per layer (weight, bias, its nodes, the nodes after it: region), and its end."""

    def __init__(self, g, first):
        self.layers = [[*g.layer(first), []]]
        value = self.layers[0][2][-1].output[0]
        while True:
            ops, value = g.region(value)
            self.layers[-1][3] = ops
            readers = g.readers.get(value, [])
            found = g.layer(readers[0]) if len(readers) == 1 and value not in g.outputs and \
                readers[0].input[0] == value else None
            if found is None:
                break
            self.layers.append([*found, []])
            value = found[2][-1].output[0]
        self.end = value

    def nodes(self):
        return [n for _, _, own, ops in self.layers for n in own + ops]


def _check(g, stacks, names, unstacked):
    """Raises where the stacks cannot be one chain (see the module); unstacked: _unstacked's answer."""
    depths = [len(s.layers) for s in stacks]
    check_stack_depths(names, depths, "layers")
    for j in range(depths[0] - 1):
        sigs = [g.signature(s.layers[j][3], s.layers[j][2][-1].output[0]) for s in stacks]
        if len(set(sigs)) > 1:
            raise ArgumentError(f"{names}: parallel stacks of layers whose layer {j} activations differ ("
                                + ", ".join(" then ".join(op for op, _, _ in sig) or "none" for sig in sigs)
                                + "); fusedmlp runs such stacks as one network, one activation a hidden layer")
    ends = {s.end for s in stacks}
    for s in stacks:
        for user in g.readers.get(s.end, []):
            # (Add / Sub / ReduceMean / Mul / Div: a linear combination of the ends, a two-layer dueling head's
            # v + a - ReduceMean(a), which the output tail folds into the merged last layer or names: _onnx_outputs)
            if not (user.op_type == "Concat" and set(g.values(user)) <= ends) and unstacked is None and \
                    user.op_type not in ("Add", "Sub", "ReduceMean", "Mul", "Div"):
                raise ArgumentError(f"{user.name or user.output[0]} ({user.op_type}): reads the end of one of the "
                                    f"parallel stacks {names}; fusedmlp runs such stacks as one network whose outputs "
                                    "are theirs (graph outputs, or one Concat of them) or combined linearly (Add, "
                                    "Sub, ReduceMean)")


def _unstacked(g, stacks):
    """(the Unsqueeze nodes, the Concat) where every stack's end is read only by an Unsqueeze and one Concat joins all
    of those and nothing else (what torch.onnx.export writes for a torch.stack of an ensemble's members), else None.
    The reader then takes the members side by side, as it takes several outputs."""
    unsq = [g.readers.get(s.end, []) for s in stacks]
    if not all(len(r) == 1 and r[0].op_type == "Unsqueeze" for r in unsq):
        return None
    outs = [r[0].output[0] for r in unsq]
    cats = [g.readers.get(o, []) for o in outs]
    if not all(len(c) == 1 and c[0].op_type == "Concat" and c[0] is cats[0][0] for c in cats) or \
            g.values(cats[0][0]) != outs:
        return None
    return [r[0] for r in unsq], cats[0][0]


def _stack_mean(g, cat):
    """The ReduceMean reading the Concat of an ensemble's Unsqueezed members alone, over the members' axis, without
    keepdims (torch.stack(members, d).mean(d) exported), else None."""
    readers = g.readers.get(cat.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "ReduceMean" or cat.output[0] in g.outputs:
        return None
    mean, axis = readers[0], g.attrs(cat).get("axis")
    attrs = g.attrs(mean)
    axes = attrs.get("axes", g.consts.get(mean.input[1]) if len(mean.input) > 1 and mean.input[1] else None)
    axes = None if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    return mean if axes is not None and len(axes) == 1 and axis is not None and axes[0] % 3 == axis % 3 and not \
        attrs.get("keepdims", 1) else None


def merge_stacks(graph, fold):
    """graph, or a copy of it with each group of parallel stacks on one value as one chain (see the module); fold: the
    reader's evaluations of nodes on constants (op -> function of the attributes and the inputs)."""
    g = _Graph(graph, fold)
    nodes, consts, group = list(g.nodes), {}, 0
    for value in [i.name for i in graph.input] + [o for n in g.nodes for o in n.output]:
        firsts = [u for u in g.readers.get(value, []) if u.input[0] == value and g.layer(u) is not None and u in nodes]
        stacks = [_Stack(g, f) for f in firsts] if len(firsts) > 1 else []
        depths = {len(s.layers) for s in stacks}
        if not stacks or min(depths) == 1:  # (none; one-layer heads, values riding along: the walker's)
            continue
        names = ", ".join(f"{f.name or f.output[0]} ({f.op_type})" for f in firsts)
        found = _unstacked(g, stacks)
        _check(g, stacks, names, found)
        mine = [n for s in stacks for n in s.nodes()]
        at = max(nodes.index(n) for n in mine)
        early = [u for s in stacks for u in g.readers.get(s.end, []) if nodes.index(u) < at]
        if early:
            raise ArgumentError(f"{early[0].name or early[0].output[0]}: reads the end of a parallel stack before the "
                                "other stacks are computed")
        mean = _stack_mean(g, found[1]) if found is not None else None
        if mean is not None and any(s.layers[-1][3] for s in stacks):
            raise ArgumentError(f"{mean.name or mean.output[0]} (ReduceMean): the mean of parallel stacks' outputs "
                                "after their own activations; fusedmlp folds the mean into the stacks' last layers, "
                                "which then must end them")
        made = _chain(g, stacks, value, f"fused_stacks{group}", consts, None if mean is None else mean.output[0])
        nodes = [n for n in nodes[:at + 1] if n not in mine] + made + nodes[at + 1:]
        if found is not None:  # (a torch.stack of the members: their Concat side by side, its output's name kept)
            unsq, cat = found
            joined = g.helper.make_node("Concat", [s.end for s in stacks], list(cat.output), name=cat.name, axis=-1)
            gone = unsq + ([cat, mean] if mean is not None else [])  # (a mean: the chain's last layer writes it)
            nodes = [joined if n is cat else n for n in nodes if all(n is not u for u in gone)]
        group += 1
    return with_nodes(graph, g, nodes, consts) if group else graph


def with_nodes(graph, g, nodes, consts):
    """A copy of graph (g: its _Graph) whose nodes are these, with these new constants (name -> array) added."""
    out = type(graph)()
    out.CopyFrom(graph)
    del out.node[:]
    out.node.extend(nodes)
    out.initializer.extend(g.numpy_helper.from_array(v, name) for name, v in consts.items())
    return out


def _chain(g, stacks, value, prefix, consts, mean=None):
    """The nodes of the merged chain on value: Gemms (transB 1) of the stacks' layers, the first stack's activation
    nodes after each hidden one, then per stack a Slice of the last output and its own nodes after its last layer,
    the last of which writes the stack's end value (so its readers and the graph outputs stay as they are). mean: the
    name of an ensemble's mean over the stacks, which the last Gemm then writes, its rows the stacks' averaged."""
    helper, made, cur = g.helper, [], value
    dtype = next(np.asarray(g.consts[own[0].input[1]]).dtype for _, _, own, _ in stacks[0].layers)
    depth = len(stacks[0].layers)
    for j in range(depth):
        w, b = stacked_layer([s.layers[j][0] for s in stacks], [s.layers[j][1] for s in stacks], j == 0,
                             mean is not None and j == depth - 1)
        b = np.zeros(w.shape[0]) if b is None else b
        name = f"{prefix}_{j}"
        out = mean if mean is not None and j == depth - 1 else name
        consts[name + "_w"], consts[name + "_b"] = w.astype(dtype), b.astype(dtype)
        made.append(helper.make_node("Gemm", [cur, name + "_w", name + "_b"], [out], name=name, transB=1))
        cur = out
        if j + 1 < depth:
            cur = _copy_region(stacks[0].layers[j], cur, None, f"{name}_act", made)
    start = 0
    for i, s in enumerate(stacks if mean is None else ()):
        width = s.layers[-1][0].shape[0]
        ops = s.layers[-1][3]
        pos = f"{prefix}_part{i}"
        consts[pos + "_starts"], consts[pos + "_ends"], consts[pos + "_axes"] = (
            np.array([start], np.int64), np.array([start + width], np.int64), np.array([-1], np.int64))
        out = s.end if not ops else pos
        made.append(helper.make_node("Slice", [cur, pos + "_starts", pos + "_ends", pos + "_axes"], [out], name=pos))
        if ops:
            _copy_region(s.layers[-1], out, s.end, f"{pos}_op", made)
        start += width
    return made


def _copy_region(layer, value, end, prefix, made):
    """Copies of a layer's region (its nodes after the layer: layer[3]) reading value in place of the layer's output,
    appended to made; their outputs renamed (prefix and their place), the one read past them `end` where given (a
    stack's end keeps its name). Returns the name of that one."""
    names = {layer[2][-1].output[0]: value}
    for k, node in enumerate(layer[3]):
        copy = type(node)()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            copy.input[i] = names.get(name, name)
        names[node.output[0]] = end if end is not None and k == len(layer[3]) - 1 else f"{prefix}{k}"
        del copy.output[:]
        copy.output.append(names[node.output[0]])
        copy.name = names[node.output[0]]
        made.append(copy)
    return names[layer[3][-1].output[0]] if layer[3] else value
