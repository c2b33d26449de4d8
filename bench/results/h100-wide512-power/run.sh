source bench/device_setup.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $OUT/smi.csv 2>&1 &
SMI=$!
t0=$(date +%s.%N)
echo "probe start $(date +%T.%N)" > $OUT/phases.txt
timeout 150 python3 -m fusedmlp.bench probe plans wide512 --rows 2097152 2>&1 | tail -5 | tee $OUT/probe_wide512.txt
echo "probe end / bench start $(date +%T.%N)" >> $OUT/phases.txt
timeout 250 python3 -m fusedmlp.bench --workloads wide512 --rows 2097152 --no-host --no-compile --quick --out $OUT/bench 2>&1 | tail -6 | tee $OUT/bench_wide512.txt
echo "bench end $(date +%T.%N)" >> $OUT/phases.txt
kill $SMI
