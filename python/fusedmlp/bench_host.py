"""The benchmark's host section (issue 25): what a small call costs the caller, beside what nothing can beat.

At 1, 64 and 1024 rows, per workload, in the same run as the main table: host microseconds per call of
``mlp(x)`` and ``mlp(x, out=y)`` back to back (N calls then one synchronize, over N: the throughput of a loop of
calls; the GPU's own time bounds it from below) and each followed by a synchronize (a caller waiting for every
answer); PyTorch eager replayed as a CUDA graph, timed the same two ways; the fused kernel's device time; the
fused model as an ``nn.Module`` (FusedModule) called directly and compiled with torch.compile, so the custom op's
cost over a direct call shows. Once per run: the launch floor, an empty kernel with the fused kernels' arguments
launched from C with cuLaunchKernel (``Gpu.launch_floor``).
"""

import copy
import statistics
import time

from . import _core

HOST_ROWS = (1, 64, 1024)
BACK_TO_BACK = 100  # calls per timed group: below the driver's launch queue, so the host is never held up by it
GROUPS = 15
EMPTY_KERNEL = ('extern "C" __global__ void fusedmlp_empty(const void *x, void *y, const void *w, const float *b, '
                'long long rows, const void *x1, const void *res) {}\n')


def launch_floor(cache_dir):
    """Host microseconds per launch of an empty kernel from C: {"async_us": back to back, "sync_us": each synced}."""
    from . import _api
    from ._cache import KernelCache

    gpu = _api._gpu(0)
    entry = _api.compile_cubin(EMPTY_KERNEL, gpu.info["arch"], KernelCache(cache_dir))
    async_us, sync_us = gpu.launch_floor(entry.cubin, "fusedmlp_empty", 2000)
    return {"async_us": async_us, "sync_us": sync_us}


def back_to_back_us(torch, fn, calls=BACK_TO_BACK, groups=GROUPS):
    """Median over groups of (calls of fn, then one synchronize) / calls, in microseconds."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(groups):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def synced_us(torch, fn, calls=300):
    """Median microseconds of one call followed by a synchronize of torch's current stream."""
    stream = torch.cuda.current_stream()
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        stream.synchronize()
        t = time.perf_counter()
        fn()
        stream.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _kernel_us(torch, kernel, x, y, rows):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream().cuda_stream
    times = []
    for _ in range(GROUPS):
        start.record()
        for _ in range(BACK_TO_BACK):
            kernel.launch(x.data_ptr(), y.data_ptr(), rows, stream)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / BACK_TO_BACK)
    return statistics.median(times)


def _graph(torch, model, x):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    return graph


def measure(torch, mlp, model, n_in, rows, compiled=None):
    """One workload at one batch size: {name: microseconds}; compiled: (FusedModule, its torch.compile) or None."""
    x = torch.randn(rows, n_in, device="cuda", dtype=torch.float16)
    y = mlp(x)
    out = torch.empty_like(y)
    row = {}
    kernel = mlp._kernel("float16", rows=rows)
    if isinstance(kernel, _core.Kernel):  # a chain of segments has no one kernel to time
        row["kernel_us"] = _kernel_us(torch, kernel, x, out, rows)
    row["call_us"] = back_to_back_us(torch, lambda: mlp(x))
    row["call_out_us"] = back_to_back_us(torch, lambda: mlp(x, out=out))
    row["call_sync_us"] = synced_us(torch, lambda: mlp(x))
    row["call_out_sync_us"] = synced_us(torch, lambda: mlp(x, out=out))
    graph = _graph(torch, model, x)
    row["graph_us"] = back_to_back_us(torch, graph.replay)
    row["graph_sync_us"] = synced_us(torch, graph.replay)
    if compiled is not None:
        module, fast, floor = compiled
        row["module_us"] = back_to_back_us(torch, lambda: module(x))
        fast(x)  # compiles for this shape
        row["compiled_us"] = back_to_back_us(torch, lambda: fast(x))
        row["compiled_sync_us"] = synced_us(torch, lambda: fast(x))
        floor(x)
        row["compile_floor_us"] = back_to_back_us(torch, lambda: floor(x))
    return row


UPDATE_ROWS = 64
UPDATE_STEPS = 15


def weight_updates(torch, mlp, model, n_in, rows=UPDATE_ROWS, steps=UPDATE_STEPS):
    """What a call costs right after the weights changed in place (an RL agent acting between optimizer steps):
    {name: median microseconds over `steps` steps}, each step a tiny in-place add (up, then down) to every parameter of the fp16
    model, then one call and a synchronize. ``update_call_us``: FusedModule (its set_weights path); ``rebuild_call_us``:
    FusedModule made to build a new fused model, as it did for every change before set_weights; ``torch_update_us``:
    PyTorch eager, which reads its parameters where they are; ``set_weights_us``: mlp.set_weights alone, from
    NumPy arrays; ``module_call_us``: FusedModule without a change, for scale."""
    from .torch import FusedModule

    with torch.inference_mode(False):  # (the run's models are inference tensors, whose changes no version counts)
        return _weight_updates(torch, FusedModule, mlp, copy.deepcopy(model), n_in, rows, steps)


