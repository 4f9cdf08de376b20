#!/usr/bin/env bash
# One device call: GPU tests on the tiny models, then the Llama-3.1-8B-shaped baseline (dummy weights, bf16).
# Usage on the GPU machine: bash benchmarks/gpu_baseline.sh OUTDIR   (PARTS="tests bench" by default)
set -uo pipefail
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$OUT/device.txt"
PARTS=${PARTS:-tests bench}
if [[ $PARTS == *tests* ]]; then
  $PY scripts/make_tiny_models.py --out models > "$OUT/make_models.log" 2>&1 || { cat "$OUT/make_models.log"; exit 1; }
  $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
[[ $PARTS == *bench* ]] || exit 0
CFG=benchmarks/configs/llama-3.1-8b
COMMON="--model-path $CFG --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning"
$PY -m radixmesh.engine.bench_one_batch $COMMON --batch-size 1 8 64 --input-len 512 --output-len 32 --roofline \
  --result-file "$OUT/one_batch.jsonl" 2>&1 | tee "$OUT/one_batch.log" | tail -6
for bs in 1 8 64; do
  n=$(( bs * 4 ))
  $PY -m radixmesh.engine.bench_offline_throughput $COMMON --num-prompts $n --random-input-len 512 \
    --random-output-len 128 --max-running-requests $bs --result-file "$OUT/offline.jsonl" 2>&1 \
    | tee -a "$OUT/offline.log" | tail -1
done
