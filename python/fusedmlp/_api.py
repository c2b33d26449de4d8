"""The public API: FusedMLP and evaluate_fused_mlp."""

import concurrent.futures
import json
import logging
import os
import pathlib
import re
import threading
import time
import warnings
from importlib import resources

import numpy as np

from . import _dlpack, _encoding, _env, _norm, _out, _segments, _tune
from ._args import (LOWBIT, LOWBIT_PRECISIONS, PRECISIONS, _as_array, _as_float_array, _calibration_input,  # noqa: F401
                    _check_expressions, _layer_activations, _layer_concat, _layer_residuals, _merge_dims,
                    _parse_arch, _parse_cache_dir, _parse_check, _parse_device, _parse_flatten_input,
                    _parse_precision)
from ._cache import KernelCache
from ._gpu import available as _gpu_available, core as _core, gpu as _gpu, gpus as _gpus, nvrtc_info as _nvrtc_info
from ._gpu import nvrtc_no_cache
from .errors import ArgumentError, CompileError, DTypeError, LimitError, ShapeError

__version__ = "0.1.0"

log = logging.getLogger("fusedmlp")

KERNEL_NAME = "fusedmlp_forward"
TEMPLATE = "fused_mlp.cu"
TEMPLATE_SM90 = "fused_mlp_sm90.cu"  # the plan's wgmma kernel (sm_90a)
TEMPLATE_GEMM = "gemm_layer.cu"  # one layer of a segmented network as a GEMM with its epilogue (_segments.py)
TEMPLATE_NORM = "row_norm.cu"  # a norm layer's second kernel, after the GEMM of the layer cut before its norm
TEMPLATE_PAD = "pad_rows.cu"  # x copied to rows of whole 16-byte pieces of the compute dtype, for the GEMMs reading it
PRELUDE = "activations.cuh"

#: Relative L2 error that ``check=True`` accepts between the GPU result and the CPU float64 reference. fp16
#: activations carry a relative rounding error of 2**-11 (4.9e-4) per layer; measured errors on PyTorch-initialised
#: networks are listed in the README.
CHECK_TOLERANCE = 2e-3

_ACCEPTED_X = (np.float32, np.float16, np.float64)

#: The npz entry FusedMLP.save writes the architecture into (JSON), and the version of its layout.
_SAVED = "__fusedmlp__"
_SAVE_FORMAT = 1

#: Relative L2 error that ``check=True`` accepts per compute dtype (see the README's precision table: bfloat16 keeps
#: 7 explicit mantissa bits to float16's 10, so its rounding error is 8x float16's; tf32 keeps float16's 10 bits with
#: float32's range). The measured maxima over 240 random graphs on an H100: 2.5e-3, 8.6e-3, 2.0e-3.
CHECK_TOLERANCES = {"float16": CHECK_TOLERANCE, "bfloat16": 1.6e-2, "tf32": CHECK_TOLERANCE,
                    # 8-bit, against the float reference: see the README's low-bit table (CPU emulation, which
                    # computes the GPU's roundings; tests/test_lowbit.py measures it over random graphs)
                    "int8": 1e-1, "float8": 2e-1}


# ------------------------------------------------------------------------------------------------ shared state

_cpu_warned = False

#: NVRTC options added to every compile in this process, outside the cache key (they must not change the code):
#: bench.never_compiled_sources sets nvrtc_no_cache() here.
_extra_options = ()


_templates = {}  # (folder, name) -> (((path, mtime_ns) of each file read), text): _template's expansions


def _template(name, folder=None):
    """A kernel template's text, with each `#include "file"` of another template file pasted in its place (NVRTC
    compiles one self-contained source; the cache key covers all of it). folder: read the files from there instead
    of the package's kernel_templates (the probe tool's A/B baselines: `probe ab --base`).

    Kept once expanded while none of its files changed (their modification times): reading and expanding them took
    ~1 ms a template, two a build (a rebuild of tcnn64 on the H100 machine: 2 of its 6 ms)."""
    root = pathlib.Path(folder) if folder is not None else resources.files("fusedmlp") / "kernel_templates"
    key = (str(root), name)
    kept = _templates.get(key)
    try:
        if kept is not None and all(os.stat(path).st_mtime_ns == mtime for path, mtime in kept[0]):
            return kept[1]
    except OSError:  # (a file gone: expanded again below, which raises what reading it raises)
        pass
    read = []

    def expand(file):
        path = root / file
        text = path.read_text(encoding="utf-8")
        read.append((str(path), os.stat(str(path)).st_mtime_ns))
        # (the included file's last newline is the #include line's own)
        return re.sub(r'^#include "([\w.]+)"$', lambda m: expand(m.group(1)).removesuffix("\n"), text, flags=re.M)

    text = expand(name)
    _templates[key] = (tuple(read), text)
    return text


def _source_of(plan):
    """CUDA source of a plan: the sm_90a warpgroup template where the plan chose wgmma, the GEMM one for a GEMM plan
    (the row pass for a norm layer's second kernel, the pad pass for x's padded copy), else the mma.sync one."""
    info = plan.info
    name = (TEMPLATE_NORM if info.get("norm_pass") else TEMPLATE_PAD if info.get("pad_pass") else
            TEMPLATE_GEMM if info.get("gemm") else TEMPLATE_SM90 if info["wgmma"] else TEMPLATE)
    return plan.render(_template(PRELUDE), _template(name), KERNEL_NAME)


def compile_cubin(source, arch, cache=None, arch_a=False):
    """Compiles a rendered kernel through the on-disk cache.

    Args:
        source: CUDA source text.
        arch: compute capability as an int (e.g. 90).
        cache: a KernelCache (default: the one at FUSEDMLP_CACHE_DIR or its fallbacks).
        arch_a: compile for the arch-specific target (sm_90a: wgmma), which runs only on that architecture.

    Returns:
        The cache entry (with ``.cubin`` and ``.path``).
    """
    cache = cache or KernelCache()
    path, version = _nvrtc_info()
    target = f"sm_{arch}{'a' if arch_a else ''}"
    options = ("-std=c++17", "--fmad=true", f"--gpu-architecture={target}")
    key = cache.key(source, options, tuple(version), target, __version__)
    entry = cache.get(key)
    if entry is not None:
        return entry
    with cache.compile_lock(key):
        entry = cache.get(key)  # another process may have compiled it while we waited
        if entry is not None:
            return entry
        start = time.perf_counter()
        try:
            cubin, compile_log = _core().nvrtc_compile(source, TEMPLATE, arch, bool(arch_a), _extra_options)
        except CompileError as e:
            raise CompileError(e.message, e.hint, source=source, options=options, log=e.log) from None
        seconds = time.perf_counter() - start
        log.info("compiled %s for %s in %.2f s with NVRTC %d.%d", KERNEL_NAME, target, seconds, *version)
        if compile_log.strip():
            log.debug("NVRTC log:\n%s", compile_log)
        meta = {"arch": target, "nvrtc": list(version), "options": list(options), "package_version": __version__,
                "kernel": KERNEL_NAME, "compile_seconds": round(seconds, 4)}
        return cache.put(key, source, cubin, meta)


