# Sourced by the one-call device scripts (device_run.sh, profile_run.sh, race_probe.sh): strict mode, $OUT, the
# kernel cache, the GPU's name and clocks into $OUT/gpu.txt, and the editable build (its log's tail, and exit, if it
# fails).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDMLP_CACHE_DIR=/tmp/fusedmlp-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
