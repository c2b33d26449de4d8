"""The benchmark's report: ratios, the text table, the plot and the files (python -m fusedmlp.bench writes them).

Reads the report dict bench.main() builds (its results, ceilings, workloads and sections); needs nothing but the
standard library, and matplotlib for the plot where it is installed.
"""

import json
import math
import os
import pathlib

from . import bench_arrays, bench_host, bench_lowbit

#: The PyTorch methods a fused result is compared with (x peer: the best of them).
PEERS = ("torch_eager", "torch_graph", "torch_compile")


def rows_label(rows):
    """2097152 -> '2^21'; other counts as digits."""
    return f"2^{rows.bit_length() - 1}" if rows & (rows - 1) == 0 else str(rows)


def summarize(result):
    """Ratios of one (workload, rows) result.

    Returns:
        dict: fused_ms, best_peer (name or None), best_peer_ms, x_floor (fused / floor, >= 1 unless the ceilings are
        off), x_peer (best peer / fused: > 1 means fusedmlp is faster), rows_per_s (of the fused kernel).
    """
    methods = result["methods"]
    fused = methods.get("fusedmlp", {}).get("ms")
    peers = [(methods[p]["ms"], p) for p in PEERS if methods.get(p, {}).get("ms") is not None]
    best_ms, best = min(peers) if peers else (None, None)
    return {
        "fused_ms": fused,
        "best_peer": best,
        "best_peer_ms": best_ms,
        "x_floor": fused / result["floor_ms"] if fused and result.get("floor_ms") else None,
        "x_peer": best_ms / fused if fused and best_ms else None,
        "rows_per_s": result["rows"] / (fused * 1e-3) if fused else None,
    }


def _si(value):
    if value is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:.3g}"


def _fixed(value):
    """4 significant digits in fixed point: 0.0040, 0.00005243, 1.660, 4.865 (no exponents: columns stay aligned)."""
    if value <= 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.{max(0, 3 - math.floor(math.log10(value)))}f}"


def _cell_ms(entry, key="ms", scale=1.0):
    if entry is None:
        return "-"
    if entry.get("error"):
        return "err"
    value = entry.get(key)
    if value is None:
        return "skip" if entry.get("skipped") else "-"
    flag = "!" if entry.get("check_ok") is False else ""
    return _fixed(value * scale) + flag


_TABLE = (  # header, width, cell(result, summary)
    ("workload", 9, lambda r, s: r["workload"]),
    ("rows", 5, lambda r, s: rows_label(r["rows"])),
    ("fused", 10, lambda r, s: _cell_ms(r["methods"].get("fusedmlp"))),
    ("f.graph", 10, lambda r, s: _cell_ms(r["methods"].get("fusedmlp_graph"))),
    ("call", 10, lambda r, s: _cell_ms(r["methods"].get("fusedmlp_call"), "call_us", 1e-3)),
    ("call+out", 10, lambda r, s: _cell_ms(r["methods"].get("fusedmlp_call"), "call_out_us", 1e-3)),
    ("eager", 10, lambda r, s: _cell_ms(r["methods"].get("torch_eager"))),
    ("graph", 10, lambda r, s: _cell_ms(r["methods"].get("torch_graph"))),
    ("compile", 10, lambda r, s: _cell_ms(r["methods"].get("torch_compile"))),
    ("floor", 11, lambda r, s: _fixed(r["floor_ms"]) + ("c" if r.get("floor_bound") == "compute" else "m")),
    ("rows/s", 7, lambda r, s: _si(s["rows_per_s"])),
    ("x floor", 7, lambda r, s: "-" if s["x_floor"] is None else f"{s['x_floor']:.2f}"),
    ("x peer", 7, lambda r, s: "-" if s["x_peer"] is None else f"{s['x_peer']:.2f}"),
    ("tile", 5, lambda r, s: (r.get("tile") or {}).get("choice", "-")),
)


_MS_COLUMNS = ("fused", "f.graph", "call", "call+out", "eager", "graph", "compile", "floor")


