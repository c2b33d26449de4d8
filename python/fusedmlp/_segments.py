"""Networks bigger than one fused kernel: the network cut into segments, chained through global memory.

A stretch of layers whose weights stay resident on chip (one CTA, or a cluster of CTAs on sm_90a) stays one fused
kernel; a layer that no such stretch takes (wider than the fused kernels hold, or whose input concat or residual
operand comes from outside any stretch it could join) runs as a tiled Tensor Core GEMM with the layer's whole
epilogue fused (kernel_templates/gemm_layer.cu). Between segments a value passes through global memory once, in the
compute dtype, in workspace buffers that are planned once and reused by every call (the liveness of each value decides
which values share one).

A norm layer that runs as a GEMM (too wide for the fused kernels' norm layers, or past a cut) is two kernels: the GEMM
of the layer cut before its norm writes z = W h + b to a workspace slot of its own, and the layer's second kernel
(kernel_templates/row_norm.cu) reads each row of z once, normalises it and runs the rest of the layer's epilogue.

A GEMM copies an input part as it is (cp.async of 16-byte pieces) where the part is in the compute dtype with rows of
whole 16-byte pieces; any other part it converted element pair by element pair through registers on the way in, by
the threads that issue the MMAs (sdf512's re-injected x, 259 float16 features, took 9.0 ms of the network's 26 at 2^21
rows on the H100 that way). So where a GEMM reads x and x is not such a part (float32 x, or a width that is not a
multiple of 8), the chain first copies x once to rows of whole pieces of the compute dtype, zeros after its width
(kernel_templates/pad_rows.cu, the pad pass), and the GEMMs read the copy.

An 8-bit network keeps its values between segments as the codes the next layer multiplies (one byte an element). Its
fused kernels take the whole network only (x and y in float32 or 16 bits), so a network no fused kernel takes runs
every layer as an 8-bit GEMM.
"""

import concurrent.futures
import dataclasses
import functools
import threading

import numpy as np

from . import _env, _norm, _tune
from .errors import LimitError

#: Global-memory dtype of the values between segments, per compute dtype (tf32 values are float32; 8-bit ones are
#: codes, with the scale of the layer reading them).
STORAGE = {"float16": "float16", "bfloat16": "bfloat16", "tf32": "float32", "int8": "codes", "float8": "codes"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "codes": 1}
#: Compute dtypes whose fused kernels take a whole network only (no fused segment: every layer of a cut one is a GEMM).
_WHOLE_ONLY = ("int8", "float8")
_ALIGN = 256  # bytes between workspace buffers: the GEMM's 16-byte loads, and a whole DRAM burst
#: The value key of a norm layer's z = W h + b between its GEMM and its second kernel (a workspace slot of its own).
NORM_Z = "z"
#: The value key of x's padded copy (the pad pass, kernel_templates/pad_rows.cu; a workspace slot of its own): what
#: the chain's GEMMs read of x where x is not in the compute dtype or its rows are not whole 16-byte pieces.
X_PAD = "x"
#: Compute dtypes with a pad pass (8-bit GEMMs quantise x on the way in; tf32 ones take float32 x as it is).
_PAD_PRECISIONS = ("float16", "bfloat16")
#: x narrower than this is converted by the GEMMs on the way in (one K stage of the wgmma form, 64 16-bit values, or
#: less: the conversion is a small part of such a layer, and the pad pass would be one more launch).
PAD_MIN_WIDTH = 64


@dataclasses.dataclass
class Segment:
    """Layers [first, last] of the network as one kernel.

    kind: 'fused' (a fused kernel over the stretch) or 'gemm' (one layer as a GEMM); reason: why the cut is there.
    reads: the values the segment reads from global memory (-1 the network input, l layer l's output); writes: l.
    """

    first: int
    last: int
    kind: str
    reason: str
    reads: tuple = ()
    x_copy: bool = False  # a first fused stretch that reads x's padded copy, not x (copy_row)

    @property
    def writes(self):
        return self.last

    def describe(self):
        span = f"layer {self.first}" if self.first == self.last else f"layers {self.first}-{self.last}"
        return f"{span}: {self.kind} ({self.reason})"


def _stretch_problem(first, last, residual, concat):
    """Why layers [first, last] cannot be one fused kernel of their own, from the graph alone (None: they can).

    A fused kernel reads only its input (value first - 1) from memory: a concat takes the network input, so it fits
    only a stretch starting at layer 0 (whose input that is) and not as the stretch's own first layer; a residual must
    read a value inside the stretch or its input."""
    for j in range(first, last + 1):
        if concat[j] and (first > 0 or j == first):
            return f"layer {j}'s input concat reads the network input"
        if residual[j] is not None:
            src = residual[j][2]
            if src < first - 1 or (src == -1 and first > 0):
                return f"layer {j}'s residual reads the output of layer {src}" if src >= 0 else \
                    f"layer {j}'s residual reads the network input"
    return None


