"""fusedmlp against PyTorch on one GPU: ``python -m fusedmlp.bench [--out DIR | --save] [--quick]``.

One process measures the device's two ceilings, then every (workload, rows) pair, and writes a table, a JSON file
with every number and a plot of rows/s against batch size. Needs PyTorch with CUDA (and matplotlib for the plot);
``import fusedmlp.bench`` itself needs neither.

What each number is (all inputs and outputs fp16, weights fp16-rounded, inputs N(0, 1) from a fixed seed):

- ``floor``: max(I/O bytes / copy rate, FLOPs / matmul rate). I/O bytes = rows * (in + out) * 2; FLOPs =
  2 * rows * sum(in_l * out_l) over the real (unpadded) widths. The copy rate is bytes read + written per second of a
  large device-to-device ``copy_``; the matmul rate is that of an 8192^3 fp16 ``torch.mm`` on random data.
- ``ms`` of a method: the median over reps of (CUDA-event time of a group of back-to-back calls) / calls in the group.
  Groups last >= 0.5 ms, so at small batches this is the steady-state cost per call, launch overhead included where
  the host is the bottleneck. Calls rotate among >= 4 input buffers, more when they are small, so that together they
  span twice the L2 cache where that takes at most 64 buffers.
- ``fusedmlp``: ``Kernel.launch`` on preallocated tensors; for a segmented network ``fused(x, out=y)``, whose launches
  run from C after a first call (the fast path; its chain's ``launch`` walks the segments in Python, 50 us at 1024
  rows of rec1024 on the H100, more than the kernels). ``fusedmlp_graph``: one CUDA graph holding one launch per
  input buffer, time per launch (device time without host overhead). ``fusedmlp_call``: ``fused(x)`` on a CUDA tensor
  (``FusedMLP.__call__`` if it accepts CUDA tensors, else a shim: check, allocate the output, launch).
- ``torch_eager``: ``nn.Sequential`` in fp16 under ``torch.inference_mode``. ``torch_graph``: the same captured in
  one CUDA graph holding one forward per input buffer, time per forward. ``torch_compile``:
  ``torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False)``, one compile per workload, recompiled
  per row count.
- ``call_us``: the median over up to 200 host-timed single calls, each followed by a stream synchronize.
  ``call_out_us``: the same for ``fused(x, out=y)`` into a preallocated output (no ``torch.empty`` per call); its
  output must equal ``fused(x)``'s bit for bit.
- ``cold_ms``: the first call of a new FusedMLP with an empty cache folder (render + NVRTC + load + launch);
  ``warm_ms``: the first call of another new FusedMLP on the same folder (disk-cache hit + load + launch).

Every method's output on the first buffer is compared with a float64 forward of the same model (relative L2) before
it is timed; fusedmlp must be within CHECK_TOLERANCE, or the run exits with status 1. A method that fails is recorded
with its error and the run goes on. torch.compile runs last, largest batches first, within the time budget.
"""

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import pathlib
import platform
import re
import signal
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from . import _encoding, bench_arrays, bench_host, bench_lowbit
from ._layers import stacked_layer
from .bench_report import PEERS, format_table, plot, rows_label, summarize, write_outputs  # noqa: F401

