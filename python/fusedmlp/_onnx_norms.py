"""fusedmlp.onnx's reading of norms written out node by node: torch's dynamo exporter writes RMSNorm so at its default
opset (18; RMSNormalization is opset 23), and exporters at opsets below 17 write LayerNorm so. Each such run of nodes
becomes the one RMSNormalization or LayerNormalization node the reader fuses into the layer before it:

    RMSNorm:   Pow(v, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul(v, .)   [-> Mul(scale)]
               (or Div(v, Sqrt(...)); Mul(v, v) for the square)
    LayerNorm: d = Sub(v, ReduceMean(v)), then the same over d                       [-> Mul(scale)] [-> Add(bias)]

each ReduceMean over the last axis keeping it, each intermediate value read by the next node alone. Anything else is
left as it is (the reader then names the node it does not read)."""

import numpy as np

from ._onnx_stacks import _Graph, with_nodes


def _last_axis_mean(g, node):
    """Whether node is a ReduceMean over the last axis (-1, or 1 of the reader's 2-D values) that keeps it."""
    if node is None or node.op_type != "ReduceMean" or not g.attrs(node).get("keepdims", 1):
        return False
    attrs = g.attrs(node)
    axes = attrs.get("axes") if "axes" in attrs else g.consts.get(node.input[1]) if len(node.input) > 1 else None
    return axes is not None and [int(a) for a in np.asarray(axes).reshape(-1)] in ([-1], [1])


def _number(g, name, want=None):
    """The constant single value called name (None: no such constant; want: that value only)."""
    c = g.consts.get(name)
    if c is None or np.asarray(c).size != 1:
        return None
    v = float(np.asarray(c).reshape(()))
    return v if want is None or v == want else None


def _other(node, name):
    """node's input that is not name (None: both are, or neither)."""
    a, b = (list(node.input) + ["", ""])[:2]
    return b if a == name and b != name else a if b == name and a != name else None


def _vector(g, name):
    c = g.consts.get(name)
    return c if c is not None and np.asarray(c).ndim <= 2 and np.asarray(c).size > 1 else None


def _norm_at(g, producer, mean):
    """The norm whose mean square (or variance) is the ReduceMean `mean`: (kind, input value, epsilon, the nodes it
    replaces, scale name or None, bias name or None, output name), or None where the nodes around it are no norm."""
    square = producer.get(mean.input[0])
    if square is None or g.only_reader(square.output[0]) is not mean:
        return None
    if square.op_type == "Pow" and _number(g, square.input[1], 2.0) is not None:
        d = square.input[0]
    elif square.op_type == "Mul" and square.input[0] == square.input[1]:
        d = square.input[0]
    else:
        return None
    add = g.only_reader(mean.output[0])
    eps = _number(g, _other(add, mean.output[0]) or "") if add is not None and add.op_type == "Add" else None
    if eps is None:
        return None
    sqrt = g.only_reader(add.output[0])
    if sqrt is None or sqrt.op_type != "Sqrt":
        return None
    after = g.readers.get(sqrt.output[0], [])
    if len(after) != 1:
        return None
    if after[0].op_type == "Div" and list(after[0].input) == [d, sqrt.output[0]]:
        out, nodes = after[0], [square, mean, add, sqrt, after[0]]
    elif after[0].op_type == "Reciprocal":
        users = g.readers.get(after[0].output[0], [])
        if len(users) != 1 or users[0].op_type != "Mul" or _other(users[0], after[0].output[0]) != d:
            return None
        out, nodes = users[0], [square, mean, add, sqrt, after[0], users[0]]
    else:
        return None
    kind, v = "RMSNormalization", d
    sub = producer.get(d)
    if sub is not None and sub.op_type == "Sub" and _last_axis_mean(g, producer.get(sub.input[1])):
        first = producer[sub.input[1]]
        if first.input[0] == sub.input[0] and [id(u) for u in g.readers.get(first.output[0], [])] == [id(sub)] and \
                sorted(id(u) for u in g.readers.get(d, [])) == sorted((id(square), id(out))):
            kind, v, nodes = "LayerNormalization", sub.input[0], [first, sub] + nodes
    scale = bias = None
    y = out.output[0]
    nxt = g.only_reader(y)
    if nxt is not None and nxt.op_type == "Mul" and _vector(g, _other(nxt, y) or "") is not None:
        scale, y, nodes = _other(nxt, y), nxt.output[0], nodes + [nxt]
        nxt = g.only_reader(y)
    if kind == "LayerNormalization" and nxt is not None and nxt.op_type == "Add" and \
            _vector(g, _other(nxt, y) or "") is not None:
        bias, y, nodes = _other(nxt, y), nxt.output[0], nodes + [nxt]
    return kind, v, eps, nodes, scale, bias, y


def fold_norms(graph, fold):
    """graph, or a copy of it with each norm written out node by node as one norm node (see the module); fold: the
    reader's evaluations of nodes on constants (as merge_stacks takes them)."""
    g = _Graph(graph, fold)
    producer = {o: n for n in g.nodes for o in n.output}
    nodes, found, ones = list(g.nodes), 0, {}
    for mean in g.nodes:
        if not _last_axis_mean(g, mean) or not any(n is mean for n in nodes):
            continue
        norm = _norm_at(g, producer, mean)
        if norm is None:
            continue
        kind, v, eps, gone, scale, bias, y = norm
        inputs = [v] + ([scale] if scale or bias else []) + ([bias] if bias else [])
        if bias and not scale:  # (LayerNormalization's scale comes before its bias: ones)
            inputs[1] = f"{y}_fused_norm_scale"
            ones[inputs[1]] = np.ones(np.asarray(g.consts[bias]).size, np.float32)
        made = g.helper.make_node(kind, inputs, [y], name=f"{y}_fused_norm", axis=-1, epsilon=eps)
        at = max(nodes.index(n) for n in gone)
        nodes = [n for n in nodes[:at] if all(n is not u for u in gone)] + [made] + nodes[at + 1:]
        found += 1
    return with_nodes(graph, g, nodes, ones) if found else graph
