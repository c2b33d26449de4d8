#!/usr/bin/env bash
# One device call: build, run the GPU tests and a quick benchmark (no torch.compile); logs under $OUT.
# Usage on the device machine (repository root): bash bench/device_run.sh [pytest -k expression] [bench options...]
source "$(dirname "$0")/device_setup.sh"
python3 -m pytest -q -rs ${1:+-k "$1"} tests/test_gpu.py tests/test_torch_gpu.py tests/test_gpu_reliability.py \
    tests/test_segments_gpu.py tests/test_norm.py tests/test_softmax.py tests/test_torch_norm.py tests/test_multi_gpu.py tests/test_c_core.py \
    tests/test_lowbit_gpu.py \
    -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
shift || true
python3 bench/run.py --quick --no-compile --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log"
