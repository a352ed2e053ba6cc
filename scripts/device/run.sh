#!/bin/bash
# The benchmarks that need more than this machine, run on the GPU machine some
# sessions are lent, from the repo root, after scripts/device/bundle.sh:
#   device run: bash scripts/device/run.sh   (carry [".devb"]; about 4 minutes)
# Each figure goes to $OUT/<step>.txt. Everything it needs travels in .devb
# (wheels, Mooncake's package, Debian libraries); nothing is fetched there.
# PY / WHEELS / MOONCAKE_TAR / QUICK=1 run it here to check the script itself;
# ONLY="gpu transfer_stream" runs only the steps it names (default: every step).
set -u
OUT=${OUT:-/tmp/devout}
mkdir -p "$OUT"
PY=${PY:-python3}
WHEELS=${WHEELS:-.devb/whl}
MOONCAKE_TAR=${MOONCAKE_TAR:-.devb/mooncake-cp312.tar.xz}
QUICK=${QUICK:-}
ONLY=${ONLY:-}
BUDGET=${BUDGET:-500}   # seconds for the whole script
export PYTHONUNBUFFERED=1
T0=$(date +%s)
ENV="$OUT/env.txt"
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$ENV"; }

# step NAME TIMEOUT CMD...: runs within what is left of the budget, output to $OUT/NAME.txt
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && ! [[ " $ONLY " == *" $name "* ]]; then return; fi
  local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
  if [ "$left" -lt 30 ]; then log "skip $name (only ${left}s left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "start $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  log "end $name rc=$?"
}

log "nproc=$(nproc) $(uname -r)"
rm -rf /tmp/site /tmp/debs /tmp/libs /tmp/bin
mkdir -p /tmp/site /tmp/debs /tmp/libs /tmp/bin
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl >> "$ENV" 2>&1 || log "pip install failed"
tar -xf "$MOONCAKE_TAR" -C /tmp/site || log "mooncake unpack failed"
export PYTHONPATH=/tmp/site
for f in .devb/deb/*.deb; do dpkg -x "$f" /tmp/debs; done
# Only the libraries the image lacks come from the Debian packages.
export LD_LIBRARY_PATH=/tmp/libs:${LD_LIBRARY_PATH:-}
M=/tmp/site/mooncake
REDIS=/tmp/debs/usr/bin/redis-server
command -v redis-server > /dev/null && REDIS=$(command -v redis-server)
for round in 1 2 3 4 5 6 7 8; do
  missing=$(for f in $M/store.so $M/engine.so $M/mooncake_master $M/mooncake_client "$REDIS"; do
    ldd "$f" 2>/dev/null; done | awk '/not found/{print $1}' | sort -u)
  [ -z "$missing" ] && break
  for lib in $missing; do
    src=$(find /tmp/debs -name "$lib" | head -1)
    if [ -n "$src" ]; then ln -sf "$src" /tmp/libs/"$lib"; else log "no package has $lib"; fi
  done
done
log "libraries taken from the packages: $(ls /tmp/libs | tr '\n' ' ')"
ln -sf $M/mooncake_master /tmp/bin/mooncake_master
ln -sf $M/mooncake_client /tmp/bin/mooncake_client
[ "$REDIS" = /tmp/debs/usr/bin/redis-server ] && ln -sf "$(readlink -f $REDIS)" /tmp/bin/redis-server
export PATH=/tmp/bin:$PATH
{
  ldd $M/store.so | grep -c "not found" | sed 's/^/store.so libraries not found: /'
  which mooncake_master redis-server
  redis-server --version
  $PY -c "import sys, torch, lmkv, lmkv_mooncake, mooncake.store as s; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', lmkv.__file__)"
  $PY -m lmkv plugins 2>&1 | head -30
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"
  free -g | head -2
} >> "$ENV" 2>&1

Q=${QUICK:+--quick}
# The Mooncake tier against Mooncake's own client where cores are not the limit.
step mooncake_embedded 130 $PY benchmarks/bench_mooncake.py $Q
step mooncake_real_client 130 $PY benchmarks/bench_mooncake.py --real-client $Q
# The GPU path's figures (docs/benchmarks.md, "GPU"; never run on a GPU yet).
if [ -z "$QUICK" ]; then
  step gpu 170 $PY benchmarks/bench_gpu.py
else
  step gpu 120 env TRITON_INTERPRET=1 $PY benchmarks/bench_gpu.py --dry-run
fi
# One 32 MiB chunk a batch: the latency of a 2048-token load (docs/tiers/mooncake.md,
# "Performance").
step mooncake_one_chunk 70 $PY benchmarks/bench_mooncake.py --chunks 1 --rounds 5
step mooncake_embedded_2 130 $PY benchmarks/bench_mooncake.py $Q
step transfer_stream 50 $PY -m pytest -q -p no:cacheprovider tests/memory/test_transfer_stream.py
# The GPU connectors and kernels through the engine, on CUDA caches: the paged
# and hf connectors' round trips, the layerwise pipeline.
step gpu_engine 120 $PY -m pytest -q -p no:cacheprovider tests/memory/test_transfer_stream.py \
  tests/kernels tests/backends/test_connectors.py
log "done"
