# Session 22, call 2: chunk dispatch by how the chunk row reaches the device; then the same under XLA's command-buffer VLOG.
export PYTHONUNBUFFERED=1 JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:runs/pylib
export JAX_COMPILATION_CACHE_DIR=/tmp/jcc JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
t0=$(date +%s)
timeout 300 python3 runs/s22_cmdbuf_probe.py $OUT/cmdbuf.json 30 2>/tmp/p1.err | grep -v MARK; echo "probe rc=$? $(( $(date +%s) - t0 )) s"
tail -3 /tmp/p1.err | cut -c1-300
t0=$(date +%s)
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 200 python3 runs/s22_cmdbuf_probe.py /tmp/v.json 3 > /tmp/v.out 2> /tmp/v.err
echo "vlog rc=$? $(( $(date +%s) - t0 )) s"
python3 runs/s22_parse_vlog.py /tmp/v.err | cut -c1-400
grep -m3 "Update command buffer" /tmp/v.err | cut -c1-300
gzip -c /tmp/v.err > $OUT/vlog.err.gz; ls -la $OUT
t0=$(date +%s)
timeout 240 python3 runs/s22_host_probe.py 8 2>&1 | grep -v "^W\|^I0" | tail -16
echo "host probe rc=$? $(( $(date +%s) - t0 )) s"
