#!/usr/bin/env bash
# Cost of sampling (penalties + top-k/top-p) against greedy at batch 64 on the 8B-shaped model (dummy weights).
# Usage on the GPU machine: bash benchmarks/gpu_sampling.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
COMMON="--model-path benchmarks/configs/llama-3.1-8b --load-format dummy --dtype bfloat16 --skip-tokenizer-init
  --log-level warning --num-prompts 256 --random-input-len 512 --random-output-len 128 --max-running-requests 64"
SAMPLED='{"temperature": 0.8, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}'
for round in 1 2; do
  python3 -m radixmesh.engine.bench_offline_throughput $COMMON --result-file "$OUT/sampling.jsonl" 2>&1 | tail -1
  python3 -m radixmesh.engine.bench_offline_throughput $COMMON --sampling-params "$SAMPLED" \
    --result-file "$OUT/sampling.jsonl" 2>&1 | tail -1
done
