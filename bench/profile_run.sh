#!/usr/bin/env bash
# One device call for a profile: build, and ncu (full set) of the default fp16 kernel of each named workload at 2^21
# rows. Results under $OUT: ncu_details.txt (every section, every workload), ncu_raw.csv (every metric, one row per
# workload).
# Usage on the device machine (repository root): bash bench/profile_run.sh tcnn64 pinn50 ...
source "$(dirname "$0")/device_setup.sh"
for w in "$@"; do
    rep="/tmp/ncu_$w"
    python3 bench/ncu_target.py "$w" 2097152 >/dev/null  # compile outside the profiler
    ncu --set full --import-source no --kernel-name fusedmlp_forward --launch-skip 2 --launch-count 1 \
        -f -o "$rep" python3 bench/ncu_target.py "$w" 2097152 >"$rep.log" 2>&1 || tail -5 "$rep.log"
    { echo "=== $w"; ncu --import "$rep.ncu-rep" --page details --print-details all; } >>"$OUT/ncu_details.txt" 2>&1
    ncu --import "$rep.ncu-rep" --page raw --csv 2>&1 | sed "s/^/$w,/" >>"$OUT/ncu_raw.csv"
    ncu --import "$rep.ncu-rep" --page details |
        grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy" -m 6 | sed "s/^/$w /"
done
