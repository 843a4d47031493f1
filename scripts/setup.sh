#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs the project (CPU JAX + test extras) on first
# use, and again whenever pyproject.toml changes. Sourced by the other scripts;
# MTP_VENV and MTP_EXTRAS pick another environment (scripts/setup_aot.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/${MTP_VENV:-.venv}"
EXTRAS="${MTP_EXTRAS:-test}"

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  echo "error: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

py="$(find_python)"
# The stamp names pyproject.toml's hash, taken by Python so that macOS (no sha1sum) works too.
digest="$("$py" -c 'import hashlib, sys; print(hashlib.sha1(open(sys.argv[1], "rb").read()).hexdigest()[:12])' "$ROOT/pyproject.toml")"
stamp="$VENV/.installed-$EXTRAS-$digest"
if [ ! -f "$stamp" ]; then
  echo "setup: creating $VENV with $py" >&2
  rm -rf "$VENV"
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -e "$ROOT[$EXTRAS]" >&2
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