__all__ = ["WORKLOADS", "Workload", "main", "floor_ms", "flops", "io_bytes", "format_table", "plot", "device_slug"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One network shape of the benchmark.

    Attributes:
        widths: input features, then each layer's output features.
        activation: the hidden layers' activation ('relu', 'silu', 'tanh' or 'sin'); the last layer has none.
        bias: whether every layer has a bias.
        residual: whether hidden layers add their input (a residual epilogue).
        concat: ((layer, 'before' | 'after'), ...): layers whose input is torch.cat([x, h]) / torch.cat([h, x]).
        output_activation: the last layer's activation.
        norm: 'layernorm' after every hidden Linear (before its activation), or 'none'.
        blocks: SimBa's residual MLP (Lee et al., 2024) where > 0: widths are (in, h, 4h, h, ..., 4h, h, out), a Linear
            in, `blocks` pre-norm blocks h + W2 act(W1 LayerNorm(h)), a LayerNorm before the head (the torch model as
            written; fusedmlp runs each LayerNorm on an identity layer: fused_layers).
        encoding: NeRF's positional encoding of x with this many frequencies where > 0, in the torch model's forward
            (torch.cat([x, sin(x), cos(x), ..., cos(2^(L-1) x)], -1)) and fusedmlp's encoding=: widths[0] is then the
            encoded width the first layer reads, and x has widths[0] / (2 L + 1) features (x_features).
        stacks: this many stacks of these widths on the one input, their outputs side by side (torch.cat: TD3's and
            SAC's twin critics); fusedmlp.from_torch reads them as one chain of block-diagonal layers (fused_layers),
            so its hidden layers do `stacks` times the multiply-adds the floor counts.
    """

    widths: tuple
    activation: str
    bias: bool
    residual: bool = False
    concat: tuple = ()
    output_activation: str = "none"
    norm: str = "none"
    blocks: int = 0
    encoding: int = 0
    stacks: int = 1

    def out_features(self):
        """y's features: the last width, of every stack."""
        return self.widths[-1] * self.stacks

    def x_features(self):
        """x's features in memory: widths[0], or the features the encoding is made of."""
        return self.widths[0] // (2 * self.encoding + 1) if self.encoding else self.widths[0]

    def layer_inputs(self):
        """Each layer's input features: the width before it, plus x's with a concat."""
        cat = dict(self.concat)
        return [a + (self.widths[0] if i in cat else 0) for i, a in enumerate(self.widths[:-1])]


WORKLOADS = {
    "tcnn64": Workload((32, 64, 64, 64, 64, 16), "relu", False),  # tiny-cuda-nn's README network
    "tcnn128": Workload((64, 128, 128, 128, 128, 64), "relu", False),
    "flex": Workload((3, 64, 128, 96, 64, 32, 16, 4), "silu", True),
    "pinn50": Workload((2, 50, 50, 50, 50, 50, 1), "tanh", True),
    "siren256": Workload((2, 256, 256, 256, 3), "sin", True),
    # issue 4's res128: 64-128, four blocks x + gelu(Linear128(x)), -64
    "res128": Workload((64, 128, 128, 128, 128, 128, 64), "gelu", True, residual=True),
    # issue 29's networks bigger than one CTA's shared memory: NeRF's trunk (the encoded input joins layer 5), a deep
    # 256-wide stack, and layers wider than one fused kernel holds (an SDF decoder with the input re-injected halfway,
    # a recommendation top-MLP)
    "nerf": Workload((63,) + (256,) * 8 + (4,), "relu", True, concat=((5, "before"),)),
    # NeRF as written: the model takes the 3-D points and encodes them in forward (fusedmlp's encoding=)
    "nerfenc": Workload((63,) + (256,) * 8 + (4,), "relu", True, concat=((5, "before"),), encoding=10),
    "deep256": Workload((64,) + (256,) * 5 + (64,), "relu", False),
    "wide512": Workload((64,) + (512,) * 4 + (64,), "gelu", True),
    "sdf512": Workload((259,) + (512,) * 8 + (1,), "relu", True, concat=((4, "before"),), output_activation="tanh"),
    "rec1024": Workload((256, 1024, 1024, 512, 256, 1), "relu", True),
    # issue 30's control-loop MLP of recent RL agents: Linear -> LayerNorm -> SiLU
    "rl256": Workload((64, 256, 256, 256, 16), "silu", True, norm="layernorm"),
    "r256": Workload((64, 256, 256, 256, 16), "silu", True),  # rl256 without its LayerNorm: what the norm costs
    # the same at a width no fused kernel's norm layer takes: each layer a GEMM, each LayerNorm a row pass after it
    "rl1024": Workload((64, 1024, 1024, 1024, 16), "silu", True, norm="layernorm"),
    "r1024": Workload((64, 1024, 1024, 1024, 16), "silu", True),
    # classifiers: a softmax over the classes after the last Linear (fused as its norm); 1000 classes are a GEMM and a
    # row pass after the two 1024-wide layers
    "cls10": Workload((64, 256, 256, 256, 10), "relu", True, output_activation="softmax"),
    "cls1000": Workload((256, 1024, 1024, 1000), "relu", True, output_activation="softmax"),
    # SimBa's residual MLP of pre-norm blocks, as an RL agent writes it: residuals from two layers back, each LayerNorm
    # of the residual stream on an identity layer of its own
    "simba64": Workload((17, 64, 256, 64, 256, 64, 5), "relu", True, blocks=2),
    # TD3's / SAC's twin Q critics on one state-action input (17 + 6 features, MuJoCo's HalfCheetah), as one network
    "twin256": Workload((23, 256, 256, 1), "relu", True, stacks=2),
}

DEFAULT_ROWS = (2**10, 2**14, 2**18, 2**21)
METHODS = ("fusedmlp", "fusedmlp_graph", "fusedmlp_call", "torch_eager", "torch_graph", "torch_compile")
COMPILE_MODE = "max-autotune-no-cudagraphs"

#: Where the torch side runs; the CPU smoke test sets "cpu" (with torch.cuda mocked).
DEVICE = "cuda"
#: Ceiling sizes: 1 GiB copied (far past any L2), and the 8192^3 product the brief names.
COPY_BYTES = 1 << 30
MATMUL_N = 8192

GROUP_MS = 0.5  # a timed group lasts at least this long, so event resolution (~0.5 us) and launch gaps amortise
MAX_INNER = 256  # calls per timed group at most
MAX_METHOD_S = 2.0  # reps are cut (never below MIN_REPS) to keep one method of one case under this
MIN_REPS = 10
MAX_BUFFERS = 64
HOST_CALL_S = 0.4  # host-timed calls of one method stop after about this long (at least 30 calls)
SLOW_COMPILE_GUESS_S = 60.0  # what the first torch.compile of the run is assumed to take before one was seen
FINAL_RESERVE_S = 20.0  # kept back from the budget for the plot and the files


# ------------------------------------------------------------------------------------------------ pure arithmetic


def flops(widths, rows, concat=(), stacks=1):
    """FLOPs of one forward: 2 * rows * sum(in_l * out_l) over the real widths (no padding, no activations), of each
    of `stacks` stacks; a layer named in concat ((layer, mode), ...) also takes the input's widths[0] features."""
    cat = dict(concat)
    return 2 * rows * stacks * sum((a + (widths[0] if i in cat else 0)) * b
                          for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])))


def io_bytes(widths, rows, itemsize=2, x_features=None, stacks=1):
    """Bytes one forward must move: each input read once, each output written once (of each of `stacks` stacks);
    x_features: x's features where they are not widths[0] (an input encoding)."""
    return rows * ((widths[0] if x_features is None else x_features) + widths[-1] * stacks) * itemsize


def floor_ms(widths, rows, ceilings, concat=(), x_features=None, stacks=1):
    """The fastest any version can be, from the measured ceilings.

    Args:
        widths: the network's widths.
        rows: batch size.
        ceilings: dict with 'copy_GBps' (bytes read + written, 1e9/s) and 'matmul_TFLOPs' (1e12 FLOP/s).
        concat, x_features, stacks: as flops and io_bytes take them.

    Returns:
        (milliseconds, 'memory' or 'compute': the term that sets it).
    """
    memory = io_bytes(widths, rows, x_features=x_features, stacks=stacks) / (ceilings["copy_GBps"] * 1e9)
    compute = flops(widths, rows, concat, stacks) / (ceilings["matmul_TFLOPs"] * 1e12)
    return max(memory, compute) * 1e3, ("memory" if memory >= compute else "compute")


def parse_rows(text):
    """'2^18', '2**18', '1<<18' or '262144' -> 262144."""
    text = text.strip()
    m = re.fullmatch(r"2\s*(?:\^|\*\*)\s*(\d+)|1\s*<<\s*(\d+)", text)
    value = 2 ** int(m.group(1) or m.group(2)) if m else int(text)
    if value < 1:
        raise ValueError(f"rows={text!r}: a batch needs at least one row")
    return value


