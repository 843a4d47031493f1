#!/usr/bin/env bash
# The main job: the drafter-context ablation on the embedded default model and its
# evaluation sessions. Sets itself up on first use. Extra flags pass through.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
exec python -m experiments.carry_ablation "$@"
