"""The peer benchmark: fusedmlp against PyTorch eager, CUDA graphs and torch.compile on one GPU (issue 4).

A thin entry point for ``python -m fusedmlp.bench``; every option is its own (``--help``). On the device machine:

    python bench/run.py --save            # all workloads and batch sizes, ~6-8 min; bench/results/<gpu>/bench.*
    python bench/run.py --quick --out DIR  # fewer reps
    python bench/run.py probe list         # the probes (fusedmlp/probe.py): `probe --help` lists them
"""

import sys

from fusedmlp.bench import main

if __name__ == "__main__":
    sys.exit(main())
