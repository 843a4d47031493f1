# Session 22, call 1: the ablation's policies interleaved by wave vs by session, HEAD, two rounds.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for run in wave1 session1 wave2 session2; do
  t0=$(date +%s)
  timeout 280 python3 -m experiments.carry_ablation --config.num_sessions=30 --config.stint=${run%?} \
    --config.out_dir=/tmp/$run > /tmp/$run.log 2>&1
  echo "$run rc=$? $(( $(date +%s) - t0 )) s $(date -u +%H:%M)"
  cp /tmp/$run/results.json $OUT/$run.json 2>/dev/null
  python3 runs/s22_summary.py /tmp/$run/results.json 2>&1 | tail -14
  tail -2 /tmp/$run.log | cut -c1-300
done
