"""The benchmark's low-bit section (issue 26): each workload in int8 and float8 beside float16, in the same run.

``python -m fusedmlp.bench --dtype float16 int8 float8`` adds, per workload and batch size, a method per 8-bit dtype:
the model built from the same weights with ``dtype=``, calibrated once on 4096 fresh random rows (not the timed
inputs), timed as the float16 kernel is (float16 x and y, CUDA events, rotating inputs) and checked against the same
float64 reference within ``CHECK_TOLERANCES[dtype]``. The 8-bit floor takes the FLOPs at the e4m3 matmul rate
measured in the same run (``torch._scaled_mm``, the 8192^3 product), the I/O at the copy rate.
"""

LOWBIT = ("int8", "float8")
CALIBRATION_ROWS = 4096


def method(dtype):
    return f"fusedmlp_{dtype}"


def tolerance(fusedmlp, name):
    """The accuracy bound of benchmark method `name`: its 8-bit dtype's check=True bound, else float16's."""
    for dtype in LOWBIT:
        if name == method(dtype):
            return fusedmlp.CHECK_TOLERANCES[dtype]
    return fusedmlp.CHECK_TOLERANCE


def ceiling(torch, n, median_ms, device):
    """The e4m3 matmul rate {"matmul8_TFLOPs", "matmul8_ms"} through torch._scaled_mm, or {"matmul8_error": why}."""
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        ms = median_ms(torch, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float16), 20)
        return {"matmul8_TFLOPs": 2 * n**3 / (ms * 1e-3) / 1e12, "matmul8_ms": ms}
    except Exception as e:  # noqa: BLE001 - no fp8 matmul on this GPU or torch: the 8-bit floor is not measured
        return {"matmul8_error": f"{type(e).__name__}: {e}"}


def floor_ms(flops, io_bytes, ceilings):
    """The 8-bit floor in ms, or None where the e4m3 rate was not measured."""
    rate = ceilings.get("matmul8_TFLOPs")
    if not rate:
        return None
    return max(io_bytes / (ceilings["copy_GBps"] * 1e9), flops / (rate * 1e12)) * 1e3


def models(torch, fusedmlp, dtypes, weights, biases, options, n_in, device):
    """{dtype: calibrated FusedMLP} for the 8-bit dtypes asked for; a dtype that cannot be built maps to its error."""
    out = {}
    sample = torch.randn(CALIBRATION_ROWS, n_in, device=device, dtype=torch.float16).float().cpu().numpy()
    for dtype in dtypes:
        if dtype not in LOWBIT:
            continue
        try:
            mlp = fusedmlp.FusedMLP(weights, biases, dtype=dtype, device="cuda", **options)
            out[dtype] = mlp.calibrate(sample)
        except Exception as e:  # noqa: BLE001 - recorded per case, as any method's failure
            out[dtype] = e
    return out


def setups(case, built):
    """{method name: setup} for the bench's _measure: each 8-bit model's kernel on the case's float16 inputs."""
    result = {}
    for dtype, mlp in built.items():
        result[method(dtype)] = _setup(case, mlp)
    return result


def _setup(case, mlp):
    def setup():
        if isinstance(mlp, Exception):
            raise mlp
        import torch

        xs, rows = case.xs, case.rows
        kernel = mlp._kernel("float16", rows=rows)
        y = torch.empty(rows, case.wl.out_features(), device=xs[0].device, dtype=torch.float16)
        stream = torch.cuda.current_stream().cuda_stream

        def fn(k):
            kernel.launch(xs[k % len(xs)].data_ptr(), y.data_ptr(), rows, stream)

        def check():
            y.fill_(float("nan"))
            fn(0)
            return y

        return fn, 1, check, None

    return setup


def format_section(report):
    """The low-bit section's text: per (workload, rows), ms per dtype, each 8-bit time against float16, and each
    against the 8-bit floor; empty when the run had no 8-bit dtype."""
    from .bench import rows_label

    rows = [r for r in report.get("results", []) if any(method(d) in r["methods"] for d in LOWBIT)]
    if not rows:
        return ""
    ceil = report.get("ceilings") or {}
    rate = ceil.get("matmul8_TFLOPs")
    lines = ["", "low-bit kernels, ms (float16 x and y); x16 = float16 ms / this (> 1: faster); x floor8 = this / the "
             "8-bit floor (e4m3 matmul " + (f"{rate:.0f} TFLOP/s" if rate else ceil.get("matmul8_error", "not measured"))
             + ")", "workload    rows    float16       int8     float8   x16 int8 x16 float8  xfl8 int8 xfl8 fp8"]
    for r in rows:
        fp16 = r["methods"].get("fusedmlp", {}).get("ms")
        cells = [_ms(fp16)]
        times = {d: r["methods"].get(method(d), {}) for d in LOWBIT}
        cells += [_ms(times[d].get("ms")) if "ms" in times[d] else ("err" if times[d].get("error") else "-")
                  for d in LOWBIT]
        cells += [f"{fp16 / times[d]['ms']:.2f}" if fp16 and times[d].get("ms") else "-" for d in LOWBIT]
        floor8 = r.get("floor8_ms")
        cells += [f"{times[d]['ms'] / floor8:.2f}" if floor8 and times[d].get("ms") else "-" for d in LOWBIT]
        lines.append(f"{r['workload']:9s} {rows_label(r['rows']):>6s} " + " ".join(f"{c:>10s}" for c in cells))
    return "\n".join(lines)


def _ms(v):
    return "-" if v is None else f"{v:.4g}"
