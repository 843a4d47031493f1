#!/usr/bin/env bash
# .venv-aot: the project with JAX's CUDA 13 plugin (about 5 GB), so that XLA's GPU compiler
# runs on a machine with no GPU: `PYTHONPATH=. .venv-aot/bin/python experiments/count_kernels.py`.
# Made and managed by setup.sh as .venv is (MTP_VENV still names an environment of your own).
MTP_SETUP_VENV=.venv-aot MTP_EXTRAS=aot source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
