"""The layers of a model read from a framework (fusedmlp.torch, fusedmlp.onnx): Linears in float64, batch norms
folded into them, fused norms and softmaxes, activations composed, a flatten of the input; then FusedMLP's arguments."""

import re

import numpy as np

from .errors import ArgumentError, ShapeError


def step_text(arg):
    """1 where arg > 0, else 0 (also for arg = -inf and +0): the ceil of a clamp, as an expression over x."""
    return f"ceil(min(max({arg}, 0), 1))"


def shrink_text(lambd, bias):
    """x - bias where x > lambd, x + bias where x < -lambd, else 0 (ONNX's Shrink; torch's Softshrink is bias =
    lambd, written x - clamp(x, -l, l), and Hardshrink bias 0, x times the step of |x| - l) as an expression: exact,
    and +-inf kept (the bias times the steps' difference, not x + b times a step)."""
    lam, b = float(lambd), float(bias)
    if b == lam:
        return f"x - min(max(x, {-lam!r}), {lam!r})"
    hard = f"x * {step_text(f'abs(x) - {lam!r}')}"
    return hard if b == 0 else f"{hard} - {b!r} * ({step_text(f'x - {lam!r}')} - {step_text(f'-x - {lam!r}')})"


def threshold_text(threshold, value):
    """x where x > t, else v (torch's Threshold; ONNX's ThresholdedRelu is v = 0) as an expression: max(x, t), then t
    moved to v below the step: exact where x > t, and for v = 0, including x = -inf. t and v as the float32 values
    torch compares and writes (x = float32(0.1) is not above Threshold(0.1)'s threshold)."""
    t, v = float(np.float32(threshold)), float(np.float32(value))
    return f"max(x, {t!r}) + ({v!r} - {t!r}) * (1 - {step_text(f'x - {t!r}')})"


def affine_map(op, c, c_first, label):
    """(s, t) with op(x, c) (op(c, x) where c_first) = s * x + t per feature, float64 vectors (one element for a
    number); op 'add', 'sub', 'mul' or 'div' (c / x is none)."""
    if c_first and op == "div":
        raise ArgumentError(f"{label}: a constant divided by the hidden state is no affine map; fusedmlp folds "
                            "x - c, c - x, x + c, x * c and x / c")
    c = np.asarray(c, np.float64)
    if not (c.ndim <= 1 or (c.ndim == 2 and c.shape[0] == 1)):
        raise ArgumentError(f"{label}: a constant of shape {c.shape}; fusedmlp folds one value per feature")
    c = c.reshape(-1)
    one, zero = np.ones_like(c), np.zeros_like(c)
    if op == "div":
        return 1.0 / c, zero  # (only here: a zero of an add's or sub's constant is no division)
    return {"mul": (c, zero), "add": (one, c), "sub": (-one, c) if c_first else (one, -c)}[op]


def then_map(earlier, s, t, label):
    """The map (s, t) at label after `earlier` ((s0, t0, its label), or None) as one (s, t, label): s s0, s t0 + t,
    labelled where it began."""
    if earlier is None:
        return s, t, label
    s0, t0, first = earlier
    return s * s0, s * t0 + t, first


def graph_edges(residual, concat, norm, flatten=None, num_layers=0, encoding=None):
    """FusedMLP's graph arguments of a read model: residual (a list: None for each layer past its end, a layer
    Layers.finish added) and concat, norm where it has norms, flatten_input where it flattens its input first,
    encoding where it encodes its input (Layers.input_encoding)."""
    if residual is not None:
        residual = list(residual) + [None] * (num_layers - len(residual))
    return {"residual": residual, "concat": concat, **({"norm": norm} if norm else {}),
            **({"flatten_input": flatten} if flatten is not None else {}),
            **({"encoding": encoding} if encoding is not None else {})}