def format_table(report):
    """The text table of a report (the dict main() writes as JSON): one line per (workload, rows), then notes."""
    lines = []
    head = report.get("device", {}).get("name", "?")
    ceil = report.get("ceilings") or {}
    if ceil:
        head += f"  copy {ceil['copy_GBps']:.0f} GB/s  fp16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s"
    lines.append(head + f"  torch {report.get('torch', '?')}  fusedmlp {report.get('fusedmlp', '?')}")
    lines.append("  ".join(f"{h:>{w}}" if i > 0 else f"{h:<{w}}" for i, (h, w, _) in enumerate(_TABLE)))
    lines.append("  ".join(f"{'ms':>{w}}" if h in _MS_COLUMNS else " " * w for h, w, _ in _TABLE).rstrip())
    failures = []
    for r in report.get("results", []):
        s = summarize(r)
        cells = [fn(r, s) for _, _, fn in _TABLE]
        lines.append("  ".join(f"{c:>{w}}" if i > 0 else f"{c:<{w}}" for i, ((_, w, _), c) in
                               enumerate(zip(_TABLE, cells))))
        for name, entry in r["methods"].items():
            if entry.get("error"):
                failures.append(f"{r['workload']} {rows_label(r['rows'])} {name}: {entry['error']}")
            elif entry.get("check_ok") is False:
                failures.append(f"{r['workload']} {rows_label(r['rows'])} {name}: relative L2 error "
                                f"{entry.get('rel_l2')} exceeds {report.get('tolerance')}")
    for name, info in report.get("workloads", {}).items():
        if info.get("skipped"):
            lines.append(f"{name:<9}  skipped: {info['skipped']}")
    for name, info in report.get("workloads", {}).items():
        if info.get("cold_ms") is not None:
            lines.append(f"{name:<9}  first call: cold {info['cold_ms']:.1f} ms (render + NVRTC + load), warm "
                         f"{info['warm_ms']:.2f} ms (disk cache)")
    lines.append("ms per call (median); call = host-timed fused(x) + sync; call+out = the same into a preallocated "
                 "y, fused(x, out=y); floor c/m = compute/memory bound; x floor = fused / floor; x peer = best of "
                 "eager/graph/compile / fused (> 1: fusedmlp faster); ! = failed the accuracy check; tile = the "
                 "tuner's choice (wgN: wgmma, N warps; wNmM: mma.sync, N warps x 16M rows; every candidate's time in "
                 "the JSON)")
    lines.extend(f"error: {f}" for f in failures)
    sections = [bench_lowbit.format_section(report), bench_host.format_section(report.get("host"))]
    if report.get("arrays"):
        sections.append(bench_arrays.format_section(report["arrays"]))
    return "\n".join(lines + [section for section in sections if section])


_PLOT_LINES = (  # method, label, style
    ("fusedmlp", "fusedmlp kernel", dict(color="C3", marker="o", lw=2)),
    ("fusedmlp_graph", "fusedmlp in a graph", dict(color="C3", marker="^", lw=1, ls=":")),
    ("fusedmlp_call", "fusedmlp call (host)", dict(color="C1", marker="s", lw=1)),
    ("torch_eager", "PyTorch eager", dict(color="C0", marker="o", lw=1)),
    ("torch_graph", "PyTorch CUDA graph", dict(color="C2", marker="o", lw=1)),
    ("torch_compile", "torch.compile max-autotune", dict(color="C4", marker="o", lw=1)),
)


def plot(report, path):
    """Draws rows/s against batch size, log-log, one panel per workload, the floor dashed; writes a PNG.

    Returns:
        True if written, False when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(report.get("workloads", {}))
    cols = min(3, max(1, len(names)))
    nrows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        info = report["workloads"][name]
        ax.set_title(f"{name}: {'-'.join(map(str, info['widths']))} {info['activation']}", fontsize=9)
        results = sorted((r for r in report.get("results", []) if r["workload"] == name), key=lambda r: r["rows"])
        if info.get("skipped") or not results:
            ax.text(0.5, 0.5, "skipped: " + str(info.get("skipped") or "no results"), ha="center", va="center",
                    wrap=True, fontsize=8, transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for method, label, style in _PLOT_LINES:
            key, scale = ("call_us", 1e-6) if method == "fusedmlp_call" else ("ms", 1e-3)
            pts = [(r["rows"], r["rows"] / (r["methods"][method][key] * scale)) for r in results
                   if r["methods"].get(method, {}).get(key)]
            if pts:
                ax.plot(*zip(*pts), label=label, ms=4, **style)
        ax.plot([r["rows"] for r in results], [r["rows"] / (r["floor_ms"] * 1e-3) for r in results], "k--", lw=1,
                label="floor (copy / matmul ceilings)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("rows / s")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:  # the first panel may be a skipped one
        h, l = ax.get_legend_handles_labels()
        if len(h) > len(handles):
            handles, labels = h, l
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    fig.suptitle(f"{report.get('device', {}).get('name', '?')}: fp16 inference, fusedmlp vs PyTorch "
                 f"{report.get('torch', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plain(obj):
    """JSON-safe copy: non-finite floats become strings (json.dump would write bare NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def write_outputs(report, out_dir, with_plot=True):
    """Writes bench.json, bench.txt and (with_plot, matplotlib present) bench.png under out_dir."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench.json.tmp"  # renamed into place: a run killed mid-write leaves the previous file whole
    tmp.write_text(json.dumps(_plain(report), indent=1) + "\n")
    os.replace(tmp, out_dir / "bench.json")
    (out_dir / "bench.txt").write_text(format_table(report) + "\n")
    if with_plot:
        plot(report, out_dir / "bench.png")
