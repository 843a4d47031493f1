#!/usr/bin/env bash
# The project's Python environment, made on first use and kept current; sourced by main.sh,
# test.sh and setup_aot.sh, so every switch below works with each of them:
#
#   bash scripts/main.sh                            # CPU: .venv, Python 3.12 + the `test` extra (CPU JAX)
#   MTP_EXTRAS=test,cuda12 bash scripts/main.sh     # NVIDIA GPU: jax[cuda12]==0.11.2 instead of CPU JAX
#   MTP_VENV=/path/to/env bash scripts/main.sh      # an environment you made yourself, used as it is
#
# The CUDA extra needs Linux (x86_64 or aarch64) and an NVIDIA driver >= 525 (CUDA 12; `nvidia-smi`
# shows it); the CUDA libraries themselves come as pip wheels.
#
# setup.sh changes only environments it created: it marks each with $VENV/.mtp-setup and a stamp of
# what it installed (.installed-EXTRAS-HASH of pyproject.toml); it reinstalls into one when
# pyproject.toml changes and recreates one when MTP_EXTRAS changes. An environment it did not
# create is never deleted nor installed into: as .venv it is refused (with what to do), named by
# MTP_VENV it is used as it is. MTP_VENV is read from the repository root unless absolute.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${MTP_EXTRAS:-test}"
venv_name="${MTP_VENV:-${MTP_SETUP_VENV:-.venv}}"  # MTP_SETUP_VENV: another managed one (setup_aot.sh)
case "$venv_name" in /*) VENV="$venv_name" ;; *) VENV="$ROOT/$venv_name" ;; esac

made_here() {  # whether setup.sh created $VENV (older versions of it left only their stamps)
  [ -f "$VENV/.mtp-setup" ] || compgen -G "$VENV/.installed-*" >/dev/null
}

if [ -e "$VENV" ] && ! made_here; then
  if [ -z "${MTP_VENV:-}" ]; then
    cat >&2 <<EOF
setup: $VENV exists but scripts/setup.sh did not create it (it has no .mtp-setup), so it is left
untouched. Either use it as it is, with this project's dependencies installed into it
(e.g. $VENV/bin/pip install -e '$ROOT[$EXTRAS]'):
    MTP_VENV=$venv_name bash scripts/$(basename "$0")
or move it aside (mv $VENV $VENV.mine) and run again: setup then makes its own $venv_name.
EOF
    exit 1
  fi
  if ! "$VENV/bin/python" -c 'import jax, flax, absl, ml_collections' >/dev/null 2>&1; then
    echo "setup: MTP_VENV=$venv_name: $VENV/bin/python cannot import jax, flax, absl and ml_collections;" \
         "install the project into it (e.g. $VENV/bin/pip install -e '$ROOT[$EXTRAS]') or unset MTP_VENV" >&2
    exit 1
  fi
  echo "setup: using $VENV as it is (MTP_VENV; setup.sh did not create it, so it installs nothing there)" >&2
else
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
    if [ -e "$VENV" ] && ! compgen -G "$VENV/.installed-$EXTRAS-*" >/dev/null && compgen -G "$VENV/.installed-*" >/dev/null; then
      echo "setup: $VENV holds other extras than [$EXTRAS]; recreating it (setup.sh created it)" >&2
      rm -rf "$VENV"
    fi
    if [ ! -e "$VENV" ]; then
      echo "setup: creating $VENV with $py" >&2
      "$py" -m venv "$VENV"
      echo "created by scripts/setup.sh; it may recreate or reinstall this environment" > "$VENV/.mtp-setup"
    fi
    echo "setup: installing the project with [$EXTRAS] into $VENV" >&2
    "$VENV/bin/pip" install -q --upgrade pip >&2
    "$VENV/bin/pip" install -q -e "$ROOT[$EXTRAS]" >&2
    rm -f "$VENV"/.installed-*
    touch "$stamp"
  fi
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