#: A reader's edges that are not FusedMLP's: how fusedmlp.torch's FusedModule joins forward's inputs ("inputs": their
#: order in the torch.cat) and gives back its outputs ("squeeze" of the one, or "outputs" widths side by side, as a
#: dict with "output_keys", each squeezed where "output_squeeze" says, or "output_stack": (dim, parts), a torch.stack
#: of equal parts along dim). The FusedMLP readers give the joined input and the outputs side by side.
MODEL_FORM = ("inputs", "squeeze", "outputs", "output_keys", "output_squeeze", "output_stack")


def widen_columns(w, pieces, total, label):
    """w's columns [src, src + n) at [dst, dst + n) of `total` columns, zeros elsewhere, for each (src, n, dst) of
    pieces: a Linear on a slice of x (x's other features meet zero weights), or on the chain's value beside extra
    rows (the graph readers' exact rewrites of where a layer's inputs are)."""
    out = np.zeros((w.shape[0], total))
    for src, n, dst in pieces:
        if src + n > w.shape[1] or dst + n > total:
            raise ShapeError(f"{label}: a Linear of {w.shape[1]} inputs does not fit the {total} columns its input "
                             "has here")
        out[:, dst:dst + n] = w[:, src:src + n]
    return out


def slices_width(x_width, slices, label):
    """x's features where forward slices it: x_width (a split's sum) where known, else the largest slice end;
    slices: {value: (start, stop)}."""
    width = x_width or max(stop for _, stop in slices.values())
    if any(stop > width for _, stop in slices.values()):
        raise ShapeError(f"{label}: slices of the input past the {width} features its split gives")
    return width