def _weight_updates(torch, FusedModule, mlp, model, n_in, rows, steps):
    x = torch.randn(rows, n_in, device="cuda", dtype=torch.float16)
    module = FusedModule(model)
    params = list(model.parameters())
    weights, biases = [w.copy() for w in mlp._w], [None if b is None else b.copy() for b in mlp._b]

    def timed(before, call):
        times = []
        for _ in range(steps + 2):
            with torch.no_grad():
                before()
                torch.cuda.synchronize()
                t = time.perf_counter()
                call()
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:]) * 1e6

    sign = [1e-3]

    def nudge():  # (up and down in turn: 17 steps one way took rec1024's fp16 outputs past float16's range)
        sign[0] = -sign[0]
        for p in params:
            p.add_(sign[0])

    def nudge_all():  # the fused model built anew, as FusedModule did for every change before set_weights
        nudge()
        module._form = None

    row = {"module_call_us": timed(lambda: None, lambda: module(x)),
           "update_call_us": timed(nudge, lambda: module(x)),
           "rebuild_call_us": timed(nudge_all, lambda: module(x)),
           "torch_update_us": timed(nudge, lambda: model(x)),
           "set_weights_us": timed(lambda: None, lambda: mlp.set_weights(weights, biases))}
    with torch.no_grad():
        want = model(x).float()
        got = module(x).float()
    row["update_rel_err"] = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return row


COLUMNS = (("kernel_us", "kernel"), ("call_us", "call"), ("call_out_us", "call+out"), ("call_sync_us", "call s"),
           ("call_out_sync_us", "call+out s"), ("graph_us", "t.graph"), ("graph_sync_us", "t.graph s"),
           ("module_us", "module"), ("compiled_us", "compiled"), ("compiled_sync_us", "compiled s"),
           ("compile_floor_us", "c.floor"))


def format_section(host):
    """The host section's text: the launch floor, then one line per (workload, rows)."""
    if not host:
        return ""
    floor = host.get("launch_floor", {})
    lines = ["", "host us per call (median): plain = back to back (%d calls, one sync), s = a sync after each call; "
             "launch floor from C: %s back to back, %s with a sync" % (
                 BACK_TO_BACK, _us(floor.get("async_us")), _us(floor.get("sync_us"))),
             "workload    rows " + "".join(f"{label:>11s}" for _, label in COLUMNS)]
    for r in host.get("rows", []):
        if "error" in r:
            lines.append(f"{r['workload']:11s} {r['rows']:>4d} error: {r['error']}")
            continue
        lines.append(f"{r['workload']:11s} {r['rows']:>4d} " + "".join(f"{_us(r.get(key)):>11s}" for key, _ in COLUMNS))
    lines.append("call = mlp(x) on a CUDA float16 tensor; call+out = mlp(x, out=y); t.graph = PyTorch eager replayed as "
                 "a CUDA graph; module = fusedmlp.torch.FusedModule called directly; compiled = torch.compile of it "
                 "(the custom op in the graph); c.floor = torch.compile of torch.sin, one op: what any compiled call "
                 "costs")
    if host.get("updates"):
        lines += ["", f"a call right after an in-place change of every parameter, {UPDATE_ROWS} rows, us (median "
                  f"of {UPDATE_STEPS} steps, each synced):",
                  "workload       module   update  rebuild  torch upd  set_weights  rel err"]
        for r in host["updates"]:
            if "error" in r:
                lines.append(f"{r['workload']:11s} error: {r['error']}")
                continue
            lines.append(f"{r['workload']:11s} {_us(r['module_call_us']):>8s} {_us(r['update_call_us']):>8s} "
                         f"{_us(r['rebuild_call_us']):>8s} {_us(r['torch_update_us']):>10s} "
                         f"{_us(r['set_weights_us']):>12s}  {r['update_rel_err']:.2e}")
        lines.append("module = FusedModule(model)(x) unchanged; update = the call after the change (set_weights in "
                     "place); rebuild = the same with a new fused model built, as before set_weights; torch upd = "
                     "PyTorch eager after the change; set_weights = FusedMLP.set_weights from NumPy arrays alone")
    return "\n".join(lines)


def _us(v):
    return "-" if v is None else f"{v:.2f}"


def run(torch, report, fused, cache_dir, compile_first, say):
    """The section for fused = {workload: (FusedMLP, fp16 torch model)}; results into report["host"].

    compile_first: also time FusedModule and its torch.compile for the first workload whose model
    fusedmlp.torch reads (a compile per batch size: one workload keeps the run short)."""
    from .torch import FusedModule

    host = report["host"] = {"rows": []}
    try:
        host["launch_floor"] = launch_floor(cache_dir)
        say("launch floor: %.2f us back to back, %.2f us with a sync" % (host["launch_floor"]["async_us"],
                                                                         host["launch_floor"]["sync_us"]))
    except Exception as e:  # noqa: BLE001 - a result, not the end of the run
        host["launch_floor"] = {"error": f"{type(e).__name__}: {e}"}
    for wname, (mlp, model) in fused.items():
        compiled = None
        if compile_first:
            try:
                module = FusedModule(model)
                compiled = (module, torch.compile(module, fullgraph=True, dynamic=False),
                            torch.compile(torch.sin, fullgraph=True, dynamic=False))  # torch.compile's own floor
                compile_first = False
            except Exception:  # noqa: BLE001 - a model from_torch cannot read (residual workloads): no module row
                compiled = None
        for rows in HOST_ROWS:
            try:
                row = measure(torch, mlp, model, mlp.in_features, rows, compiled)
            except Exception as e:  # noqa: BLE001
                row = {"error": f"{type(e).__name__}: {e}"}
            host["rows"].append({"workload": wname, "rows": rows, **row})
            say(f"{wname:9s} host {rows:>5d} rows: " + "  ".join(f"{k[:-3]} {v:.2f}" for k, v in row.items()
                                                                   if isinstance(v, float)))
        try:
            row = weight_updates(torch, mlp, model, mlp.in_features)
        except Exception as e:  # noqa: BLE001 - a model from_torch cannot read: its error in the row
            row = {"error": f"{type(e).__name__}: {e}"}
        host.setdefault("updates", []).append({"workload": wname, **row})
        say(f"{wname:9s} weight update: " + "  ".join(f"{k} {v:.3g}" for k, v in row.items() if isinstance(v, float)))
