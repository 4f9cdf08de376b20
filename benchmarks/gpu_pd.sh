#!/usr/bin/env bash
# One device call: PD (prefill + decode worker sharing the GPU, or on two GPUs with PD_DEVICES="0 1"; Mooncake TCP staged through pinned host memory) vs
# one colocated worker, Llama-3.1-8B-shaped dummy model, 2k-token prompts. Usage: bash benchmarks/gpu_pd.sh OUTDIR
# Needs `.gpu-wheels/` carried (the image lacks Mooncake's CPU build, its Debian libraries and our gRPC pins):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .gpu-wheels \
#     mooncake-transfer-engine-non-cuda grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
#     protobuf==7.36.2   (and the services' other dependencies the image lacks: aiohttp, uvloop, orjson, redis,
#     prometheus-client, the opentelemetry packages, with theirs; no flashinfer: both modes run Triton's kernels)
#   (cd .gpu-wheels && apt-get download libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200)
# and the generated stubs (`make protos`, carry radixmesh/v1).
set -uo pipefail
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install --no-deps --quiet .gpu-wheels/*.whl 2>&1 | tail -2
mkdir -p /tmp/debs && for f in .gpu-wheels/*.deb; do dpkg -x "$f" /tmp/debs; done
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
# TRANSFER=shm: the prefill and decode workers move KV through shared memory (no Mooncake needed)
[[ ${TRANSFER:-mooncake} == mooncake ]] && CHECK="import mooncake.engine;" || CHECK=""
python3 -c "import torch, grpc; $CHECK print('torch', torch.__version__, 'grpc', grpc.__version__)" \
  | tee -a "$OUT/device.txt" || exit 1
python3 -m radixmesh.benchmarks.pd --model-path benchmarks/configs/llama-3.1-8b --load-format dummy --dtype bfloat16 \
  --input-len 2048 --output-len 64 --num-prompts ${NUM_PROMPTS:-48 128} --concurrency ${CONCURRENCY:-8 64} \
  --vocab 128000 --max-total-tokens ${MAX_TOTAL_TOKENS:-160000} --log-dir "$OUT" --result-file "$OUT/pd.json" \
  ${PD_DEVICES:+--pd-devices $PD_DEVICES} ${TRANSFER:+--transfer-backend $TRANSFER} ${MODES:+--modes $MODES} 2>&1 | tee "$OUT/pd.log" | grep -v "^\[transformers\]" | tail -12
