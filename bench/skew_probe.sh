#!/usr/bin/env bash
# One device call: siren256's cluster kernel timed (bench/act_cost.py, sin and relu) as it is and with its odd
# warpgroups started 0.5-4 us late (a __nanosleep patched into a copy of the template, restored at the end), to test
# whether warpgroups running their layers in step are what keeps the tensor pipe idle. NOTES, v17-v18.
source bench/device_setup.sh
T=kernel_templates/fused_mlp_sm90.cu
cp $T /tmp/orig.cu
python3 bench/act_cost.py siren256 sin relu 2>&1 | tail -2
for ns in 500 1000 2000 4000; do
  cp /tmp/orig.cu $T
  python3 - "$T" "$ns" <<'PY'
import sys
p, ns = sys.argv[1], sys.argv[2]
s = open(p).read()
old = "        fm_cluster_sync();  // also: every CTA's barriers are initialised before any other CTA signals them\n    else\n        __syncthreads();\n"
assert old in s
s = s.replace(old, old + "    if (FM_CLUSTER > 0 && (wg & 1)) __nanosleep(%s);\n" % ns)
open(p, "w").write(s)
PY
  echo "skew $ns ns"; python3 bench/act_cost.py siren256 sin relu 2>&1 | tail -2
done
cp /tmp/orig.cu $T
