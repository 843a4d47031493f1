#!/usr/bin/env bash
# The main job: the drafter-context ablation on the embedded default model and its evaluation
# sessions. Sets itself up on first use (scripts/setup.sh: MTP_EXTRAS=test,cuda12 for an NVIDIA
# GPU, MTP_VENV=DIR for an environment of your own). Extra flags pass through to
# experiments/carry_ablation.py; `bash scripts/main.sh --help` lists its config's fields.
#
# The default serves 3 sessions (configs/carry_ablation.py). On a 2-core x86 CPU on 2026-12-02 it
# took 28 min of wall time with the machine shared (load average ~12; 507 s of CPU time, so about
# 5-8 min on an idle one); the run prints its own wall time at the end. Three sessions are too few
# for the paired bootstrap's intervals, and the output says so beside each of them: for intervals
# to read, --config.num_sessions=30 (10-20 min on 2 cores, results/carry_ablation_30/).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
python -m experiments.carry_ablation "$@"
echo "main.sh: ${SECONDS} s of wall time, setup included" >&2
