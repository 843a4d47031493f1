# Session 22, call 6: the engine's calls compiled with SKIP_TEMP (per jit, the new default) vs MTP_GRAPH_UPDATE=always, 30 sessions.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
start=$(date +%s)
for run in skip1 always1 skip2 always2; do
  t0=$(date +%s)
  if [ $(( t0 - start )) -gt 210 ]; then echo "skip $run"; continue; fi
  mode=skip_temp; [ ${run%?} = always ] && mode=always
  MTP_GRAPH_UPDATE=$mode timeout 170 python3 -m experiments.carry_ablation --config.num_sessions=30 --config.out_dir=/tmp/$run > /tmp/$run.log 2>&1
  echo "$run rc=$? $(( $(date +%s) - t0 )) s $(date -u +%H:%M)"
  cp /tmp/$run/results.json $OUT/$run.json 2>/dev/null
  python3 runs/s22_summary.py /tmp/$run/results.json 2>&1 | tail -14 | grep -v "multi"
  tail -1 /tmp/$run.log | cut -c1-200
done