def device_slug(name):
    """A folder name for a GPU: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090'."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    picked = []
    for w in words:
        picked.append(w)
        if any(c.isdigit() for c in w):
            break
    return "-".join(picked) or "gpu"


# ------------------------------------------------------------------------------------------------ progress

_t0 = time.perf_counter()


def _elapsed():
    return time.perf_counter() - _t0


def _say(msg):
    print(f"[{_elapsed():6.1f}s] {msg}", flush=True)


def _error_text(e):
    return f"{type(e).__name__}: {e}"[:600]


class _OutOfTime(BaseException):
    """Raised by the alarm when one torch.compile runs past the budget (a BaseException, so that inductor's own
    ``except Exception`` handlers pass it through)."""


@contextlib.contextmanager
def _alarm(seconds):
    # A safety net for a compile that hangs: without it the whole run would be killed from outside, files unwritten.
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread() and seconds > 0
    if not usable:
        yield
        return

    def fire(signum, frame):
        raise _OutOfTime(f"stopped after {seconds:.0f} s: the run's --budget-s was spent")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------------------ torch side


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"fusedmlp.bench needs PyTorch with CUDA ({e}); install it, e.g. pip install torch") from None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusedmlp.bench needs a CUDA GPU that PyTorch can use (torch.cuda.is_available() is False)")
    return torch


def _median_ms(torch, fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(torch):
    """The device's copy bandwidth and fp16 matmul rate, through torch (METHOD.md: measure, don't quote)."""

    def copy_ms():
        src = torch.randn(COPY_BYTES // 2, device=DEVICE, dtype=torch.float16)
        dst = torch.empty_like(src)
        return _median_ms(torch, lambda: dst.copy_(src), 20)

    def matmul_ms():
        a, b = (torch.randn(MATMUL_N, MATMUL_N, device=DEVICE, dtype=torch.float16) for _ in range(2))
        c = torch.empty_like(a)
        return _median_ms(torch, lambda: torch.mm(a, b, out=c), 20)

    copy, mm = copy_ms(), matmul_ms()
    return {
        "copy_GBps": 2 * COPY_BYTES / (copy * 1e-3) / 1e9,
        "copy_bytes": COPY_BYTES,
        "copy_ms": copy,
        "matmul_TFLOPs": 2 * MATMUL_N**3 / (mm * 1e-3) / 1e12,
        "matmul_n": MATMUL_N,
        "matmul_ms": mm,
    }


def torch_model(torch, wl):
    """nn.Sequential of Linear + activation (none after the last layer), PyTorch-default initialisation."""
    nn = torch.nn

    class Sin(nn.Module):
        def forward(self, x):
            return torch.sin(x)

    acts = {"relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh, "sin": Sin, "gelu": nn.GELU}

    class Residual(nn.Module):  # x + act(Linear(x)): the hidden layers of a residual workload
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width, bias=wl.bias)
            self.act = acts[wl.activation]()

        def forward(self, x):
            return x + self.act(self.linear(x))

    if wl.blocks:
        return _simba_model(torch, wl, acts)
    if wl.stacks > 1:
        return _stacks_model(torch, wl, acts)
    if wl.concat or wl.output_activation != "none" or wl.norm != "none" or wl.encoding:
        return _concat_model(torch, wl, acts)
    layers = []
    last = len(wl.widths) - 2
    for i, (a, b) in enumerate(zip(wl.widths[:-1], wl.widths[1:])):
        if wl.residual and 0 < i < last:
            layers.append(Residual(a))
            continue
        layers.append(nn.Linear(a, b, bias=wl.bias))
        if i < last:
            layers.append(acts[wl.activation]())
    return nn.Sequential(*layers)


def _simba_model(torch, wl, acts):
    """SimBa's residual MLP: a Linear in, blocks h + W2 act(W1 LayerNorm(h)), LayerNorm, the head."""
    nn = torch.nn
    width = wl.widths[1]

    class Block(nn.Module):  # h + down(act(up(LayerNorm(h))))
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, wl.widths[2], bias=wl.bias)
            self.act = acts[wl.activation]()
            self.down = nn.Linear(wl.widths[2], width, bias=wl.bias)

        def forward(self, h):
            return h + self.down(self.act(self.up(self.norm(h))))

    class SimBa(nn.Module):  # (its Linears in forward's order in modules(): fused_layers reads them so)
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(wl.widths[0], width, bias=wl.bias)
            self.blocks = nn.Sequential(*(Block() for _ in range(wl.blocks)))
            self.out_norm, self.out = nn.LayerNorm(width), nn.Linear(width, wl.widths[-1], bias=wl.bias)

        def forward(self, x):
            return self.out(self.out_norm(self.blocks(self.inp(x))))

    return SimBa()


def _stacks_model(torch, wl, acts):
    """wl.stacks Sequentials of Linear + activation on the one input, their outputs side by side (TD3's twin critics;
    each stack's Linears together in modules(): fused_layers reads them so)."""
    nn = torch.nn
    last = len(wl.widths) - 2

    def stack():
        layers = []
        for i, (a, b) in enumerate(zip(wl.widths[:-1], wl.widths[1:])):
            layers += [nn.Linear(a, b, bias=wl.bias)] + ([acts[wl.activation]()] if i < last else [])
        return nn.Sequential(*layers)

    class Stacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.stacks = nn.ModuleList(stack() for _ in range(wl.stacks))

        def forward(self, x):
            return torch.cat([s(x) for s in self.stacks], -1)

    return Stacks()


def _concat_model(torch, wl, acts):
    """NeRF's form: Linear (+ LayerNorm) + activation per layer, the input x (encoded first where the workload
    encodes it) concatenated into the named layers' inputs, the output activation after the last."""
    nn = torch.nn
    cat = dict(wl.concat)
    final = {"none": nn.Identity, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
             "softmax": lambda: nn.Softmax(dim=-1)}[wl.output_activation]

    class ConcatMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = nn.ModuleList(nn.Linear(k, n, bias=wl.bias)
                                         for k, n in zip(wl.layer_inputs(), wl.widths[1:]))
            self.norms = nn.ModuleList(nn.LayerNorm(n) if wl.norm == "layernorm" else nn.Identity()
                                       for n in wl.widths[1:-1])
            self.act = acts[wl.activation]()
            self.final = final()

        def forward(self, x):
            if wl.encoding:  # NeRF's embedder, as nerf-pytorch writes it
                parts = [x]
                for k in range(wl.encoding):
                    parts += [torch.sin(x * 2.0 ** k), torch.cos(x * 2.0 ** k)]
                x = torch.cat(parts, -1)
            h = x
            for i, linear in enumerate(self.linears):
                if i in cat:
                    h = torch.cat([x, h] if cat[i] == "before" else [h, x], -1)
                h = linear(h)
                h = self.act(self.norms[i](h)) if i < len(self.linears) - 1 else self.final(h)
            return h

    return ConcatMLP()


