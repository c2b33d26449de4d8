"""A first timing of the fused kernel against PyTorch on one GPU (the full peer benchmark is bench/run.py, issue 4).

Times fusedmlp's kernel on CUDA tensors and PyTorch fp16 eager and eager-in-a-CUDA-graph on the same inputs, with
CUDA events, warm-up, and the median of repeated runs rotating among 4 input buffers. Outputs are checked against
PyTorch before timing. Prints one line per workload and writes JSON when --json is given.

    python bench/quick.py [--rows 2097152] [--json out.json]
"""

import argparse
import json
import statistics

import numpy as np
import torch

import fusedmlp

WORKLOADS = {
    # name: (widths, activation, bias)
    "tcnn64": ([32, 64, 64, 64, 64, 16], "relu", False),
    "tcnn128": ([64, 128, 128, 128, 128, 64], "relu", False),
    "flex": ([3, 64, 128, 96, 64, 32, 16, 4], "silu", True),
    "pinn50": ([2, 50, 50, 50, 50, 50, 1], "tanh", True),
    "siren256": ([2, 256, 256, 256, 3], "sin", True),
}
SWEEP = []  # (warps, m_tiles) tile shapes to time besides the plan's choice (--sweep)
TORCH_ACT = {"relu": torch.nn.ReLU, "silu": torch.nn.SiLU, "tanh": torch.nn.Tanh}


class Sin(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x)


def torch_model(widths, act, bias):
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b, bias=bias))
        if i < len(widths) - 2:
            layers.append(TORCH_ACT[act]() if act in TORCH_ACT else Sin())
    return torch.nn.Sequential(*layers)


def time_ms(fn, inputs, reps):
    for i in range(10):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(name, rows, reps):
    widths, act, bias = WORKLOADS[name]
    torch.manual_seed(0)
    model = torch_model(widths, act, bias).cuda().half().eval()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    mlp = fusedmlp.FusedMLP([m.weight.detach().float().cpu().numpy() for m in linears],
                            [m.bias.detach().float().cpu().numpy() if bias else None for m in linears],
                            activation=act, device="cuda")
    kernel = mlp._kernel("float16")
    xs = [torch.randn(rows, widths[0], device="cuda", dtype=torch.float16) for _ in range(4)]
    y = torch.empty(rows, widths[-1], device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream

    def fused(x):
        kernel.launch(x.data_ptr(), y.data_ptr(), rows, stream)

    with torch.no_grad():
        fused(xs[0])
        ref = model.double()(xs[0].double())
        model.half()
        err = ((y.double() - ref).norm() / ref.norm()).item()  # vs float64 on the same fp16-rounded weights
        eager_ms = time_ms(model, xs, reps)
        static_x = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static_x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            model(static_x)

        def graphed(x):
            graph.replay()

        graph_ms = time_ms(graphed, xs, reps)
    fused_ms = time_ms(fused, xs, reps)
    sweep = {}
    for warps, m_tiles in SWEEP:
        try:
            variant = mlp._build("float16", warps=warps, m_tiles=m_tiles)[0]
        except fusedmlp.FusedMLPError as e:  # does not fit
            sweep[f"w{warps}m{m_tiles}"] = str(e).split(";")[0]
            continue

        def run_variant(x, variant=variant):
            variant.launch(x.data_ptr(), y.data_ptr(), rows, stream)

        sweep[f"w{warps}m{m_tiles}"] = time_ms(run_variant, xs, reps)
    io_bytes = rows * (widths[0] + widths[-1]) * 2
    flops = 2 * rows * sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    return {"workload": name, "rows": rows, "fusedmlp_ms": fused_ms, "torch_eager_ms": eager_ms,
            "torch_graph_ms": graph_ms, "rel_l2_vs_torch": err, "io_bytes": io_bytes, "flops": flops,
            "plan": mlp._net.plan(90, 0, 0, "float16", "float16").info, "sweep_ms": sweep}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2**21)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time warps x m_tiles in {4, 8} x {1, 2}")
    ap.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    args = ap.parse_args()
    if args.sweep:
        SWEEP.extend([(4, 1), (4, 2), (8, 1), (8, 2)])
    results = []
    print(f"{torch.cuda.get_device_name()}  rows={args.rows}")
    print(f"{'workload':10s} {'fusedmlp ms':>12s} {'eager ms':>10s} {'graph ms':>10s} {'vs graph':>9s} "
          f"{'TFLOP/s':>8s} {'GB/s':>7s} {'relL2':>8s}")
    for name in args.workloads:
        r = bench(name, args.rows, args.reps)
        results.append(r)
        print(f"{name:10s} {r['fusedmlp_ms']:12.4f} {r['torch_eager_ms']:10.4f} {r['torch_graph_ms']:10.4f} "
              f"{r['torch_graph_ms'] / r['fusedmlp_ms']:8.2f}x {r['flops'] / r['fusedmlp_ms'] / 1e9:8.1f} "
              f"{r['io_bytes'] / r['fusedmlp_ms'] / 1e6:7.0f} {r['rel_l2_vs_torch']:8.2e}  plan {r['plan']['warps']}w"
              f"x{r['plan']['m_tiles']}m/{r['plan']['blocks_per_sm']}cta  sweep "
              + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}=n/a" for k, v in r["sweep_ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