class Layers:
    """The layers read so far, in float64 until the end (the folds are exact there, then rounded once to float32).

    A LayerNorm / RMSNorm (or a softmax) directly after a Linear is that layer's norm, fused before its activation;
    anywhere else (the network input, after an activation, a residual or another norm) it runs on a layer of its own,
    an identity Linear (norm_layer). A batch norm (torch's BatchNorm1d, ONNX's BatchNormalization) directly after a
    Linear folds into it,
    W' = diag(s) W, b' = s b + t (into its LayerNorm / RMSNorm affine where it has one: gamma' = s gamma,
    beta' = s beta + t); anywhere else it must come directly before a Linear and folds into that one's input side,
    W' = W diag(s), b' = b + W t. Both are exact; a batch norm with an
    activation, residual or concat between it and the next Linear has no exact fold and is an error naming it. At the
    end of the network after an activation (an RL actor's tanh(z) * action_scale + action_bias) it is a layer of its
    own, diag(s) and bias t (finish): the values before it are then stored in the compute dtype, one more rounding."""

    def __init__(self, to_array, bn="BatchNorm1d"):
        """to_array: a weight, bias or norm vector as given (a tensor) -> float64 NumPy (None stays None); bn: what
        the framework calls a batch norm, for the messages."""
        self.to_array, self.bn = to_array, bn
        self.weights, self.biases, self.acts = [], [], []
        self.norms = []  # per layer None or [kind, weight, bias, eps] of its LayerNorm / RMSNorm (FusedMLP's norm=)
        self.open = False  # the last layer's output is still W h + b, or its norm of it (only folds since its Linear)
        self.pending = None  # (s, t, label) of batch norm(s) waiting for the next Linear
        self.encoding = None  # FusedMLP's encoding= where forward encodes its input (input_encoding)
        self.flatten = None  # the start dim of a flatten of the input before the first Linear (FusedMLP's flatten_input)
        self.flatten_width = None  # the features x.view(-1, K) gives each row: the first Linear must take K
        self.pending_parts = None  # [(s, t, label) or None per joined input], set_input_parts

    def linear(self, weight, bias, label):
        self.linear64(self.to_array(weight), self.to_array(bias), label)

    def linear64(self, w, b, label):
        """A Linear of float64 arrays w (out, in) and b (or None)."""
        if not self.weights and self.flatten_width is not None and w.shape[1] != self.flatten_width:
            raise ShapeError(f"{label}: the input is viewed as rows of {self.flatten_width} features, but the Linear "
                             f"takes {w.shape[1]}")
        if self.pending_parts is not None:  # several inputs' maps, joined in torch.cat's order (set_input_parts)
            self.pending = self.joined_parts(w, label)
            self.pending_parts = None
        if self.pending is not None:
            s, t, bn_label = self.pending
            if w.ndim == 2 and s.shape[0] == 1:  # one scale and shift for every feature (an ONNX graph's Mul by 2)
                s, t = np.full(w.shape[1], s[0]), np.full(w.shape[1], t[0])
            if w.ndim != 2 or w.shape[1] != s.shape[0]:
                raise ShapeError(f"{bn_label}: {self.bn} has {s.shape[0]} features but the Linear after it "
                                 f"({label}) takes {w.shape[1] if w.ndim == 2 else w.shape} inputs")
            b = (b if b is not None else np.zeros(w.shape[0])) + w @ t
            w = w * s[None, :]
            self.pending = None
        self.weights.append(w)
        self.biases.append(b)
        self.acts.append("none")
        self.norms.append(None)
        self.open = True

    def batchnorm(self, s, t, label):
        """A batch norm in eval mode at label, bn(x) = s * x + t (float64 vectors; of one element where the map is the
        same for every feature): folded into the Linear before or after it."""
        if self.open:
            w = self.weights[-1]
            if s.shape[0] != w.shape[0]:
                raise ShapeError(f"{label}: {self.bn} has {s.shape[0]} features but the Linear before it has "
                                 f"{w.shape[0]} outputs")
            norm = self.norms[-1]
            if norm is not None:  # Linear -> LayerNorm -> batch norm: into the norm's affine
                norm[1] = s * (norm[1] if norm[1] is not None else 1.0)
                norm[2] = s * (norm[2] if norm[2] is not None else 0.0) + t
                return
            b = self.biases[-1]
            self.weights[-1] = w * s[:, None]
            self.biases[-1] = s * (b if b is not None else 0.0) + t
            return
        if self.pending is not None:  # two in a row: one affine map
            s0, _, first = self.pending
            if s0.shape != s.shape and 1 not in (s0.shape[0], s.shape[0]):
                raise ShapeError(f"{label}: {self.bn} has {s.shape[0]} features but the one before it ({first}) "
                                 f"has {s0.shape[0]}")
        self.pending = then_map(self.pending, s, t, label)

    def norm(self, kind, shape, weight, bias, eps, label, own=False):
        """A LayerNorm (kind 'layernorm') or RMSNorm ('rmsnorm') over `shape` (its normalized_shape) at label: the
        last layer's norm, fused before its activation, where it comes directly after that layer's Linear (fusable);
        anywhere else, or where `own` (a graph reader's: the Linear's output is also read elsewhere, a residual's
        operand), on a layer of its own, an identity Linear (norm_layer)."""
        name = "LayerNorm" if kind == "layernorm" else "RMSNorm"
        if own or not self.fusable():
            self.norm_layer(name, shape, label)
        width = self.weights[-1].shape[0]
        if tuple(shape) != (width,):
            raise ShapeError(f"{label}: {name} normalizes over {tuple(shape)}, but the Linear before it has {width} "
                             f"outputs; fusedmlp fuses a norm over the layer's features, normalized_shape ({width},)")
        self.norms[-1] = [kind, self.to_array(weight), self.to_array(bias), None if eps is None else float(eps)]

    def fusable(self):
        """Whether a norm or softmax here is the last layer's, fused before its activation: directly after its Linear
        (folds between them allowed), which has none yet."""
        return self.open and self.norms[-1] is None

    def norm_layer(self, name, shape, label):
        """A layer of its own for a norm (or softmax) that follows no Linear directly (the network input, an
        activation, a residual, another norm): an identity Linear with no bias, whose fused norm is then the one at
        label. In float16 or bfloat16 its MMAs multiply by exact ones and add exact zeros, so its W h is h and the norm
        sees the value as the kernel holds it; a batch norm waiting for a Linear folds into it (diag(s), bias t). It
        costs a width x width matmul per row (on a 64-wide value 4096 MACs a row)."""
        if len(shape) != 1 or not isinstance(shape[0], (int, np.integer)) or shape[0] < 1:
            raise ShapeError(f"{label}: {name} normalizes over {tuple(shape)}; fusedmlp normalizes over the features, "
                             "a normalized_shape of one dimension")
        width = int(shape[0])
        if self.weights and self.weights[-1].shape[0] != width:
            raise ShapeError(f"{label}: {name} normalizes over {tuple(shape)}, but the value before it has "
                             f"{self.weights[-1].shape[0]} features; fusedmlp normalizes over the features, "
                             f"normalized_shape ({self.weights[-1].shape[0]},)")
        self.linear64(np.eye(width), None, label)

    def set_input_parts(self, parts):
        """Several inputs joined by one torch.cat before the first Linear, each with its own affine map (s, t, label),
        or None where it has none: the first Linear folds the joined map (joined_parts)."""
        if any(p is not None for p in parts):
            self.pending_parts = parts

    def joined_parts(self, w, label):
        """(s, t, label) over the first Linear's K inputs from the joined inputs' maps: a vector map tells its input's
        width; one input of unknown width (no map, or one number for all its features) takes the rest of K."""
        k = w.shape[1]
        widths = [None if p is None or p[0].shape[0] == 1 else p[0].shape[0] for p in self.pending_parts]
        unknown = [i for i, v in enumerate(widths) if v is None]
        known = sum(v for v in widths if v is not None)
        if len(unknown) > 1 or known > k or (not unknown and known != k):
            where = next(p[2] for p in self.pending_parts if p is not None)
            raise ShapeError(f"{where}: the joined inputs' widths cannot be told from their maps ({widths}; the Linear "
                             f"{label} takes {k}); give each input but one a map of one value per feature")
        if unknown:
            widths[unknown[0]] = k - known
        s, t = [], []
        for p, width in zip(self.pending_parts, widths):
            s.append(np.ones(width) if p is None else np.broadcast_to(p[0], (width,)))
            t.append(np.zeros(width) if p is None else np.broadcast_to(p[1], (width,)))
        return np.concatenate(s), np.concatenate(t), next(p[2] for p in self.pending_parts if p is not None)

    def l2_normalize(self, eps, label):
        """F.normalize(z, p=2, dim=-1, eps) at label, right after a Linear: z / max(||z||, eps) is rmsnorm with gamma
        1 / sqrt(N) and eps^2 / N (z / sqrt(sum z^2 + eps^2): the same wherever ||z|| is not within a few eps of 0,
        and 0 for a zero row), so it runs as the layer's fused rmsnorm."""
        self.after_linear("F.normalize", label, "it follows a norm")
        width = self.weights[-1].shape[0]
        self.norms[-1] = ["rmsnorm", np.full(width, 1.0 / np.sqrt(width)), None, float(eps) ** 2 / width]

    def flatten_input(self, start, end, label):
        """A flatten of dims start..end at label: before the first Linear, of the network input (FusedMLP's
        flatten_input: images run as rows of their pixels); after it, of (rows, features) values, which it leaves as
        they are."""
        if self.weights:
            return
        if end not in (-1, None) or not isinstance(start, int) or start < 1:
            raise ArgumentError(f"{label}: a flatten of dims {start}..{end} of the input; fusedmlp flattens an input's "
                                "dims from start_dim >= 1 through the last (nn.Flatten(start_dim), torch.flatten(x, "
                                "start_dim), x.view(x.size(0), -1))")
        if self.flatten is not None:
            raise ArgumentError(f"{label}: a second flatten of the input; fusedmlp takes one")
        self.flatten = start

    def softmax(self, kind, dim, label, own=False):
        """A Softmax (kind 'softmax'), Softmin ('softmin') or LogSoftmax ('log_softmax') over dim at label: the last
        layer's norm (FusedMLP fuses it before the layer's activation) where it comes directly after that layer's
        Linear; elsewhere, or where `own`, on an identity layer of its own (as norm). A softmin is the softmax of the
        layer's negated rows and bias, softmin(W h + b) = softmax(-W h - b): exact. dim: -1, or 1 (or None, which
        torch reads as 1) of the (rows, features) batches fusedmlp runs."""
        name = {"softmax": "Softmax", "softmin": "Softmin", "log_softmax": "LogSoftmax"}[kind]
        if dim not in (None, -1, 1):
            raise ArgumentError(f"{label}: {name}(dim={dim}) does not run over the features; fusedmlp fuses a {name} "
                                "over a layer's features, dim=-1 (or 1) of its (rows, features) input")
        if not self.weights:
            raise ArgumentError(f"{label}: {name} of the network input; fusedmlp takes a {name} of a layer's outputs "
                                "(one directly after a Linear is fused into it)")
        if own or not self.fusable():
            self.norm_layer(name, (self.weights[-1].shape[0],), label)
        if kind == "softmin":
            kind = "softmax"
            self.weights[-1] = -self.weights[-1]
            self.biases[-1] = None if self.biases[-1] is None else -self.biases[-1]
        self.norms[-1] = [kind, None, None, None]
        self.open = False  # a batch norm after it folds into the next Linear (a softmax has no affine to take it)

    def after_linear(self, name, label, after_norm):
        """Raises unless module `name` at label comes directly after a Linear whose layer has no norm yet (the layer's
        norm is fused before its activation); after_norm: what the message adds where a norm came first."""
        self.unfoldable(label, f"a {name}")
        if not self.open or self.norms[-1] is not None:
            raise ArgumentError(f"{label}: {name} is not directly after a Linear" + (
                f" ({after_norm})" if self.weights and self.norms[-1] is not None else "") +
                f"; fusedmlp fuses a {name} over a Linear's outputs, before the layer's activation (Linear -> {name} "
                "-> activation)")

    def unfoldable(self, label, what):
        """Raises if a batch norm waits for a Linear and `what` (at label) comes first."""
        if self.pending is not None:
            raise ArgumentError(f"{self.pending[2]}: {self.bn} is followed by {what} ({label}) before the next "
                                f"Linear, so it folds into no Linear exactly; fusedmlp folds a {self.bn} directly "
                                "after a Linear or directly before one")

    def activation(self, text, label, whole=False):
        """The layer's activation becomes text over its current one (compose), or text itself where `whole` (an
        expression in x of the layer's output that already holds the activation so far: x * sigmoid(x))."""
        self.unfoldable(label, "an activation")
        self.acts[-1] = text if whole or self.acts[-1] == "none" else compose(text, self.acts[-1])
        self.open = False

    def stack_rows(self, parts):
        """The last layer becomes the rows of parts, (w, b or None) each, one after another (Linear heads of one value
        merged, Fourier features' copies): a bias where any part has one, zeros in the parts without."""
        self.weights[-1] = np.concatenate([w for w, _ in parts])
        self.biases[-1] = (np.concatenate([np.zeros(w.shape[0]) if b is None else b for w, b in parts])
                           if any(b is not None for _, b in parts) else None)

    def input_encoding(self, parts, label):
        """A positional encoding of the network input at label, a concat of parts (kind, scale): kind 'x' (x itself,
        or scale * x) or 'sin' / 'cos' of scale * x (a number, one value per feature, or None for 1). It becomes FusedMLP's
        encoding= (fusedmlp._encoding: computed in the kernel as x is loaded), and its value is the network input as
        the layers see it, so a later concat of it (NeRF's skip) is a concat of x."""
        encoding = []
        for kind, c in parts:
            if kind == "x" and c is None:
                encoding.append("x")
                continue
            c = np.asarray(1.0 if c is None else c, np.float64)
            if c.ndim > 1 and c.size != max(c.shape):
                raise ArgumentError(f"{label}: a positional encoding's scale of shape {c.shape}; fusedmlp reads a "
                                    "number or one value per feature")
            encoding.append((kind, c.reshape(-1) if c.size > 1 else float(c.reshape(-1)[0])))
        self.encoding = encoding

    def sine_pair(self, cos_parts):
        """The last layer's rows once for each part of Fourier features' [sin(z), cos(z)] of its output z: since
        cos z = sin(z + pi / 2), a copy whose cos_parts flag is set has its bias shifted by pi / 2, so that sin of the
        layer is the concat (the graph readers make sin its activation, each in its own way)."""
        w, b = self.weights[-1], self.biases[-1]
        self.stack_rows([(w, (np.zeros(w.shape[0]) if b is None else b) + np.pi / 2 if cos else b)
                         for cos in cos_parts])

    def merge_pairs(self, residual=None, concat=None):
        """Two Linears with nothing between them become one, W2 W1 and W2 b1 + b2 in float64 (exact up to the one
        rounding to the compute dtype, one fewer than the two layers'), where that is fewer multiply-adds: the first
        without activation, norm or residual, its output read by the second alone, at most one of the two joined by
        x (a concat). nerf_pl's and nerf-pytorch's NeRF feed their identity feature layer (257 rows with the density
        head) to the view layer: merged, the network keeps to 256-wide layers. residual (per layer None or [op,
        then, source]) and concat ({layer: side}) are renumbered; returns them."""
        residual = list(residual) if residual is not None else [None] * len(self.weights)
        residual += [None] * (len(self.weights) - len(residual))
        concat = dict(concat or {})
        a = 0
        while a + 1 < len(self.weights):
            b = a + 1
            w1, w2 = self.weights[a], self.weights[b]
            n_h = w1.shape[0]  # (b's columns for a's output: after x's where x joins before h)
            h_at = w2.shape[1] - n_h if concat.get(b) == "before" else 0
            read_later = any(r is not None and r[2] == a for r in residual[b:])  # (b's own input is a's output)
            if (self.acts[a] != "none" or self.norms[a] is not None or residual[a] is not None or read_later
                    or (a in concat and b in concat)
                    or w2.shape[0] * w1.shape[1] > n_h * (w1.shape[1] + w2.shape[0])):
                a += 1
                continue
            w2h = w2[:, h_at:h_at + n_h]
            merged = w2h @ w1
            bias = (w2h @ self.biases[a] if self.biases[a] is not None else 0.0) + (
                self.biases[b] if self.biases[b] is not None else 0.0)
            if not np.all(np.abs(merged) < MERGE_LIMIT):  # (kept apart where 16-bit weights could not hold it)
                a += 1
                continue
            if b in concat:  # (b's x columns stay where they were, beside the merged h part)
                merged = np.concatenate([w2[:, :h_at], merged] if h_at else [merged, w2[:, n_h:]], axis=1)
            self.weights[a:b + 1] = [merged]
            self.biases[a:b + 1] = [None if self.biases[a] is None and self.biases[b] is None else np.broadcast_to(
                bias, (w2.shape[0],)).astype(np.float64)]
            self.acts[a:b + 1] = [self.acts[b]]
            self.norms[a:b + 1] = [self.norms[b]]
            residual[a:b + 1] = [residual[b]]
            residual = [None if r is None else [r[0], r[1], r[2] if r[2] == "input" or r[2] < a else r[2] - 1]
                        for r in residual]
            side = concat.pop(a, None) or concat.pop(b, None)
            concat = {(k - 1 if k > b else k): v for k, v in concat.items()}
            if side:
                concat[a] = side
        return residual, concat

    def finish(self, name):
        """(weights, biases, activations, norm) in float32, norm FusedMLP's norm= argument (None without norms)."""
        if not self.weights:
            raise ShapeError(f"{name} holds no Linear layer")
        if self.pending is not None:  # after the last activation: diag(s) h + t, a layer of its own
            width = self.weights[-1].shape[0]
            if self.pending[0].shape[0] not in (1, width):
                raise ShapeError(f"{self.pending[2]}: {self.bn} has {self.pending[0].shape[0]} features but the "
                                 f"network's output has {width}")
            self.linear64(np.eye(width), None, self.pending[2])

        def f32(a):
            return None if a is None else a.astype(np.float32)

        weights = [f32(w) for w in self.weights]
        biases = [f32(b) for b in self.biases]
        norm = {l: {"kind": n[0], "weight": f32(n[1]), "bias": f32(n[2]), "eps": n[3]}
                for l, n in enumerate(self.norms) if n is not None}
        return weights, biases, self.acts, norm or None, self.flatten