def cut(num_layers, residual, concat, fits):
    """The segments of a network, greedily: from the first layer not yet placed, the longest stretch that is one fused
    kernel with resident weights (fits(first, last) -> (True, info) or (False, reason)); a layer that starts no such
    stretch is a GEMM. Values a later segment reads (residual operands, the concat's input) end a stretch where they
    are made, so each is in memory."""
    needed = set()  # values some layer reads from another segment: each must be a segment's output
    while True:
        segments, first = [], 0
        while first < num_layers:
            best, why = None, None
            for last in range(num_layers - 1, first - 1, -1):
                if any(v in needed for v in range(first, last)):
                    continue  # a value inside would be read by a later segment
                problem = _stretch_problem(first, last, residual, concat)
                if problem is None:
                    ok, info = fits(first, last)
                    if ok:
                        best = (last, info)
                        break
                    problem = info
                if last == first:
                    why = problem
            if best is not None:
                last, info = best
                segments.append(Segment(first, last, "fused", info, (first - 1,)))
            else:
                last = first
                segments.append(Segment(first, first, "gemm", why, ()))
            first = last + 1
        # what each segment reads from memory: a fused one its input alone (its residuals and concat read inside),
        # a GEMM also the concat's network input and its residual operand; each must be x or a segment's output
        outputs = {-1} | {seg.last for seg in segments}
        missing = set()
        for seg in segments:
            reads = {seg.first - 1}
            if seg.kind == "gemm":
                if concat[seg.first]:
                    reads.add(-1)
                if residual[seg.first] is not None:
                    reads.add(residual[seg.first][2])
            seg.reads = tuple(sorted(reads))
            missing |= reads - outputs
        if not missing:
            return segments
        needed |= missing


def workspace_slots(segments, num_layers):
    """Which workspace slot holds each intermediate value (not x, not the output): a value may take the slot of one
    whose last reader came before its writer. Returns ({value: slot}, number of slots)."""
    last_read = {}
    for i, seg in enumerate(segments):
        for v in seg.reads:
            last_read[v] = i
    slot_of, free_after = {}, []  # free_after[s]: index of the last segment reading slot s's value
    for i, seg in enumerate(segments):
        v = seg.writes
        if v == num_layers - 1:
            continue
        for s, done in enumerate(free_after):
            if done < i:
                slot_of[v], free_after[s] = s, last_read.get(v, i)
                break
        else:
            slot_of[v] = len(free_after)
            free_after.append(last_read.get(v, i))
    return slot_of, len(free_after)


