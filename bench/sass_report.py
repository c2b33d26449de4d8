"""Per-workload resource report of the generated kernels, no GPU needed: ptxas registers/stack/spills and SASS
instruction counts (HMMA = Tensor Core mma, LDSM = ldmatrix, LDL/STL = local memory, MUFU = special functions).

    pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm   # or a CUDA toolkit on PATH
    python bench/sass_report.py [--arch 90]

Plans for the H100's shared-memory limits (232448 B per block, 233472 per SM, 132 SMs) by default.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from fusedmlp.bench import WORKLOADS, fused_options  # noqa: E402

import fusedmlp  # noqa: E402
from fusedmlp import _api, _core  # noqa: E402


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    cuobjdump = find_tool("cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(find_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
    _api._nvrtc_info()
    rng = np.random.default_rng(0)
    for name, wl in WORKLOADS.items():
        widths, bias = wl.widths, wl.bias
        ws = [rng.uniform(-1, 1, (o, i)).astype(np.float32) / np.sqrt(i) for i, o in zip(widths[:-1], widths[1:])]
        bs = [rng.uniform(-1, 1, o).astype(np.float32) if bias else None for o in widths[1:]]
        mlp = fusedmlp.FusedMLP(ws, bs, device="cpu", **fused_options(wl))
        plan = mlp._net.plan(args.arch, 232448, 132, "float16", "float16", smem_per_sm=233472)
        source = plan.render(_api._template(_api.PRELUDE), _api._template(_api.TEMPLATE_SM90 if plan.info["wgmma"] else _api.TEMPLATE), _api.KERNEL_NAME)
        wgmma = bool(plan.info["wgmma"])  # the warpgroup kernel targets sm_90a
        cubin, log = _core.nvrtc_compile(source, _api.TEMPLATE, args.arch, wgmma,
                                         ("--ptxas-options=-v",) + _api.nvrtc_no_cache())
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
        count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
        usage = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        info = plan.info
        kind = "wgmma" if wgmma else "mma.sync"
        print(f"{name:9s} sm_{args.arch} {kind} {info['warps']}w x {info['m_tiles'] * 16} rows, "
              f"resident={info['resident']}: {usage.group(1) if usage else '?'} registers, stack {spill.group(1)} B, "
              f"spills {spill.group(2)}/{spill.group(3)} B | SASS {len(ops)}: HMMA {count('HMMA')}, "
              f"HGMMA {count('HGMMA')}, LDSM {count('LDSM')}, LDL {count('LDL')}, STL {count('STL')}, "
              f"MUFU {count('MUFU')}")


if __name__ == "__main__":
    main()