def _activation_scales(amax, concat, qmax):
    """One scale per layer input from the float forward's ranges amax (x, then each layer's output): max / qmax, x's
    and every concat layer's input sharing their largest; float32's smallest normal at least."""
    num_layers = len(concat)
    names = ["x (the network input)"] + [f"layer {v}'s output" for v in range(num_layers)]
    for v, a in enumerate(amax):
        if not np.isfinite(a):
            raise ArgumentError(f"calibrate: {names[v]} is {'NaN' if np.isnan(a) else 'infinite'} on x_sample (float32 "
                                "overflow, or an activation undefined there), so it has no scale",
                                "check the network on that sample; an 8-bit network cannot represent it either")
    ranges = [float(a) for a in amax[:num_layers]]
    for v, a in enumerate(ranges):
        if a == 0.0:  # a dead layer on this sample: its range is unknown, and a zero scale has no inverse
            warnings.warn(f"fusedmlp: calibrate: {names[v]} is zero on every row of x_sample; its scale assumes "
                          f"|values| <= 1 (give a sample on which it is not zero)", RuntimeWarning, stacklevel=3)
            ranges[v] = 1.0
    group = [0] + [l for l in range(num_layers) if concat[l]]  # x joins each concat layer's input
    shared = max(ranges[v] for v in group)
    scales = [shared if l in group else ranges[l] for l in range(num_layers)]
    tiny = float(np.finfo(np.float32).tiny)
    return [max(float(np.float32(a / qmax)), tiny) for a in scales]


# ------------------------------------------------------------------------------------------------ FusedMLP