#: The largest weight a merge of two Linears may make (Layers.merge_pairs): a product that large, far beyond trained
#: networks' weights, stays two layers, whose own weights float16 holds as given.
MERGE_LIMIT = 4096.0


def activation_runs(parts):
    """(activation text, columns) of consecutive output parts, with neighbours of one activation joined: the last
    layer's column pieces in output order."""
    runs = []
    for act, n in parts:
        if runs and runs[-1][0] == act:
            runs[-1][1] += n
        else:
            runs.append([act, n])
    return runs


def pieces_text(runs, base, label):
    """The activation text of the last layer whose columns take runs ([activation, columns], activation_runs) over
    its activation so far, base: one activation where the runs are one, else column pieces ("sigmoid:3 | none:1")."""
    from ._gpu import core

    if len(runs) > core().ACT_PIECES:
        raise ArgumentError(f"{label}: the last layer's output takes {len(runs)} runs of activations; fusedmlp gives "
                            f"a layer at most {core().ACT_PIECES} column pieces")
    texts = [a if base == "none" else base if a == "none" else compose(a, base) for a, _ in runs]
    return texts[0] if len(runs) == 1 else " | ".join(f"{t}:{n}" for t, (_, n) in zip(texts, runs))


def compose(outer, inner):
    """outer(inner(x)) as one expression: every whole-word x of outer becomes (inner); over column pieces
    ("sigmoid:3 | none:1"), each piece's."""
    if "|" in inner:
        return " | ".join(f"{outer if expr.strip() == 'none' else compose(outer, expr)}:{n}"
                          for expr, _, n in (p.rpartition(":") for p in inner.split("|")))
    inner_expr = inner if "(" in inner else f"{inner}(x)"
    outer_expr = outer if "(" in outer else f"{outer}(x)"
    return re.sub(r"\bx\b", f"({inner_expr})", outer_expr)


