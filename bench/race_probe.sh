#!/usr/bin/env bash
# One device call: racecheck of a script's kernels (default bench/ncu_target.py: one workload's kernel with plan
# options), its report, and the SASS lines at the offsets the report names (compiled by the device's NVRTC, from the
# kernel cache; the first marked "=>"). Usage on the device machine:
#   bash bench/race_probe.sh siren256 300 cluster=2 warps=4
#   SCRIPT=bench/race_cases.py bash bench/race_probe.sh
source "$(dirname "$0")/device_setup.sh"
export FUSEDMLP_CACHE_DIR=/tmp/race-cache
rm -rf /tmp/race-cache
timeout 300 compute-sanitizer --tool racecheck --racecheck-report all python3 "${SCRIPT:-bench/ncu_target.py}" "$@" >"$OUT/race.txt" \
    2>&1
for c in $(find /tmp/race-cache -name "*.cubin"); do
    echo "=== $c $(grep -o '// Plan: [^;]*;[^;]*;[^;]*; [0-9]* warps' "${c%.cubin}.cu" | head -1)" >>"$OUT/race_sass.txt"
    python3 - "$c" "$OUT/race.txt" >>"$OUT/race_sass.txt" <<'PY'
import re, struct, subprocess, sys, tempfile
data = open(sys.argv[1], "rb").read()
_, _, header = struct.unpack_from("<8sII", data)
f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
f.write(data[16 + header:])
f.close()
sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
offsets = {int(o, 16) for o in re.findall(r"fusedmlp_forward\+0x([0-9a-f]+)", open(sys.argv[2]).read())}
for line in sass.splitlines():
    m = re.search(r"/\*([0-9a-f]{4})\*/\s+(.*?;)", line)
    if m and (int(m.group(1), 16) in offsets or re.search(r"STS|SYNCS|UBLKCP|STSM|BAR", m.group(2))):
        print(("=> " if int(m.group(1), 16) in offsets else "   ") + m.group(1), m.group(2)[:100])
PY
done
grep -v "^=========     in \|^=========         " "$OUT/race.txt" | head -40
grep "===\|=>" "$OUT/race_sass.txt"
