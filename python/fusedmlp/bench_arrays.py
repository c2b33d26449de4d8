"""The benchmark's host-array section: a GPU call on NumPy arrays, as a NumPy user makes it, at large batches.

Per workload and batch size, in the same run (milliseconds, median of REPS calls after a warm-up call):

- ``fused``: ``mlp(x)`` with float32 NumPy x, float32 y returned (fresh pages), the default (pieces through
  page-locked staging from 16 MiB, ``csrc/host_pipe.c``).
- ``fused_out``: ``mlp(x, out=y)`` into the same preallocated array each call.
- ``fused_one``: as ``fused_out`` with ``FUSEDMLP_HOST_PIPE=-1``: one copy each way through pageable memory (the form
  before the pieces).
- ``torch``: what a PyTorch user writes for the same arrays: ``model(torch.from_numpy(x).cuda().half()).float()
  .cpu().numpy()`` with the benchmark's float16 model.
- ``kernel``: the fused call on x already on the device (float32 in and out), the device's share.
- ``floor``: the bus's share at the rates measured in this run with page-locked buffers: x's bytes at the host-to-device
  rate and y's at the device-to-host rate, the two directions at once (the slower of the two).

``x torch`` is torch over fused+out; ``x floor`` is fused+out over the larger of the bus's floor and the kernel.
"""

import os
import statistics
import time

import numpy as np

REPS = 5
ARRAY_ROWS = (2**20, 2**22, 2**24)


def _median_ms(torch, fn, reps=REPS):
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bus_rates(torch, nbytes=1 << 30):
    """Host-to-device and device-to-host GB/s between page-locked host memory and the device, each direction alone."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _median_ms(torch, lambda: dev.copy_(host, non_blocking=True))
    d2h = _median_ms(torch, lambda: host.copy_(dev, non_blocking=True))
    return {"h2d_GBps": nbytes / h2d / 1e6, "d2h_GBps": nbytes / d2h / 1e6}


class _HostPipe:
    """FUSEDMLP_HOST_PIPE set to `value` inside the block (_env reads it at call time)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.before = os.environ.get("FUSEDMLP_HOST_PIPE")
        os.environ["FUSEDMLP_HOST_PIPE"] = self.value

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("FUSEDMLP_HOST_PIPE", None)
        else:
            os.environ["FUSEDMLP_HOST_PIPE"] = self.before


def measure(torch, mlp, model, rows, rates):
    """One workload at one batch size: {column: ms} and the largest difference between the forms' outputs."""
    n_in, n_out = mlp.in_features, mlp.widths[-1]
    x = np.random.default_rng(rows).standard_normal((rows, n_in), dtype=np.float32)
    y = np.empty((rows, n_out), np.float32)
    row = {"fused_ms": _median_ms(torch, lambda: mlp(x))}
    row["fused_out_ms"] = _median_ms(torch, lambda: mlp(x, out=y))
    piped = y.copy()
    with _HostPipe("-1"):
        row["fused_one_ms"] = _median_ms(torch, lambda: mlp(x, out=y))
    row["same_bits"] = bool(np.array_equal(piped.view(np.uint32), y.view(np.uint32)))
    row["torch_ms"] = _median_ms(torch, lambda: model(torch.from_numpy(x).cuda().half()).float().cpu().numpy())
    xd = torch.from_numpy(x).cuda()
    yd = torch.empty((rows, n_out), device="cuda")
    row["kernel_ms"] = _median_ms(torch, lambda: mlp(xd, out=yd))
    row["floor_ms"] = max(x.nbytes / rates["h2d_GBps"], y.nbytes / rates["d2h_GBps"]) / 1e6
    xd = yd = None  # (the device copies go before the next size)
    torch.cuda.empty_cache()
    return row


COLUMNS = (("fused_ms", "fused"), ("fused_out_ms", "fused+out"), ("fused_one_ms", "one copy"), ("torch_ms", "torch"),
           ("kernel_ms", "kernel"), ("floor_ms", "floor"))


def format_section(section):
    """The section's text: the bus rates, then one line per (workload, rows)."""
    rates = section.get("rates", {})
    lines = ["", "Host arrays (float32 NumPy x and y; ms a call, median of %d)" % REPS]
    if "h2d_GBps" in rates:
        lines.append("page-locked bus: %.1f GB/s to the device, %.1f GB/s back" % (rates["h2d_GBps"], rates["d2h_GBps"]))
    lines.append("%-9s %9s " % ("workload", "rows") + " ".join("%10s" % name for _, name in COLUMNS)
                 + "  x torch  x floor  same bits")
    for r in section.get("rows", []):
        if "error" in r:
            lines.append("%-9s %9d  %s" % (r["workload"], r["rows"], r["error"]))
            continue
        cells = " ".join("%10.2f" % r[key] for key, _ in COLUMNS)
        lines.append("%-9s %9d " % (r["workload"], r["rows"]) + cells + "  %7.2f  %7.2f  %s" % (
            r["torch_ms"] / r["fused_out_ms"], r["fused_out_ms"] / max(r["floor_ms"], r["kernel_ms"]), r["same_bits"]))
    return "\n".join(lines)


def run(torch, report, fused, rows_list, say):
    """The section for fused = {workload: (FusedMLP, fp16 torch model)} at rows_list; into report["arrays"]."""
    section = report["arrays"] = {"rows": []}
    try:
        section["rates"] = rates = bus_rates(torch)
    except Exception as e:  # noqa: BLE001 - a result, not the end of the run
        section["rates"] = {"error": f"{type(e).__name__}: {e}"}
        return section
    say("page-locked bus: %.1f GB/s to the device, %.1f back" % (rates["h2d_GBps"], rates["d2h_GBps"]))
    for wname, (mlp, model) in fused.items():
        for rows in rows_list:
            try:
                row = measure(torch, mlp, model, rows, rates)
            except Exception as e:  # noqa: BLE001
                row = {"error": f"{type(e).__name__}: {e}"}
            section["rows"].append({"workload": wname, "rows": rows, **row})
            say(f"{wname:9s} arrays {rows:>9d} rows: " + "  ".join(
                f"{k[:-3]} {v:.2f}" for k, v in row.items() if isinstance(v, float)))
    return section
