# Session 22, call 3: the GDN chunk's triangular solve replaced by block-doubling matmuls (one CUDA graph per chunk):
# new tree vs the tree before (runs/old_tree = HEAD 84ad..), carry ablation 30 sessions, alternating processes.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
start=$(date +%s)
for run in new1 old1 new2 old2; do
  t0=$(date +%s)
  if [ $(( t0 - start )) -gt 480 ]; then echo "skip $run"; continue; fi
  if [ ${run%?} = new ]; then timeout 230 python3 -m experiments.carry_ablation --config.num_sessions=30 --config.out_dir=/tmp/$run > /tmp/$run.log 2>&1
  else timeout 230 python3 runs/run_tree.py runs/old_tree experiments.carry_ablation --config.num_sessions=30 --config.out_dir=/tmp/$run > /tmp/$run.log 2>&1; fi
  echo "$run rc=$? $(( $(date +%s) - t0 )) s $(date -u +%H:%M)"
  cp /tmp/$run/results.json $OUT/$run.json 2>/dev/null
  python3 runs/s22_summary.py /tmp/$run/results.json 2>&1 | tail -14 | grep -v "multi\|wait_ms"
  tail -1 /tmp/$run.log | cut -c1-300
done