class FusedMLP:
    """An MLP compiled into one fused Tensor Core kernel.

    Args:
        weights: one (out_features, in_features) array per layer, as ``nn.Linear.weight`` stores it.
        biases: None, or one (out_features,) array or None per layer.
        activation: the activation of every hidden layer (a name or an expression over ``x``), or a list with one
            per hidden layer, or one per layer (then leave output_activation None).
        output_activation: the activation of the last layer; None means "none". 'softmax' and 'log_softmax' (over
            the output features, a classifier's head) are fused too: they run as that layer's norm (below). Column
            pieces give its columns different activations: [("sigmoid", 3), ("none", 1)] or the text
            "sigmoid:3 | none:1" (NeRF's rgb and density; up to 8 pieces, their counts adding up to its outputs).
        residual: residual epilogues y = then(act(W h + b) op r), fused: a dict {layer: spec} (or a list with one
            spec or None per layer). A spec is 'add' or 'mul' (r = h, the layer's input), (op, then),
            (op, then, from) or {'op': ..., 'then': ..., 'from': ...}; ``from`` names an earlier layer (r is its
            output, as wide as this layer's) or 'input' (the network input).
        concat: NeRF-style input re-injection: a dict {layer: 'after' | 'before'}; that layer's input is
            torch.cat([h, x], -1) ('after') or torch.cat([x, h], -1) ('before'), x the network input, and its weight
            has h's plus x's features as in_features.
        norm: LayerNorm / RMSNorm of a layer's W h + b before its activation, fused (the row's statistics in
            float32 across its columns): a dict {layer: spec} (or a list with one spec or None per layer). A spec is
            'layernorm' or 'rmsnorm' (no affine), (kind, weight, bias, eps) cut short anywhere after kind, or
            {'kind': ..., 'weight': ..., 'bias': ..., 'eps': ...}: weight and bias (out_features,) arrays or None,
            eps default 1e-5 (layernorm) / float32's machine epsilon (rmsnorm, as torch.nn.RMSNorm's eps=None).
            'softmax' and 'log_softmax' (no weight, bias or eps) normalise the row the same way: exp(z - max) / sum
            exp(z - max), or its log.
        encoding: an input encoding computed in the kernel as x is loaded (NeRF's positional encoding): a list of
            parts, each 'x' or (func, scale) with func 'sin', 'cos' or 'x' (scale * x) and scale a number or one per
            feature of x, whose concat along the features is what layer 0 (and a concat layer's x part) reads, so
            its in_features are x's features times the parts; fusedmlp.frequency_encoding(L) gives nerf-pytorch's
            [x, sin(x), cos(x), ..., sin(2^(L-1) x), cos(2^(L-1) x)]. Each sine's argument is formed in float32.
            x is then (..., in_features) with in_features x's own (3 for NeRF's points). A network cut into
            segments encodes x once in its pad pass, which its GEMMs reading x read (not in tf32: a LimitError).
        flatten_input: None (x is (..., in_features)), or the first dim of x that a call merges with the ones after
            it before the network, as nn.Flatten(start_dim) (>= 1; from_torch reads it from a model's leading
            nn.Flatten / torch.flatten / x.view(x.size(0), -1)): images (N, C, H, W) run with 1.
        dtype: the Tensor Core compute dtype, 'float16' (default), 'bfloat16' or 'tf32' (sm_80+): what weights and
            the activations between layers are stored as on chip; every path accumulates in float32. Inputs and
            outputs keep the caller's dtype (float32, float16 or bfloat16) and are converted in the kernel.
            'int8' (sm_80+) and 'float8' (e4m3, sm_89+) store 8-bit codes with per-output-channel weight scales and
            one scale per layer input, which calibrate() sets: call it before the first call.
        device: 'auto' (the GPU when one exists, else the CPU path with a warning), 'cuda', 'cuda:N' or 'cpu'.
        check: also run the CPU reference on every call and raise if the GPU result's relative L2 error exceeds
            CHECK_TOLERANCE.
        cache_dir: kernel cache directory (default FUSEDMLP_CACHE_DIR, $XDG_CACHE_HOME/fusedmlp, ~/.cache/fusedmlp).
    """

    def __init__(self, weights, biases=None, activation="relu", output_activation=None, *, residual=None,
                 concat=None, norm=None, encoding=None, flatten_input=None, dtype="float16", device="auto",
                 check=False, cache_dir=None):
        if isinstance(weights, np.ndarray) or not isinstance(weights, (list, tuple)):
            raise ArgumentError("weights must be a list of (out_features, in_features) arrays, one per layer")
        if len(weights) == 0:
            raise ArgumentError("weights is empty; a network needs at least one layer")
        n = len(weights)
        if n > _core().MAX_LAYERS:
            raise LimitError(f"weights has {n} layers; at most {_core().MAX_LAYERS} fit one fused kernel (and the "
                             "CPU path, which shares its network description)")
        w, b = _float_arrays(weights, biases, n)
        self._flatten_input = _parse_flatten_input(flatten_input)
        self._norm = _norm.parse(n, [wi.shape[0] for wi in w], norm)
        acts = _norm.take_softmax(_layer_activations(n, activation, output_activation), self._norm)
        _check_expressions(acts)
        self._residual = _layer_residuals(n, residual)
        self._concat = _layer_concat(n, concat)
        self._precision = _parse_precision(dtype)
        self._encoding = _encoding.parse(encoding, w[0].shape[1])  # (x_features, columns, parts) or None
        self._net = _core().Network(w, b, acts, self._residual, self._concat, self._norm, self._encoding_arg)
        if self._precision in LOWBIT:  # the weight scales now; the activation scales come from calibrate()
            self._net.set_quant(self._precision)
        self.calibration_error = None  # calibrate()'s relative L2 error on its sample
        self._w, self._b, self._acts = w, b, acts  # a segmented network's fused stretches are networks of their own
        self._cuts = {}  # target and dtypes -> the segments (None: one fused kernel), see _segments.py
        self._chains = {}  # (in dtype, out dtype, segment policy or None) -> _segments.Chain
        self._segment_policy = "auto"  # see _segments.plan: whether a network with streamed weights is cut
        self._gemm_options = {}  # forced GEMM choices (bm, bn, stages, wgmma, cluster): the probe tool's A/B runs
        self._prenorm = None  # the network whose norm layers stop before their norm (_prenorm_net), once needed
        self._n_in, self._n_out = self._net.x_features, self._net.widths[-1]  # read on every tensor call
        self._sm_count = 0  # the GPU's SMs, which size the untuned tile choice (set once the GPU is known)
        self._tuned = {}  # (dtype, out dtype, batch bucket) -> plan options chosen by the tuner
        self._bf16_io = None  # whether the GPU takes bfloat16 I/O in the kernel (sm_80+), once known
        self._has_bias = [bi is not None for bi in b]
        self._kind, self._ordinal = _parse_device(device)
        self._check = _parse_check(check)
        self._cache = KernelCache(_parse_cache_dir(cache_dir))
        self._tuning = _tune.TuningStore(self._cache.directory)
        self._kernels = {}  # (in dtype, out dtype, plan options) -> _core.Kernel
        self._calls = _dlpack.CallTable()  # _kernel's answers for calls, and their C mirror (the fast path)
        self._lock = threading.Lock()
        self._source = None
        self._cache_path = None
        if self._kind == "auto":
            self._kind = "cuda" if _gpu_available() else "cpu"
            if self._kind == "cpu":
                _warn_cpu_once()

    @classmethod
    def from_npz(cls, path, activation=None, output_activation=None, **kwargs):
        """Loads a model saved as ``np.savez(path, **{k: v.cpu().numpy() for k, v in state_dict.items()})``, or by
        FusedMLP.save.

        Layers are the ``<prefix>.weight`` arrays in natural order of their prefix (so '2' < '10'); each takes the
        ``<prefix>.bias`` beside it if present. A state dict's file takes the architecture from the arguments (the
        activation defaults to 'relu'); a file FusedMLP.save wrote carries its own, so only device, check and
        cache_dir may be given then.
        """
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        saved = arrays.pop(_SAVED, None)
        prefixes = [k[: -len(".weight")] for k in arrays if k.endswith(".weight") and arrays[k].ndim == 2]
        if not prefixes:
            raise ShapeError(f"{path} holds no '<name>.weight' 2-D arrays (keys: {sorted(arrays)})")

        def natural(s):
            return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]

        prefixes.sort(key=natural)
        weights = [arrays[p + ".weight"] for p in prefixes]
        biases = [arrays.get(p + ".bias") for p in prefixes]
        if saved is None:
            return cls(weights, biases, "relu" if activation is None else activation, output_activation, **kwargs)
        given = [k for k in ("residual", "concat", "norm", "encoding", "flatten_input", "dtype") if k in kwargs]
        given += [k for k, v in (("activation", activation), ("output_activation", output_activation)) if v is not None]
        if given:
            raise ArgumentError(f"{path} was written by FusedMLP.save and carries its architecture; {', '.join(given)} "
                                "cannot be given with it (only device, check and cache_dir)")
        try:
            meta = json.loads(str(saved))
        except ValueError as e:
            raise ArgumentError(f"{path}: its {_SAVED} entry is not the JSON FusedMLP.save writes ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != _SAVE_FORMAT:
            raise ArgumentError(f"{path}: {_SAVED} has format {meta.get('format') if isinstance(meta, dict) else '?'}; "
                                f"this fusedmlp reads format {_SAVE_FORMAT}", "load it with the fusedmlp that saved it")
        norm = {int(i): {"kind": n["kind"], "eps": n["eps"], "weight": arrays.get(f"{i}.norm.weight"),
                         "bias": arrays.get(f"{i}.norm.bias")} for i, n in meta["norm"].items()}
        mlp = cls(weights, biases, meta["activations"], None,
                  residual={int(i): tuple(r) for i, r in meta["residual"].items()} or None,
                  concat={int(i): c for i, c in meta["concat"].items()} or None, norm=norm or None,
                  encoding=[tuple(p) for p in meta["encoding"]] if meta.get("encoding") else None,
                  flatten_input=meta.get("flatten_input"), dtype=meta["dtype"], **kwargs)
        if list(mlp.widths) != meta["widths"]:
            raise ShapeError(f"{path}: the arrays give widths {list(mlp.widths)}, its architecture {meta['widths']}")
        if meta.get("act_scales") is not None:  # an 8-bit model saved calibrated: the weight scales follow the weights
            mlp._set_act_scales(meta["act_scales"])
        return mlp

    def save(self, path):
        """Writes the model to an npz file that FusedMLP.from_npz reads back whole (a Ray worker, another process).

        The file holds ``<layer>.weight`` / ``<layer>.bias`` as float32 in PyTorch's layout (so tools that read state
        dicts read it too), each norm's ``<layer>.norm.weight`` / ``.norm.bias``, and the architecture (activations,
        residuals, concats, norms, compute dtype, an 8-bit model's activation scales) as JSON in ``__fusedmlp__``.

        Args:
            path: a file name (``.npz`` is appended where it is missing, as numpy.savez does) or a binary file object.

        Returns:
            the path written (the file object as given).
        """
        arrays, norms = {}, {}
        for i, (w, b) in enumerate(zip(self._w, self._b)):
            arrays[f"{i}.weight"] = w
            if b is not None:
                arrays[f"{i}.bias"] = b
        for i, entry in enumerate(self._norm):
            if entry is not None:
                code, eps, weight, bias = entry
                norms[str(i)] = {"kind": _norm.NAMES[code], "eps": eps}
                for name, value in (("weight", weight), ("bias", bias)):
                    if value is not None:
                        arrays[f"{i}.norm.{name}"] = value
        meta = {"format": _SAVE_FORMAT, "widths": list(self.widths), "activations": list(self._acts),
                "dtype": self._precision, "norm": norms,
                "residual": {str(i): ["add" if r[0] == 1 else "mul", r[1], "input" if r[2] < 0 else r[2]]
                             for i, r in enumerate(self._residual) if r},
                "concat": {str(i): "after" if c == 1 else "before" for i, c in enumerate(self._concat) if c},
                "flatten_input": self._flatten_input}
        if self._encoding is not None:
            meta["encoding"] = _encoding.to_json(self._encoding[2])
        if self.act_scales is not None:  # float32 values, exact through JSON's float64 text
            meta["act_scales"] = [float(v) for v in self.act_scales]
        np.savez(path, **arrays, **{_SAVED: np.array(json.dumps(meta))})
        if isinstance(path, (str, os.PathLike)) and not os.fspath(path).endswith(".npz"):
            return os.fspath(path) + ".npz"
        return path

    # -------------------------------------------------------------------------------------------- low-bit

    def calibrate(self, x_sample):
        """Sets an 8-bit model's activation scales from a batch of typical inputs (dtype 'int8' or 'float8').

        Each layer's input gets one scale, max |value| over the sample as the float network computes it divided by
        the largest code (127, or 448 for float8), so the sample's largest value maps to the largest code and larger
        ones later saturate; a concat layer shares x's scale (its two parts are one dot product). The scales are
        kept with the model (save / from_npz) and change the kernels, which are rebuilt at the next call.

        Args:
            x_sample: (rows, in_features) or (in_features,) real array (NumPy, torch, lists), finite (or the shape
                flatten_input merges into rows).

        Returns:
            self. ``calibration_error`` then holds the relative L2 error of the 8-bit network against the float one
            on the sample; a RuntimeWarning says so where it exceeds ``CHECK_TOLERANCES[dtype]``.
        """
        if self._precision not in LOWBIT:
            raise ArgumentError(f"calibrate sets the activation scales of dtype='int8' or 'float8' models; this one "
                                f"computes in {self._precision}, which needs none")
        if self._flatten_input is not None:
            x_sample = _merge_dims(x_sample, self._flatten_input, "x_sample")
        x = _calibration_input(x_sample, self.in_features)
        scales = _activation_scales(self._net.amax(x), self._concat, LOWBIT[self._precision])
        self._set_act_scales(scales)
        ref = self._net.forward_cpu(x, quantised=False).astype(np.float64)
        err = float(np.linalg.norm(self._net.forward_cpu(x).astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
        self.calibration_error = err
        bound = CHECK_TOLERANCES[self._precision]
        if not err <= bound:
            warnings.warn(f"fusedmlp: calibrate: this network's {self._precision} error on the sample is {err:.3g} "
                          f"(relative L2 against float), over the {bound} that check=True accepts for {self._precision}; "
                          "consider dtype='float16' (or 'int8' for a float8 model)", RuntimeWarning, stacklevel=2)
        return self

    def _set_act_scales(self, scales):
        """Gives the network these activation scales (the C core checks them) and drops the kernels built before."""
        self._net.set_quant(self._precision, [float(v) for v in scales])
        with self._lock:  # the scales are in the kernels' source and packed data: every kernel is rebuilt
            self._drop_kernels()

    def _drop_kernels(self):
        """Forgets every kernel and chain built so far (the next call builds them again, through the cache); with
        self._lock held."""
        self._prenorm = None  # (an 8-bit network's has the scales too)
        self._kernels.clear()
        self._calls.clear()
        self._chains.clear()
        self._source = None

    # -------------------------------------------------------------------------------------------- weights

    def set_weights(self, weights, biases=None, norm=None):
        """Gives the model new weights of the same architecture, in place: what an optimizer step or a loaded
        checkpoint changes, without planning, compiling or loading a kernel again.

        Every kernel the model has loaded gets the new packed weights in its own device buffers once all work queued
        on the GPU so far has finished (the call waits for it), so later calls, and CUDA graphs captured over calls
        before, read them. Where the new weights change what a kernel's source takes from the weights (a sine
        layer's bound on its arguments, the zero blocks of parallel stacks), the kernels are rebuilt at the next call
        instead (through the cache), as after calibrate(), and graphs captured before must be captured again. An
        8-bit model's weight scales follow the weights; its activation scales stay (calibrate again where the
        weights moved far). Calls on other threads meanwhile may see the old or the new weights, or a mix: keep them
        apart, as for any change of a model's parameters.

        Args:
            weights: one (out_features, in_features) array per layer, each of the model's shape.
            biases: None (no layer has a bias), or one entry per layer: an array where the model's layer has a bias,
                None where it has none.
            norm: None (the norm layers keep their gamma and beta), or as the constructor's norm= with the model's
                norm kinds and eps: new gamma and beta.

        Returns:
            True where the kernels kept their code and took the weights in place; False where they are rebuilt.
        """
        n = len(self._w)
        if isinstance(weights, np.ndarray) or not isinstance(weights, (list, tuple)) or len(weights) != n:
            raise ArgumentError(f"weights must be a list of {n} (out_features, in_features) arrays, one per layer of "
                                "the model")
        w, b = _float_arrays(weights, biases, n)
        keep = "set_weights keeps the architecture; build a new FusedMLP for another"
        for i in range(n):
            if w[i].shape != self._w[i].shape:
                raise ShapeError(f"weights[{i}] has shape {w[i].shape}; the model's layer {i} has "
                                 f"{self._w[i].shape} ({keep})")
            if (b[i] is None) != (self._b[i] is None):
                raise ArgumentError(f"biases[{i}] is {'None' if b[i] is None else 'an array'}, but the model's layer "
                                    f"{i} has {'no bias' if self._b[i] is None else 'one'} ({keep})")
            if b[i] is not None and b[i].shape != self._b[i].shape:
                raise ShapeError(f"biases[{i}] has shape {b[i].shape}; the model's layer {i} has {self._b[i].shape}")
        norms = self._norm if norm is None else self._same_norms(norm)
        net = _core().Network(w, b, list(self._acts), list(self._residual), list(self._concat), norms,
                              self._encoding_arg)
        if self._precision in LOWBIT:  # its weight scales (checked against the activation scales) from w
            scales = self.act_scales
            net.set_quant(self._precision, None if scales is None else [float(v) for v in scales])
        with self._lock:
            in_place = self._net.assign(net)
            self._w, self._b, self._norm = w, b, norms
            if self._prenorm is not None:
                in_place = self._prenorm.assign(self._prenorm_of()) and in_place
            for chain in self._chains.values():  # a segmented network's fused stretches are models of their own
                for seg, sub, _, _ in chain.fused:
                    in_place = sub.set_weights(*_segments.stretch_arrays(self, seg, chain.in_dtype)) and in_place
            if not in_place:
                self._drop_kernels()
        return in_place

    def _same_norms(self, norm):
        """set_weights' norm= parsed, each layer's kind and eps the model's (a softmax head's kept as it is)."""
        norms = _norm.parse(len(self._w), [wi.shape[0] for wi in self._w], norm)
        for layer, (new, old) in enumerate(zip(norms, self._norm)):
            if new is None and old is not None and _norm.NAMES[old[0]] in _norm.SOFTMAX:
                norms[layer] = old  # (an activation the constructor moved into norms: nothing to set)
            elif (new is None) != (old is None) or (new is not None and new[:2] != old[:2]):
                have = "none" if old is None else f"{_norm.NAMES[old[0]]} with eps {old[1]}"
                give = "none" if new is None else f"{_norm.NAMES[new[0]]} with eps {new[1]}"
                raise ArgumentError(f"norm: layer {layer} gets {give}, but the model's has {have} (set_weights "
                                    "takes new gamma and beta for the model's norms; build a new FusedMLP for others)")
        return norms

    @property
    def act_scales(self):
        """An 8-bit model's activation scale of each layer's input (a stored value v is the code of v / scale), or
        None: not calibrated, or not an 8-bit model."""
        quant = self._net.quant
        return None if quant is None or quant[1] is None else np.array(quant[1], dtype=np.float32)

    @property
    def weight_scales(self):
        """An 8-bit model's per-output-channel weight scales (one float32 array per layer: max |W[n, :]| / the
        largest code; 1 for an all-zero row), or None."""
        quant = self._net.quant
        return None if quant is None else quant[2]

    # -------------------------------------------------------------------------------------------- properties

    @property
    def widths(self):
        """Feature counts: the input as layer 0 reads it (an input encoding's columns), then each layer's output."""
        return self._net.widths

    @property
    def in_features(self):
        """x's features: widths[0], or fewer where the network encodes x (encoding=)."""
        return self._n_in

    @property
    def encoding(self):
        """The input encoding's parts ('x' or (func, float64 scale per feature)), or None."""
        return None if self._encoding is None else ["x" if s is None else (k, s.copy()) for k, s in self._encoding[2]]

    @property
    def _encoding_arg(self):
        """The encoding as _core.Network takes it: (x_features, [(src, sin, scale, phase), ...]), or None."""
        return None if self._encoding is None else self._encoding[:2]

    @property
    def activations(self):
        """The canonical text of each layer's activation."""
        return self._net.activations

    @property
    def device(self):
        return "cpu" if self._kind == "cpu" else f"cuda:{self._ordinal}"

    @property
    def source(self):
        """The generated CUDA source of the most recently built kernel (rendered for sm_90 if none was built; a
        segmented network's kernels one after the other)."""
        if self._source is None:
            if self._segments_for(90, 0, 0, 0, "float32", "float32") is not None:
                self._source = "\n".join(_source_of(plan) for plan in _segments.plans(self, 90, "float32", "float32"))
            else:
                self._source = self._render(90, 0, 0, "float32", "float32")[1]
        return self._source

    @property
    def segments(self):
        """How the network is cut for its GPU (for sm_90 when it runs on the CPU): None when it is one fused kernel,
        else one line per segment saying its layers, its kernel and why the cut is there. (A call below 64 rows per SM
        of a cut network with a fused stretch of two or more layers wider than 256 runs every layer as a GEMM
        instead: _segments.gemms_at.)"""
        target = self._target() if self._kind == "cuda" else (90, 0, 0, 0)
        cut = self._segments_for(*target, "float32", "float32")
        return None if cut is None else [seg.describe() for seg in cut]

    @property
    def cache_path(self):
        """Path of the most recently used kernel cache entry, or None before the first compile."""
        return self._cache_path

    def __repr__(self):
        widths = "-".join(str(w) for w in self.widths)
        acts = ", ".join(self.activations)
        bias = "all" if all(self._has_bias) else ("none" if not any(self._has_bias) else
                                                  ",".join("y" if h else "n" for h in self._has_bias))
        device = self.device
        if self._kind == "cuda" and self._ordinal in _gpus:
            device += f" ({_gpus[self._ordinal].info['name']})"
        res = [f"{i}: {'add' if r[0] == 1 else 'mul'} then {r[1]} from {'input' if r[2] < 0 else r[2]}"
               for i, r in enumerate(self._residual) if r]
        res = f", residual={{{', '.join(res)}}}" if res else ""
        cat = [f"{i}: {'after' if c == 1 else 'before'}" for i, c in enumerate(self._concat) if c]
        cat = f", concat={{{', '.join(cat)}}}" if cat else ""
        cat += _norm.describe(self._norm)
        if self._encoding is not None:
            cat += f", encoding=[{_encoding.describe(self._encoding[2])} of {self.in_features} features]"
        if self._flatten_input is not None:
            cat += f", flatten_input={self._flatten_input}"
        cut = self.segments if self._kind == "cuda" else None
        cut = f", segments=[{'; '.join(cut)}]" if cut else ""
        if self._precision in LOWBIT:
            cat += ", calibrated" if self.act_scales is not None else ", not calibrated (call calibrate)"
        return (f"FusedMLP(widths={widths}, activations=[{acts}], bias={bias}{res}{cat}, compute={self._precision} mma "
                f"/ float32 accumulate, device={device}{cut}, cache_entry={self._cache_path})")

    # -------------------------------------------------------------------------------------------- segments

    def _segments_for(self, arch, smem_per_block, sm_count, smem_per_sm, in_dtype, out_dtype, policy=None):
        """The segments of this network for a target (_segments.plan), or None where it is one fused kernel; policy
        (default the model's, _segment_policy) as _segments.plan reads it."""
        key = (arch, smem_per_block, sm_count, smem_per_sm, in_dtype, out_dtype, policy or self._segment_policy)
        if key not in self._cuts:
            self._cuts[key] = _segments.plan(self, *key[:-1], policy=key[-1])
        return self._cuts[key]

    def _build_gemm(self, layer, a0, a1, res, out, **tile):
        """Plans, renders, compiles (through the cache) and loads layer `layer` as a GEMM (gemm_layer.cu) for this
        model's GPU; a0, a1, res, out: dtype names of its input parts, residual operand (None: absent) and result;
        tile: bm, bn (the plan's default where absent; _gemm_options, when set, win)."""
        return self._load(self._gemm_plan(layer, *self._target(), a0, a1, res, out, **tile))

    def _load(self, plan):
        """A chain step's plan (a GEMM, a norm layer's row pass) rendered, compiled (through the cache) and loaded on
        this model's GPU."""
        entry = compile_cubin(_source_of(plan), plan.info["arch"], self._cache, plan.info["wgmma"])
        return plan.load(_gpu(self._ordinal), entry.cubin, KERNEL_NAME)

    def _prenorm_net(self):
        """This network with each norm layer cut before its norm: W h + b alone (no norm, activation or residual), so
        its GEMM writes z and the layer's second kernel (_norm_plan, row_norm.cu) finishes the rows. A layernorm
        layer's weights and bias come less their means over the layer's outputs (float64, then float32): a layernorm
        (and a softmax: softmax(z - c) = softmax(z)) is blind to a common part of its row, and z then has a near-zero
        row mean, so storing it in 16 bits keeps the deviations' bits (as the fused kernels' centred weights,
        fm_plan.centred). Only the norm layers' GEMMs read it. An 8-bit network's keeps its weights as given (their
        codes, and the CPU emulation's, are of those) and its activation scales, and centres the bias alone; its GEMM
        writes z in float16 (csrc/ref.c rounds z so, less the bias's mean, too)."""
        if self._prenorm is None:
            self._prenorm = self._prenorm_of()
        return self._prenorm

    def _prenorm_of(self):
        """_prenorm_net's network, made from the model's weights as they are now."""
        w, b, acts, residual = list(self._w), list(self._b), list(self._acts), list(self._residual)
        quant = self._precision in LOWBIT
        for l, entry in enumerate(self._norm):
            if entry is None:
                continue
            acts[l], residual[l] = "none", None
            if _norm.NAMES[entry[0]] in ("layernorm", "softmax", "log_softmax"):  # blind to a common part
                if not quant:
                    w64 = w[l].astype(np.float64)
                    w[l] = np.ascontiguousarray(w64 - w64.mean(axis=0), dtype=np.float32)
                if b[l] is not None:
                    b[l] = (b[l].astype(np.float64) - b[l].astype(np.float64).mean()).astype(np.float32)
        prenorm = _core().Network(w, b, acts, residual, self._concat, [None] * len(w))
        if quant and self.act_scales is not None:
            prenorm.set_quant(self._precision, [float(v) for v in self.act_scales])
        return prenorm

    def _gemm_net(self, layer):
        """The network whose layer `layer` a GEMM multiplies: this one, or for a norm layer _prenorm_net."""
        return self._prenorm_net() if 0 <= layer < len(self._norm) and self._norm[layer] is not None else self._net

    def _norm_plan(self, layer, arch, smem_per_block, sm_count, smem_per_sm, z, res, out):
        """Norm layer `layer`'s second kernel (row_norm.cu): z (its GEMM's result, dtype z) through the norm and the
        rest of the layer's epilogue, the residual operand of dtype res (None: none), the output out."""
        return self._net.gemm_plan(layer, arch, smem_per_block, sm_count, z, None, res, out, smem_per_sm=smem_per_sm,
                                   precision=self._precision, norm_pass=True)

    def _build_norm(self, layer, z, res, out):
        """Plans, renders, compiles (through the cache) and loads norm layer `layer`'s second kernel (_norm_plan)."""
        return self._load(self._norm_plan(layer, *self._target(), z, res, out))

    def _pad_plan(self, layer, arch, smem_per_block, sm_count, smem_per_sm, x_dtype):
        """The pad pass (pad_rows.cu) of layer `layer` (the chain's first GEMM that reads x, else 0): x (x_dtype) to
        its padded copy in the compute dtype (_segments.pad_row), before the first kernel that reads it (that GEMM, or
        a first fused stretch: _segments.pad_pass_at)."""
        return self._net.gemm_plan(layer, arch, smem_per_block, sm_count, x_dtype, None, None, x_dtype,
                                   smem_per_sm=smem_per_sm, precision=self._precision, pad_pass=True,
                                   a0_row=_segments.pad_row(self, x_dtype))

    def _build_pad(self, layer, x_dtype):
        """Plans, renders, compiles (through the cache) and loads the pad pass (_pad_plan)."""
        return self._load(self._pad_plan(layer, *self._target(), x_dtype))

    def _gemm_plan(self, layer, arch, smem_per_block, sm_count, smem_per_sm, a0, a1, res, out, **tile):
        """Layer `layer`'s GEMM plan (a norm layer's: of the layer cut before its norm, _gemm_net);
        FUSEDMLP_GEMM_CLUSTER (_env.gemm_cluster) and FUSEDMLP_GEMM_WS (_env.gemm_ws) pick the wgmma form's clusters
        and warp specialisation where neither tile nor _gemm_options does; FUSEDMLP_GEMM_TMA=-1 (_env.gemm_tma) loads
        A by cp.async, FUSEDMLP_GEMM_TMA_STORE (_env.gemm_tma_store) has the persistent form store y by TMA or not."""
        options = {**_segments.part_rows(self, layer, a0, a1), **tile, **self._gemm_options}
        if _env.gemm_tma() < 0 and "tma" not in options:
            options["tma"] = -1
        net = self._gemm_net(layer)
        plan = net.gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out, smem_per_sm=smem_per_sm,
                             precision=self._precision, **options)
        forced = {}
        cluster, ws = _env.gemm_cluster(), _env.gemm_ws()
        if cluster and "cluster" not in options and plan.info["wgmma"] and plan.info["cluster"] != cluster:
            forced["cluster"] = cluster
        # (the form in turn, ws 2, takes the default tile only: a small batch's smaller tile keeps the plan's form;
        # a forced cluster changes the auto form, so ws is forced with it)
        if ws and "ws" not in options and plan.info["wgmma"] and (plan.info["ws"] != max(ws, 0) or forced) and not (
                ws == 2 and tile):
            forced["ws"] = ws
        if forced:
            try:
                plan = net.gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out, smem_per_sm=smem_per_sm,
                                     precision=self._precision, **forced, **options)
            except LimitError:
                if forced.get("ws") != 2:
                    raise
                forced.pop("ws")  # (the form in turn takes no residual yet: such a layer keeps the plan's form)
                if forced:
                    plan = net.gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out,
                                         smem_per_sm=smem_per_sm, precision=self._precision, **forced, **options)
        store = _env.gemm_tma_store()
        if store and "tma_store" not in options and plan.info["ws"] == 3 and plan.info["tma_store"] != max(store, 0):
            try:  # (where y's rows or the tile's slabs do not allow TMA stores, the plan's own store)
                plan = net.gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out, smem_per_sm=smem_per_sm,
                                     precision=self._precision, tma_store=store, **forced, **options)
            except LimitError:
                pass
        return plan

    def _gpu_info(self):
        """The model's GPU: arch, sm_count, smem_per_block, smem_per_sm, name (opens it on first use)."""
        return _gpu(self._ordinal).info

    def _target(self):
        """The model's GPU as the plans take it: (arch, smem_per_block, sm_count, smem_per_sm)."""
        info = self._gpu_info()
        return info["arch"], info["smem_per_block"], info["sm_count"], info["smem_per_sm"]

    def _device_buffer(self, nbytes):
        """Device memory of this model's GPU, freed with the object (a segmented network's workspace)."""
        return _core().Buffer(_gpu(self._ordinal), int(nbytes))

    # -------------------------------------------------------------------------------------------- kernels

    def _render(self, arch, smem_per_block, sm_count, in_dtype, out_dtype, smem_per_sm=0, **plan_options):
        plan = self._net.plan(arch, smem_per_block, sm_count, in_dtype, out_dtype, smem_per_sm=smem_per_sm,
                              precision=self._precision, **plan_options)
        return plan, _source_of(plan)

    def compile(self, arch="sm_90", io_dtype="float32"):
        """Renders and compiles the kernel for a named GPU, no GPU needed; returns the cache entry's path (a
        segmented network's: a tuple of them, one per segment, see ``segments``).

        Args:
            arch: the target, e.g. 'sm_80' or 'sm_90'.
            io_dtype: the input/output dtype the kernel will serve ('float32', 'float16' or 'bfloat16'); the compute
                dtype is the model's.
        """
        number, _ = _parse_arch(arch)
        io_dtype = _io_dtype_name(io_dtype, "io_dtype")
        if self._segments_for(number, 0, 0, 0, io_dtype, io_dtype) is not None:
            plans = _segments.plans(self, number, io_dtype, io_dtype)
            sources = [_source_of(plan) for plan in plans]
            with concurrent.futures.ThreadPoolExecutor(min(8, len(plans))) as pool:  # NVRTC releases the GIL
                built = list(pool.map(lambda ps: compile_cubin(ps[1], number, self._cache, ps[0].info["wgmma"]),
                                      zip(plans, sources)))
            self._source, self._cache_path = "\n".join(sources), _entry_path(built[-1])
            return tuple(_entry_path(entry) for entry in built)
        plan, source = self._render(number, 0, 0, io_dtype, io_dtype)
        entry = compile_cubin(source, number, self._cache, plan.info["wgmma"])
        self._source, self._cache_path = source, _entry_path(entry)
        return self._cache_path

    def _build(self, dtype, out_dtype=None, **plan_options):
        """Plans, renders, compiles (through the cache) and loads a kernel for this model's GPU.

        Args:
            dtype: 'float32', 'float16' or 'bfloat16', the input dtype.
            out_dtype: the output dtype (default: dtype).
            plan_options: warps, m_tiles, n_chunk, resident: force a tile shape (the tuner's candidates).

        Returns:
            (kernel, plan, source, cache entry).
        """
        gpu = _gpu(self._ordinal)
        info = gpu.info
        plan, source = self._render(info["arch"], info["smem_per_block"], info["sm_count"], dtype, out_dtype or dtype,
                                    info["smem_per_sm"], **plan_options)
        entry = compile_cubin(source, info["arch"], self._cache, plan.info["wgmma"])
        kernel = plan.load(gpu, entry.cubin, KERNEL_NAME)
        if plan.info["kpipe"] and "kpipe" not in plan_options and spilled(kernel, plan):
            # plan.c's register estimate for K-pipelined layers is a fit to NVRTC 13's counts; where ptxas spilled
            # after all, the same plan without them (both compiles stay in the cache, so this happens once)
            log.debug("fusedmlp: K-pipelined kernel spilled (%s); built without it", kernel.info)
            return self._build(dtype, out_dtype, kpipe=-1, **plan_options)
        if plan.info["norm_half"] and "norm_half" not in plan_options and spilled(kernel, plan):
            # a norm layer's act taking x / 2 (fm_plan.norm_half) is one FMUL an element fewer, yet ptxas spilled 8-16
            # bytes at 255 registers in two of ten random streamed chains where the plain form spills none (NVRTC 13,
            # tests/test_graphs.py): the plain form then, same bits
            log.debug("fusedmlp: kernel with halved norms spilled (%s); built without them", kernel.info)
            return self._build(dtype, out_dtype, norm_half=-1, **plan_options)
        if (plan.info["stream_slots"] and not plan.info["wide_layers"] and "n_chunk" not in plan_options
                and plan.info["precision"] not in LOWBIT and spilled(kernel, plan)):
            # the same for the streamed form's group width: 128-column groups where the estimate allowed them, but
            # ptxas spilled (3-256-256-256-160-160 gelu with a concat and residuals: 12 bytes at 255 registers); then
            # 64-column groups, whose accumulators are half as many. Not where the network has wide layers: unrolled
            # (wide_loop=-1) their 128 input registers leave ptxas a few loop-invariant addresses to spill with either
            # width (wide512: 44 and 48 bytes, NVRTC 13), and 128-column groups ran 13% faster
            # (bench/results/h100-wide-stream/); looped, the default, they spill none. Not 8-bit either: its layers
            # are whole groups (their codes packed whole), and NeRF's trunk, which spills 152 bytes so, has no
            # narrower form
            log.debug("fusedmlp: streamed kernel spilled (%s); built with 64-column groups", kernel.info)
            return self._build(dtype, out_dtype, **{**plan_options, "wgmma": 1, "resident": 0, "n_chunk": 64})
        return kernel, plan, source, entry

    def _kernel(self, dtype, out_dtype=None, rows=None):
        """The loaded kernel a call of `rows` rows uses (rows=None: the default plan).

        With autotuning on (FUSEDMLP_AUTOTUNE, default), the first call in a new batch-size bucket times the tile
        candidates and keeps the fastest (see _tune.py); otherwise _tune.untuned picks by the batch size per SM.
        """
        out_dtype = out_dtype or dtype
        if rows is not None and not self._sm_count:  # known before the first build: a warm-up call must build
            self._sm_count = _gpu(self._ordinal).info["sm_count"]  # what later calls use (graph capture)
        # The hot path of a call: what every input of the answer below depends on, looked up once (the walk below
        # re-parses the environment and sorts the options: 3.8 us of a ~17 us call).
        call_key = bucket = None
        if rows is not None:
            bucket = _tune.bucket(rows)
            call_key = (dtype, out_dtype, bucket, _tune.size_class(rows, self._sm_count),
                        os.environ.get("FUSEDMLP_AUTOTUNE"))
            kernel = self._calls.get(call_key)
            if kernel is not None:
                return kernel
        segments = self._segments_for(*self._target(), dtype, out_dtype)
        if segments is not None:
            small = rows is not None and _segments.gemms_at(self, segments, rows, self._sm_count)
            kernel = _segments.chain(self, dtype, out_dtype, "gemm" if small else None)
            if call_key is not None:
                self._calls[call_key] = kernel
            return kernel
        if rows is None:
            options = None
        elif _env.autotune_enabled():
            options = self._tuned.get((dtype, out_dtype, bucket))
            if options is None:
                with self._lock:
                    options = _tune.choose(self, dtype, out_dtype, rows, _gpu(self._ordinal).info, self._tuning)
                self._tuned[(dtype, out_dtype, bucket)] = options
        else:
            options = _tune.untuned(self, dtype, out_dtype, rows, self._sm_count)
        key = (dtype, out_dtype, tuple(sorted(options.items())) if options else None)
        kernel = self._kernels.get(key)
        if kernel is not None:
            if call_key is not None:
                self._calls[call_key] = kernel
            return kernel
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel, source, entry = None, None, None
                if options:
                    try:
                        kernel, _, source, entry = self._build(dtype, out_dtype, **options)
                    except LimitError:  # that shape does not fit this network: the default one does
                        pass
                if kernel is None:
                    kernel, _, source, entry = self._build(dtype, out_dtype)
                self._source, self._cache_path = source, _entry_path(entry)
                self._kernels[key] = kernel
        if call_key is not None:
            self._calls[call_key] = kernel
        return kernel

    # -------------------------------------------------------------------------------------------- calls

    def __call__(self, x, out_dtype=None, *, out=None):
        """Runs the network on x: a (..., in_features) NumPy array (float32/float16/float64; (batch, in_features), 1-D
        for one row, or more leading dimensions, as nn.Linear takes), or a torch tensor / CuPy array / DLPack object
        (..., in_features) on the CPU or a CUDA device.

        Args:
            x: the inputs.
            out_dtype: the output dtype for tensors (default: x's dtype, or out's); with out, it must equal out's.
            out: None, or a preallocated output the result is written into (and which is returned): of x's kind (a
                NumPy array for NumPy or list x, a torch tensor for torch x and other DLPack objects, a CuPy array
                for CuPy x), on x's device, of shape (*x.shape[:-1], out_features), not sharing memory with x.
                NumPy: x's dtype. Tensors: float32, float16 or bfloat16 (CuPy: float32 or float16), which is then
                the output dtype; not requiring grad. A C-contiguous, 16-byte aligned CUDA tensor of a dtype the
                kernel writes is written in place, with no allocation (at batch 1024 on an H100: 9.8-17 us of host
                time a call against 12.5-22 us without out) and under CUDA graph capture; any other out gets a copy
                of the result.

        Returns:
            out if given; else the outputs, of x's kind (array or tensor) and dtype (or out_dtype), on x's device.
        """
        if self._flatten_input is not None:
            x = _merge_dims(x, self._flatten_input, "x")
        fast = self._calls.fast  # a steady-state CUDA tensor call, in C (csrc/module_fast.c); NotImplemented: not one
        if fast is not None:
            y = fast(x, out_dtype, out)
            if y is not NotImplemented:
                return y
        if not isinstance(x, np.ndarray) and _is_device_array(x):
            return _dlpack.call(self, x, out_dtype, out)
        arr = _as_array(x, "x")
        if arr.dtype.kind == "f" and not arr.dtype.isnative:  # big-endian data (from a file): same values, native
            arr = arr.astype(arr.dtype.newbyteorder("="))
        bf16 = arr.dtype.name == "bfloat16"  # ml_dtypes' bfloat16 (what JAX and others hand NumPy users)
        if arr.dtype not in _ACCEPTED_X and not bf16:
            raise DTypeError(f"x has dtype {arr.dtype}; it must be float32, float16, bfloat16 (ml_dtypes) or float64")
        n_in, n_out = self.in_features, self.widths[-1]
        if arr.ndim == 0 or arr.shape[-1] != n_in:
            raise ShapeError(f"x has shape {np.shape(x)}; the network takes (batch, {n_in}) (or ({n_in},) for one "
                             f"row, or (..., {n_in}) with more leading dimensions)")
        lead = arr.shape[:-1]  # the rows' shape, as nn.Linear keeps it: () for one row, (batch,), (rays, samples)...
        arr = arr.reshape(-1, n_in)  # (a view where x's layout allows, else a copy)
        if out is not None:
            _out.check_numpy(x, arr, out, (*lead, n_out))
        direct = out is not None and arr.shape[0] > 0 and self._writes_into(arr, bf16, out)
        if arr.shape[0] == 0:
            y = np.empty((0, n_out), dtype=arr.dtype)
        else:
            y = self._host_forward(arr, bf16, out.reshape(-1, n_out) if direct else None)
        if direct:
            return out
        y = y.reshape(*lead, n_out)
        if out is not None:
            np.copyto(out, y, casting="unsafe")  # float32 to x's dtype: the cast astype makes
            return out
        return y.astype(arr.dtype, copy=False)

    def _writes_into(self, arr, bf16, out):
        """Whether a GPU host call can write its outputs straight into out (checked by _out.check_numpy): out in the
        dtype the kernel writes (x's; float32 for float64 x is not) and C-contiguous, so the device's copy lands in
        it with no array in between (a large batch's outputs were copied twice, the second time into fresh pages)."""
        kernel_dtype = arr.dtype if bf16 or arr.dtype == np.float16 else np.dtype(np.float32)
        return self._kind == "cuda" and out.dtype == kernel_dtype and out.flags.c_contiguous and out.flags.aligned

    def _host_forward(self, arr, bf16, out=None, rows=None):
        """The outputs of a (batch > 0, in_features) host array, as its path computes them: float32, or x's own
        16-bit dtype; the caller casts them to x's dtype. out (GPU path, _writes_into): a 2-D C-contiguous array of
        that dtype the outputs are written into. rows: the batch size whose kernel runs (default arr's; a
        MultiDeviceMLP share runs the whole call's, for its bits)."""
        if self._kind == "cpu":
            # aligned: the C forward reads float32 elements in place (any strides, but not at odd addresses)
            return _cpu_forward(self._net, np.require(arr, np.float32, ["A"]))
        rows = len(arr) if rows is None else rows
        if bf16:  # the kernel reads and writes the bits; NumPy itself has no bfloat16
            xin = np.ascontiguousarray(arr).view(np.uint16)
            y = self._kernel("bfloat16", rows=rows).run(
                xin, out=None if out is None else out.view(np.uint16), pipeline=_env.host_pipeline()).view(arr.dtype)
            if self._check:
                self._verify(arr.astype(np.float32), y.astype(np.float32))
            return y
        dtype = "float16" if arr.dtype == np.float16 else "float32"
        xin = np.require(arr, dtype, ["C", "A"])
        y = self._kernel(dtype, rows=rows).run(xin, out=out, pipeline=_env.host_pipeline())
        if self._check:
            self._verify(arr, y)  # y in the kernel's dtype: _verify compares in float64, as after the cast
        return y

    def _verify(self, x, y):
        # against the float network: an 8-bit model's bound is its quantisation error too (CHECK_TOLERANCES)
        ref = _cpu_forward(self._net, np.asarray(x, dtype=np.float32), quantised=False).astype(np.float64)
        err = np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
        tolerance = CHECK_TOLERANCES[self._precision]
        if not err <= tolerance:  # also catches NaN
            from .errors import FusedMLPError

            raise FusedMLPError(f"check=True: GPU result differs from the CPU reference by relative L2 error "
                                f"{err:.3g} > {tolerance} (dtype={self._precision})",
                                "see the README's precision notes")


