"""fusedmlp.torch's reading of a module torch.fx traces: its graph walked as a chain of layers (read_traced)."""

import operator

import numpy as np
import torch
from torch import nn

from . import _encoding
from ._layers import Layers, activation_runs, affine_map, compose as _compose, graph_edges, pieces_text, then_map
from ._torch_fx_branch import Branches
from ._torch_fx_trunks import merge_trunks
from ._torch_fx_nodes import (F, TRACED_SUPPORTED, _ADD, _ARITH, _ARITH_METHODS, _ASIDE, _DROPOUT_FUNCTIONS,
                              _FOLD_FUNCTIONS, _FOLD_METHODS, _FUNCTIONS, _METHODS, _MUL, _SAME_METHODS, _arg,
                              _expression, _functional_text, _is_parametrization_call, _over, _scalar_text,
                              _traced_attr, _traced_constant_op, _traced_flatten, _traced_matmul_weight, _traced_norm,
                              _traced_softmax, _weight_view)
from ._torch_modules import (_DROPOUTS, _activation_text, _batchnorm_affine, _check_dropout_off, _effective,
                             _numpy64)
from .errors import ArgumentError


def _forward_params(module):
    """forward's parameters (inspect.Parameter), or none where its signature cannot be read."""
    import inspect

    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _flag_defaults(module):
    """forward's parameters after its inputs that have a number, bool or None default (nerf_pl's sigma_only=False):
    traced at their defaults, as a call that passes only the inputs runs them, so an `if` on one is plain Python."""
    flags = {p.name: p.default for p in _forward_params(module) if p.default is not p.empty
             and (p.default is None or isinstance(p.default, (bool, int, float)))}
    return flags or None


_SHAPE_FUNCTIONS = (getattr, len, operator.getitem, operator.gt, operator.ge, operator.lt, operator.le,
                    operator.eq, operator.ne, operator.add, operator.sub, operator.mul, operator.floordiv,
                    operator.mod, operator.not_, operator.and_, operator.or_)
_SHAPE_ATTRS = ("shape", "ndim")
_SHAPE_METHODS = ("size", "dim")


class _ShapeTracer(torch.fx.Tracer):
    """torch.fx's tracer, but an `if` on the input's shape (DeepSDF's `if input.shape[1] > 3 and ...`) takes the branch
    a (rows, width) input takes, as a call does: the condition is evaluated on meta tensors of two row counts, and one
    that reads more than the shape, or whose answer depends on the row count, stays torch.fx's error. The conditions'
    nodes are dropped from the graph after the trace (prune), so the walk never meets them."""

    def __init__(self, width):
        super().__init__()
        self.width = width
        self.decided = []

    def to_bool(self, obj):
        answers = {bool(self.shape_value(obj.node, rows)) for rows in (2, 3)}
        if len(answers) > 1:
            raise torch.fx.proxy.TraceError(f"an `if` on {obj.node.name} depends on the number of rows")
        self.decided.append(obj.node)
        return answers.pop()

    def shape_value(self, node, rows):
        def value(a):
            if isinstance(a, torch.fx.Node):
                return self.shape_value(a, rows)
            if isinstance(a, (tuple, list)):
                return type(a)(value(b) for b in a)
            return a

        if node.op == "placeholder" and node.target == self.input_name:
            return torch.empty((rows, self.width), device="meta")
        if node.op == "call_function" and node.target in _SHAPE_FUNCTIONS and (
                node.target is not getattr or node.args[1] in _SHAPE_ATTRS):
            return node.target(*value(node.args), **value(node.kwargs))
        if node.op == "call_method" and node.target in _SHAPE_METHODS:
            return getattr(value(node.args[0]), node.target)(*value(node.args[1:]))
        raise torch.fx.proxy.TraceError(f"symbolically traced variables cannot be used as inputs to control flow "
                                        f"({node.name} is more than the input's shape)")

    def prune(self, graph):
        """Drops the decided conditions and what only they read (the shape queries behind them)."""
        _erase_unused(graph, self.decided, lambda n: n.op in ("call_function", "call_method"))


def _first_width(module):
    """The in_features of module's first Linear (in the order its modules were registered): the input width a
    forward that branches on the input's shape is traced at (checked against the read model, read_traced)."""
    return next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)


def _trace(module, flags, in_features=None):
    """module's torch.fx GraphModule, and the input width an `if` on the input's shape was decided at (or None):
    in_features where given, else the first Linear's."""
    def fail(e):
        return ArgumentError(f"{type(module).__name__} is not an nn.Sequential and torch.fx cannot trace it: {e}")

    try:
        gm = torch.fx.symbolic_trace(module, concrete_args=flags)
        _drop_unused_reads(gm.graph)
        gm.recompile()
        return gm, None
    except torch.fx.proxy.TraceError as e:  # control flow: on the input's shape, a single input, read below
        width, first = in_features or _first_width(module), e
    except Exception as e:  # data-dependent control flow and the like
        raise fail(e) from None
    inputs = [p.name for p in _forward_params(module) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.name not in (flags or {})]
    if width is None or len(inputs) != 1:
        raise fail(first) from None
    tracer = _ShapeTracer(width)
    tracer.input_name = inputs[0]
    try:
        graph = tracer.trace(module, concrete_args=flags)
    except Exception as e:
        raise fail(e) from None
    tracer.prune(graph)
    _drop_unused_reads(graph)
    return torch.fx.GraphModule(tracer.root, graph, type(module).__name__), width


def _drop_unused_reads(graph):
    """Drops indexing and shape queries whose value nothing reads (DeepSDF's xyz = input[:, -3:] where its options
    leave xyz unused): they change nothing, and a slice without its end would otherwise be refused."""
    def read(n):
        return (n.op == "call_function" and n.target in (operator.getitem, getattr)) or (
            n.op == "call_method" and n.target in ("size", "dim"))

    _erase_unused(graph, list(graph.nodes), read)


def _erase_unused(graph, nodes, erasable):
    """Erases each of nodes that nothing reads and erasable takes, then the same among what it read."""
    todo, gone = list(nodes), set()
    while todo:
        node = todo.pop()
        if node not in gone and not node.users and erasable(node):
            todo.extend(node.all_input_nodes)
            graph.erase_node(node)
            gone.add(node)


