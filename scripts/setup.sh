#!/usr/bin/env bash
# Set up a development environment in .venv: torch (CPU build) first, then lmkv
# with its transformers and dev extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch==2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# Triton for lmkv_kernels' kernels (optional at run time; its tests run them on
# the CPU under TRITON_INTERPRET=1). It depends on no torch: torch stays as is.
.venv/bin/python -m pip install -q "triton==3.9.0"
.venv/bin/python -m pip install -q -e ".[transformers,s3,dev,plot]" -c scripts/constraints-dev.txt
.venv/bin/python -m pip install -q -e plugins/lmkv-redis
# The Mooncake tier with its CPU client build (mooncake-transfer-engine-non-cuda:
# the client library and mooncake_master; needs libibverbs1 librdmacm1 libnuma1).
.venv/bin/python -m pip install -q -e "plugins/lmkv-mooncake[cpu]" -c scripts/constraints-dev.txt