def fused_layers(wl, weights, biases):
    """The fused network's weights and biases from the workload's Linears' (torch_model's, in order): as they are, but
    for a SimBa workload an identity layer without bias before each block and before the head, carrying that
    LayerNorm, and for parallel stacks one layer of every stack's j-th Linears, block-diagonal after the first (what
    fusedmlp.from_torch makes of the module)."""
    if wl.stacks > 1:
        depth = len(wl.widths) - 1
        ws, bs = [], None if biases is None else []
        for j in range(depth):
            w, b = stacked_layer([weights[i * depth + j] for i in range(wl.stacks)],
                                 [None if biases is None else biases[i * depth + j] for i in range(wl.stacks)], j == 0)
            ws.append(w.astype(np.float32))
            if bs is not None:
                bs.append(b.astype(np.float32))
        return ws, bs
    if not wl.blocks:
        return weights, biases
    ws, bs, width = [weights[0]], [None if biases is None else biases[0]], wl.widths[1]
    for i in range(1, 2 * wl.blocks + 2, 2):
        ws.append(np.eye(width, dtype=np.float32))
        bs.append(None)
        ws += weights[i:i + 2]
        bs += [None] * 2 if biases is None else biases[i:i + 2]
    return ws, bs


def fused_options(wl):
    """FusedMLP keyword arguments matching torch_model(wl) (with fused_layers' weights)."""
    if wl.blocks:  # layers: in, then per block the identity (its norm), up (act), down (+ the block's input), then
        # the identity before the head and the head
        layers = 3 * wl.blocks + 3
        acts = ["none"] * layers
        for b in range(wl.blocks):
            acts[3 * b + 2] = wl.activation
        return {"activation": acts, "norm": {3 * b + 1: "layernorm" for b in range(wl.blocks + 1)},
                "residual": {3 * b + 3: ("add", "none", 3 * b) for b in range(wl.blocks)}}
    options = {"activation": wl.activation}
    if wl.residual:
        options["residual"] = {i: "add" for i in range(1, len(wl.widths) - 2)}
    if wl.concat:
        options["concat"] = dict(wl.concat)
    if wl.output_activation != "none":
        options["output_activation"] = wl.output_activation
    if wl.norm != "none":  # torch_model's LayerNorms keep their initial affine parameters: ones and zeros
        options["norm"] = {i: wl.norm for i in range(len(wl.widths) - 2)}
    if wl.encoding:
        options["encoding"] = _encoding.frequency_encoding(wl.encoding)
    return options


def rel_l2(torch, y, ref, rows_at_once=1 << 18):
    """||y - ref|| / ||ref|| in float64; NaN if y holds a NaN (an unwritten, poisoned element). Summed over pieces of
    rows: y in float64 at once was a 16 GB temporary for cls1000's 2^21 x 1000 output, which ran an 80 GB H100 out of
    memory beside the case's reference and the models' workspaces."""
    num = den = 0.0
    for at in range(0, max(y.shape[0], 1), rows_at_once):
        r = ref[at:at + rows_at_once]
        num += float((y[at:at + rows_at_once].double() - r).square().sum())
        den += float(r.square().sum())
    return (num / den) ** 0.5 if den > 0 else float("nan") if num == 0 or num != num else float("inf")


def _n_buffers(torch, wl, rows):
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    per_buffer = rows * wl.x_features() * 2
    return max(4, min(MAX_BUFFERS, math.ceil(2 * l2 / per_buffer)))


def _time_events(torch, fn, calls_per_fn, reps):
    """Median ms per call of fn (which runs calls_per_fn calls; fn(k) picks input k), over groups of >= GROUP_MS."""
    for k in range(3):
        fn(k)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for k in range(4):
        fn(k)
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / 4, 1e-4)
    inner = max(1, min(MAX_INNER, math.ceil(GROUP_MS / est_ms)))
    reps = max(MIN_REPS, min(reps, int(MAX_METHOD_S * 1e3 / (est_ms * inner))))
    times, k = [], 0
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn(k)
            k += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (inner * calls_per_fn))
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "reps": reps,
            "calls_per_group": inner * calls_per_fn}


def _time_host(torch, fn, max_calls):
    """Median microseconds of fn(k) + stream synchronize, timed on the host: {"call_us": ..., "calls": ...}."""
    stream = torch.cuda.current_stream()
    times = []
    budget_end = time.perf_counter() + HOST_CALL_S
    for k in range(max_calls):
        stream.synchronize()
        t = time.perf_counter()
        fn(k)
        stream.synchronize()
        times.append(time.perf_counter() - t)
        if k >= 30 and time.perf_counter() > budget_end:
            break
    return {"call_us": statistics.median(times) * 1e6, "calls": len(times)}


def _fused_shim(torch, mlp):
    """fused(x, out=None) for a CUDA fp16 tensor: checks, allocates the output (unless out is given: a contiguous
    fp16 tensor of shape (rows, out_features)), launches on torch's current stream."""
    n_in, n_out = mlp.in_features, mlp.widths[-1]

    def fused(x, out=None):
        if x.dtype != torch.float16 or x.dim() != 2 or x.shape[1] != n_in or x.device.type != DEVICE:
            raise ValueError(f"x must be a ({DEVICE}) float16 tensor of shape (rows, {n_in})")
        x = x.contiguous()
        if out is not None and (out.dtype != torch.float16 or tuple(out.shape) != (x.shape[0], n_out)
                                or not out.is_contiguous() or out.device != x.device):
            raise ValueError(f"out must be a contiguous ({DEVICE}) float16 tensor of shape ({x.shape[0]}, {n_out})")
        y = torch.empty((x.shape[0], n_out), device=x.device, dtype=x.dtype) if out is None else out
        if x.shape[0]:
            stream = torch.cuda.current_stream().cuda_stream
            mlp._kernel("float16", rows=x.shape[0]).launch(x.data_ptr(), y.data_ptr(), x.shape[0], stream)
        return y

    return fused