class _Tracer(Branches):
    """One walk over a traced module's graph (read_traced). Each node goes to the first handler that takes it; the
    chain's state (the current value, the values a residual may read, the layers) lives here."""

    def __init__(self, module, activations, in_features=None):
        self.module = module
        self.activations = dict(activations or {})
        flags = _flag_defaults(module)
        self.flags = flags or {}  # (their placeholders and torch.fx's guards on them are skipped: guard)
        self.gm, self.assumed_width = _trace(module, flags, in_features)
        self.output_stack = merge_trunks(self.gm, self.activations)  # parallel stacks: one chain (_torch_fx_trunks)
        self.width_given = in_features is not None
        self.layers = Layers(_numpy64)
        self.residual, self.concat = [], {}
        self.cur = self.x_node = self.pending_cat = None
        self.cat_scale = 1.0  # a number the pending input concat was multiplied by before its Linear (cat_scale_op)
        self.value_of = {}  # node -> value index: -1 the network input, l layer l's output (once layer l + 1 starts)
        self.folded = {}  # node -> label: a BatchNorm1d's output folded into the next Linear (no value the kernel keeps)
        self.same = {}  # node -> node: an Identity's or eval-mode Dropout's output -> its input (one value, two names)
        # node -> the current layer's activation up to it, as expression text over the layer's output x ("x" for the
        # output itself): the values a product or sum of two of them may take (x * sigmoid(x) spelled out)
        self.act_path = {}
        self.squeeze = None  # the dim of a squeeze of the network's output (a value head's y.squeeze(-1)), or ()
        self.read_by_last = None  # the value the last Linear read (no fold or concat between): a head may join it
        self.out_heads = []  # (node, width): Linears merged on one value as the network's outputs, in order
        self.head_acts = []  # each head's activation (head_activation): the last layer's column pieces at the end
        self.head_sums = {}  # node -> matrix: a linear combination of the heads' columns (heads_combination)
        self.before_bn = None  # the node a pending BatchNorm1d normalized: the previous layer's output as kept
        self.shapes = {}  # shape-query nodes of the input (x.size(0), x.shape, ...) -> the node they query
        self.dims = {}  # after the first Linear: h.shape / h.size() -> (h, None), h.size(d) / h.shape[d] -> (h, d)
        self.placeholders, self.input_order = [], None  # forward's inputs; with several, their order in the join
        self.heads, self.maps = {}, []  # several inputs before their join: latest node -> index; each one's map
        self.consts = {}  # node -> its value (float64 tensor, or a number): arithmetic on constants alone
        # a positional encoding of the input (encoding_candidates): torch.cat node -> its parts, and the nodes of those
        self.encodings, self.encoding_parts = self.encoding_candidates()
        self.init_branches()  # slices of the input, values carried to the output (_torch_fx_branch)
        self.x_width = self.assumed_width  # (an `if` on x.shape fixed x's width: x[:, -3:] reads with it)

    def run(self):
        for node in self.gm.graph.nodes:
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
            label = f"{node.name} ({target})"
            if self.out_heads and any(h in node.all_input_nodes for h, _ in self.out_heads) or any(
                    v in self.head_sums for v in node.all_input_nodes):
                if node.op != "output" and (self.head_activation(node) or self.heads_cat(node, label)
                                            or self.heads_combination(node, label)):
                    continue
                if self.head_sums:  # the combination ends here: it becomes the last layer (fold_combination)
                    self.fold_combination(node, label)
                elif node.op != "output":
                    self.lead_head(node, label)  # forward goes on from one head, the others ride along (NeRF's alpha)
            if node.op == "output":
                if self.out_heads and self.heads_output(node, label):
                    break
                if self.output_parts(node, label):
                    break
                if node.args[0] is not self.cur or self.pending_cat is not None:
                    raise ArgumentError(f"{label}: the output is not the end of the layer chain; supported: "
                                        f"{TRACED_SUPPORTED}")
                break
            if node in self.encoding_parts or self.guard(node):  # (encoding parts: read where their torch.cat is)
                continue
            if self.placeholder(node) or self.fold_constant(node) or self.before_join(node, label):
                continue
            if self.encoding(node, label):
                self.cur = node
                continue
            if (node.op == "get_attr" or _is_parametrization_call(self.gm, node) or self.input_shape(node, label)
                    or self.shape_query(node) or _weight_view(node) is not None):  # (W.T: read by its h @ W.T)
                continue
            self.inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
            self.leaf = self.gm.get_submodule(node.target) if node.op == "call_module" else None
            self.text = self.activations.pop(node.target, None) if node.op == "call_module" else None
            for handler in (self.input_slice, self.output_split, self.output_slice, self.linear, self.carried_output, self.batchnorm, self.l2_normalize, self.norm, self.cat, self.passthrough,
                            self.squeeze_output, self.constant_op, self.residual_op, self.activation):
                taken = handler(node, label)
                if taken:
                    break
            if taken is not _ASIDE:
                self.cur = node
        return self.finish()

    def guard(self, node):
        """A flag traced at its default (_flag_defaults): its placeholder, and torch.fx's check of its value."""
        def flag(n):  # (torch.fx names such a placeholder after the parameter and keeps its value as its args)
            return isinstance(n, torch.fx.Node) and n.op == "placeholder" and bool(self.flags) and len(n.args) == 1

        if node.op == "placeholder":
            return flag(node)
        return node.op == "call_function" and (node.target is torch._assert or (
            (node.target in (operator.eq, operator.is_) or getattr(node.target, "__name__", "") == "_assert_is_none")
            and any(flag(a) for a in node.args)))

    def placeholder(self, node):
        if node.op != "placeholder":
            return False
        self.heads[node] = len(self.placeholders)
        self.maps.append(None)
        self.placeholders.append(node)
        if self.cur is None:
            self.cur = self.x_node = node
            self.value_of[node] = -1
        return True

    def encoding_candidates(self):
        """Positional encodings of the network input written in forward (NeRF's embedder): a torch.cat over the last
        dim whose parts are x itself, or sin / cos of x or of x times a constant (a number, a parameter or buffer, or
        arithmetic on those), each such node read by the cat alone. -> ({cat: [(kind, scale node or None)]}, the
        nodes of those parts), x's part as ('x', None); found by shape before the walk, read at the cat (encoding)."""
        x = next((n for n in self.gm.graph.nodes if n.op == "placeholder"), None)
        found, inner = {}, set()
        # x times a constant before the encoding (NeuS's inputs * self.scale): its parts are of x, their scales times it
        pre = {n: (n.args[1] if n.args[0] is x else n.args[0]) for n in self.gm.graph.nodes
               if _ARITH.get(n.target) == "mul" and n.op == "call_function" and len(n.args) == 2 and x in n.args
               and not (isinstance(n.args[0], torch.fx.Node) and isinstance(n.args[1], torch.fx.Node)
                        and n.args[0].op == n.args[1].op == "placeholder")}
        for node in self.gm.graph.nodes:
            if not (node.op == "call_function" and node.target is torch.cat and isinstance(node.args[0], (list, tuple))
                    and _arg(node, 1, "dim", 0) in (-1, 1) and x is not None):
                continue
            parts, nodes = [], set()
            for p in node.args[0]:
                if p is x or p in pre:
                    parts.append(("x", pre.get(p)))
                    nodes |= {p} & set(pre)
                    continue
                kind = (_FUNCTIONS.get(p.target) if isinstance(p, torch.fx.Node) and p.op == "call_function" else
                        _METHODS.get(p.target) if isinstance(p, torch.fx.Node) and p.op == "call_method" else None)
                if kind not in ("sin", "cos") or len(p.all_input_nodes) != 1 or set(p.users) != {node}:
                    break
                q = p.all_input_nodes[0]
                scale = pre.get(q)
                if q is not x and q not in pre:
                    op = (_ARITH.get(q.target) if q.op == "call_function" else
                          _ARITH_METHODS.get(q.target) if q.op == "call_method" else None)
                    base = next((a for a in q.args if a is x or a in pre), None) if op == "mul" else None
                    if base is None or len(q.args) != 2 or not set(q.users) <= set(node.args[0]):
                        break  # (a product may feed both a sin and a cos part)
                    scale = q.args[1] if q.args[0] is base else q.args[0]
                    if base in pre:
                        scale, _ = (scale, pre[base]), nodes.add(base)
                    nodes.add(q)
                elif q in pre:
                    nodes.add(q)
                nodes.add(p)
                parts.append((kind, scale))
            else:
                if any(k != "x" for k, _ in parts):
                    found[node] = parts
                    inner |= nodes
        return found, inner

    def encoding(self, node, label):
        """A positional encoding of the network input (encoding_candidates) at its torch.cat: FusedMLP's encoding=
        (Layers.input_encoding), computed in the kernel as x is loaded. Its value is the network input as the layers
        see it, so the Linear reading it is layer 0 and a later torch.cat of it (NeRF's skip) a concat of x."""
        if node not in self.encodings:
            return False
        parts, layers = self.encodings[node], self.layers
        if self.cur is not self.x_node or layers.weights or layers.pending is not None or len(self.placeholders) > 1:
            raise ArgumentError(f"{label}: a positional encoding (sin / cos of x in a torch.cat) of anything but the "
                                "network input itself, before any Linear or constant map, is not read")
        def value(c):  # a constant argument (a number, a node), or a product of two (x scaled first: pre)
            if isinstance(c, tuple):
                return np.asarray(value(c[0]), np.float64) * np.asarray(value(c[1]), np.float64)
            c = self.constant(c, label) if isinstance(c, torch.fx.Node) else c
            return c.detach().cpu().double().numpy() if isinstance(c, torch.Tensor) else c

        scales = [(kind, None if c is None else value(c)) for kind, c in parts]
        layers.input_encoding(scales, label)
        self.x_node = node
        self.value_of[node] = -1  # (a residual or concat of the encoded input reads x as the kernel sees it)
        self.act_path = {}
        return True

    def constant(self, node, label):
        """The value a constant argument stands for: a node folded while reading (consts), else what _traced_attr
        reads (a parameter or buffer, a parametrized weight, a number or None as given; an error for anything else)."""
        return self.consts[node] if node in self.consts else _traced_attr(self.module, node, label)

    def fold_constant(self, node):
        """A deterministic op (_FOLD_FUNCTIONS, _FOLD_METHODS) of constants alone (numbers, parameters and buffers,
        nodes folded before): evaluated here in float64, so that the ops which read it see one constant ((ub - lb)
        of a PINN's input scaling, a frequency vector times 2 pi). Nothing of the chain's values is read."""
        if node.op == "call_function":
            known = node.target in _FOLD_FUNCTIONS
        else:
            known = node.op == "call_method" and node.target in _FOLD_METHODS
        inputs = node.all_input_nodes
        if not known or not inputs or not all(n in self.consts or n.op == "get_attr" for n in inputs):
            return False

        def value(n):
            v = self.constant(n, n.name)
            return v.detach().to(torch.float64).cpu() if isinstance(v, torch.Tensor) else v

        args = torch.fx.node.map_arg(node.args, value)
        kwargs = torch.fx.node.map_arg(node.kwargs, value)
        if node.op == "call_method" and node.target in ("float", "to"):  # (stays float64: the fold's precision)
            self.consts[node] = args[0]
            return True
        try:
            result = node.target(*args, **kwargs) if node.op == "call_function" else \
                getattr(args[0], node.target)(*args[1:], **kwargs)
        except Exception:  # (not a tensor op after all: left to the handlers, which name what they refuse)
            return False
        if not isinstance(result, (torch.Tensor, int, float)) or isinstance(result, bool):
            return False
        self.consts[node] = result.to(torch.float64) if isinstance(result, torch.Tensor) else result
        return True

    def before_join(self, node, label):
        """Several inputs before one torch.cat joins them: an input's own affine map ((obs - mean) / std), or that
        torch.cat (a critic's [obs, act]: the kernel's x, the maps folded into the first Linear)."""
        if len(self.placeholders) < 2 or self.input_order is not None or self.layers.weights:
            return False
        heads, maps = self.heads, self.maps
        const = _traced_constant_op(self.module, node, None, label, heads, self.consts)
        if const is not None:
            op, c, c_first, head = const
            i = heads.pop(head)
            maps[i] = then_map(maps[i], *affine_map(op, c, c_first, label), label)
            heads[node] = i
            return True
        if (node.op == "call_function" and node.target is torch.cat and isinstance(node.args[0], (list, tuple))
                and sorted(heads.get(p, -1) for p in node.args[0]) == list(range(len(self.placeholders)))
                and _arg(node, 1, "dim", 0) in (-1, 1)):
            self.input_order = [heads[p] for p in node.args[0]]
            self.layers.set_input_parts([maps[i] for i in self.input_order])
            self.cur = self.x_node = node
            self.value_of[node] = -1
            return True
        return False

    def input_shape(self, node, label):
        """Before the first Linear: a shape query of the input, or a flatten / view of it (flatten_input)."""
        layers = self.layers
        if layers.weights:
            return False
        if (node.op == "call_method" and node.target == "size") or (
                node.op == "call_function" and node.target is getattr and node.args[1] == "shape"):
            self.shapes[node] = node.args[0]  # for a view of the input (_traced_flatten)
            return True
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.shapes:
            self.shapes[node] = self.shapes[node.args[0]]
            return True
        start = _traced_flatten(node, self.cur, self.shapes) if self.cur is self.x_node else None
        if isinstance(start, tuple):  # x.view(-1, K)
            start, layers.flatten_width = start
        if start is None:
            return False
        if start == -1:
            raise ArgumentError(f"{label}: a view or flatten of the input that is not x.view(x.size(0), -1) or "
                                "torch.flatten(x, start_dim) through the last dim; fusedmlp flattens an input's dims "
                                "from start_dim on")
        layers.flatten_input(start, -1, label)
        self.cur = self.x_node = node  # the kernel's input is the flattened x (a concat or residual of x reads it)
        self.value_of[node] = -1
        return True

    def squeeze_output(self, node, label):
        """y.squeeze(-1) / torch.squeeze(y, -1) (dim -1 or 1, or none) of the network's output, as a value head writes
        it: the model gives y as (rows, outputs); FusedModule squeezes it as the module does (read_module's edges name
        the dim, "squeeze")."""
        if not ((node.op == "call_method" and node.target == "squeeze") or
                (node.op == "call_function" and node.target is torch.squeeze)):
            return False
        dims = node.args[1:] if len(node.args) > 1 else tuple(node.kwargs.values())
        if not self.takes_cur() or not self.layers.weights or [u.op for u in node.users] != ["output"] or (
                dims and (len(dims) != 1 or dims[0] not in (-1, 1))):
            raise ArgumentError(f"{label}: a squeeze of a value other than the network's output, or over a dim other "
                                "than the features; fusedmlp reads y.squeeze(-1) of the output (a value head)")
        self.squeeze = (-1,) if dims else ()
        return True

    def shape_query(self, node):
        """A shape query of a value after the first Linear (h.shape, h.size(), h.size(-1), h.shape[-1:]), which a
        norm's normalized_shape may read (F.layer_norm(h, h.shape[-1:])): noted, the chain left where it is."""
        if not self.layers.weights:
            return False
        if node.op == "call_method" and node.target == "size" and isinstance(node.args[0], torch.fx.Node):
            dim = _arg(node, 1, "dim", None)
            self.dims[node] = (node.args[0], dim)
        elif node.op == "call_function" and node.target is getattr and node.args[1:] == ("shape",):
            self.dims[node] = (node.args[0], None)
        elif (node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.dims
                and self.dims[node.args[0]][1] is None):
            self.dims[node] = (self.dims[node.args[0]][0], node.args[1])
        else:
            return False
        return _ASIDE

    def norm_shape(self, shape, label):
        """A norm's normalized_shape as numbers: one given as numbers, or the normalized value's last dimension read
        from it (h.shape[-1:], (h.size(-1),), [h.shape[-1]]): the width of the layer before the norm."""
        def last(n):  # whether n reads the last dimension of the chain's value: as a slice [-1:], or as an index -1
            if not isinstance(n, torch.fx.Node) or n not in self.dims:
                return None
            value, dim = self.dims[n]
            if self.root(value) is not self.root(self.cur):
                return None
            return "slice" if dim == slice(-1, None) else "index" if dim == -1 else None

        items = shape if isinstance(shape, (tuple, list)) else (shape,)
        if not any(isinstance(n, torch.fx.Node) for n in items):
            return shape
        if not self.layers.weights:
            raise ArgumentError(f"{label}: a norm of the network input whose normalized_shape is read from a tensor; "
                                "fusedmlp reads it there as numbers (the input's feature count)")
        whole = last(shape) == "slice" if isinstance(shape, torch.fx.Node) else (
            len(items) == 1 and last(items[0]) == "index")
        if not whole:
            raise ArgumentError(f"{label}: a normalized_shape read from a tensor other than as the normalized value's "
                                "last dimension (h.shape[-1:], (h.size(-1),)); fusedmlp normalizes over the features")
        return (self.layers.weights[-1].shape[0],)

    def side_value(self):
        """The node's one tensor input where it is a value of the current layer's activation other than the chain's
        (the layer's output, or a function of it, read again beside the chain), before any residual op; else None."""
        inputs = self.inputs
        if len(inputs) == 1 and inputs[0] is not self.cur and inputs[0] in self.act_path and self.residual and \
                self.residual[-1] is None:
            return inputs[0]
        return None

    def takes_cur(self):
        return bool(self.inputs) and self.inputs[0] is self.cur

    def linear(self, node, label):
        leaf, layers = self.leaf, self.layers
        matmul = _traced_matmul_weight(self.module, node, label, self.consts) if self.text is None else None
        is_linear = (leaf is not None and isinstance(leaf, nn.Linear) and self.text is None) or (
            node.op == "call_function" and node.target is F.linear) or matmul is not None
        if self.pending_cat is not None and not is_linear:
            if self.cat_scale_op(node, label):
                return True
            raise ArgumentError(f"{label}: torch.cat of the hidden state with the input must feed a Linear directly "
                                "(or through a multiplication or division by a number)")
        if not is_linear:
            return False
        if matmul is not None:  # h @ W: its bias, if any, is the Add after it (a per-feature map folded into it)
            w, b = matmul, None
        elif leaf is not None:
            w, b = _effective(leaf, "weight", node.target), _effective(leaf, "bias", node.target)
        else:
            w, b = (self.constant(a, label) for a in (node.args[1], _arg(node, 2, "bias", None)))
        w, b = (None if v is None else np.asarray(_numpy64(v) if isinstance(v, torch.Tensor) else v, np.float64)
                for v in (w, b))  # (float64 once: the rewrites below and head work on arrays)
        if not (self.inputs and (self.inputs[0] in self.x_slices or self.inputs[0] in self.x_maps)) and \
                not self.takes_cur():
            if self.head(node, w, b, label):
                return _ASIDE
            raise ArgumentError(f"{label}: a Linear that does not take the previous layer's output")
        self.branch_linear(label)  # (values riding along: the last layer's rows for them first)
        w = self.place_columns(w, label)
        plain = self.pending_cat is None and layers.pending is None and layers.pending_parts is None
        if self.pending_cat is not None:
            self.concat[len(layers.weights)] = self.pending_cat
            self.pending_cat = None
            w, self.cat_scale = w * self.cat_scale, 1.0  # (NeuS's torch.cat([x, inputs], 1) / sqrt(2): into W)
        else:
            self.keep_input()
        layers.linear64(w, b, label)
        self.residual.append(None)
        self.act_path = {node: "x"}
        self.read_by_last = self.cur if plain else None  # (a second head on it joins this Linear: head)
        return True

    def head(self, node, w, b, label):
        """Another Linear on the value the last Linear read, while that one has no activation, norm or residual yet
        (an actor-critic's pi(h), v(h) on one trunk): its rows join the last Linear's, and both are heads of the
        network, the outputs FusedModule returns as a tuple (read_module's edges: "outputs", their widths)."""
        layers = self.layers
        if self.read_by_last is None or self.root(self.inputs[0]) is not self.root(self.read_by_last):
            return False
        if (layers.pending is not None or layers.norms[-1] is not None or self.residual[-1] is not None
                or (layers.open and layers.acts[-1] != "none")):
            raise ArgumentError(f"{label}: a second Linear on the value the last one read, after that one's "
                                "activation, norm or residual; fusedmlp merges heads on one value that are the "
                                "network's outputs as they are (return pi(h), v(h))")
        last_w, last_b = layers.weights[-1], layers.biases[-1]
        if w.ndim != 2 or w.shape[1] != last_w.shape[1]:
            raise ArgumentError(f"{label}: a head of {w.shape} beside a Linear of {last_w.shape} on the same value")
        if not self.out_heads:  # (the first head's activation so far becomes its own: head_acts)
            self.out_heads, self.head_acts = [(self.cur, last_w.shape[0])], [layers.acts[-1]]
            layers.acts[-1] = "none"
        self.out_heads.append((node, w.shape[0]))
        self.head_acts.append("none")
        layers.stack_rows([(last_w, last_b), (w, b)])
        return True

    def head_activation(self, node):
        """An activation of one head (torch.tanh(self.pi(h)) beside self.v(h)): that head's, its columns' piece of the
        last layer's activation (head_pieces)."""
        ins = [a for a in node.args if isinstance(a, torch.fx.Node)]
        heads = [h for h, _ in self.out_heads]
        if len(ins) != 1 or ins[0] not in heads or node.all_input_nodes != ins:
            return False
        text = self.activation_text(node, self.activations.get(node.target) if node.op == "call_module" else None)
        if text is None:  # a number times, over, plus or minus the head: part of its activation
            const = _traced_constant_op(self.module, node, ins[0], node.name, consts=self.consts)
            if const is None or np.ndim(const[1]) != 0:
                return False
            text = _scalar_text(*const)
        if node.op == "call_module":
            self.activations.pop(node.target, None)
        i = heads.index(ins[0])
        self.head_acts[i] = text if self.head_acts[i] == "none" else _compose(text, self.head_acts[i])
        self.out_heads[i] = (node, self.out_heads[i][1])
        return True

    def heads_combination(self, node, label):
        """A linear combination of the heads' columns (a dueling Q-network's v + a - a.mean(-1, keepdim=True)): a sum
        or difference of two heads or combinations (a one-column one broadcast over the other's columns), a mean over
        the features kept as one column, a number times or over one; kept as a matrix over the last layer's rows
        (head_sums) until forward reads it otherwise (fold_combination). Heads without activations only; slices of
        the last layer's output as they are combine alike (output_slice, slice_matrix)."""
        if any(a != "none" for a in self.head_acts) or not (self.out_heads or self.head_sums or self.out_slices):
            return False
        total = self.layers.weights[-1].shape[0]

        def matrix(v):  # v's columns as rows over the last layer's outputs, or None
            if v in self.head_sums:
                return self.head_sums[v]
            if v in self.out_slices:  # (a slice of the layer's output, as it is: output_slice)
                return self.slice_matrix(v)
            at = 0
            for h, n in self.out_heads:
                if v is h:
                    return np.eye(total)[at:at + n]
                at += n
            return None

        op = (_ARITH.get(node.target) if node.op == "call_function" else
              _ARITH_METHODS.get(node.target) if node.op == "call_method" else None)
        ins = node.all_input_nodes
        if op in ("add", "sub") and len(node.args) == 2 and not node.kwargs and len(ins) == 2:
            a, b = (matrix(v) for v in node.args)
            if a is None or b is None or (len(a) != len(b) and 1 not in (len(a), len(b))):
                return False
            a, b = (np.repeat(m, max(len(a), len(b)), 0) if len(m) == 1 else m for m in (a, b))
            combined = a + b if op == "add" else a - b
        elif len(ins) == 1 and ((node.op == "call_method" and node.target == "mean")
                                or (node.op == "call_function" and node.target is torch.mean)):
            m = matrix(ins[0])
            if m is None or _arg(node, 1, "dim", None) not in (-1, 1) or not _arg(node, 2, "keepdim", False):
                return False
            combined = m.mean(axis=0, keepdims=True)
        elif op in ("mul", "div") and len(ins) == 1 and ins[0] in self.head_sums:
            const = _traced_constant_op(self.module, node, ins[0], label, consts=self.consts)
            if const is None or np.ndim(const[1]) != 0 or (op == "div" and const[2]):
                return False
            combined = self.head_sums[ins[0]] * (const[1] if op == "mul" else 1.0 / const[1])
        else:
            return False
        self.head_sums[node] = combined
        return True

    def fold_combination(self, node, label):
        """forward reads a linear combination of the heads (heads_combination) otherwise, returning it or going on
        from it: the last layer becomes the combination of its rows (exact in float64: W' = M W, b' = M b), the
        chain's value."""
        read = [v for v in node.all_input_nodes if v in self.head_sums]
        if len(read) != 1 or any(h in node.all_input_nodes for h, _ in self.out_heads) or any(
                v in self.out_slices for v in node.all_input_nodes):
            raise ArgumentError(f"{label}: it reads Linear heads merged on one value other than through one linear "
                                "combination of them (a dueling head's v + a - a.mean(-1, keepdim=True): sums, "
                                "differences, a mean over the features kept as one column, numbers times it); "
                                "fusedmlp folds one such combination into the last layer, which forward then reads "
                                "alone")
        m, layers = self.head_sums[read[0]], self.layers
        layers.weights[-1] = m @ layers.weights[-1]
        layers.biases[-1] = None if layers.biases[-1] is None else m @ layers.biases[-1]
        self.out_heads, self.head_acts, self.head_sums = [], [], {}
        self.out_slices = {}  # (slices of the layer before the fold: its rows are the combination's now)
        self.cur, self.act_path = read[0], {read[0]: "x"}

    def heads_output(self, node, label):
        """forward returning every head once, as a tuple or a dict, in any order: the last layer's rows in that
        order, the outputs FusedModule gives back (read_module's edges: "outputs", "output_keys")."""
        out = node.args[0]
        keys = list(out) if isinstance(out, dict) else None
        order = self.head_order(list(out.values()) if keys else out)
        if order is None:
            return False
        self.reorder_heads(order, label)
        self.part_widths, self.part_keys = [self.out_heads[i][1] for i in order], keys
        self.out_heads, self.head_acts = [], []
        return True

    def head_order(self, parts):
        """Each head's index where parts (a tuple or list of nodes) are every head once, in any order; else None."""
        heads = [h for h, _ in self.out_heads]
        if not isinstance(parts, (list, tuple)) or len(parts) != len(heads) or sorted(
                heads.index(p) if p in heads else -1 for p in parts) != list(range(len(heads))):
            return None
        return [heads.index(p) for p in parts]

    def reorder_heads(self, order, label):
        """The last layer's rows in the heads' `order`, their activations its column pieces (head_pieces)."""
        offsets = np.cumsum([0] + [n for _, n in self.out_heads]).tolist()
        rows = [r for i in order for r in range(offsets[i], offsets[i + 1])]
        layers = self.layers
        layers.weights[-1] = layers.weights[-1][rows]
        layers.biases[-1] = None if layers.biases[-1] is None else layers.biases[-1][rows]
        self.head_pieces(order, label)

    def heads_cat(self, node, label):
        """torch.cat of every head once, over the features (NeRF's torch.cat([sigmoid(rgb), softplus(sigma)], -1)):
        the last layer's rows in the cat's order, one output."""
        order = self.head_order(node.args[0]) if node.op == "call_function" and node.target is torch.cat and \
            node.args and _arg(node, 1, "dim", 0) in (-1, 1) else None
        if order is None:
            return False
        self.reorder_heads(order, label)
        self.out_heads, self.head_acts, self.cur = [], [], node
        self.act_path = {node: "x"}
        return True

    def head_pieces(self, order, label):
        """The heads' activations (in the output's head order) as the last layer's column pieces, where any has one."""
        if any(a != "none" for a in self.head_acts):
            runs = activation_runs((self.head_acts[i], self.out_heads[i][1]) for i in order)
            self.layers.acts[-1] = pieces_text(runs, self.layers.acts[-1], label)

    def batchnorm(self, node, label):
        if self.leaf is None or self.text is not None or not isinstance(self.leaf, nn.BatchNorm1d):
            return False
        if not self.takes_cur():
            raise ArgumentError(f"{node.target}: a BatchNorm1d that does not take the previous layer's output")
        after_linear = self.layers.open  # (folded into its output side: the activation starts here)
        if self.layers.pending is None and not self.layers.open:
            self.before_bn = self.cur
        self.layers.batchnorm(*_batchnorm_affine(self.leaf, node.target), node.target)
        self.act_path = {node: "x"} if after_linear else {}
        return True

    def l2_normalize(self, node, label):
        """F.normalize(z, p=2, dim=-1) of a Linear's output (an embedding head): the layer's fused rmsnorm."""
        if node.op != "call_function" or node.target is not F.normalize:
            return False
        if not self.takes_cur() or _arg(node, 1, "p", 2.0) != 2 or _arg(node, 2, "dim", 1) not in (-1, 1):
            raise ArgumentError(f"{label}: F.normalize of another value, p or dim; fusedmlp fuses "
                                "F.normalize(z, p=2, dim=-1) of a Linear's output z")
        self.layers.l2_normalize(_arg(node, 3, "eps", 1e-12), label)
        self.act_path = {node: "x"}
        return True

    def norm(self, node, label):
        """A LayerNorm / RMSNorm, or a softmax: right after a Linear whose output nothing else reads, the layer's fused
        norm; anywhere else (the network input, a residual's sum, after an activation: a pre-norm block's
        LayerNorm(h) beside h + f(...)) on an identity layer of its own (Layers.norm_layer), the value it reads kept
        as the previous layer's output, so that a residual may still read it."""
        leaf = self.leaf if self.text is None else None
        norm = _traced_norm(self.module, node, leaf, label)
        if norm is not None:
            norm = (norm[0], self.norm_shape(norm[1], label), *norm[2:])
        soft = None if norm is not None else _traced_softmax(node, leaf)
        if norm is None and soft is None:
            return False
        if not self.takes_cur():
            raise ArgumentError(f"{label}: a {'norm' if soft is None else 'softmax'} that does not take the previous "
                                "layer's output")
        where = node.target if self.leaf is not None else label
        names = self.names(self.cur)  # the value's names through Identity / Dropout, and what reads any of them
        readers = {user for name in names for user in name.users} - names - set(self.dims)  # (not shape queries)
        own = len(readers) > 1 or not self.layers.fusable()
        if own:  # the value it reads becomes the identity layer's input, as a Linear taking it would make it
            self.keep_input()
            self.residual.append(None)
        if soft is None:
            self.layers.norm(*norm, where, own=own)
        else:
            self.layers.softmax(*soft, where, own=own)
        self.act_path = {node: "x"}
        return True

    def cat(self, node, label):
        """torch.cat of the hidden state with the network input (or a slice of it) right before a Linear: that layer's
        input concat."""
        if node.op != "call_function" or node.target is not torch.cat:
            return False
        parts, dim = node.args[0], _arg(node, 1, "dim", 0)
        if self.fourier(node, parts, dim, label):
            return True
        other = [p for p in parts if p is not self.cur] if isinstance(parts, (list, tuple)) else []
        if (len(parts) != 2 or len(other) != 1 or (other[0] is not self.x_node and other[0] not in self.x_slices)
                or self.cur is self.x_node or dim not in (-1, 1)):
            raise ArgumentError(f"{label}: only torch.cat([h, x], -1) or torch.cat([x, h], -1) of the hidden state h "
                                "with the network input x (or a slice of it) is supported")
        self.cat_slice = self.x_slices.get(other[0])  # (a slice: its features of x, place_columns)
        self.layers.unfoldable(label, "torch.cat")
        self.keep(self.cur, len(self.layers.weights) - 1)
        self.pending_cat = "after" if parts[0] is self.cur else "before"
        return True

    def cat_scale_op(self, node, label):
        """A number times (or over) an input concat before its Linear (NeuS's torch.cat([x, inputs], 1) / sqrt(2)):
        the Linear's weights take the factor (cat_scale)."""
        const = _traced_constant_op(self.module, node, self.cur, label, consts=self.consts)
        if const is None or np.ndim(const[1]) != 0 or const[0] not in ("mul", "div") or (const[0] == "div" and const[2]):
            return False
        self.cat_scale *= float(const[1]) if const[0] == "mul" else 1.0 / float(const[1])
        return True

    def fourier(self, node, parts, dim, label):
        """torch.cat([torch.sin(z), torch.cos(z)], -1) (either order) of a Linear's output z, Fourier features as
        neural fields write them (sin and cos of x @ B): since cos z = sin(z + pi / 2), one layer of the Linear's rows
        twice, the second copy's bias shifted by pi / 2 where it is the cos, and sin its activation."""
        path, layers = self.act_path, self.layers
        if (not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, 1)
                or not all(p in path for p in parts) or self.cur not in parts or self.residual[-1] is not None
                or sorted(path[p] for p in parts) != ["cos(x)", "sin(x)"] or layers.acts[-1] not in ("sin", "cos")
                or layers.norms[-1] is not None):
            return False
        layers.sine_pair([path[p] == "cos(x)" for p in parts])
        layers.acts[-1] = "sin"  # (the chain's activation was the first part's, sin or cos)
        self.act_path = {node: "sin(x)"}
        return True

    def keep_input(self):
        """The chain's value becomes the next layer's input, so a residual may read it: kept as the previous layer's
        output (-1: the network input), or where a batch norm that the layer absorbs comes between, the value before
        it (the batch norm's own output is no value the kernel keeps)."""
        layers = self.layers
        if layers.pending is not None:
            self.folded[self.cur] = layers.pending[2]
            self.keep(self.before_bn, len(layers.weights) - 1)
        else:
            self.keep(self.cur, len(layers.weights) - 1)

    def root(self, node):
        """A value's first name, before the Identity and Dropout calls that named it again."""
        while node in self.same:
            node = self.same[node]
        return node

    def names(self, node):
        """Every name of node's value: its first and all Identity / Dropout outputs of it (a set of nodes)."""
        first = self.root(node)
        return {first} | {n for n in self.same if self.root(n) is first}

    def keep(self, node, index):
        """Node's value is kept as value `index` (-1 the network input, l layer l's output), and so are the names it
        has through Identity and Dropout (a block's `self.norm = nn.Identity()` between a value and its Linear, while
        the residual reads the value itself)."""
        while node is not None:
            self.value_of.setdefault(node, index)
            node = self.same.get(node)

    def passthrough(self, node, label):
        """Identity and Dropout in eval mode (modules and functions), and the tensor methods that keep a value as it
        is (x.float(), x.to(torch.float32), .contiguous(), .clone(), .detach()): another name of the value."""
        if not self.keeps_value(node, label):
            return False
        src = self.inputs[0] if self.inputs else None
        if src is None:
            return True
        self.same[node] = src
        if src in self.value_of:
            self.value_of[node] = self.value_of[src]
        if src in self.act_path:
            self.act_path[node] = self.act_path[src]
        # another name of the chain's value (the chain goes on from it), or of a value aside from it (a block's
        # Dropout called again on its input: `drop(h) + f(norm(drop(h)))`), which the chain does not follow
        return True if self.root(src) is self.root(self.cur) else _ASIDE

    def keeps_value(self, node, label):
        """Whether passthrough reads the node: an eval-mode Identity or Dropout, or a method keeping its value."""
        if self.leaf is not None and self.text is None and isinstance(self.leaf, (nn.Identity, *_DROPOUTS)):
            if isinstance(self.leaf, _DROPOUTS):
                _check_dropout_off(self.leaf, node.target)
        elif node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            if _arg(node, 2, "training", _DROPOUT_FUNCTIONS[node.target]) and _arg(node, 1, "p", 0.5) > 0:
                raise ArgumentError(f"{label}: dropout with training=True is active; fusedmlp runs inference")
        elif node.op == "call_method" and node.target in _SAME_METHODS and len(node.args) == 1 and not node.kwargs:
            pass
        elif node.op == "call_method" and node.target in ("to", "type") and len(node.args) >= 1:
            for a in (*node.args[1:], *(v for k, v in node.kwargs.items() if k not in ("non_blocking", "copy"))):
                if isinstance(a, torch.dtype) and a not in (torch.float32, torch.float64):
                    raise ArgumentError(f"{label}: a cast to {a}; fusedmlp reads casts to float32 or float64 (the "
                                        "model's dtype= decides what the kernel computes in)")
                if not isinstance(a, (torch.dtype, torch.device, str)):
                    return False
        else:
            return False
        return True

    def constant_op(self, node, label):
        """An arithmetic op of the chain's value and a constant: folded into a Linear (one value per feature, any on
        the input, or a number right after a Linear that is its only use) or joined to the activation (a number).
        Of another value of the activation (z / sqrt(2) beside 0.5 * z): that value's expression (a side branch)."""
        side = self.side_value()
        value = self.cur if side is None else side
        const = _traced_constant_op(self.module, node, value, label, consts=self.consts) if self.text is None else None
        if const is None:
            return False
        if side is not None:
            op, c, c_first = const
            if np.ndim(c) != 0:
                raise ArgumentError(f"{label}: a per-feature constant on a value the activation reads besides its "
                                    "chain; fusedmlp reads numbers there")
            self.act_path[node] = _over(_scalar_text(op, c, c_first), self.act_path[side])
            return _ASIDE
        layers, residual = self.layers, self.residual
        op, c, c_first = const
        if (np.ndim(c) == 0 and layers.weights and layers.open and len(self.cur.users) == 1
                and not (c_first and op == "div")):  # (so that a norm or softmax may still follow)
            c = np.full(layers.weights[-1].shape[0], c)
        if np.ndim(c) == 0 and layers.weights:  # part of the activation (or the residual's)
            expr = _scalar_text(op, c, c_first)
            if residual[-1] is None:
                layers.activation(expr, label)
                self.act_path[node] = _expression(layers.acts[-1])
            else:
                residual[-1][1] = expr if residual[-1][1] == "none" else _compose(expr, residual[-1][1])
        else:  # folded into a Linear, as a batch norm
            after_linear = layers.open  # (into its output side: the activation starts here)
            if layers.pending is None and not layers.open:
                self.before_bn = self.cur
            layers.batchnorm(*affine_map(op, c, c_first, label), label)
            self.act_path = {node: "x"} if after_linear else {}
        return True

    def residual_op(self, node, label):
        """h + f(h) / h * f(h) with a kept value (the layer's input, an earlier layer's output, the network input)."""
        if node.op not in ("call_function", "call_method") or not (
                node.target in _ADD or node.target in _MUL or node.target in ("add", "mul", "add_", "mul_")):
            return False
        inputs, layers, path = self.inputs, self.layers, self.act_path
        is_add = node.target in _ADD or node.target in ("add", "add_")
        if (len(inputs) == 2 and all(a in path for a in inputs) and self.residual and self.residual[-1] is None):
            # two values of the activation (x * sigmoid(x) spelled out): the chain's, or a side branch's (z * z)
            text = f"({path[inputs[0]]}) {'+' if is_add else '*'} ({path[inputs[1]]})"
            path[node] = text
            if self.cur not in inputs:
                return _ASIDE
            layers.activation(text, label, whole=True)
            return True
        if not layers.weights or len(inputs) != 2 or self.cur not in inputs:
            raise ArgumentError(f"{label}: only a residual of the current layer with a kept value is supported")
        other = inputs[0] if inputs[1] is self.cur else inputs[1]
        if other in self.folded:
            raise ArgumentError(f"{label}: the residual operand {other.name} is the output of {self.folded[other]} "
                                "(BatchNorm1d), which was folded into the next Linear's weights; the kernel keeps no "
                                "such value")
        if other not in self.value_of and self.root(other) in self.value_of:  # another name of a kept value
            self.value_of[other] = self.value_of[self.root(other)]
        if other not in self.value_of:
            raise ArgumentError(f"{label}: the residual operand {other.name} is neither the network input nor a "
                                "layer's output (the tensor a Linear or torch.cat consumed)")
        if self.residual[-1] is not None:
            raise ArgumentError(f"{label}: a second residual op in the same layer is not supported")
        layers.unfoldable(label, "a residual op")
        src = self.value_of[other]
        self.residual[-1] = ["add" if is_add else "mul", "none", "input" if src < 0 else src]
        layers.open = False
        return True

    def activation_text(self, node, mapped):
        """The node's activation as expression text where it is an activation module or function, or mapped (the
        text activations= gives its module), else None."""
        if mapped is not None:
            return mapped
        if node.op == "call_module":
            return _activation_text(self.gm.get_submodule(node.target))
        return _functional_text(node) if node.op in ("call_function", "call_method") else None

    def activation(self, node, label):
        """An activation module or function (or a module mapped by activations=): the layer's (or its residual's)."""
        text, leaf = self.activation_text(node, self.text), self.leaf
        side = self.side_value()
        if text is not None and side is not None:  # erf(z / sqrt(2)) beside 0.5 * z: a side branch's expression
            self.act_path[node] = _over(text, self.act_path[side])
            return _ASIDE
        if text is None or not self.takes_cur():
            what = type(leaf).__name__ if leaf is not None else label
            raise ArgumentError(f"{node.target if leaf is not None else label}: {what} is not supported; supported: "
                                f"{TRACED_SUPPORTED}" + (f"; or map it with activations={{'{node.target}': '...'}}"
                                                          if leaf is not None else ""))
        if not self.layers.weights:
            raise ArgumentError(f"{label}: an activation before the first Linear; fusedmlp applies activations after a "
                                "layer")
        if self.residual[-1] is None:
            self.layers.activation(text, label)
            self.act_path[node] = _expression(self.layers.acts[-1])
        else:
            self.layers.unfoldable(label, "an activation")
            res = self.residual[-1]
            res[1] = text if res[1] == "none" else _compose(text, res[1])
        return True

    def finish(self):
        name = type(self.module).__name__
        if self.activations:
            raise ArgumentError(f"activations names {sorted(self.activations)}, which are not modules of the model")
        if len(self.placeholders) > 1 and self.input_order is None:
            raise ArgumentError(f"{name}.forward takes {len(self.placeholders)} inputs; fusedmlp reads several only as "
                                "one torch.cat of all of them along the last dim before the first Linear (a critic's "
                                "torch.cat([obs, act], -1))")
        self.residual, self.concat = self.layers.merge_pairs(self.residual, self.concat)
        weights, biases, acts, norm, flatten = self.layers.finish(name)
        edges = graph_edges([tuple(r) if r else None for r in self.residual], self.concat or None, norm, flatten,
                            len(weights), self.layers.encoding)
        if self.input_order:
            edges["inputs"] = self.input_order
        if self.squeeze is not None:
            edges["squeeze"] = self.squeeze
        if self.output_stack is not None:
            edges["output_stack"] = list(self.output_stack)
        if self.out_heads:
            edges["outputs"] = [width for _, width in self.out_heads]
        elif self.part_widths:
            edges["outputs"] = self.part_widths
            if self.part_keys:
                edges["output_keys"] = self.part_keys
            if self.part_squeeze:
                edges["output_squeeze"] = self.part_squeeze
        return weights, biases, acts, edges


def read_traced(module, activations, in_features=None):
    """Walks module's torch.fx graph as a chain (_Tracer): each Linear starts a layer, activations before a residual
    op are the layer's activation, the op with a kept value (the layer's input, an earlier layer's output, the network
    input) is its residual, activations after it the residual's; torch.cat of the hidden state with the network input
    right before a Linear is that layer's input concat; BatchNorm1d and constant affine maps fold into the Linear
    before or after them (Layers)."""
    tracer = _Tracer(module, activations, in_features)
    weights, biases, acts, edges = tracer.run()
    width = tracer.assumed_width
    if width is not None:
        x_width = (_encoding.parse(edges["encoding"], weights[0].shape[1])[0] if "encoding" in edges
                   else weights[0].shape[1])
        if "flatten_input" in edges or x_width != width:
            raise ArgumentError(f"{type(module).__name__}.forward branches on its input's shape (an `if` on "
                                f"x.shape); it was traced for inputs of {width} features ("
                                + ("in_features" if tracer.width_given else "its first Linear's in_features; pass "
                                   "from_torch's in_features= to trace it at another")
                                + f"), but reads {x_width}" + (" after a flatten" if "flatten_input" in edges else ""))
    return weights, biases, acts, edges
