# Session 22, call 5: XLA's command-buffer update mode SKIP_TEMP (temp allocation VA-remapped, no re-record when it moves):
# the served flow under VLOG, then the carry ablation with and without it.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
start=$(date +%s)
FLAG="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
vlog() {  # $1: label, $2: XLA_FLAGS
  t0=$(date +%s)
  XLA_FLAGS="$2" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 200 python3 runs/s22_host_probe.py 3 marks > /tmp/$1.out 2> /tmp/$1.err
  echo "$1 rc=$? $(( $(date +%s) - t0 )) s"; head -2 /tmp/$1.out
  python3 runs/s22_parse_flow.py /tmp/$1.err | grep "chunk\|decode\|begin"
  grep -m2 -i "error\|skip_temp\|remap" /tmp/$1.err | cut -c1-300
}
vlog skip_temp "$FLAG"
upd=$(python3 runs/s22_parse_flow.py /tmp/skip_temp.err | grep "blind:_prefill_chunk" | sed 's/.*updates *\([0-9.]*\).*/\1/')
echo "updates per chunk with SKIP_TEMP: $upd"
if awk "BEGIN{exit !($upd > 3)}"; then FLAG="$FLAG --xla_gpu_temp_buffer_use_separate_color=true"; vlog skip_temp_color "$FLAG"; fi
for run in flag plain; do
  t0=$(date +%s)
  if [ $(( t0 - start )) -gt 380 ]; then echo "skip $run"; continue; fi
  F=""; [ $run = flag ] && F="$FLAG"
  XLA_FLAGS="$F" timeout 200 python3 -m experiments.carry_ablation --config.num_sessions=20 --config.out_dir=/tmp/$run > /tmp/$run.log 2>&1
  echo "$run [$F] rc=$? $(( $(date +%s) - t0 )) s $(date -u +%H:%M)"
  cp /tmp/$run/results.json $OUT/$run.json 2>/dev/null
  python3 runs/s22_summary.py /tmp/$run/results.json 2>&1 | tail -14 | grep -v "multi"
  tail -1 /tmp/$run.log | cut -c1-300
done
