#!/usr/bin/env bash
# The test suite on CPU (Pallas kernels run in interpret mode). Sets itself up on first use.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
exec python -m pytest tests "$@"