class Chain:
    """A segmented network's kernels for one input/output dtype pair, launched in order on one stream.

    It serves where a fused kernel (_core.Kernel) does: launch(x_ptr, y_ptr, rows, stream) for device arrays and
    run(x, poison) for host arrays. The workspace grows on demand per stream and is never freed while the chain
    lives, so a CUDA graph captured over a call keeps valid pointers."""

    def __init__(self, mlp, segments, in_dtype, out_dtype, steps, fused):
        self.segments = segments
        self._mlp = mlp
        self._steps = steps  # per segment: (kernel of rows, its input value, output, concat part, residual)
        self.fused = fused  # (segment, its FusedMLP, its input and output dtypes): what tune() tunes
        self._out = out_dtype
        self.in_dtype = in_dtype
        storage = STORAGE[mlp._precision]
        widths = mlp.widths
        slot_of, count = workspace_slots(segments, len(widths) - 1)
        self._slot_of = slot_of
        self._slot_row_bytes = [0] * count
        for v, s in slot_of.items():
            self._slot_row_bytes[s] = max(self._slot_row_bytes[s], widths[v + 1] * _ITEMSIZE[storage])
        # the z of the norm layers that run as a GEMM and a row pass (NORM_Z): one slot of its own, live only between
        # a layer's two kernels
        z_rows = [widths[seg.first + 1] for seg in segments if seg.kind == "gemm" and mlp._norm[seg.first] is not None]
        if z_rows:
            slot_of[NORM_Z] = len(self._slot_row_bytes)
            self._slot_row_bytes.append(max(z_rows) * _ITEMSIZE[z_dtype(mlp)])
        if any(step[2] == X_PAD for step in steps):  # x's padded copy: from its pad pass to the last GEMM reading it
            slot_of[X_PAD] = len(self._slot_row_bytes)
            self._slot_row_bytes.append(pad_row(mlp, in_dtype) * _ITEMSIZE[copy_dtype(mlp)])
        self._workspaces = {}  # stream -> (rows capacity, Buffer, offsets)
        self._programs = {}  # (rows, stream) -> program(rows, stream), for launch(); cleared as the workspace grows
        self._keep = []  # outgrown workspaces: a captured graph may still use them
        self._host = None  # (rows, x Buffer, y Buffer) for run()
        self._pieces = None  # (piece rows, Buffer, its stride a staging slot, slot offsets) for run() in pieces
        self._lock = threading.Lock()  # growing the workspaces
        self._run_lock = threading.Lock()  # one run() at a time: its staging buffers are shared, as _core.Kernel's
        # one launch sequence at a time: two threads on one stream would otherwise interleave their segments on it,
        # the second's first kernel overwriting a value the first's next kernel reads (launches are asynchronous,
        # so this orders the host's few microseconds only)
        self._launch_lock = threading.Lock()
        # each kernel after the first starts while the one before it finishes (sm_90+, Kernel.launch's after)
        self._after = _env.dependent_launch()
        self.info = {"segments": [seg.describe() for seg in segments], "kernels": len(steps), "in_dtype": in_dtype,
                     "out_dtype": out_dtype}

    def _workspace(self, rows, stream):
        ws = self._workspaces.get(stream)
        if ws is not None and ws[0] >= rows:
            return ws
        with self._lock:
            ws = self._workspaces.get(stream)
            if ws is None or ws[0] < rows:
                cap = max(rows, 2 * ws[0]) if ws is not None else rows
                offsets, total = self._layout(cap)
                buf = self._mlp._device_buffer(total)
                if ws is not None:
                    self._keep.append(ws[1])
                ws = self._workspaces[stream] = (cap, buf, offsets)
                self._programs.clear()
        return ws

    def _layout(self, rows):
        """A workspace of `rows` rows: each slot's byte offset, and the bytes in all (a multiple of _ALIGN, >= 1)."""
        offsets, total = [], 0
        for row_bytes in self._slot_row_bytes:
            offsets.append(total)
            total += -(-rows * row_bytes // _ALIGN) * _ALIGN
        return offsets, max(total, _ALIGN)

    def _operand(self, v, offsets):
        """Value v's place in a call: -1 the input x, -3 the output y, -2 none, else its byte offset in the
        workspace (csrc/module_fast.c reads the same codes)."""
        if v is None:
            return -2
        if v in (NORM_Z, X_PAD):
            return offsets[self._slot_of[v]]
        if v == -1:
            return -1
        if v == len(self._mlp.widths) - 2:
            return -3
        return offsets[self._slot_of[v]]

    def launch(self, x, y, rows, stream=0):
        key = (rows, stream)
        program = self._programs.get(key)
        if program is None:  # its kernels and operands, resolved once per batch size and stream
            program = self.program(rows, stream)
            if len(self._programs) >= 64:
                self._programs.clear()
            self._programs[key] = program
        steps, base, _ = program
        where = {-1: x, -2: 0, -3: y}
        with self._launch_lock:
            for kernel, a, b, a1, r, after in steps:
                kernel.launch(where.get(a, base + a), where.get(b, base + b), rows, stream, where.get(a1, base + a1),
                              where.get(r, base + r), after)

    def forget(self):
        """Drops the resolved launches (a stretch of the chain was tuned: its calls take their kernels again)."""
        self._programs.clear()

    def program(self, rows, stream):
        """What a call of `rows` rows on `stream` launches, for the C fast path (FastPath.add_chain): (steps, the
        workspace's address, its rows), steps as (kernel, x, y, x1, res, after) in _operand's codes, after as
        Kernel.launch's."""
        cap, buf, offsets = self._workspace(rows, stream)
        return self._resolved(rows, offsets), buf.ptr, cap

    def _resolved(self, rows, offsets):
        """The steps as (kernel, x, y, x1, res, after): the kernels of a call of `rows` rows, the operands in
        _operand's codes for a workspace laid out at `offsets`."""
        return [(kernel(rows), *(self._operand(v, offsets) for v in values), self._after and i > 0)
                for i, (kernel, *values) in enumerate(self._steps)]

    def run(self, x, poison=False, out=None, pipeline=-1):
        """The outputs of a C-contiguous host array x (rows >= 1) of the chain's input dtype, synchronously; written
        into out (a C-contiguous array of the output dtype and shape) where given. pipeline as Kernel.run's: 1 in
        pieces through the device's page-locked staging (_core.pipe_chain), 0 one copy each way, -1 by size."""
        import numpy as np

        rows = x.shape[0]
        n_out = self._mlp.widths[-1]
        out_np = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[self._out]
        if out is not None and (out.dtype != out_np or out.shape != (rows, n_out) or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous ({rows}, {n_out}) array of {np.dtype(out_np)}")
        y = np.empty((rows, n_out), dtype=out_np) if out is None else out
        from . import _core as core, _gpu

        if pipeline < 0:
            pipeline = x.nbytes + y.nbytes >= core.PIPE_MIN_BYTES
        if pipeline:
            self._run_pieces(core, _gpu.gpu(self._mlp._ordinal), x, y, poison)
            return y
        with self._run_lock:
            if self._host is None or self._host[0] < rows:
                self._host = (rows, self._mlp._device_buffer(max(x.nbytes, 16)),
                              self._mlp._device_buffer(max(y.nbytes, 16)))
            _, xb, yb = self._host
            xb.write(x)
            if poison:
                yb.fill(0xFF)
            self.launch(xb.ptr, yb.ptr, rows, 0)
            yb.read(y)
        return y

    def _run_pieces(self, core, gpu, x, y, poison):
        """run() in pieces: the kernels of x's whole batch (their bits), each staging slot with a workspace of a
        piece's rows of its own, made on first use and kept (rec1024 at 16K rows a piece: 16 x 92 MB, against 12 GB
        for one workspace of 2^21 rows)."""
        piece_rows, slots = core.pipe_layout(x.strides[0], y.strides[0])
        with self._run_lock:
            if self._pieces is None or self._pieces[0] != piece_rows:
                offsets, stride = self._layout(piece_rows)
                self._pieces = (piece_rows, self._mlp._device_buffer(stride * slots), stride, offsets)
            _, buf, stride, offsets = self._pieces
            core.pipe_chain(gpu, x, y, self._resolved(x.shape[0], offsets), buf.ptr, stride, bool(poison))

    def time(self, rows, reps=5):
        raise LimitError("a segmented network is not tuned as one kernel; its fused segments are tuned on their own")


def fused_options(mlp, first, last):
    """The FusedMLP arguments of layers [first, last] as a network of their own: the input is value first - 1, a
    residual reading it says 'input', one reading a layer inside names it by its index in the stretch."""
    residual = {}
    for j in range(first, last + 1):
        r = mlp._residual[j]
        if r is None:
            continue
        op = "add" if r[0] == 1 else "mul"
        src = r[2] - first
        residual[j - first] = {"op": op, "then": r[1], "from": "input" if src == -1 else src}
    concat = {j: ("after" if mlp._concat[j] == 1 else "before") for j in range(first, last + 1) if mlp._concat[j]}
    return residual, concat


def _sub_network(mlp, first, last, x_row=0):
    """Layers [first, last] as a _core.Network of their own (the whole network's object for all of it); x_row > 0:
    the first layer reading x's padded copy of rows that wide (_stretch_weights)."""
    if first == 0 and last == len(mlp._w) - 1 and not x_row:
        return mlp._net
    residual = [None if r is None else (r[0], r[1], r[2] - first) for r in mlp._residual[first:last + 1]]
    return type(mlp._net)(_stretch_weights(mlp, first, last, x_row), mlp._b[first:last + 1],
                          mlp._acts[first:last + 1], residual, mlp._concat[first:last + 1], mlp._norm[first:last + 1],
                          mlp._encoding_arg if _encodes_x(mlp, first, x_row) else None)


def _encodes_x(mlp, first, x_row):
    """Whether the stretch from layer `first` computes the model's input encoding itself: it starts at layer 0 and
    reads x as it is (x_row 0), not the pad pass's copy, which comes encoded. Its plan (_sub_network) and the
    FusedMLP that runs it (stretch_model) both take the encoding by this rule."""
    return mlp._encoding is not None and first == 0 and not x_row


def _stretch_weights(mlp, first, last, x_row=0):
    """The weights of layers [first, last]; x_row > 0: the first one's columns padded with zeros to x_row, for a
    stretch that reads x's padded copy (copy_row). Its kernel pads K with zeros beyond x anyway, so its MMAs
    and results are those of the stretch reading x."""
    ws = list(mlp._w[first:last + 1])
    if x_row:
        ws[0] = np.pad(ws[0], ((0, 0), (0, x_row - ws[0].shape[1])))
    return ws


def _value_dtype(mlp, v, in_dtype, out_dtype):
    """The global-memory dtype of value v: x's, y's, or the compute dtype's storage between segments."""
    return in_dtype if v == -1 else out_dtype if v == len(mlp._w) - 1 else STORAGE[mlp._precision]


def _stretch_dtypes(mlp, first, last, in_dtype, out_dtype, x_row=0):
    """The global dtypes of layers [first, last]'s input and output as one fused kernel; x_row > 0: its input x's
    padded copy, in the compute dtype's storage."""
    k_in = copy_dtype(mlp) if x_row else _value_dtype(mlp, first - 1, in_dtype, out_dtype)
    return k_in, _value_dtype(mlp, last, in_dtype, out_dtype)


def _stretch_plan(mlp, first, last, target, in_dtype, out_dtype, x_row=0):
    """The default plan of layers [first, last] as one fused kernel; x_row > 0: reading x's padded copy."""
    arch, smem_per_block, sm_count, smem_per_sm = target
    return _sub_network(mlp, first, last, x_row).plan(
        arch, smem_per_block, sm_count, *_stretch_dtypes(mlp, first, last, in_dtype, out_dtype, x_row),
        smem_per_sm=smem_per_sm, precision=mlp._precision)


def _kernel_words(info):
    if info["cluster"]:
        return f"wgmma on clusters of {info['cluster']}, weights resident"
    if info["stream_slots"]:
        n = len(info["wide_layers"])
        wide = f", outputs of {n} wide layer{'s' if n > 1 else ''} through shared memory" if n else ""
        return f"wgmma, weights streamed from L2 through {info['stream_slots']} slots{wide}"
    return f"{'wgmma' if info['wgmma'] else 'mma.sync'}, weights resident"


def plan(mlp, arch, smem_per_block, sm_count, smem_per_sm, in_dtype, out_dtype, policy=None):
    """The segments of mlp for a target, or None where the whole network is one fused kernel: with its weights on
    chip, or (mlp._segment_policy "streamed") any fused kernel, streamed weights included; policy "resident" cuts a
    network whose weights do not stay on chip into stretches whose weights do. "auto" (the default) is "resident" on
    sm_90, where NeRF's trunk ran 9.56 ms cut against 11.0 ms streamed (H100, 2^21 rows: docs/performance.md), and
    "streamed" on the GPUs not measured. "gemm" runs every layer as a GEMM (a 16- or 32-bit network without norm
    layers; others as "auto"): what a small batch of a network with wide fused stretches takes (gemms_at)."""
    target = (arch, smem_per_block, sm_count, smem_per_sm)
    n = len(mlp._w)

    from . import _core

    # the widest layer a fused kernel holds (8-bit: 256, its streamed warpgroup form keeping no wide buffer of codes)
    most = _core.MAX_ONCHIP_WIDTH if mlp._precision in _WHOLE_ONLY else _core.MAX_FUSED_WIDTH

    def too_wide(first, last):  # why layers [first, last] are too wide for a fused kernel (None: they are not)
        widest = max(w for w in mlp.widths[first:last + 2])
        return f"{widest} features; a fused kernel holds {most} a layer" if widest > most else None

    x_row, copied = pad_row(mlp, in_dtype), set()  # (the lasts of the stretches from layer 0 that read x's copy)
    copy_word = "copy" if mlp._encoding is None else "encoded copy"  # (the pad pass encodes x where the model does)

    def fits(first, last):
        why = too_wide(first, last)
        if why:
            return False, why
        try:
            info = _stretch_plan(mlp, first, last, target, in_dtype, out_dtype).info
        except LimitError as e:
            info, why = None, e.message
        copy = _copy_plan(mlp, last, target, in_dtype, out_dtype, x_row) if first == 0 else None
        if copy is not None and (info is None or (copy["warps"] > info["warps"] and _copy_pays(mlp, last, in_dtype,
                                                                                                x_row))):
            copied.add(last)
            info = copy
        if info is None:
            return False, why
        if not info["resident"] and not info["stream_slots"]:  # the mma.sync kernel's per-tile weight stream
            return False, "its weights do not fit on chip (one CTA or a cluster)"
        return True, _kernel_words(info)

    policy = policy or mlp._segment_policy
    if policy == "gemm":  # (not for an encoded x: the all-GEMM small-batch chain is untried with its pad pass)
        if (mlp._precision not in _WHOLE_ONLY and not any(nm is not None for nm in mlp._norm)
                and mlp._encoding is None):
            return cut(n, mlp._residual, mlp._concat, lambda first, last: (False, "every layer a GEMM (a small batch)"))
        policy = "auto"
    whole, _ = fits(0, n - 1)
    if whole and n - 1 not in copied:
        return None
    if policy == "auto":
        # 8-bit: its one streamed kernel where it has one, until the all-GEMM chain is measured against it
        policy = "resident" if arch == 90 and mlp._precision not in _WHOLE_ONLY else "streamed"

    @functools.lru_cache(maxsize=None)  # (asked once for each norm layer the cut makes a GEMM)
    def one_kernel():  # the whole network's plan of any form (streamed weights included), or None
        try:
            return _stretch_plan(mlp, 0, n - 1, target, in_dtype, out_dtype)
        except LimitError:
            return None

    if policy == "streamed" and one_kernel() is not None:
        return None
    if mlp._precision in _WHOLE_ONLY:
        segments = cut(n, mlp._residual, mlp._concat, lambda first, last: (False, too_wide(first, last) or (
            f"a cut {mlp._precision} network runs every layer as a GEMM")))
    else:
        segments = cut(n, mlp._residual, mlp._concat, fits)
    # A layer the cut leaves to a GEMM may be one no GEMM takes: then the one streamed kernel where the network has
    # it, else the plan's error, which names the layer and the rule. A norm layer is its GEMM and a second kernel;
    # the one streamed kernel, where the network has it, beats that cut (its norm layers' rows stay on chip).
    for seg in segments:
        if seg.kind == "gemm":
            norm = mlp._norm[seg.first] is not None
            if norm and one_kernel() is not None:
                return None
            try:
                if norm:
                    mlp._norm_plan(seg.first, *target, *norm_dtypes(mlp, seg.first, in_dtype, out_dtype))
                mlp._gemm_plan(seg.first, *target, *gemm_dtypes(mlp, seg.first, in_dtype, out_dtype))
            except LimitError:
                if one_kernel() is not None:
                    return None
                raise
            if norm:
                seg.reason += f"; its {_norm.NAMES[mlp._norm[seg.first][0]]} in a second kernel over whole rows"
            if x_row and reads_x(mlp, seg.first):
                seg.reason += (f"; x read from its {copy_word} in rows of {x_row} {copy_dtype(mlp)} (made "
                               "once, before the first kernel that reads x)")
    # a first stretch reads x's copy where that gave it two warpgroups (or any kernel at all), or where the chain makes
    # the copy anyway (a GEMM reads x) and the stretch reads x as its input alone
    head = segments[0]
    if head.kind == "fused" and x_row and (head.last in copied or (pad_before(mlp, segments, in_dtype) is not None
                                                                     and _reads_x_alone(mlp, head.last))):
        head.x_copy = True
        head.reason += f"; x read from its {copy_word} in rows of {x_row} {copy_dtype(mlp)}"
    return segments


def _reads_x_alone(mlp, last):
    """Whether layers [0, last] read x as the first one's input only (no concat of x, no residual from it)."""
    return not any(mlp._concat[j] or (mlp._residual[j] is not None and mlp._residual[j][2] == -1)
                   for j in range(last + 1))


#: FLOPs a row of a stretch must take per byte a row of x's pad pass moves for the copy to pay for two warpgroups
#: instead of one: one warpgroup took 1.38-1.51x two's time for sdf512's stretches (H100, 2^21 rows), so the pass pays
#: where a third of the stretch's time (at 746 TFLOP/s) passes its bytes' (at 2.9 TB/s): 86 FLOPs a byte; doubled
#: for the stretches below FLOP-bound (bench/results/h100-in-shared/).
COPY_FLOPS_PER_BYTE = 172


def _copy_pays(mlp, last, in_dtype, x_row):
    """Whether layers [0, last] do enough arithmetic a row to pay for x's pad pass to rows of x_row
    (COPY_FLOPS_PER_BYTE)."""
    widths = mlp.widths
    flops = sum(2 * widths[l] * widths[l + 1] for l in range(last + 1))
    moved = widths[0] * _ITEMSIZE[in_dtype] + x_row * _ITEMSIZE[copy_dtype(mlp)]
    return flops >= COPY_FLOPS_PER_BYTE * moved


def _copy_plan(mlp, last, target, in_dtype, out_dtype, x_row):
    """The info of layers [0, last]'s streamed warpgroup plan reading x's padded copy (rows of x_row, pad_row), or
    None where there is no copy, the stretch reads x otherwise too, or no such plan: where x would land through a raw
    buffer (a width of no whole 16-byte pieces, or float32), the copy may give the stretch two warpgroups, or any
    kernel (float32 512-wide x: 32 KB of landing buffer a warp)."""
    if not x_row or not _reads_x_alone(mlp, last) or mlp._precision not in _PAD_PRECISIONS:
        return None  # (an 8-bit network's encoded copy is for its GEMMs: no 8-bit streamed stretch reads it)
    try:
        info = _stretch_plan(mlp, 0, last, target, in_dtype, out_dtype, x_row).info
    except LimitError:
        return None
    return info if info["wgmma"] and info["stream_slots"] else None


def _gemm_operands(mlp, layer):
    """Layer's GEMM operands as value indices: input part 0, the concat's part 1 (None) and the residual's (None)."""
    cat = mlp._concat[layer]
    p0, p1 = (-1, layer - 1) if cat == 2 else (layer - 1, -1 if cat == 1 else None)
    res = mlp._residual[layer][2] if mlp._residual[layer] is not None else None
    return p0, p1, res


def pad_row(mlp, in_dtype):
    """Elements a row of x's padded copy (X_PAD) in a chain of input dtype in_dtype, or 0 where its GEMMs read x as
    it is: a 16-bit compute dtype, x not in it or its rows not whole 16-byte pieces, and x wider than PAD_MIN_WIDTH
    (FUSEDMLP_GEMM_PAD=1 / -1: any width / never). An encoded x (encoding=) always has its copy (copy_dtype), which
    the pass encodes (pad_rows.cu), but in tf32 (its GEMMs reading x are then a LimitError)."""
    storage, force = STORAGE[mlp._precision], _env.gemm_pad()
    if mlp._encoding is not None:  # the pass encodes x's copy, the only x a GEMM of such a network reads
        return _whole_pieces(mlp.widths[0]) if copy_dtype(mlp) is not None else 0
    if mlp._precision not in _PAD_PRECISIONS or (in_dtype == storage and mlp.widths[0] * _ITEMSIZE[storage] % 16 == 0):
        return 0
    if force < 0 or (force == 0 and mlp.widths[0] < PAD_MIN_WIDTH):
        return 0
    return _whole_pieces(mlp.widths[0])


def copy_dtype(mlp):
    """The dtype of x's padded copy (pad_row): the compute dtype's storage in a 16-bit chain, float16 for an 8-bit
    network's encoded x (its GEMMs quantise a float16 part on the way in, as they do x); None where there is none."""
    if mlp._precision in _PAD_PRECISIONS:
        return STORAGE[mlp._precision]
    return "float16" if mlp._encoding is not None and STORAGE[mlp._precision] == "codes" else None


def _whole_pieces(width):
    """width 16-bit elements rounded up to whole 16-byte pieces (fm_gemm_pad_row)."""
    return -(-width // 8) * 8


def reads_x(mlp, layer):
    """Whether GEMM layer `layer` reads x (the network input) as an input part."""
    return -1 in _gemm_operands(mlp, layer)[:2]


def pad_before(mlp, segments, in_dtype):
    """The first GEMM layer of `segments` that reads x where the chain pads x of dtype in_dtype (its pad pass runs
    just before that GEMM, once for every GEMM reading x), else None."""
    if not pad_row(mlp, in_dtype):
        return None
    return next((seg.first for seg in segments if seg.kind == "gemm" and reads_x(mlp, seg.first)), None)


def copy_row(mlp, seg, in_dtype):
    """The row of x's padded copy (pad_row) where segment seg, a chain's first fused stretch, reads the copy instead
    of x (Segment.x_copy, set by plan: where the copy gives it two warpgroups, or where the chain makes the copy anyway
    for a GEMM reading x and the stretch reads x as its input alone), else 0. The pad pass then runs first, and the
    stretch's kernel takes rows of whole 16-byte pieces in the compute dtype, which land in its warps' input buffers as
    they are: no raw landing buffer, which left sdf512's first stretch (259-wide x, 512-wide layers) room for one
    warpgroup only."""
    return pad_row(mlp, in_dtype) if seg.x_copy else 0


def pad_pass_at(mlp, segments, in_dtype):
    """Where a chain runs x's pad pass: (the index of the segment it runs just before, the GEMM layer whose pad plan
    it is), or (None, None) where the chain makes no copy. The first segment where it reads the copy (the plan of the
    first GEMM reading x, or layer 0's where none does), else the first GEMM reading x (pad_before)."""
    layer = pad_before(mlp, segments, in_dtype)
    if segments and segments[0].x_copy:
        return 0, layer or 0
    if layer is None:
        return None, None
    return next(i for i, seg in enumerate(segments) if seg.first == layer), layer


def part_rows(mlp, layer, a0, a1):
    """gemm_plan's a0_row / a1_row for layer's GEMM with input parts of dtypes a0, a1: the padded copy's row for a
    part that is x in the compute dtype's storage where the chain pads x of that dtype (pad_row). x of another dtype
    read as the compute dtype's storage is the copy too; its row is x's width where pad_row(storage) is 0 (whole
    pieces), which the plan takes as 0, so the same rule serves."""
    if copy_dtype(mlp) is None or not 0 <= layer < len(mlp._w):  # (gemm_plan names a bad layer)
        return {}
    storage, (p0, p1, _) = copy_dtype(mlp), _gemm_operands(mlp, layer)
    row = pad_row(mlp, storage)
    if not row:
        return {}
    return {name: row for name, v, d in (("a0_row", p0, a0), ("a1_row", p1, a1)) if v == -1 and d == storage}


def gemm_dtypes(mlp, layer, in_dtype, out_dtype):
    """The global dtypes of layer's GEMM operands (part 0, the concat's part 1, the residual's: None where absent) and
    of its result, as gemm_plan takes them. A norm layer's GEMM has no residual and writes z in the compute dtype's
    storage: its second kernel (norm_dtypes) reads the residual and writes the layer's result. x read from its padded
    copy (pad_row) is in the compute dtype's storage."""
    padded = pad_row(mlp, in_dtype)
    p0, p1, res = _gemm_operands(mlp, layer)
    dtypes = tuple(None if v is None else copy_dtype(mlp) if v == -1 and padded and part else
                   _value_dtype(mlp, v, in_dtype, out_dtype) for v, part in ((p0, 1), (p1, 1), (res, 0), (layer, 0)))
    if mlp._norm[layer] is not None:
        return dtypes[0], dtypes[1], None, z_dtype(mlp)
    return dtypes


def z_dtype(mlp):
    """The global dtype of a norm layer's z between its GEMM and its row pass (NORM_Z): the compute dtype's storage,
    float16 for an 8-bit network (whose CPU emulation rounds z so too: csrc/gemm.c, fm_plan_gemm_norm)."""
    return "float16" if STORAGE[mlp._precision] == "codes" else STORAGE[mlp._precision]


def norm_dtypes(mlp, layer, in_dtype, out_dtype):
    """The global dtypes of norm layer's second kernel: z (its GEMM's result), the residual operand (None: absent) and
    the layer's result, as _norm_plan takes them."""
    _, _, res = _gemm_operands(mlp, layer)
    return (z_dtype(mlp), None if res is None else _value_dtype(mlp, res, in_dtype, out_dtype),
            _value_dtype(mlp, layer, in_dtype, out_dtype))


def plans(mlp, arch, in_dtype, out_dtype, target=None):
    """Ahead of time: the plan of every segment's kernel for a named arch (fused stretches: their default plan), or
    for a GPU's limits (target: arch, smem_per_block, sm_count, smem_per_sm)."""
    target = target or (arch, 0, 0, 0)
    out = []
    segments = mlp._segments_for(*target, in_dtype, out_dtype)
    pad_at, pad_layer = pad_pass_at(mlp, segments, in_dtype)
    for i, seg in enumerate(segments):
        if i == pad_at:
            out.append(mlp._pad_plan(pad_layer, *target, in_dtype))
        if seg.kind == "fused":
            out.append(_stretch_plan(mlp, seg.first, seg.last, target, in_dtype, out_dtype,
                                     copy_row(mlp, seg, in_dtype)))
        else:
            out.append(mlp._gemm_plan(seg.first, *target, *gemm_dtypes(mlp, seg.first, in_dtype, out_dtype)))
            if mlp._norm[seg.first] is not None:
                out.append(mlp._norm_plan(seg.first, *target, *norm_dtypes(mlp, seg.first, in_dtype, out_dtype)))
    return out


def stretch_model(mlp, seg, in_dtype, out_dtype):
    """A fused segment's layers as a FusedMLP of their own (tuned and cached as any network: its tuning records are
    the same for every model built of the same layers), with the dtypes of its input and output in memory (its input
    x's padded copy where it reads that: copy_row)."""
    f, last, x_row = seg.first, seg.last, copy_row(mlp, seg, in_dtype)
    residual, concat = fused_options(mlp, f, last)
    weights, biases, norm = stretch_arrays(mlp, seg, in_dtype)
    sub = type(mlp)(weights, biases, mlp._acts[f:last + 1], residual=residual, concat=concat or None, norm=norm,
                    encoding=mlp.encoding if _encodes_x(mlp, f, x_row) else None,
                    dtype=mlp._precision, device=mlp.device, cache_dir=mlp._cache.directory)
    return (sub, *_stretch_dtypes(mlp, f, last, in_dtype, out_dtype, x_row))


def stretch_arrays(mlp, seg, in_dtype):
    """A fused segment's weights, biases and norm= as stretch_model gives its FusedMLP, from mlp's as they are now
    (FusedMLP.set_weights passes them on)."""
    f, last = seg.first, seg.last
    return (_stretch_weights(mlp, f, last, copy_row(mlp, seg, in_dtype)), mlp._b[f:last + 1],
            _norm.option(mlp._norm, f, last))


#: Smaller GEMM tiles, largest first (rows, columns), for calls whose default tile leaves SMs idle.
SMALL_TILES = ((128, 128), (64, 128), (64, 64))


def smaller_tiles(default):
    """The SMALL_TILES a layer whose default GEMM tile is `default` may step down to, largest first."""
    return [t for t in SMALL_TILES if t[0] <= default[0] and t[1] <= default[1] and t != default]


def gemm_tile_plans(mlp, layer, target, dtypes):
    """Layer `layer`'s GEMM plan info at its default tile and at each smaller one: {tile: info}, the default first;
    gemm_tile's `specialised` are the tiles whose info has ws."""
    info = mlp._gemm_plan(layer, *target, *dtypes).info
    plans = {(info["bm"], info["bn"]): info}
    for bm, bn in smaller_tiles((info["bm"], info["bn"])):
        plans[(bm, bn)] = mlp._gemm_plan(layer, *target, *dtypes, bm=bm, bn=bn).info
    return plans


def gemm_tile(rows, n, default, sm_count, specialised=()):
    """The GEMM tile (bm, bn) for a call of `rows` rows of a layer of n outputs: the plan's default tile (bm, bn)
    where its tiles fill the GPU's SMs at least once, else the largest smaller tile that does, else the smallest. The
    `specialised` tiles (those whose form for the layer is warp-specialised: csrc/gemm.c, fm_gemm_small_form and the
    default's auto rules) need fill only half the SMs.

    At 2^10 rows a 512-wide layer's default 128 x 256 tile makes 16 CTAs for 132 SMs; each then runs the whole K loop
    alone (wide512's five GEMMs took 66 us at 2^10 rows on the H100, PyTorch's CUDA graph 25). A warp-specialised CTA
    keeps its loads ahead of its MMAs, so fewer, larger tiles win sooner: on the H100 (bench/results/h100-gemm-small/)
    rec1024's 1024 x 1024 layer at 4096 rows took 16.9 us in the default tile's 128 CTAs, 24.2 in 128 x 128's 256; at
    1024 rows its 1024 -> 512 layer 8.1 us in 64 x 64's 128 CTAs with a producer warpgroup, 9.4 in 64 x 128's 64."""
    tiles = [default] + smaller_tiles(default)
    for bm, bn in tiles:
        need = -(-sm_count // 2) if (bm, bn) in specialised else sm_count
        if -(-rows // bm) * -(-n // bn) >= need:
            return bm, bn
    return tiles[-1]


class GemmLayer:
    """One GEMM layer of a chain: its kernel for each tile a call's batch size asks for (gemm_tile), built on first
    use; the default tile's is built with the chain."""

    def __init__(self, mlp, layer, dtypes, default, kernel, sm_count, specialised=()):
        self._mlp, self._layer, self._dtypes, self._sm_count = mlp, layer, dtypes, sm_count
        self._n = mlp.widths[layer + 1]
        self.default = default
        self.specialised = tuple(specialised)  # the tiles whose form is warp-specialised (gemm_tile)
        self._kernels = {default: kernel}
        self._lock = threading.Lock()

    def kernel(self, rows):
        tile = self.default if self._mlp._gemm_options else gemm_tile(rows, self._n, self.default, self._sm_count,
                                                                       self.specialised)
        found = self._kernels.get(tile)
        if found is None:
            with self._lock:
                found = self._kernels.get(tile)
                if found is None:
                    found = self._kernels[tile] = self._mlp._build_gemm(self._layer, *self._dtypes, bm=tile[0],
                                                                        bn=tile[1])
        return found


#: A batch in _tune.size_class up to this one (0: below 16 rows per SM, 1: below 64; the class is part of a call's
#: key, so every call of a key runs the same kernels) runs a cut network every layer a GEMM (policy "gemm") where a
#: fused stretch of it holds two or more layers wider than 256 (gemms_at). sdf512 on the H100, each form in a CUDA
#: graph (bench/results/h100-gemm-small-batch/): 1024 rows 62.4 -> 50.8 us, 2048 72.7 -> 56.2, 4096 77.0 -> 69.7, 8192
#: 97.5 -> 98.5 and 16384 183.4 -> 182.5 (even), the same bits (the stretches keep their values in 16 bits between
#: layers, as the GEMMs do). rec1024, whose fused stretch is its narrow tail, lost as all GEMMs (29.4 -> 30.3
#: us) and wide512, one kernel, too (26.0 -> 28.3): neither is picked.
GEMMS_SIZE_CLASS = 1


def gemms_at(mlp, segments, rows, sm_count):
    """Whether a call of `rows` rows of a network cut into `segments` runs every layer as a GEMM instead."""
    if not sm_count or _tune.size_class(rows, sm_count) > GEMMS_SIZE_CLASS:
        return False
    widths = mlp.widths  # (a network that is one fused stretch reading x's copy keeps its own small-batch plans)
    return any(seg.kind == "gemm" for seg in segments) and any(
        seg.kind == "fused" and sum(widths[l + 1] > 256 for l in range(seg.first, seg.last + 1)) >= 2
        for seg in segments)


def chain(mlp, in_dtype, out_dtype, policy=None):
    """The Chain of mlp's segments on its GPU for one dtype pair, built (compiled, loaded) once; policy as
    _segments_for takes it (None: the model's)."""
    key = (in_dtype, out_dtype, policy)
    found = mlp._chains.get(key)
    if found is not None:
        return found
    with mlp._lock:
        found = mlp._chains.get(key)
        if found is not None:
            return found
        target = mlp._target()
        segments = mlp._segments_for(*target, in_dtype, out_dtype, policy)
        # the GEMMs compile and load in parallel first, as the tuner's candidates do (NVRTC releases the GIL): sdf512's
        # nine layers are four distinct sources
        gemms = [seg.first for seg in segments if seg.kind == "gemm"]
        norms = [l for l in gemms if mlp._norm[l] is not None]

        with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(gemms) + len(norms)))) as pool:
            built = pool.map(lambda l: mlp._build_gemm(l, *gemm_dtypes(mlp, l, in_dtype, out_dtype)), gemms)
            built_norms = pool.map(lambda l: mlp._build_norm(l, *norm_dtypes(mlp, l, in_dtype, out_dtype)), norms)
            built, built_norms = dict(zip(gemms, built)), dict(zip(norms, built_norms))
        steps, fused = [], []
        padded = pad_row(mlp, in_dtype)
        pad_at, pad_layer = pad_pass_at(mlp, segments, in_dtype)
        for i, seg in enumerate(segments):
            f, last = seg.first, seg.last
            if i == pad_at:  # x to its padded copy, once, before the first kernel reading it
                steps.append((lambda rows, k=mlp._build_pad(pad_layer, in_dtype): k, -1, X_PAD, None, None))
            if seg.kind == "fused":
                sub, k_in, k_out = stretch_model(mlp, seg, in_dtype, out_dtype)
                fused.append((seg, sub, k_in, k_out))
                kernel = lambda rows, sub=sub, k_in=k_in, k_out=k_out: sub._kernel(k_in, k_out, rows)  # noqa: E731
                steps.append((kernel, X_PAD if seg.x_copy else f - 1, last, None, None))
            else:
                p0, p1, res = _gemm_operands(mlp, f)  # (a residual from x reads x itself, in its dtype)
                p0, p1 = (X_PAD if padded and v == -1 else v for v in (p0, p1))
                dtypes = gemm_dtypes(mlp, f, in_dtype, out_dtype)
                plans = gemm_tile_plans(mlp, f, target, dtypes)
                specialised = [tile for tile, info in plans.items() if info["ws"]]
                gemm = GemmLayer(mlp, f, dtypes, next(iter(plans)), built[f], target[2], specialised)
                if f in built_norms:  # z = W h + b to its slot, then the rows through the norm and the rest
                    steps.append((gemm.kernel, p0, NORM_Z, p1, None))
                    steps.append((lambda rows, k=built_norms[f]: k, NORM_Z, f, None, res))
                else:
                    steps.append((gemm.kernel, p0, f, p1, res))
        found = mlp._chains[key] = Chain(mlp, segments, in_dtype, out_dtype, steps, fused)
        return found