#: Rows a thread of the CPU path takes at least: below that a thread's start is a visible part of its share (the C
#: forward runs a 64-wide row in ~2-10 us a row on one core).
CPU_ROWS_PER_THREAD = 4096


def _float_arrays(weights, biases, n):
    """The n weights and the biases (None, or one array or None per layer) as checked float32 arrays."""
    if biases is None:
        biases = [None] * n
    if not isinstance(biases, (list, tuple)) or len(biases) != n:
        raise ArgumentError(f"biases must be None or a list of {n} entries (an array or None per layer)")
    return ([_as_float_array(wi, f"weights[{i}]", 2) for i, wi in enumerate(weights)],
            [None if bi is None else _as_float_array(bi, f"biases[{i}]", 1) for i, bi in enumerate(biases)])


def _cpu_forward(net, x, **options):
    """net.forward_cpu(x, **options) with x's rows split over the threads _env.cpu_threads() allows (the C forward
    releases the GIL; a row's result does not depend on the others, so the bits are those of one call)."""
    rows = len(x)
    parts = min(_env.cpu_threads(), rows // CPU_ROWS_PER_THREAD)
    if parts < 2:
        return net.forward_cpu(x, **options)
    cuts = [rows * i // parts for i in range(parts + 1)]
    with concurrent.futures.ThreadPoolExecutor(parts - 1) as pool:
        futures = [pool.submit(net.forward_cpu, x[a:b], **options) for a, b in zip(cuts[1:-1], cuts[2:])]
        first = net.forward_cpu(x[: cuts[1]], **options)
        return np.concatenate([first] + [f.result() for f in futures])


def spilled(kernel, plan):
    """Whether ptxas spilled registers in a loaded kernel: it has local memory and uses every register the launch
    bounds of its plan allow (64K over the threads of the CTAs per SM, in steps of 8, at most 255): ptxas spills only
    past that. The driver's local size alone also counts call frames: a network with sin or cos has 32 bytes for the
    far-argument sinf without spilling anything (2-64-64-64-3 sin at 16 warps: 123 of 128 registers)."""
    info = plan.info
    cap = min(255, 65536 // (info["threads"] * info["blocks_per_sm"]) // 8 * 8)
    return kernel.info["local_bytes"] > 0 and kernel.info["regs"] >= cap


def _is_device_array(x):
    # torch tensors (CPU ones too: they keep their type), CuPy arrays, and anything speaking DLPack or the CUDA array
    # interface; NumPy arrays and plain sequences take the host path.
    module = type(x).__module__.split(".")[0]
    return module in ("torch", "cupy") or hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")


def tune(mlp, batch_sizes=(1024, 16384, 262144, 2097152), io_dtype="float16"):
    """Times the tile candidates for each batch size on the model's GPU and keeps the fastest for later calls.

    Choices persist beside the kernel cache (keyed by GPU, widths, activations and dtype), so later processes start
    tuned. Calls do this by themselves for new batch-size buckets unless FUSEDMLP_AUTOTUNE=0.

    Args:
        mlp: a FusedMLP on a CUDA device.
        batch_sizes: the batch sizes to tune for (one record per power-of-4 bucket).
        io_dtype: 'float16', 'float32' or 'bfloat16', the input and output dtype of the calls to tune for.

    Returns:
        {batch size: {"options": chosen plan options, "ms": {candidate: kernel ms}}}; for a segmented network (see
        FusedMLP.segments) that per fused segment, {segment: {batch size: ...}}: each fused stretch tunes as the
        network of its own it is (its records serve the model's calls), and its GEMMs have their one tile.
    """
    if mlp._kind != "cuda":
        raise ArgumentError(f"tune needs a model on a CUDA device; this one runs on {mlp.device}")
    dtype = _io_dtype_name(io_dtype, "io_dtype")
    info = _gpu(mlp._ordinal).info
    cut = mlp._segments_for(*mlp._target(), dtype, dtype)
    if cut is not None:  # the chain's own stretch models, so its next calls take the choices at once
        chain = _segments.chain(mlp, dtype, dtype)
        results = {seg.describe(): _tune_sizes(sub, k_in, k_out, batch_sizes, info)
                   for seg, sub, k_in, k_out in chain.fused}
        chain.forget()
        mlp._calls.clear()  # (the fast path's steps hold the stretches' kernels too)
        return results
    return _tune_sizes(mlp, dtype, dtype, batch_sizes, info)


def _tune_sizes(mlp, dtype, out_dtype, batch_sizes, info):
    """tune()'s records for one fused network and dtype pair."""
    results = {}
    for rows in batch_sizes:
        options = _tune.choose(mlp, dtype, out_dtype, int(rows), info, mlp._tuning, force=True)
        mlp._tuned[(dtype, out_dtype, _tune.bucket(int(rows)))] = options
        mlp._calls.clear()  # calls look their kernel up again, under the new choice
        key = _tune._model_key(mlp, dtype, out_dtype, info)
        results[int(rows)] = mlp._tuning.load(key)[str(_tune.bucket(int(rows)))]
    return results


def _io_dtype_name(dtype, field):
    """'float32', 'float16' or 'bfloat16' from a dtype-like, or DTypeError naming the field."""
    text = str(dtype)
    if text in ("bfloat16", "torch.bfloat16"):
        return "bfloat16"
    try:
        name = np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in ("float32", "float16", "bfloat16"):
        raise DTypeError(f"{field}={dtype!r}: a kernel reads and writes float32, float16 or bfloat16")
    return name


def _entry_path(entry):
    # An entry held in memory (the cache directory was not writable) has no path.
    return None if entry.path is None else str(entry.path)


def _warn_cpu_once():
    global _cpu_warned
    if not _cpu_warned:
        _cpu_warned = True
        warnings.warn("fusedmlp: no CUDA GPU found; running on the CPU path (pass device='cpu' to silence this)",
                      RuntimeWarning, stacklevel=3)


def evaluate_fused_mlp(x, weights, biases=None, activation="relu", output_activation=None, *, residual=None,
                       concat=None, norm=None, encoding=None, flatten_input=None, dtype="float16", device="auto",
                       check=False):
    """Runs an MLP given as PyTorch-layout weights on x in one fused kernel; see FusedMLP for the arguments. An 8-bit
    dtype ('int8', 'float8') is calibrated on x itself, the only batch there is (FusedMLP.calibrate).

    Returns:
        The (batch, out_features) outputs, with x's dtype.
    """
    mlp = FusedMLP(weights, biases, activation, output_activation, residual=residual, concat=concat, norm=norm,
                   encoding=encoding, flatten_input=flatten_input, dtype=dtype, device=device, check=check)
    if mlp._precision in LOWBIT:
        mlp.calibrate(x)
    return mlp(x)
