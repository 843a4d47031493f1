#!/usr/bin/env bash
# The test suite on the CPU (Pallas kernels in interpret mode). Sets itself up on first use.
#   bash scripts/test.sh           the fast loop: every module, the tests tests/slow_tests.txt lists left out
#   bash scripts/test.sh --full    every test (what CI runs)
# Other arguments go to pytest.
#
# The tests' models are tiny, so their time is XLA's CPU compiles. Two settings, for this process
# and every subprocess a test starts, make those cheaper: LLVM's optimisation level 0 (XLA's HLO
# passes and fusion decisions are unchanged; a vectorised sum may add in another order, within f32
# rounding, so tests compare differently-shaped programs with tolerances, as they must anyway), and a
# persistent compilation cache for this run, which serves a program compiled again after a
# `jax.clear_caches()`, in a test's subprocess or on the other worker. A user's own XLA_FLAGS and
# JAX_COMPILATION_CACHE_DIR are kept.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/mtp-test-jax-cache.XXXXXX")"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR
fi
# Only programs that took a second or more to compile are cached: eager ops' tiny programs cost
# little to compile again, and writing every one of them costs the run disk time.
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# Two workers: one a core of the 2-core machine the README times both loops on (and CI's).
if [ "${1:-}" = "--full" ]; then
  shift
  python -m pytest tests -n 2 --dist worksteal "$@"
else
  python -m pytest tests -m "not slow" -n 2 --dist worksteal "$@"
fi
