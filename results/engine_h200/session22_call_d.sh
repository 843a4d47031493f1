# Session 22, call 4: the served flow (blind, carry) under XLA's command-buffer VLOG, per call type; and a cProfile of it.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
t0=$(date +%s)
timeout 240 python3 runs/s22_prof.py 6 2>&1 | grep -v "^W\|^I1\|^I0" | head -45
echo "prof rc=$? $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 200 python3 runs/s22_host_probe.py 3 marks > /tmp/f.out 2> /tmp/f.err
echo "flow vlog rc=$? $(( $(date +%s) - t0 )) s"; head -3 /tmp/f.out
python3 runs/s22_parse_flow.py /tmp/f.err
grep -m4 "command buffer" /tmp/f.err | cut -c1-250
gzip -c /tmp/f.err > $OUT/flow_vlog.err.gz
