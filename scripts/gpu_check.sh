#!/usr/bin/env bash
# The GPU checks, in three parts: `tests` (the kernels compile and pass their own and the model's
# tests; greedy speculative decoding equals plain greedy on real-shape MoE models, `check_lossless`), `ab` (each kernel that `auto` leaves on its reference, `mtp.ops.dispatch.OPT_IN`, off and on,
# interleaved twice by `experiments/ab_decode.py`: in the decode step, 1.38B model, part A, and in the
# real decode loops, the default model, part B: plain and speculative K = 2, batch 1) and `tp` (tensor
# parallelism, when the machine has two GPUs). (The loops' CUDA-graph options, measured on 2026-11-29
# (docs/gpu.md): `MTP_DECODE_LOOP_GRAPH=0` turns them off.) Each part writes under $OUT/<part>/; a summary table
# ends the output. On one H200 the tests took 7 minutes (2026-11-30) and the A/B about 5; where a
# call is time-limited, run them as two (from the repository root, with the project importable):
#
#     PYTHONPATH=. PARTS=tests bash scripts/gpu_check.sh
#     PYTHONPATH=. PARTS=ab,tp bash scripts/gpu_check.sh
#     SMALL=1 OUT=/tmp/gpu_check bash scripts/gpu_check.sh   # tiny shapes: checks the script on a CPU
set -uo pipefail
OUT=${OUT:?set OUT to an output directory}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
PARTS=,${PARTS:-tests,ab,tp},
for part in ${PARTS//,/ }; do
  [[ $part == @(tests|ab|tp) ]] || { echo "PARTS: unknown part '$part' (tests, ab, tp)" >&2; exit 2; }
done
want() { [[ $PARTS == *,$1,* ]]; }
small=(); reps=7; kernel=pallas; batches=1,8
tests=(tests/test_kernels_in_model.py tests/test_ops_gdn_step.py tests/test_ops_conv_step.py tests/test_ops_attn_prologue.py
       tests/test_ops_fc_gemm.py tests/test_ops_add_rms_norm.py
       tests/test_ops_paged_attention.py::test_triton_form_matches_reference
       tests/test_ops_paged_attention.py::test_merge_kernel_matches_its_reference)
if [[ -n "${SMALL:-}" ]]; then small=(--small --steps_per_call=128); reps=2; kernel=interpret; batches=1; tests=(tests/test_ops_conv_step.py); fi
ngpu=$($PY -c "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))")
mkdir -p "$OUT"
summary=()

run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going on failure
  local name=$1; shift
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then summary+=("$name: ok"); else summary+=("$name: FAILED (see $name.log)"); fi
}

decode_row() {  # the decode rows of a bench_decode results.json, one line
  $PY - "$1" <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1] + "/results.json"))["rows"] if r.get("what") == "decode"]
print("; ".join(f"B={r['batch']} {r['ms']:.3f} ms ({r['ratio_to_floor']:.2f}x floor)" for r in rows))
EOF
}

want tests && run tests $PY -m pytest -p no:cacheprovider "${tests[@]}"
# Greedy speculative == plain greedy on real-shape MoE models (4 layers), bf16 and FP8, on the default
# path (the MoE weight-streaming kernels); the tiny models on a CPU check.
lossless=(); [[ -n "${SMALL:-}" ]] && lossless=(--models=tiny_qwen35_moe,tiny_moe:fp8 --layers=2 --new_tokens=6)
want tests && run lossless $PY -m experiments.check_lossless "${lossless[@]}"
want ab && for op in $($PY -c "from mtp.ops.dispatch import OPT_IN; print(*OPT_IN)"); do
  run "ab_$op" $PY experiments/ab_decode.py --rounds 2 --out_dir "$OUT/ab_$op" \
      --old_env "MTP_KERNELS=$op=reference" --new_env "MTP_KERNELS=$op=$kernel" \
      --bench="${small[*]} --parts A --batches $batches --decode_only --reps $reps" \
      --bench="${small[*]} --parts B --batches 1 --spec_ks 2 --reps $reps"
  summary+=("$(cat "$OUT/ab_$op/ab.md" 2>/dev/null)")
done
if want tp && (( ngpu >= 2 )); then
  for tp in 1 2; do
    run "tp$tp" env MTP_KERNELS=reference $PY experiments/bench_decode.py --parts A --batches 1,8 \
        --decode_only --reps $reps --tp $tp --out_dir "$OUT/tp$tp"
    summary+=("  $(decode_row "$OUT/tp$tp" 2>/dev/null)")
  done
  # The kernels under the mesh, in bf16 (the kernels' dtype). bf16 tensor parallelism may flip a
  # near-tied token against one GPU (results/sharding/sharding.md), so read the counts, not the exit status.
  run tp2_kernels $PY -m experiments.sharded_generate --tp 2 --kernels auto --out "$OUT/tp2_kernels.json"
  summary+=("  $($PY -c "import json; d=json.load(open('$OUT/tp2_kernels.json')); print({k: v['sequences_identical'] for k, v in d['runs'].items()}, 'of', d['num_prompts'], 'sequences identical to one GPU')" 2>/dev/null)")
fi
printf '\nsummary (%s GPUs)\n' "$ngpu"; printf '%s\n' "${summary[@]}"
