"""Per-workload resource report of the generated kernels, no GPU needed: ptxas registers/stack/spills and SASS
instruction counts (HMMA = Tensor Core mma, LDSM = ldmatrix, LDL/STL = local memory, MUFU = special functions).

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm   # or a CUDA toolkit on PATH
    python bench/sass_report.py [--gpu h100]

Plans for a named GPU's limits (fusedmlp.probe.GPUS: the H100's by default), as `python -m fusedmlp.bench probe list`
does, float16 x and y; a network cut into segments reports each kernel of its chain (probe.kernel_plans); weights are
probe.weights's.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from fusedmlp import _api, _core, probe
from fusedmlp.bench import WORKLOADS


def find_tool(name):
    found = shutil.which(name)
    if found:
        return found
    for root in sys.path:
        hits = glob.glob(os.path.join(root, "nvidia", "cu1*", "bin", name))
        if hits:
            return hits[0]
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", choices=sorted(probe.GPUS), default="h100", help="the GPU to plan for (default h100)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="NAME",
                    help="the benchmark workloads to report (default all)")
    ap.add_argument("--ops", action="store_true", help="also each kernel's 12 most frequent SASS opcodes")
    args = ap.parse_args()
    gpu = probe.GPUS[args.gpu]
    arch = gpu["arch"]
    cuobjdump = find_tool("cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(find_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
    _api._nvrtc_info()
    for name in args.workloads:
        mlp = probe.model(WORKLOADS[name], device="cpu")
        for plan in probe.kernel_plans(mlp, gpu, "float16"):  # (a chain's: every kernel, its passes too)
            report(name, plan, arch, cuobjdump, env, args.ops)


def report(name, plan, arch, cuobjdump, env, ops_too):
    """One kernel's line (and with ops_too its most frequent opcodes)."""
    info = plan.info
    source = _api._source_of(plan)
    wgmma = bool(info["wgmma"])  # the warpgroup kernels target sm_90a
    cubin, log = _core.nvrtc_compile(source, _api.KERNEL_NAME, arch, wgmma,
                                     ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
    usage = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    what = ("norm pass" if info.get("norm_pass") else "pad pass" if info.get("pad_pass") else
            f"GEMM layer {info['gemm_layer']} {probe.gemm_shape(info)}" if info.get("gemm") else probe.shape(info))
    print(f"{name:9s} sm_{arch} {what}: {usage.group(1) if usage else '?'} registers, stack {spill.group(1)} B, "
          f"spills {spill.group(2)}/{spill.group(3)} B | SASS {len(ops)}: HMMA {count('HMMA')}, "
          f"HGMMA {count('HGMMA')}, LDSM {count('LDSM')}, LDL {count('LDL')}, STL {count('STL')}, "
          f"MUFU {count('MUFU')}", flush=True)
    if ops_too:
        tally = {}
        for o in ops:
            tally[o.split(".")[0]] = tally.get(o.split(".")[0], 0) + 1
        print("    " + ", ".join(f"{o} {n}" for o, n in sorted(tally.items(), key=lambda t: -t[1])[:12]))


if __name__ == "__main__":
    main()