def _fused_caller(torch, mlp, x):
    """FusedMLP.__call__ where it takes CUDA tensors (returning one), else the shim; with the path's name."""
    try:
        y = mlp(x)
        if isinstance(y, torch.Tensor) and y.device == x.device and tuple(y.shape) == (x.shape[0], mlp.widths[-1]):
            return mlp, "FusedMLP.__call__"
    except Exception:  # noqa: BLE001 - any refusal means "not supported yet"
        pass
    return _fused_shim(torch, mlp), "shim: check, torch.empty, Kernel.launch"


@contextlib.contextmanager
def never_compiled_sources():
    """Within: NVRTC's own compile cache is off, so a cold first call pays the whole compile even where an earlier
    process compiled the same source (on the H100 machines, 0.12-0.25 s instead of ~1 s for siren256;
    docs/performance.md, compile time and the kernel cache). A comment appended to the source, the earlier way, did
    not keep that cache from answering."""
    from . import _api

    before = _api._extra_options
    _api._extra_options = before + _api.nvrtc_no_cache()
    try:
        yield
    finally:
        _api._extra_options = before


def first_calls(torch, fusedmlp, wl, weights, biases, root):
    """Cold and warm first-call times of one workload, and the FusedMLP to benchmark (its kernel then loaded)."""
    folder = pathlib.Path(root)
    x = torch.randn(1024, wl.x_features(), device=DEVICE, dtype=torch.float16)

    def first_call(mlp):
        torch.cuda.synchronize()
        t = time.perf_counter()
        _fused_shim(torch, mlp)(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    make = dict(fused_options(wl), device="cuda", cache_dir=folder)
    with never_compiled_sources():
        t = time.perf_counter()
        cold = fusedmlp.FusedMLP(weights, biases, **make)
        construct_ms = (time.perf_counter() - t) * 1e3
        cold_ms = first_call(cold)
        warm = fusedmlp.FusedMLP(weights, biases, **make)  # the same sources: from the disk cache cold just filled
        warm_ms = first_call(warm)
    return warm, {"construct_ms": construct_ms, "cold_ms": cold_ms, "warm_ms": warm_ms}


def _plan_info(mlp):
    from . import _api, _segments

    info = _api._gpu(0).info
    if mlp.segments is not None:  # cut into segments: how, each segment's kernel, its GEMMs' clusters (1: none)
        target = mlp._target()
        gemms = [mlp._gemm_plan(seg.first, *target, *_segments.gemm_dtypes(mlp, seg.first, "float16", "float16")).info
                 for seg in mlp._segments_for(*target, "float16", "float16") if seg.kind == "gemm"]
        return {"segments": mlp.segments, "kernel": dict(mlp._kernel("float16").info), "cache_entry": mlp.cache_path,
                "gemm_cluster": sorted({g["cluster"] for g in gemms})}
    plan = mlp._net.plan(info["arch"], info["smem_per_block"], info["sm_count"], "float16", "float16",
                         smem_per_sm=info["smem_per_sm"]).info
    return {"plan": dict(plan), "kernel": dict(mlp._kernel("float16").info), "cache_entry": mlp.cache_path}


class _Case:
    """Inputs, reference and floor of one (workload, rows) pair."""

    def __init__(self, torch, name, wl, rows, model, ref_model, ceilings):
        self.name, self.wl, self.rows = name, wl, rows
        gen = torch.Generator(device=DEVICE)
        gen.manual_seed(_seed(name, rows))
        n = _n_buffers(torch, wl, rows)
        self.xs = [torch.randn(rows, wl.x_features(), device=DEVICE, dtype=torch.float16, generator=gen)
                   for _ in range(n)]
        self.ref = ref_model(self.xs[0].double())
        self.model = model
        ms, bound = floor_ms(wl.widths, rows, ceilings, wl.concat, wl.x_features(), wl.stacks)
        self.result = {"workload": name, "rows": rows, "n_buffers": n,
                       "io_bytes": io_bytes(wl.widths, rows, x_features=wl.x_features(), stacks=wl.stacks),
                       "flops": flops(wl.widths, rows, wl.concat, wl.stacks), "floor_ms": ms, "floor_bound": bound,
                       "methods": {}}


def _seed(name, rows):
    # str hash() is salted per process; this is not
    return (sum(ord(c) * 31**i for i, c in enumerate(name)) + rows) % (2**31)


def _measure(torch, case, method, setup, tolerance, reps, host_calls):
    """Runs one method of one case: setup() -> (fn, calls_per_fn, check, host_fn); check, time, record.

    fn(k) runs calls_per_fn calls starting at input k; check() returns the output for input 0 (poisoned first where
    the output buffer is reused); host_fn(k) is one call (None: no host timing), or a dict {"call_us": fn,
    "call_out_us": fn}: each is timed and recorded under its key (call_us's count as "calls", the others' as
    "<name>_calls").
    """
    entry = {}
    case.result["methods"][method] = entry
    try:
        t = time.perf_counter()
        fn, calls_per_fn, check, host_fn = setup()
        y = check()
        torch.cuda.synchronize()
        entry["setup_s"] = time.perf_counter() - t
        entry["rel_l2"] = rel_l2(torch, y, case.ref)
        if method.startswith("fusedmlp"):
            entry["check_ok"] = bool(entry["rel_l2"] <= tolerance)  # NaN fails
        entry.update(_time_events(torch, fn, calls_per_fn, reps))
        for key, timed in ({"call_us": host_fn} if callable(host_fn) else host_fn or {}).items():
            host = _time_host(torch, timed, host_calls)
            entry[key] = host["call_us"]
            entry["calls" if key == "call_us" else key.replace("_us", "_calls")] = host["calls"]
    except _OutOfTime as e:
        entry["error"] = str(e)
        raise
    except Exception as e:  # noqa: BLE001 - one method's failure is a result, not the end of the run
        entry["error"] = _error_text(e)
    extra = f"  call {entry['call_us']:.1f} us" if "call_us" in entry else ""
    extra += f"  call+out {entry['call_out_us']:.1f} us" if "call_out_us" in entry else ""
    state = entry.get("error") or (f"{entry['ms']:.4g} ms{extra}  relL2 {entry['rel_l2']:.2e}"
                                   + ("  CHECK FAILED" if entry.get("check_ok") is False else ""))
    _say(f"{case.name:9s} {rows_label(case.rows):>5s} {method:15s} {state}")
    return entry


_SIDE_STREAM = []  # the one side stream every graph's warm-up and capture runs on (made on first use)


def _graph_of(torch, body, order):
    """One CUDA graph that runs body(j) for j in order (after a warm-up on a side stream, as torch requires).

    Every graph warms up and is captured on one side stream, made once: a segmented model keeps a workspace per
    stream it ran on (_segments.Chain), and a new stream per warm-up plus torch's own capture stream gave each model
    three of them (cls1000 at 2^21 rows in three dtypes then ran an 80 GB H100 out of memory)."""
    if not _SIDE_STREAM:
        _SIDE_STREAM.append(torch.cuda.Stream())
    side = _SIDE_STREAM[0]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for j in order:
            body(j)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(graph, stream=side):
        for j in order:
            outs.append(body(j))
    return graph, outs


def _tuned_tile(mlp, rows):
    """The tile the tuner chose for calls of `rows` rows and every candidate's time ({"choice": "wg16",
    "candidates_ms": {...}}), or None where nothing was tuned (FUSEDMLP_AUTOTUNE=0)."""
    from . import _api, _tune

    key = _tune._model_key(mlp, "float16", "float16", _api._gpu(0).info)
    record = mlp._tuning.load(key).get(str(_tune.bucket(rows)))
    return {"choice": _tune.label(record["options"]), "candidates_ms": record["ms"]} if record else None


def _fused_methods(torch, case, mlp, caller):
    from . import _segments

    kernel = mlp._kernel("float16", rows=case.rows)  # the kernel a call of this size gets (small batches: small tiles)
    case.result["tile"] = _tuned_tile(mlp, case.rows)
    xs, rows, n = case.xs, case.rows, len(case.xs)
    y = torch.empty(rows, case.wl.out_features(), device=DEVICE, dtype=torch.float16)
    xp, yp = [x.data_ptr() for x in xs], y.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream

    def poisoned(run):
        y.fill_(float("nan"))
        run()
        return y

    def kernel_setup():
        if isinstance(kernel, _segments.Chain) and caller is mlp:
            def fn(k):  # a segmented network's launches from C, as a caller's call with out= gets them
                caller(xs[k % n], out=y)

            return fn, 1, lambda: poisoned(lambda: fn(0)), fn

        def fn(k):
            kernel.launch(xp[k % n], yp, rows, stream)

        return fn, 1, lambda: poisoned(lambda: fn(0)), fn

    def graph_setup():
        order = list(range(1, n)) + [0]  # input 0 last: y then holds its output, for the check

        def body(j):
            kernel.launch(xp[j], yp, rows, torch.cuda.current_stream().cuda_stream)

        graph, _ = _graph_of(torch, body, order)
        return (lambda k: graph.replay()), n, lambda: poisoned(graph.replay), None

    def call_setup():
        y_out = torch.empty_like(y)  # the caller's preallocated output: no allocation per call

        def fn(k):
            return caller(xs[k % n])

        def fn_out(k):
            return caller(xs[k % n], out=y_out)

        def check():
            y0 = fn(0)
            y_out.fill_(float("nan"))  # NaN equals nothing: a call that writes nothing cannot pass
            if fn_out(0) is not y_out or not torch.equal(y_out, y0):
                raise RuntimeError("fused(x, out=y) did not return y holding fused(x)'s result bit for bit")
            return y0

        return fn, 1, check, {"call_us": fn, "call_out_us": fn_out}

    return {"fusedmlp": kernel_setup, "fusedmlp_graph": graph_setup, "fusedmlp_call": call_setup}


def _torch_methods(torch, case):
    model, xs, n = case.model, case.xs, len(case.xs)

    def eager_setup():
        def fn(k):
            return model(xs[k % n])

        return fn, 1, lambda: fn(0), fn

    def graph_setup():
        order = list(range(1, n)) + [0]
        graph, outs = _graph_of(torch, lambda j: model(xs[j]), order)

        def check():
            outs[-1].fill_(float("nan"))
            graph.replay()
            return outs[-1]

        return (lambda k: graph.replay()), n, check, None

    return {"torch_eager": eager_setup, "torch_graph": graph_setup}


def _compile_setup(torch, case, compiled, entry_times):
    xs, n = case.xs, len(case.xs)

    def setup():
        t = time.perf_counter()
        compiled(xs[0])  # compiles for this shape (dynamic=False: every row count is its own graph)
        torch.cuda.synchronize()
        entry_times.append(time.perf_counter() - t)

        def fn(k):
            return compiled(xs[k % n])

        return fn, 1, lambda: fn(0), fn

    return setup


def _set_recompile_limit(torch, limit):
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), limit))


