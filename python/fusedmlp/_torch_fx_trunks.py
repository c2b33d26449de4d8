"""fusedmlp.torch's reading of parallel stacks of Linears on one value, before the chain is walked: TD3's and SAC's twin
Q critics (`sa = torch.cat([state, action], 1)`, then `q1 = l3(relu(l2(relu(l1(sa)))))` and `q2` from l4-l6 on the same
sa), an actor-critic whose actor and critic are networks of their own on one input (Stable-Baselines3's default for PPO:
`net_arch=dict(pi=[64, 64], vf=[64, 64])`), heads of several layers on one trunk.

The stacks become one chain (merge_trunks rewrites the traced graph): its layer j holds every stack's layer j, the first
one their rows on the value they all read, each later one block-diagonal (stack i's layer reads stack i's columns only,
zero weights for the others), so every stack's outputs are the chain's last layer's columns, exactly: the zero blocks
add exact zeros to finite values. Each stack's end becomes a slice of the chain's output with the stack's own ops after
its last Linear (its activation, numbers), as the walker reads slices of the output (_torch_fx_branch.output_slice: the
last layer's column pieces, and a tuple, dict or torch.cat of them returned).

A stack's activation between two Linears is the region of nodes after the first that compute a function of its output
alone (_region: an activation module or function, or one written out, x * torch.sigmoid(x), which a Swish module of
the user's becomes when torch.fx inlines it); the stacks' regions must do the same at each depth, compared node by
node, and the first stack's is copied into the chain.

Stacks merge where two or more start on one value, each of two Linears or more (a one-layer head beside them is the
walker's: a head, or a value riding along the others' layers, as NeRF's density does). What must hold then, else an
error names the stacks: as many Linears in each stack, the same activation between them at each depth (one merged layer
has one hidden activation), no norm between them (a row norm would reach across the stacks), and the stacks' ends
returned (or joined by one torch.cat, or one torch.stack of an ensemble's members or its mean: _stacked_output) rather
than read by another layer. k stacks of width w run as one of width k w:
the streamed kernel's looped wide layers skip the zero blocks (fm_spec_find_blocks finds them in the weights,
fm_stream.cuh's fm_blocks), the other forms multiply them, k times the stacks' own hidden work."""

import operator

import torch
from torch import nn

from ._layers import check_stack_depths, stacked_layer
from ._torch_fx_nodes import _DROPOUT_FUNCTIONS, _SAME_METHODS, _arg, _functional_text
from ._torch_modules import _DROPOUTS, _activation_text, _check_dropout_off, _effective, _numpy64
from .errors import ArgumentError


def _linear_of(gm, node, activations):
    """The nn.Linear a call_module node runs (weight_norm / spectral_norm parametrized too), or None."""
    if node.op != "call_module" or node.target in activations:
        return None
    leaf = gm.get_submodule(node.target)
    return leaf if isinstance(leaf, nn.Linear) else None


def _op_text(gm, node, activations):
    """What an op on a stack's value between two of its Linears does: "" where it keeps the value (eval-mode dropout,
    Identity, x.float()), its activation's expression text, else None (the stack ends before it)."""
    if node.op == "call_module":
        if node.target in activations:
            return activations[node.target]
        leaf = gm.get_submodule(node.target)
        if isinstance(leaf, _DROPOUTS):
            _check_dropout_off(leaf, node.target)
            return ""
        return "" if isinstance(leaf, nn.Identity) else _activation_text(leaf)
    if node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
        active = _arg(node, 2, "training", _DROPOUT_FUNCTIONS[node.target]) and _arg(node, 1, "p", 0.5) > 0
        return None if active else ""  # (active: the walker names it)
    if node.op == "call_method" and node.target in _SAME_METHODS and len(node.args) == 1 and not node.kwargs:
        return ""
    return _functional_text(node) if node.op in ("call_function", "call_method") else None


# arithmetic an activation may be written with between two of its values or with numbers (x * torch.sigmoid(x), a
# Swish module fx inlines, x * 0.5 * (1 + torch.erf(x / 1.4142)))
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, torch.add, torch.sub,
          torch.mul, torch.div, torch.neg, torch.pow, "add", "sub", "mul", "div", "neg", "pow"}


def _elementwise(gm, node, activations):
    """Whether node may be part of an activation between two Linears: an activation or a value-keeping op (_op_text),
    or arithmetic on the layer's values and numbers alone."""
    if node.op in ("call_function", "call_method") and node.target in _ARITH and not node.kwargs:
        return all(isinstance(a, (torch.fx.Node, int, float)) and not isinstance(a, bool) for a in node.args)
    return _op_text(gm, node, activations) is not None


