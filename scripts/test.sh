#!/usr/bin/env bash
# The test suite on the CPU (Pallas kernels in interpret mode). Sets itself up on first use.
#   bash scripts/test.sh           the fast loop: every module, the tests tests/slow_tests.txt lists left out
#   bash scripts/test.sh --full    every test (what CI runs)
# Other arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
if [ "${1:-}" = "--full" ]; then
  shift
  exec python -m pytest tests -n 2 --dist worksteal "$@"  # one worker a core of the 2-core CI machine
fi
exec python -m pytest tests -m "not slow" "$@"