def _quiet_autotune(torch):
    # max-autotune prints a table per matrix shape (~10 lines each, dozens of shapes); the log is read remotely
    try:
        import torch._inductor.select_algorithm as select_algorithm

        select_algorithm.PRINT_AUTOTUNE = False
        return True
    except Exception:  # noqa: BLE001 - a private switch; keep the tables if it moved
        return False


# ------------------------------------------------------------------------------------------------ the run


def _parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m fusedmlp.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=parse_rows, default=list(DEFAULT_ROWS),
                    help="batch sizes (e.g. 1024 2^14 1<<18); default 2^10 2^14 2^18 2^21")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                    help=f"names, space- or comma-separated, from {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="20 reps and 50 host calls instead of 100 and 200")
    ap.add_argument("--reps", type=int, help="timed groups per method (default 100, --quick 20)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--no-host", action="store_true", help="skip the host section (small calls' host time)")
    ap.add_argument("--arrays", nargs="+", type=parse_rows, metavar="ROWS",
                    help="add the host-array section (float32 NumPy calls) at these batch sizes, e.g. 2^20 2^24")
    ap.add_argument("--dtype", nargs="+", default=["float16"], choices=("float16",) + bench_lowbit.LOWBIT,
                    help="compute dtypes to time: float16 always, int8 and float8 beside it (the low-bit section)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock seconds for the whole run; torch.compile measurements that would not fit are "
                         "skipped (default 420)")
    ap.add_argument("--show-autotune", action="store_true", help="let max-autotune print its choice tables")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", help="folder for bench.json, bench.txt and bench.png")
    where.add_argument("--save", action="store_true", help="write them under bench/results/<device>/")
    args = ap.parse_args(argv)
    names = [n for item in args.workloads for n in item.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.workloads = list(dict.fromkeys(names))
    args.rows = sorted(set(args.rows))
    if args.reps is None:
        args.reps = 20 if args.quick else 100
    args.host_calls = 50 if args.quick else 200
    return args


def _results_dir(args, device_name):
    if args.out:
        return pathlib.Path(args.out)
    if not args.save:
        return None
    root = pathlib.Path(__file__).resolve().parents[2]  # the repository, for an editable install
    if not (root / "bench").is_dir():
        root = pathlib.Path.cwd()
    return root / "bench" / "results" / device_slug(device_name)


def _new_report(torch, fusedmlp, args, argv):
    props = torch.cuda.get_device_properties(0)
    return {
        "schema": 1,
        "device": {"name": torch.cuda.get_device_name(0), "sm_count": getattr(props, "multi_processor_count", None),
                   "capability": f"{getattr(props, 'major', '?')}.{getattr(props, 'minor', '?')}",
                   "l2_bytes": getattr(props, "L2_cache_size", None),
                   "memory_bytes": getattr(props, "total_memory", None)},
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "fusedmlp": fusedmlp.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tolerance": fusedmlp.CHECK_TOLERANCE,
        "settings": {"rows": args.rows, "reps": args.reps, "host_calls": args.host_calls, "group_ms": GROUP_MS,
                     "max_buffers": MAX_BUFFERS, "compile_mode": None if args.no_compile else COMPILE_MODE,
                     "budget_s": args.budget_s},
        "ceilings": None,
        "workloads": {},
        "results": [],
    }


def _init_fusedmlp(report):
    """Loads NVRTC and opens the GPU once, so that no workload's cold first call pays for the process's."""
    from . import _api

    t = time.perf_counter()
    try:
        nvrtc_path, nvrtc_version = _api._nvrtc_info()
        _api._gpu(0)
        report["nvrtc"] = {"path": nvrtc_path, "version": list(nvrtc_version)}
    except Exception as e:  # noqa: BLE001 - every fusedmlp method will then record its own error
        report["nvrtc"] = {"error": _error_text(e)}
    report["process_init_ms"] = (time.perf_counter() - t) * 1e3


def _run_workload(torch, fusedmlp, args, report, wname, cache_root, save):
    """Phase 1 for one workload: first-call times, then every method but torch.compile at every row count.

    Returns:
        (fp16 model, the benchmarked FusedMLP or None, whether a fusedmlp method failed).
    """
    wl = WORKLOADS[wname]
    # "skipped" stays in the report format (readers of older results, where res128 was skipped, rely on it).
    winfo = {"widths": list(wl.widths), "activation": wl.activation, "bias": wl.bias, "residual": wl.residual,
             "concat": dict(wl.concat), "output_activation": wl.output_activation,
             "flops_per_row": flops(wl.widths, 1, wl.concat, wl.stacks),
             "io_bytes_per_row": io_bytes(wl.widths, 1, x_features=wl.x_features(), stacks=wl.stacks),
             "skipped": None}
    report["workloads"][wname] = winfo
    model, ref_model = _models(torch, wl)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights, biases = fused_layers(wl, [m.weight.detach().float().cpu().numpy() for m in linears],
                                   [m.bias.detach().float().cpu().numpy() if wl.bias else None for m in linears])
    failed = False
    try:
        mlp, times = first_calls(torch, fusedmlp, wl, weights, biases, os.path.join(cache_root, wname))
        winfo.update(times)
        _say(f"{wname:9s} first call: cold {times['cold_ms']:.1f} ms, warm {times['warm_ms']:.2f} ms")
        try:
            winfo.update(_plan_info(mlp))
        except Exception as e:  # noqa: BLE001
            winfo["plan_error"] = _error_text(e)
    except Exception as e:  # noqa: BLE001 - the torch methods still run, for the record
        winfo["fusedmlp_error"] = _error_text(e)
        _say(f"{wname:9s} fusedmlp failed: {winfo['fusedmlp_error']}")
        failed, mlp = True, None
    low = {}
    if mlp is not None and any(d in bench_lowbit.LOWBIT for d in args.dtype):
        low = bench_lowbit.models(torch, fusedmlp, args.dtype, weights, biases,
                                  dict(fused_options(wl), cache_dir=os.path.join(cache_root, wname)), wl.x_features(),
                                  DEVICE)
    for rows in args.rows:
        case = _Case(torch, wname, wl, rows, model, ref_model, report["ceilings"])
        report["results"].append(case.result)
        setups = {}
        if mlp is not None:
            caller, winfo["call_path"] = _fused_caller(torch, mlp, case.xs[0])
            setups.update(_fused_methods(torch, case, mlp, caller))
        if low:
            setups.update(bench_lowbit.setups(case, low))
            case.result["floor8_ms"] = bench_lowbit.floor_ms(case.result["flops"], case.result["io_bytes"],
                                                             report["ceilings"])
        setups.update(_torch_methods(torch, case))
        for method, setup in setups.items():
            entry = _measure(torch, case, method, setup, bench_lowbit.tolerance(fusedmlp, method), args.reps,
                             args.host_calls)
            if method.startswith("fusedmlp") and (entry.get("error") or entry.get("check_ok") is False):
                failed = True
        del case, setups
        # torch keeps the freed inputs, references and outputs of the case cached (a 2^21-row float64 reference of a
        # 1024-wide output alone is 16 GB); fusedmlp's own buffers come from the driver, which cannot reach them
        torch.cuda.empty_cache()
        save()
    return model, mlp, failed


def _models(torch, wl):
    """The fp16 model (seed 0) and a float64 copy of its fp16-rounded weights, on DEVICE."""
    torch.manual_seed(0)
    model = torch_model(torch, wl).to(DEVICE).half().eval()
    ref_model = torch_model(torch, wl).to(DEVICE).double().eval()
    ref_model.load_state_dict(model.state_dict())
    return model, ref_model


def _run_compiles(torch, fusedmlp, args, report, models, save):
    """Phase 2: torch.compile per workload, largest batches first, while the budget lasts.

    Returns:
        True when the alarm stopped a compile (inductor's state is then not to be trusted).
    """
    torch._dynamo.reset()
    # nn.Sequential.forward is one code object for every workload, and every row count is a recompile
    _set_recompile_limit(torch, len(models) * len(args.rows) + 8)
    report["settings"]["autotune_tables_quiet"] = (not args.show_autotune) and _quiet_autotune(torch)
    compiled, compile_times, stopped = {}, [], False
    by_key = {(r["workload"], r["rows"]): r for r in report["results"]}
    for rows in sorted(args.rows, reverse=True):
        for wname, model in models.items():
            result = by_key[(wname, rows)]
            left = args.budget_s - _elapsed() - FINAL_RESERVE_S
            guess = max(compile_times[-3:]) if compile_times else SLOW_COMPILE_GUESS_S
            if stopped or left < guess:
                why = "an earlier compile ran out of time" if stopped else "time budget spent (--budget-s)"
                result["methods"]["torch_compile"] = {"skipped": why}
                _say(f"{wname:9s} {rows_label(rows):>5s} torch_compile   skipped: {why}")
                continue
            if wname not in compiled:
                compiled[wname] = torch.compile(model, mode=COMPILE_MODE, dynamic=False)
            _, ref_model = _models(torch, WORKLOADS[wname])
            case, times = None, []
            try:
                case = _Case(torch, wname, WORKLOADS[wname], rows, model, ref_model, report["ceilings"])
                case.result = result
                with _alarm(left + 30):
                    entry = _measure(torch, case, "torch_compile", _compile_setup(torch, case, compiled[wname], times),
                                     fusedmlp.CHECK_TOLERANCE, args.reps, args.host_calls)
            except _OutOfTime:
                stopped = True
                entry = result["methods"]["torch_compile"]
                _say(f"{wname:9s} {rows_label(rows):>5s} torch_compile   {entry['error']}")
            except torch.OutOfMemoryError as e:  # the case's float64 reference, or the compiled model's buffers, beside
                # the earlier compiled models' (sdf512's 2^21-row reference after wide512's compile on an 80 GB H100)
                entry = result["methods"]["torch_compile"] = {"error": _error_text(e)}
                _say(f"{wname:9s} {rows_label(rows):>5s} torch_compile   out of memory")
            if times:
                entry["compile_s"] = times[0]
                compile_times.append(times[0])
            del case, ref_model
            torch.cuda.empty_cache()
            save()
    return stopped


def main(argv=None):
    """Runs the benchmark; returns 0, or 1 when fusedmlp failed a check or a run. ``probe ...``: fusedmlp.probe's."""
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["probe"]:
        from . import probe

        return probe.main(given[1:])
    global _t0
    _t0 = time.perf_counter()
    args = _parse_args(argv)
    torch = _import_torch()
    import torch._dynamo  # noqa: F401 - reset before phase 2

    import fusedmlp

    report = _new_report(torch, fusedmlp, args, argv)
    name = report["device"]["name"]
    out_dir = _results_dir(args, name)

    def save(with_plot=False):
        report["elapsed_s"] = _elapsed()
        for r in report["results"]:
            r["summary"] = summarize(r)
        if out_dir is not None:
            write_outputs(report, out_dir, with_plot)

    _say(f"{name}, torch {torch.__version__} (CUDA {report['torch_cuda']}), fusedmlp {fusedmlp.__version__}; "
         f"workloads {' '.join(args.workloads)}; rows {' '.join(rows_label(r) for r in args.rows)}")
    report["ceilings"] = c = measure_ceilings(torch)
    if any(d in bench_lowbit.LOWBIT for d in args.dtype):
        c.update(bench_lowbit.ceiling(torch, MATMUL_N, _median_ms, DEVICE))
    _say(f"ceilings: copy {c['copy_GBps']:.0f} GB/s (read + write), fp16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    _init_fusedmlp(report)
    models, failed, stopped = {}, False, False
    with tempfile.TemporaryDirectory(prefix="fusedmlp-bench-") as cache_root, torch.inference_mode():
        fused = {}
        for wname in args.workloads:
            model, mlp, workload_failed = _run_workload(torch, fusedmlp, args, report, wname, cache_root, save)
            failed |= workload_failed
            if model is not None:
                models[wname] = model
            if mlp is not None and (not args.no_host or args.arrays):
                # the host section times small calls: the 2^21-row workspaces of the chains go (a chain and its
                # FusedMLP refer to each other, so gc.collect below frees them, and the low-bit models' too)
                mlp._chains.clear()
                fused[wname] = (mlp, model)
            del mlp
            gc.collect()
            torch.cuda.empty_cache()
        save(with_plot=True)
        if not args.no_host:
            bench_host.run(torch, report, fused, os.path.join(cache_root, "launch-floor"), not args.no_compile, _say)
            save()
        if args.arrays:
            bench_arrays.run(torch, report, fused, args.arrays, _say)
            save()
        if args.no_compile:
            for r in report["results"]:
                r["methods"]["torch_compile"] = {"skipped": "--no-compile"}
        elif models:
            stopped = _run_compiles(torch, fusedmlp, args, report, models, save)

    save(with_plot=True)
    print(format_table(report), flush=True)
    if out_dir is not None:
        png = (out_dir / "bench.png").exists()
        _say(f"wrote {out_dir}/bench.json, bench.txt" + (", bench.png" if png else " (no plot: matplotlib missing)"))
    if stopped:
        # a compile interrupted by the alarm can leave inductor's worker pool waiting forever; the files are written
        sys.stdout.flush()
        os._exit(1 if failed else 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