def stacked_layer(ws, bs, first, average=False):
    """One layer of parallel stacks' layers j (fusedmlp.torch's and fusedmlp.onnx's stacks as one network): weights
    (out x in each) and biases (or None) -> (weight, bias or None), float64: the stacks' rows on the one value they
    all read (first), else block-diagonal (stack i's rows on stack i's columns, zeros elsewhere); a bias where any
    stack's layer has one, zeros for the others. average: the block-diagonal rows summed over the stacks and divided
    by their number, one layer as wide as each (an ensemble's mean over its members, folded)."""
    ws = [np.asarray(w, np.float64) for w in ws]
    w = np.zeros((sum(wi.shape[0] for wi in ws), ws[0].shape[1] if first else sum(wi.shape[1] for wi in ws)))
    r = c = 0
    for wi in ws:
        w[r:r + wi.shape[0], (0 if first else c):(0 if first else c) + wi.shape[1]] = wi
        r, c = r + wi.shape[0], c + wi.shape[1]
    b = None if all(bi is None for bi in bs) else np.concatenate(
        [np.zeros(wi.shape[0]) if bi is None else np.asarray(bi, np.float64).reshape(-1) for wi, bi in zip(ws, bs)])
    if average:
        k = len(ws)
        w, b = w.reshape(k, -1, w.shape[1]).sum(0) / k, None if b is None else b.reshape(k, -1).sum(0) / k
    return w, b


def check_stack_depths(names, depths, what):
    """Raises where parallel stacks of `what` (Linears, layers) are not all as deep: one network of block-diagonal
    layers needs as many in each."""
    if len(set(depths)) > 1:
        raise ArgumentError(f"{names}: stacks of {what} on one value with {depths} layers; fusedmlp runs parallel "
                            "stacks (twin critics, an actor and a critic of their own) as one network of "
                            "block-diagonal layers, which needs as many layers in each")
