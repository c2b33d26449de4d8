source bench/device_setup.sh
(timeout 300 python3 -m pytest -q -rs tests/test_gpu.py -k "far_arguments or cluster" -s 2>&1 | tail -4) | tee $OUT/gpu_tests.log
export FUSEDMLP_CACHE_DIR=/tmp/race-cache
for spec in "siren256 300 cluster=2 warps=8" "tcnn128 300 cluster=1 warps=8" "tcnn128 300 cluster=2 warps=8"; do
  echo "=== $spec" >> $OUT/race.txt
  rm -rf /tmp/race-cache
  timeout 120 compute-sanitizer --tool racecheck --racecheck-report all python3 bench/ncu_target.py $spec 2>&1 | grep -v "^=========     in\|^=========         " | head -30 >> $OUT/race.txt
  for c in $(find /tmp/race-cache -name "*.cubin"); do python3 - "$c" >> $OUT/race.txt <<'PY'
import sys, struct, subprocess, tempfile, re
data = open(sys.argv[1], 'rb').read()
magic, ver, hl = struct.unpack_from("<8sII", data)
f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False); f.write(data[16 + hl:]); f.close()
sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
offs = set(re.findall(r"\+0x([0-9a-f]+)", open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null").read())) if len(sys.argv) > 2 else set()
for l in sass.splitlines():
    m = re.search(r"/\*([0-9a-f]{4})\*/\s+(.*?;)", l)
    if m and ("STS" in m.group(2) or "SYNCS" in m.group(2) or "UBLKCP" in m.group(2) or "STSM" in m.group(2) or "MEMBAR" in m.group(2) or "UCGABAR" in m.group(2)):
        print(m.group(1), m.group(2)[:90])
PY
  done
done
tail -c 6000 $OUT/race.txt