def _region(gm, value, activations):
    """(the nodes after a Linear's output `value` that compute a function of it alone, in graph order: each reads
    value or those before it only, and is elementwise where it reads two of them; the one of theirs read past them,
    or value itself where there are none). Where their values are read past them more than once: ([], value)."""
    made, nodes, node = {value}, [], value.next
    while node.op != "output":
        ins = node.all_input_nodes
        if ins and set(ins) <= made and _linear_of(gm, node, activations) is None and (
                len(ins) == 1 or _elementwise(gm, node, activations)):
            nodes.append(node)
            made.add(node)
        node = node.next
    inside = set(nodes)
    exits = [v for v in [value] + nodes if any(u not in inside for u in v.users)]
    if len(exits) != 1:
        return [], value
    keep = {exits[0]}  # (the nodes the exit is computed from)
    for n in reversed(nodes):
        if n in keep:
            keep |= set(n.all_input_nodes)
    return [n for n in nodes if n in keep], exits[0]


class _Stack:
    """One stack from its first Linear: its Linears' nodes, the nodes after each (_region: [] per layer), its last
    node."""

    def __init__(self, gm, first, activations):
        self.linears, self.ops, value = [first], [], first
        while True:
            ops, value = _region(gm, value, activations)
            self.ops.append(ops)
            users = list(value.users)
            if len(users) != 1 or _linear_of(gm, users[0], activations) is None or users[0].args[:1] != (value,):
                break
            self.linears.append(users[0])
            value = users[0]
        self.end = value

    def hidden(self, gm, activations, j):
        """What the nodes after layer j (not the last) do to its output, comparable across stacks: each one's op, its
        activation text and its arguments (the layer's output, an earlier node by its place, numbers)."""
        refs, out = {self.linears[j]: "x"}, []
        for n in self.ops[j]:
            text = _op_text(gm, n, activations)
            args = tuple(refs.get(a, a) if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
            if text == "":  # (a Dropout, an Identity: another name of its input)
                refs[n] = args[0]
                continue
            refs[n] = len(out)
            out.append((n.op, text or getattr(n.target, "__name__", n.target), args))
        return tuple(out)

    def nodes(self):
        return [n for j, lin in enumerate(self.linears) for n in [lin] + self.ops[j]]


def _name(node):
    return f"{node.name} ({node.target if isinstance(node.target, str) else getattr(node.target, '__name__', '')})"


def _check(gm, stacks, activations):
    """Raises where stacks on one value cannot be one chain (see the module)."""
    names = ", ".join(_name(s.linears[0]) for s in stacks)
    depths = [len(s.linears) for s in stacks]
    check_stack_depths(names, depths, "Linears")
    for j in range(depths[0] - 1):
        for s in stacks:
            for n in s.ops[j]:
                if not _elementwise(gm, n, activations):
                    raise ArgumentError(f"{_name(n)}: between two Linears of parallel stacks {names}; fusedmlp runs "
                                        "such stacks as one network, whose hidden layers take activations only (a "
                                        "norm would reach across the stacks)")
        texts = [s.hidden(gm, activations, j) for s in stacks]
        if len(set(texts)) > 1:
            raise ArgumentError(f"{names}: parallel stacks of Linears whose layer {j} activations differ "
                                f"({', '.join(' then '.join(str(op[1]) for op in t) or 'none' for t in texts)}); "
                                "fusedmlp runs such stacks as one network, one activation a hidden layer")
    ends = {s.end for s in stacks}
    for s in stacks:
        for user in s.end.users:
            joined = user.op == "call_function" and user.target in (torch.cat, torch.stack) and set(
                user.all_input_nodes) <= ends
            # (a sum, difference or mean of the stacks' outputs, a two-layer dueling head's v + a - a.mean(-1, True):
            # the walker folds it into the merged last layer, or names what it cannot: output_slice)
            combined = user.op in ("call_function", "call_method") and (
                user.target in _ARITH or user.target in (torch.mean, "mean"))
            if user.op != "output" and not joined and not combined:
                raise ArgumentError(f"{_name(user)}: reads the end of one of the parallel stacks {names}; fusedmlp "
                                    "runs such stacks as one network whose outputs are theirs, returned (a tuple, a "
                                    "dict, one torch.cat or torch.stack of them) or combined linearly (sums, "
                                    "differences, a mean over the features)")


def _returned(node):
    """Whether node has one user, the output, returning it as it is."""
    out = next(iter(node.users)) if len(node.users) == 1 else None
    return out is not None and out.op == "output" and out.args[0] is node


def _stacked_output(gm, stacks):
    """(the torch.stack node, its dim, the mean of it or None) where forward returns one torch.stack of every stack's
    end, all as wide (an ensemble's members: FusedModule then gives back that stack of the model's side-by-side
    outputs, read_module's edge "output_stack"), or the mean of that stack over the members (the members' last
    Linears then one layer of their rows averaged, where nothing follows them); else None. A torch.stack the stacks'
    ends meet otherwise raises."""
    ends = [s.end for s in stacks]
    node = next((u for e in ends for u in e.users if u.op == "call_function" and u.target is torch.stack), None)
    if node is None:
        return None
    parts, dim = _arg(node, 0, "tensors", None), _arg(node, 1, "dim", 0)
    widths = {gm.get_submodule(s.linears[-1].target).out_features for s in stacks}
    mean = next(iter(node.users)) if len(node.users) == 1 else None
    if not (mean is not None and (mean.op == "call_method" and mean.target == "mean" or mean.op == "call_function"
                                  and mean.target is torch.mean) and isinstance(dim, int)
            and _arg(mean, 1, "dim", None) in (dim, dim - 3, dim + 3) and not _arg(mean, 2, "keepdim", False)
            and _returned(mean)):
        mean = None
    elif any(s.ops[-1] for s in stacks):
        raise ArgumentError(f"{_name(mean)}: the mean of parallel stacks' outputs after their own activations; "
                            "fusedmlp folds the mean into the stacks' last Linears, which then must end them")
    if (not isinstance(parts, (list, tuple)) or sorted(map(id, parts)) != sorted(map(id, ends)) or len(widths) != 1
            or dim not in (0, 1, 2, -1, -2, -3) or not (mean is not None or _returned(node))):
        raise ArgumentError(f"{_name(node)}: a torch.stack of parallel stacks' outputs; fusedmlp reads one torch.stack "
                            "of every stack's output, all as wide, returned as it is or as its mean over the stacks")
    return node, dim % 3, mean


def _merged_linear(layers, first, average=False):
    """One nn.Linear (float64) of the stacks' layers [(module, label)] (stacked_layer; average: an ensemble's mean)."""
    w, b = stacked_layer([_numpy64(_effective(m, "weight", label)) for m, label in layers],
                         [_numpy64(_effective(m, "bias", label)) for m, label in layers], first, average)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        if b is not None:
            lin.bias.copy_(torch.from_numpy(b))
    return lin


def merge_trunks(gm, activations):
    """Rewrites gm's graph in place where a value is read by two or more Linears each starting a stack of two or more
    (see the module). Stacks of one Linear each are left to the walker, which reads them as heads (an actor-critic's
    pi(h), v(h) on one trunk, NeRF's alpha and feature layers).

    Returns:
        (dim, stacks) where forward returns a torch.stack of the stacks' outputs along dim (0, 1 or 2 of the
        3-D result; the graph then returns their torch.cat), else None.
    """
    graph, merged, stacked = gm.graph, 0, None
    for value in list(graph.nodes):
        if value.graph is not graph:  # (erased by an earlier group)
            continue
        firsts = [u for u in value.users if _linear_of(gm, u, activations) is not None and u.args[:1] == (value,)]
        if len(firsts) < 2:
            continue
        stacks = [_Stack(gm, f, activations) for f in firsts]
        depths = {len(s.linears) for s in stacks}
        if min(depths) == 1:  # (one-layer heads, a value riding along the others: the walker's)
            continue
        _check(gm, stacks, activations)
        found = _stacked_output(gm, stacks)
        mean = found[2] if found is not None else None
        if found is not None and mean is None:  # (the stack's parts in its order, joined side by side instead)
            node, dim, _ = found
            with graph.inserting_before(node):
                joined = graph.call_function(torch.cat, (list(node.args[0]), -1))
            node.replace_all_uses_with(joined)
            graph.erase_node(node)
            stacked = (dim, len(stacks))
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max((n for s in stacks for n in s.nodes()), key=order.__getitem__)
        early = [u for s in stacks for u in s.end.users if order[u] <= order[last]]
        if early:
            raise ArgumentError(f"{_name(early[0])}: reads the end of a parallel stack before the other stacks are "
                                "computed; fusedmlp reads such stacks' outputs where forward returns or joins them")
        cur, template = value, stacks[0]

        def copy_region(stack, j, value):  # (layer j's nodes after it on value; their last, or value)
            names = {stack.linears[j]: value}
            for op in stack.ops[j]:
                names[op] = graph.node_copy(op, lambda n: names[n])
            return names[stack.ops[j][-1]] if stack.ops[j] else value

        with graph.inserting_before(last.next):  # (each new node after the one before)
            depth = len(template.linears)
            for j in range(depth):
                name = f"fused_stacks{merged}_{j}"
                gm.add_submodule(name, _merged_linear([(gm.get_submodule(s.linears[j].target), _name(
                    s.linears[j])) for s in stacks], j == 0, mean is not None and j == depth - 1))
                cur = graph.call_module(name, (cur,))
                if j + 1 < depth:
                    cur = copy_region(template, j, cur)
            start = 0
            tails = []
            for s in stacks if mean is None else ():  # each stack's columns of the last layer, then its own ops
                width = gm.get_submodule(s.linears[-1].target).out_features
                part = graph.call_function(operator.getitem, (cur, (Ellipsis, slice(start, start + width))))
                tails.append(copy_region(s, len(s.linears) - 1, part))
                start += width
        if mean is not None:  # (the mean is the chain's output; the stack it read goes)
            mean.replace_all_uses_with(cur)
            graph.erase_node(mean)
            graph.erase_node(found[0])
        for s, tail in zip(stacks, tails):
            s.end.replace_all_uses_with(tail)
        kept = {n.target for n in graph.nodes if n.op == "call_module"}
        for s in stacks:
            for node in reversed(s.nodes()):
                graph.erase_node(node)
                if node.op == "call_module" and node.target not in kept:
                    activations.pop(node.target, None)  # (a module activations= maps that no copy runs)
        merged += 1
    if merged:
        graph.lint()
        gm.recompile()
    return stacked
