#!/usr/bin/env bash
# Issue 10's GPU numbers, in parts that each fit one device call (10 min):
#   PARTS="setup tests"     wheels, tiny models, the bench tokenizer, then every GPU-marked test (over 10 minutes on an
#                           H200 now: split it, TESTS=tests/kernels, then TESTS="tests/gpu tests/parity/...")
#   PARTS="setup onebatch"  per attention backend: decode steps at batch 1/8/64/256 (graphs on and off), batch-1
#                           decode at 32k context, one 8k-token prefill, against the same run's copy bandwidth and
#                           bf16 matmul rate
#   PARTS="setup offline"   offline throughput (512 in / 128 out, 1024 prompts, 256 running) for each lever, then
#                           1024 in / 1024 out
#   PARTS="pdl"             the step's projections alone, chained in a CUDA graph: cuBLAS against kernels.gemv with
#                           and without programmatic dependent launch (benchmarks.pdl_chain), and its GPU tests
#   PARTS="pdlstep"         the decode step with and without programmatic dependent launch (benchmarks.pdl_step),
#                           then the kernel tests
#   PARTS="setup fusion"    the decode step with rotary + KV store in one kernel or two (benchmarks.fusion_step),
#                           per backend
#   PARTS="setup ablate"    the decode step with attention, the norms or SiLU-and-mul replaced by free stand-ins
#                           (benchmarks.ablate_step): what each part of the step beyond its products costs
#   PARTS="setup prefetch"  decode attention's first keys and values pulled into L2 before its PDL wait, or not
#                           (benchmarks.prefetch_step), after the attention kernel and backend tests on CUDA
#   PARTS="setup splits"    the decode step with decode attention's split-KV count as chosen or fixed at 1, 2, 4,
#                           8, 16, 32 (benchmarks.splits_step; BATCH, ROUNDS, GEMM as for prefetch)
#   PARTS="setup profile"   per decode step: GPU time, kernel count and time by kernel (benchmarks.profile_decode)
#   PARTS="setup multiturn" multi-turn TTFT: hierarchy off, L2, L2 + L3 (issue 11)
#   PARTS="setup kvcopy"    host <-> device KV page copies: staged against kernels.kv_pages (issue 11)
#   PARTS="setup extend"    an extend forward over cached histories against none, per backend (issue 11)
#   PARTS="setup tiles"     kernels.extend_attention's tiles swept on this GPU (TILES_APPLY=1: later parts use the best)
#   PARTS="setup transport" L3 page bytes over gRPC against the Mooncake transfer engine (issue 11)
#   PARTS="setup routing"   multi-turn over two workers: cache_aware against kv_index, one router and two (issue 11)
#   PARTS="setup scale"     the engine and the mesh side by side at 1, 64, 256, 512 streams (issue 50), one command
#   PARTS="setup fp8"       issue 52: the fp8 weight kernels' tests (tests/gpu/test_fp8_weights_cuda.py and the kernel
#                           twins), then the 8B shape's decode steps at batch 1/8/64/256 and an 8192-token prefill with
#                           fp8 weights (per-channel: --quantization fp8; block-wise 128x128: a config declaring
#                           DeepSeek's weight_block_size) against bf16, each against its floor (--roofline)
#   PARTS="setup moe"       issue 51: the MoE tests on the GPU, tiles tuned, the few-token expert path against the
#                           grouped GEMMs per layer, a Qwen3-30B-A3B-shaped model (runner auto)
#   PARTS="setup moebs1"    issue 51 at batch 1 (seventeenth session): the MoE tests on CUDA, one layer's experts at 1
#                           token with the tiles searched (the down launch's expert loop or stacked form), then the
#                           Qwen3-30B-A3B-shaped model's batch-1 step against the roofline with the default tiles and
#                           with the best (RADIXMESH_MOE_DECODE_TILES)
#   PARTS="setup moefp8"    issues 51/52: the fp8 few-token expert tests on CUDA, then one layer's fp8 experts (block-wise
#                           and per row) at 1 and 2 tokens, the tiles searched with the down launch's stacked form
#                           (FP8_TILES keeps the expert loop until this measures the stacked one)
#   PARTS="setup moegate"   issue 51 (eighteenth session): kernels.moe_gate's tests on CUDA, then the Qwen3-30B-A3B
#                           shape's batch-1 step with the sparse layers' norm, router and routing in one launch and in
#                           three (RADIXMESH_MOE_FUSED_GATE=0), synchronous and profiled by kernel
#   PARTS="setup moefp8step" issues 51/52: the Qwen3-30B-A3B-shaped model's batch-1 and 64 steps with fp8 experts,
#                           block-wise and per row, beside bf16
#   PARTS="setup fp8moeengine" issues 51/52: tiny-qwen3-moe's fp8 experts held in fp8 in CUDA graphs against the
#                           dequantized twin (tests/gpu/test_fp8_weights_cuda.py -k engine_holds_moe), bounded by
#                           pytest's own timeout so a traceback reaches the log; on a failure then
#                           benchmarks.fp8_moe_agreement, one suspect off at a time
#   PARTS="setup fp8prof"   issue 52: the 8B shape's batch-1 step with fp8 weights (per channel, then block-wise) by
#                           kernel (profile_decode --timeline; the plan's fp8 one-row tiles recorded per shape)
#   PARTS="setup fp8issue"  issue 52: the fp8 one-row tiles' instructions a weight byte on this machine's Triton
#                           (benchmarks.row_issue), then each tile (also grouped: kernels.fp8_gemv's GROUP) timed at
#                           one row on the 8B layer's four products (benchmarks.fp8_rows --row-configs), after the
#                           one-row kernel's tests on CUDA: does time follow instructions a byte, or registers?
#   PARTS="setup fp8tput"   issue 52: offline throughput (1024 prompts, 512 in / 128 out, 256 running) on the 8B shape
#                           with bf16 weights, fp8 weights (per channel), and fp8 weights with an fp8 KV cache; then
#                           an 8192-token prefill with fp8 weights against the fp8 matmul peak (bench_one_batch)
#   PARTS="setup fp8gemmtune" issue 52: kernels.fp8_gemm's block-wise tiles tuned offline for the 8B shapes on this GPU
#                           (benchmarks.tune_fp8_gemm, written to $OUT/configs and into kernels/configs): the block-fp8
#                           8B model's batch 64 and 256 steps and 8k prefill without tuned tiles, tuned, then without
#                           and with them again (not with TUNE_ONE_PAIR=1; no runs with TUNE_ONLY=1), then the
#                           candidate tiles' and the tuner's CUDA tests
#   PARTS="setup gemmab"    issue 52: the block-fp8 8B model's batch 64 and 256 steps without the shipped fp8 GEMM tile
#                           file and with it (GEMMAB_RUNS, default "none shipped": labels starting "none" run without)
#   PARTS="setup moeunion"  issue 51: the Qwen3-30B-A3B shape at batch 1, 64, 128, 256 (those whose KV fits) against
#                           the experts each step reads (bench_one_batch --roofline counts the union of its tokens'
#                           top-k), the 8k prefill, and the batch-64 step's time by kernel (profile_decode;
#                           MOEUNION_PROFILE= empty skips it)
#   PARTS="setup moetune"   issue 51: the grouped expert GEMMs' tiles tuned for the Qwen3-30B-A3B layer on this GPU
#                           (benchmarks.tune_moe; the H100 and H200 have files), written to $OUT/configs, and the
#                           model's batch-64 step and 8k prefill without, with, without and with the file (the same
#                           TUNE_ONE_PAIR and TUNE_ONLY)
#   PARTS="setup deepseek"  DeepSeek (multi-head latent attention): kernels.mla_decode's, mla_extend's and the tiny
#                           DeepSeek models' CUDA tests (fp8 projections, the expanded prefill, latent host pages too),
#                           then the DeepSeek-V2-Lite shape (dummy weights) at batch 1, 64, 256 and an 8k prefill
#                           against the roofline, decoded on Triton's latent kernel (DEEPSEEK_DECODES adds
#                           torch_native), and the 8k prefill in the expanded form
#   PARTS="setup gemma"     Gemma's norms in kernels (kernels.norm.gemma_rmsnorm / gemma_sandwich) against torch's ops
#                           (RADIXMESH_GEMMA_NORMS=0): the Gemma-3-12B and Gemma-2-9B shapes at batch 1 and 64
#   PARTS="setup families"  the thirty-second and thirty-third sessions' kernels (the rotary kernel's partial heads,
#                           interleaved pairs, Gemma's offset q/k norms, SWA slots and per-head LayerNorms; Gemma's
#                           GELU; OLMo 2's norms; GPT-OSS's biased gate; Qwen2-MoE's gated shared expert; the column
#                           products planned): their CUDA tests, then batch 1 against an earlier tree ($FAMILIES_BASE,
#                           default build/base: `git archive <commit> radixmesh | tar -x -C build/base`, radixmesh/v1
#                           copied in, carried) for Qwen1.5-MoE-A2.7B, Gemma-3-12B and gpt-oss-20b (FAMILIES_MODELS),
#                           then the Qwen2-MoE, Gemma and DeepSeek engine tests, one engine at a time
#   PARTS="setup moeprof"  GPT-OSS's and DeepSeek-V2-Lite's decode steps by kernel (profile_decode --timeline)
#   PARTS="setup mxfp4"     gpt-oss-20b's few-token MXFP4 launches: their CUDA tests, benchmarks.moe_decode --mxfp4
#                           (forms and tiles at 1 token, the grouped GEMMs at 1-8), the model at batch 1/2/4 against
#                           tl.dot_scaled's tiles (MXFP4_S bounds the search)
#   PARTS="setup gptoss"    GPT-OSS: the sink kernels' and the tiny GPT-OSS's CUDA tests, then the gpt-oss-20b shape
#                           (dummy weights in bf16: the MXFP4 experts as the loader dequantizes them) at batch 1, 64,
#                           256 and an 8k prefill against the roofline (GPTOSS_S bounds the benchmark)
#   PARTS="setup spec"      issue 53: speculative decoding's CUDA tests, then the 8B shape (dummy weights, the stand-in
#                           tokenizer): a decode forward against verifies of 2-8 tokens, and NGRAM against plain decoding
#                           at batch 1 and 64 on prompts holding the model's own continuation (radixmesh.benchmarks.speculative)
#   PARTS="setup eagle"     issue 53: an EAGLE-3 head (dummy weights, the published 8B head's shape) on the 8B shape:
#                           what a drafting step costs against plain decoding at batch 1 and 64
#   PARTS="setup newgpu"    the GPU tests of issues 51-55: the kernel files (speculative trees, LoRA, fp8, attention),
#                           then the engine files (hybrid SWA pool, sliding windows, model families, speculative,
#                           LoRA, attention backends, fp8 weights), under NEWGPU_TIMEOUT seconds (480) in all so
#                           the call ends with its logs
#   PARTS="setup pending"   the GPU tests the fifteenth session wrote and could not run (trees in graphs, FlashInfer's
#                           tree lists and sliding lists, FlashInfer over fp8 pages, LoRA's side stream, families)
#   PARTS="setup lora"      issue 54: multi-LoRA decode cost on the 8B shape (radixmesh.benchmarks.lora, dummy weights),
#                           the decode steps profiled (LORA_NOPDL=1: again with PDL off, each kernel's own time;
#                           LORA_NOSIDE=1: again with every LoRA kernel on the one stream)
#   PARTS="setup lorasweep" issue 54: the LoRA kernel tests and the engine's peft parity (defaults and both decode
#                           options off), then the LoRA kernels alone (radixmesh.benchmarks.lora_kernels: a decode
#                           step's shrinks and expands at batch 64 with 8 adapters, per expand tiling, over K parts or
#                           summed parts), then the decode step (batch 1 and 64, 0/1/8 adapters) per expand tiling of
#                           LORA_TILINGS ("128x1x4 64x1x4")
#   PARTS="setup meshprof" where the mesh's time goes at 256 streams: queue depths over time, GIL holders (py-spy)
#   PARTS="setup servab"    engine, mesh, and mesh with a call per request (--disable-generate-stream), alternated
#   PARTS="setup meshab"    engine, mesh, and the mesh of an earlier tree ($BASE), alternated, with each thread's CPU
#                           per token (--thread-cpu)
#   PARTS="setup serving"   the serving benchmark through the mesh (router + tokenizer + worker) and the offline
#                           engine on the same workload, 64 concurrent requests
#   PARTS="setup router"    the router's CPU per request (benchmarks.router) on this machine's many cores, where
#                           the load side has cores of its own: this tree against $BASE (an earlier tree's services,
#                           benchmarks, engine, kernels and radixmesh stubs), alternated; SGLang's router beside ours
#                           where .whl/sglang is carried; then tracing on against off
# Usage on the GPU machine: PARTS="..." bash benchmarks/gpu_speed.sh OUTDIR
# Carry `.whl` (flashinfer-python 0.6.18.post1, apache-tvm-ffi, grpcio/protobuf pins: see README "Benchmarks") and the
# generated stubs `radixmesh` (make protos).
set -uo pipefail
OUT=${1:-/tmp/out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # (absolute: some parts run from inside another tree)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLASHINFER_WORKSPACE_BASE=$PWD/build/fi  # JIT-compiled FlashInfer kernels survive between calls here
# Triton's compiled kernels at a fixed path: a cache packed on an earlier machine (PACK_TRITON=1 below; its group files
# name their members by absolute path) and carried here as .tcache/triton.tgz is unpacked once, so a fresh machine
# skips the compiles an earlier one did (a key that differs, another Triton or source, only misses)
export TRITON_CACHE_DIR=/tmp/radixmesh-triton
if [[ -f .tcache/triton.tgz && ! -e $TRITON_CACHE_DIR/.unpacked ]]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .tcache/triton.tgz -C / && touch "$TRITON_CACHE_DIR/.unpacked"
  echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels unpacked"
fi
PY=python3
TIMELINE=${TIMELINE:+--timeline}  # TIMELINE=1: profile_decode also records one step's kernels in order
PARTS=${PARTS:-setup tests}
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
CFG=benchmarks/configs/llama-3.1-8b
COMMON="--model-path $CFG --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning"

block_fp8_config() {  # SRC DST: a copy of the config folder SRC declaring DeepSeek-style block-wise fp8 (128 x 128)
  mkdir -p "$2" && $PY - "$1" "$2" <<'PYEOF'
import json, shutil, sys, pathlib
src, dst = map(pathlib.Path, sys.argv[1:])
for f in src.iterdir():
    if f.is_file():
        shutil.copy(f, dst)
cfg = json.loads((src / "config.json").read_text())
cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
(dst / "config.json").write_text(json.dumps(cfg, indent=1))
PYEOF
}

if [[ $PARTS == *setup* ]]; then
  $PY -m pip install --no-deps --no-index --quiet .whl/*.whl 2>&1 | tail -2
  # the services' own dependencies, where the machine lacks them (.whl/router: pip download of pyproject's pins;
  # the mesh parts need them as the router part does)
  [[ -d .whl/router ]] && $PY -m pip install --no-deps --no-index --quiet .whl/router/*.whl 2>&1 | tail -2
  # peft and what it needs beyond torch/transformers, for the LoRA parity tests (pip download of pyproject's pins)
  [[ -d .whl/lora ]] && $PY -m pip install --no-deps --no-index --quiet .whl/lora/*.whl 2>&1 | tail -2
  if [[ -d .gpu-wheels ]]; then  # Mooncake's CPU build and its Debian libraries (benchmarks/gpu_pd.sh says how)
    $PY -m pip install --no-deps --no-index --quiet .gpu-wheels/*.whl 2>&1 | tail -2
    mkdir -p /tmp/debs && for f in .gpu-wheels/*.deb; do dpkg -x "$f" /tmp/debs; done
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
  $PY -c 'import torch, triton, flashinfer, grpc; print("torch", torch.__version__, "triton", triton.__version__,
"flashinfer", flashinfer.__version__, "grpc", grpc.__version__)' | tee -a "$OUT/device.txt"
  git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"
  [[ -f models/tiny-qwen3/config.json ]] || $PY scripts/make_tiny_models.py --out models > "$OUT/models.log" 2>&1
  [[ -f build/llama-3.1-8b/tokenizer.json ]] || $PY scripts/make_bench_tokenizer.py --config $CFG --out build/llama-3.1-8b
fi

if [[ $PARTS == *tests* ]]; then
  # Every GPU-marked test, plus the kernel and backend tests whose small cases run on whatever device is there.
  $PY -m pytest -q -p no:cacheprovider --timeout 900 ${TESTS:-tests/kernels tests/gpu tests/parity/test_attention_backends.py} \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|FAILED" | tail -25
fi

if [[ $PARTS == *onebatch* ]]; then
  for backend in ${BACKENDS:-flashinfer triton torch_native}; do
    extra="--eager-too"
    # torch_native: no graphs to turn off, and its gathered keys and masks need more room next to the KV pool
    [[ $backend == torch_native ]] && extra="--mem-fraction-static 0.8"
    $PY -m radixmesh.engine.bench_one_batch $COMMON --attention-backend $backend --batch-size 1 8 64 256 \
      --input-len 512 --output-len 32 --long-context 32768 --prefill-len 8192 --roofline $extra \
      --result-file "$OUT/one_batch.jsonl" 2>&1 | tee -a "$OUT/one_batch.log" | grep -v Warning | tail -14
  done
fi

if [[ $PARTS == *pdlstep* ]]; then
  $PY -m radixmesh.benchmarks.pdl_step --batch-size 1 8 64 --rounds 2 --result-file "$OUT/pdl_step.jsonl" 2>&1 \
    | tee "$OUT/pdl_step.log" | grep -v Warning
  $PY -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.log" | tail -5
elif [[ $PARTS == *pdl* ]]; then
  $PY -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py 2>&1 | tee "$OUT/pdl_tests.log" | tail -3
  $PY -m radixmesh.benchmarks.pdl_chain --result-file "$OUT/pdl_chain.jsonl" 2>&1 | tee "$OUT/pdl_chain.log" \
    | grep -v Warning
fi

if [[ $PARTS == *fusion* ]]; then
  # rotary + KV store in one kernel or two, in one process per backend
  for backend in ${BACKENDS:-triton flashinfer}; do
    $PY -m radixmesh.benchmarks.fusion_step --attention-backend $backend --batch-size 1 8 64 --rounds ${ROUNDS:-2} \
      --result-file "$OUT/fusion_step.jsonl" 2>&1 | tee -a "$OUT/fusion_step.log" | grep -v Warning
  done
fi

if [[ $PARTS == *prefetch* ]]; then
  $PY -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py tests/gpu/test_attention_backends_cuda.py 2>&1 \
    | tee "$OUT/prefetch_tests.log" | tail -3
  $PY -m radixmesh.benchmarks.prefetch_step --batch-size ${BATCH:-1 8 64} --rounds ${ROUNDS:-2} \
    --decode-gemm ${GEMM:-auto} --result-file "$OUT/prefetch_step.jsonl" 2>&1 | tee -a "$OUT/prefetch_step.log" \
    | grep -v Warning
fi

if [[ $PARTS == *splits* ]]; then
  $PY -m radixmesh.benchmarks.splits_step --batch-size ${BATCH:-1 8} --rounds ${ROUNDS:-2} --decode-gemm ${GEMM:-auto} \
    --result-file "$OUT/splits_step.jsonl" 2>&1 | tee -a "$OUT/splits_step.log" | grep -v Warning
fi

if [[ $PARTS == *ablate* ]]; then
  for backend in ${BACKENDS:-triton}; do
    $PY -m radixmesh.benchmarks.ablate_step --attention-backend $backend --batch-size ${BATCH:-1 8} \
      --rounds ${ROUNDS:-2} --result-file "$OUT/ablate_step.jsonl" 2>&1 | tee -a "$OUT/ablate_step.log" \
      | grep -v Warning
  done
fi

if [[ $PARTS == *profile* ]]; then
  for backend in ${BACKENDS:-triton flashinfer}; do
    $PY -m radixmesh.benchmarks.profile_decode --attention-backend $backend --batch-size ${BATCH:-1 64 256} $TIMELINE \
      --result-file "$OUT/profile.jsonl" 2>&1 | tee -a "$OUT/profile.log" | grep -v Warning | tail -48
  done
fi

offline() {  # label, then engine flags
  local label=$1; shift
  echo "== $label"
  $PY -m radixmesh.engine.bench_offline_throughput $COMMON --max-running-requests 256 "$@" \
    --result-file "$OUT/offline.jsonl" 2>&1 | tee -a "$OUT/offline.log" | tail -1
}

if [[ $PARTS == *offline* ]]; then
  SHAPE="--num-prompts 1024 --random-input-len 512 --random-output-len 128"
  offline "flashinfer graphs+overlap" $SHAPE --attention-backend flashinfer
  offline "flashinfer no-overlap" $SHAPE --attention-backend flashinfer --disable-overlap-schedule
  offline "flashinfer no-graphs" $SHAPE --attention-backend flashinfer --disable-cuda-graph
  offline "triton graphs+overlap" $SHAPE --attention-backend triton
  offline "torch_native (no graphs)" $SHAPE --attention-backend torch_native
  offline "flashinfer 1024/1024" --num-prompts 512 --random-input-len 1024 --random-output-len 1024 \
    --attention-backend flashinfer
fi

if [[ $PARTS == *serving* ]]; then
  MODEL=build/llama-3.1-8b  # the 8B config with the stand-in byte-level BPE tokenizer
  LOAD="--model-path $MODEL --load-format dummy --dtype bfloat16 --max-running-requests 256 --log-level warning"
  WORK="--num-prompts 512 --random-input-len 512 --random-output-len 128 --random-range-ratio 0.5 --max-concurrency 64
        --disable-tqdm --output-file $OUT/serving.jsonl"
  for backend in engine radixmesh; do
    launch=""
    [[ $backend == radixmesh ]] && launch="--launch"
    $PY -m radixmesh.benchmarks.serving --backend $backend $launch $LOAD $WORK 2>&1 | tee -a "$OUT/serving.log" \
      | tail -32
  done
fi

if [[ $PARTS == *scale* ]]; then
  # Issue 50's table in one command: the engine and the mesh side by side at 1, 64, 256 and 512 streams (streamed,
  # 256-512 tokens in, 64-128 out, greedy, ignore_eos), ROUNDS sweeps with the order alternating.
  MODEL=build/llama-3.1-8b
  $PY -m radixmesh.benchmarks.serving --backend engine radixmesh --launch --model-path $MODEL --load-format dummy \
    --dtype bfloat16 --max-running-requests 256 --log-level warning --random-input-len 512 --random-output-len 128 \
    --random-range-ratio 0.5 --max-concurrency 1 64 256 512 --num-prompts 24 512 1024 1024 --rounds ${ROUNDS:-2} \
    --disable-tqdm --output-file "$OUT/scale.jsonl" 2>&1 | tee "$OUT/scale.log" | sed -n '/Side by side/,$p'
fi

if [[ " $PARTS " == *" moe "* ]]; then
  # Issue 51: the MoE kernels on the GPU (their tests, a tiny Qwen3-MoE in CUDA graphs against transformers), the
  # grouped GEMMs' tiles tuned for the Qwen3-30B-A3B layer shape (saved to kernels/configs and $OUT), then that
  # shape as a dummy model with the default runner (triton, CUDA graphs): batch 1, 64, 256 decode steps against the
  # roofline (a batch-1 step reads the router, the dense parts and the top-k experts), an 8k prefill, and offline
  # throughput. Batch 1 runs kernels.moe_decode's few-token path (up to 4 tokens at this shape) and Qwen3's q/k norms
  # inside the rotary kernel; benchmarks.moe_decode times one layer's experts on both paths at 1-8 tokens (its tiles
  # searched) against the floor.
  $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py tests/kernels/test_moe_decode.py \
    tests/kernels/test_moe_decode_fp8.py tests/kernels/test_rotary_qk_norm.py tests/gpu/test_moe_cuda.py 2>&1 | tail -3
  $PY -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/qwen3-30b-a3b --tokens 1 2 4 8 16 \
    --result-file "$OUT/moe_decode.jsonl" 2>&1 | tee "$OUT/moe_decode.log" | grep -v "^  skipped" | tail -15
  $PY -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/qwen3-30b-a3b --tokens 1 2 4 --fp8 block \
    --result-file "$OUT/moe_decode_fp8.jsonl" 2>&1 | tee "$OUT/moe_decode_fp8.log" | grep -v "^  skipped" | tail -10
  $PY -m radixmesh.benchmarks.tune_moe --model-path benchmarks/configs/qwen3-30b-a3b 2>&1 | tee "$OUT/tune_moe.log" \
    | tail -3 && cp radixmesh/kernels/configs/moe-*.json "$OUT/"
  for moe in ${MOE_BACKENDS:-auto}; do
    $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/qwen3-30b-a3b --load-format dummy \
      --dtype bfloat16 --skip-tokenizer-init --log-level warning --moe-runner-backend $moe --batch-size 1 64 256 \
      --input-len 512 --output-len 32 --prefill-len 8192 --roofline --result-file "$OUT/moe_one_batch.jsonl" 2>&1 \
      | tee -a "$OUT/moe_one_batch.log" | grep -v Warning | tail -8
  done
  $PY -m radixmesh.engine.bench_offline_throughput --model-path benchmarks/configs/qwen3-30b-a3b --load-format dummy \
    --dtype bfloat16 --skip-tokenizer-init --log-level warning --num-prompts ${MOE_PROMPTS:-512} --random-input-len 512 \
    --random-output-len 128 --result-file "$OUT/moe_offline.jsonl" 2>&1 | tee -a "$OUT/moe_offline.log" | tail -2
fi

if [[ " $PARTS " == *" moebs1 "* ]]; then
  timeout ${MOE_TIMEOUT:-150} $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py \
    tests/kernels/test_moe_decode.py tests/gpu/test_moe_cuda.py 2>&1 \
    | tee "$OUT/moebs1_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -8
  # one layer's experts at 1 token, the tiles searched (the down launch's expert loop and its stacked form)
  timeout ${MOE_TIMEOUT:-150} $PY -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/qwen3-30b-a3b \
    --tokens 1 --result-file "$OUT/moe_decode.jsonl" 2>&1 | tee "$OUT/moe_decode.log" | grep -E "^tokens|Error"
  BEST=$($PY -c 'import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(json.dumps(
[r for r in rows if r.get("best_tiles")][-1]["tiles"]))' "$OUT/moe_decode.jsonl" 2>/dev/null)
  # the model's batch-1 step with the default tiles, then with the best found above
  for tiles in "" "$BEST"; do
    echo "== tiles: ${tiles:-default}"
    RADIXMESH_MOE_DECODE_TILES="$tiles" timeout ${MOE_TIMEOUT:-150} $PY -m radixmesh.engine.bench_one_batch \
      --model-path benchmarks/configs/qwen3-30b-a3b --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
      --log-level warning --batch-size 1 --input-len 512 --output-len 32 --roofline \
      --result-file "$OUT/moe_one_batch.jsonl" 2>&1 | tee -a "$OUT/moe_one_batch.log" | grep -v Warning | tail -3
  done
fi

if [[ " $PARTS " == *" moefp8 "* ]]; then
  timeout ${MOE_TIMEOUT:-150} $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_decode_fp8.py 2>&1 \
    | tee "$OUT/moefp8_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -8
  for scales in block channel; do
    timeout ${MOE_TIMEOUT:-200} $PY -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/qwen3-30b-a3b \
      --tokens 1 2 --fp8 $scales --result-file "$OUT/moe_decode_fp8.jsonl" 2>&1 | tee -a "$OUT/moe_decode_fp8.log" \
      | grep -E "^tokens|Error"
  done
fi

if [[ " $PARTS " == *" moegate "* ]]; then
  # issue 51 (eighteenth session): kernels.moe_gate (a sparse layer's norm, router and routing in one launch) on CUDA,
  # then the Qwen3-30B-A3B-shaped model's batch-1 step with it and without (RADIXMESH_MOE_FUSED_GATE=0), alternated,
  # synchronous (bench_one_batch) and in GPU time by kernel (profile_decode)
  timeout ${MOE_TIMEOUT:-200} $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gate.py \
    tests/kernels/test_moe.py tests/gpu/test_moe_cuda.py 2>&1 | tee "$OUT/moegate_tests.log" \
    | grep -E "passed|failed|^E  |FAILED" | tail -8
  MOE="--model-path benchmarks/configs/qwen3-30b-a3b --load-format dummy --dtype bfloat16 --skip-tokenizer-init"
  for round in 1 2; do
    for fused in 0 1; do
      echo "== fused gate: $fused (round $round)"
      RADIXMESH_MOE_FUSED_GATE=$fused timeout ${MOE_TIMEOUT:-150} $PY -m radixmesh.engine.bench_one_batch $MOE \
        --log-level warning --batch-size 1 --input-len 512 --output-len 32 --roofline \
        --result-file "$OUT/moegate_one_batch.jsonl" 2>&1 | tee -a "$OUT/moegate_one_batch.log" | grep -v Warning \
        | tail -2
    done
  done
  for fused in 0 1; do
    echo "== profile, fused gate: $fused"
    RADIXMESH_MOE_FUSED_GATE=$fused timeout ${MOE_TIMEOUT:-150} $PY -m radixmesh.benchmarks.profile_decode \
      --model-path benchmarks/configs/qwen3-30b-a3b --attention-backend triton --batch-size 1 --timeline \
      --result-file "$OUT/moegate_profile.jsonl" 2>&1 | tee -a "$OUT/moegate_profile.log" | grep -v Warning | tail -30
  done
fi

if [[ " $PARTS " == *" moefp8step "* ]]; then
  # issues 51/52 (eighteenth session): the Qwen3-30B-A3B-shaped model with fp8 weights, block-wise 128 x 128 (a
  # config declaring them, as Qwen3-30B-A3B-FP8 does) and per row (--quantization fp8), at batch 1 with the fp8
  # experts' new default tiles (kernels.moe_decode_fp8.FP8_TILES), beside bf16, against each floor
  MOE_BLOCK=build/qwen3-30b-a3b-fp8-block
  block_fp8_config benchmarks/configs/qwen3-30b-a3b $MOE_BLOCK
  for weights in bf16 block channel; do
    case $weights in
      bf16) args="--model-path benchmarks/configs/qwen3-30b-a3b" ;;
      block) args="--model-path $MOE_BLOCK" ;;
      channel) args="--model-path benchmarks/configs/qwen3-30b-a3b --quantization fp8" ;;
    esac
    echo "== weights: $weights"
    timeout ${MOE_TIMEOUT:-200} $PY -m radixmesh.engine.bench_one_batch $args --load-format dummy --dtype bfloat16 \
      --skip-tokenizer-init --log-level warning --batch-size 1 64 --input-len 512 --output-len 32 --roofline \
      --result-file "$OUT/moefp8_step.jsonl" 2>&1 | tee -a "$OUT/moefp8_step.log" | grep -v Warning | tail -4
  done
fi

if [[ " $PARTS " == *" fp8moeengine "* ]]; then
  # A cold Triton cache compiles every MoE and fp8 kernel in the first test: keep the bound generous (over 150 s).
  timeout 480 $PY -m pytest -q -p no:cacheprovider --timeout 420 -x --tb=long tests/gpu/test_fp8_weights_cuda.py \
    -k engine_holds_moe 2>&1 | tee "$OUT/fp8moeengine.log" | grep -E "passed|failed|^E  |FAILED" | tail -12
  # on a failure, which suspect it is: one switched off at a time (graphs, the fused gate, the experts' runner, dtype)
  if grep -q " failed" "$OUT/fp8moeengine.log"; then
    timeout 300 $PY -m radixmesh.benchmarks.fp8_moe_agreement --child-timeout 150 \
      --result-file "$OUT/fp8moeengine.jsonl" 2>&1 | tee -a "$OUT/fp8moeengine.log" | grep "variant"
    timeout 120 $PY -m radixmesh.benchmarks.fp8_moe_agreement --block 0 0 --variants graphs \
      --result-file "$OUT/fp8moeengine.jsonl" 2>&1 | tee -a "$OUT/fp8moeengine.log" | grep "variant"
  fi
fi

if [[ " $PARTS " == *" fp8prof "* ]]; then
  block_fp8_config $CFG build/llama-3.1-8b-fp8-block  # (the fp8 part's copy)
  for model in "$CFG --quantization fp8" build/llama-3.1-8b-fp8-block; do
    echo "== $model"
    timeout 150 $PY -m radixmesh.benchmarks.profile_decode --model-path $model --batch-size 1 --timeline \
      --result-file "$OUT/fp8prof.jsonl" 2>&1 | tee -a "$OUT/fp8prof.log" | grep "^bs 1"
  done
fi

if [[ " $PARTS " == *" fp8issue "* ]]; then
  # the plan's ungrouped tiles, then grouped ones (each thread's 16 products summed first: fewer registers)
  TILES="2,2048,4 2,4096,4 4,2048,4 2,4096,8 8,1024,4 2,2048,4,16 4,2048,4,16 8,1024,4,16 2,1024,2,16 4,1024,4,16"
  timeout 200 $PY -m pytest -q -p no:cacheprovider --timeout 180 tests/kernels/test_fp8_gemv.py -k row 2>&1 \
    | tee "$OUT/fp8issue_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -6
  $PY -m radixmesh.benchmarks.row_issue --fp8-tiles $TILES --result-file "$OUT/fp8issue_static.jsonl" 2>&1 \
    | tee "$OUT/fp8issue.log" | grep -E "^(fp8|bf16)"
  timeout 400 $PY -m radixmesh.benchmarks.fp8_rows --rows 1 --scales channel --no-bf16 --row-configs $TILES \
    --result-file "$OUT/fp8issue_rows.jsonl" 2>&1 | tee -a "$OUT/fp8issue.log" | grep -E "^rows|rror" | tail -12
fi

if [[ " $PARTS " == *" fp8tput "* ]]; then
  SHAPE="--num-prompts 1024 --random-input-len 512 --random-output-len 128"
  offline "bf16" $SHAPE
  offline "fp8 weights" $SHAPE --quantization fp8
  offline "fp8 weights, fp8 KV" $SHAPE --quantization fp8 --kv-cache-dtype fp8_e4m3
  $PY -m radixmesh.engine.bench_one_batch $COMMON --quantization fp8 --batch-size 1 --input-len 512 --output-len 8 \
    --prefill-len 8192 --roofline --result-file "$OUT/fp8tput_prefill.jsonl" 2>&1 | tee -a "$OUT/offline.log" \
    | grep -E "matmul|prefill of"
fi

# A tuner's A/B (the fp8gemmtune and moetune parts). NAME MODULE TUNE_TIMEOUT "TUNER ARGS" BENCH ARGS...: the tile file
# kernels.MODULE's config_path names for this GPU is moved aside if one is shipped (and restored after); the model
# runs (bench_one_batch with BENCH ARGS, each run's rows after a label line in $OUT/NAME_runs.jsonl: $OUT brings
# back 8 files) untuned, the tuner (its module and arguments) writes under $OUT/configs, then the model runs tuned,
# untuned and tuned again (TUNE_ONE_PAIR=1: once each; TUNE_ONLY=1: no runs, the file alone).
tile_file() { $PY -c "import torch; from radixmesh.kernels.$1 import config_path; \
print(config_path(torch.cuda.get_device_name(), '$2'))"; }
tuner_run() {  # NAME LABEL BENCH ARGS...
  local name=$1 label=$2; shift 2
  [[ -n ${TUNE_ONLY:-} ]] && return
  echo "== $label"
  echo "{\"label\": \"$label\"}" >> "$OUT/${name}_runs.jsonl"
  timeout "${RUN_TIMEOUT:-150}" $PY -m radixmesh.engine.bench_one_batch --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
    --log-level warning --input-len 512 --output-len 16 --prefill-len 8192 --result-file "$OUT/${name}_runs.jsonl" \
    "$@" 2>&1 | tee -a "$OUT/$name.log" | grep -E "True|prefill of|rror"
}
tuner_ab() {
  local name=$1 module=$2 limit=$3 tuner=$4 pkg; shift 4
  pkg=$(tile_file "$module" radixmesh/kernels/configs)
  [[ -f $pkg ]] && mv "$pkg" "$pkg.kept"
  tuner_run "$name" untuned "$@"
  # shellcheck disable=SC2086  # (the tuner's arguments split on spaces)
  timeout "$limit" $PY -m $tuner --out "$OUT/configs" 2>&1 | tee "$OUT/${name}_tune.log" | grep -E "wrote|rror" \
    | tail -3
  if cp "$(tile_file "$module" "$OUT/configs")" "$pkg"; then
    tuner_run "$name" tuned "$@"
    if [[ -z ${TUNE_ONE_PAIR:-} ]]; then
      mv "$pkg" "$pkg.new"; tuner_run "$name" untuned2 "$@"; mv "$pkg.new" "$pkg"; tuner_run "$name" tuned2 "$@"
    fi
  fi
  rm -f "$pkg" "$pkg.new"
  [[ -f $pkg.kept ]] && mv "$pkg.kept" "$pkg"
}

if [[ " $PARTS " == *" fp8gemmtune "* ]]; then
  block_fp8_config $CFG build/llama-3.1-8b-fp8-block  # (the fp8 part's copy)
  tuner_ab fp8gemmtune fp8_gemm 240 "radixmesh.benchmarks.tune_fp8_gemm --model-path $CFG" \
    --model-path build/llama-3.1-8b-fp8-block --batch-size 64 256
  # the candidate tiles' and the tuner's CUDA tests last: a call cut at its bound keeps the runs above
  timeout 200 $PY -m pytest -q -p no:cacheprovider --timeout 190 tests/gpu/test_fp8_weights_cuda.py \
    -k "candidate_block or tuner" 2>&1 | tee -a "$OUT/fp8gemmtune.log" | grep -E "passed|failed|^E  |FAILED" | tail -6
fi

if [[ " $PARTS " == *" gemmab "* ]]; then  # the shipped block-fp8 tile file against none, on one machine
  block_fp8_config $CFG build/llama-3.1-8b-fp8-block
  pkg=$(tile_file fp8_gemm radixmesh/kernels/configs)
  for label in ${GEMMAB_RUNS:-none shipped}; do
    [[ $label == none* ]] && mv "$pkg" "$pkg.kept"
    # (the first run on a fresh machine compiles every tile: the twenty-fifth session's cold "none" run passed 150 s)
    RUN_TIMEOUT=${RUN_TIMEOUT:-270} tuner_run gemmab "$label" --model-path build/llama-3.1-8b-fp8-block --batch-size 64 256 --prefill-len 0
    [[ -f $pkg.kept ]] && mv "$pkg.kept" "$pkg"
  done
fi

if [[ " $PARTS " == *" families "* ]]; then
  # Predictions, written before any run (H100, batch 1, GPU time a step, against bef0c17): DeepSeek-V2-Lite 2.76 ->
  # 2.52-2.60 ms (q_proj and kv_a_proj_with_mqa off cuBLAS: 13.5 us of a layer's shares for 15 MB); Gemma-3-12B 8.74 ->
  # 8.3-8.45 ms; Phi-4-mini -0.6 to -0.9 ms; OLMo-2-7B -1.5 to -2.0 ms (~34 torch launches a layer become 4 kernels).
  # Measured (thirty-third session, one H100, base run from inside build/base): DeepSeek-V2-Lite 2.784 -> 2.604,
  # Phi-4-mini 3.931 -> 3.128, OLMo-2-7B 7.436 -> 5.289; Gemma-3-12B and gpt-oss-20b not yet.
  # Thirty-third session (against 2861b8c: FAMILIES_BASE holding `git archive 2861b8c radixmesh`): Qwen1.5-MoE-A2.7B
  # -0.08 to -0.14 ms (the gated shared expert's four launches a layer, ~7 us, become one of ~2 us; 24 layers).
  xdist=$($PY -c "import xdist" 2> /dev/null && echo "-n 8")  # (pytest-xdist, carried in .whl; kernel tests only)
  timeout ${FAMILIES_KT:-200} $PY -m pytest -q -p no:cacheprovider --tb=short -rfE $xdist \
    tests/kernels/test_rotary_qk_norm.py tests/kernels/test_moe_gate.py tests/kernels/test_elementwise.py \
    tests/kernels/test_decode_products.py tests/kernels/test_moe_shared.py -k "qk_norm or partial or interleaved \
    or slot_map or router_bias or gelu or olmo2 or gemma or column or shared" 2>&1 | grep -v "site-packages\|^ *$" \
    | tee "$OUT/families_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -14
  base=${FAMILIES_BASE:-build/base}
  for model in ${FAMILIES_MODELS:-qwen1.5-moe-a2.7b gemma-3-12b gpt-oss-20b}; do
    for tree in new base; do
      root=$PWD; [[ $tree == base ]] && root=$PWD/$base
      [[ -d $root/radixmesh ]] || { echo "families: no $root/radixmesh"; continue; }
      echo "== $model $tree"
      echo "{\"label\": \"$model $tree\"}" >> "$OUT/families.jsonl"
      # (run from inside the tree: `python -m` puts the working directory before PYTHONPATH, so from here the base
      # run would import this tree's package)
      (cd "$root" && PYTHONPATH=$root timeout ${FAMILIES_S:-150} $PY -m radixmesh.engine.bench_one_batch \
        --model-path "$OLDPWD/benchmarks/configs/$model" --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
        --log-level warning --batch-size 1 --input-len 512 --output-len 16 --roofline \
        --result-file "$OUT/families.jsonl") 2>&1 | tee -a "$OUT/families.log" | grep -E "True|rror"
    done
  done
  # (one engine at a time: under xdist every engine but the first refuses its KV pool, mem_fraction_static being a
  # share of the whole GPU)
  timeout ${FAMILIES_ET:-400} $PY -m pytest -v -p no:cacheprovider --tb=short -rfE --timeout 300 \
    tests/gpu/test_moe_cuda.py tests/gpu/test_sliding_window_cuda.py tests/gpu/test_deepseek_cuda.py \
    -k "qwen2_moe or gemma or fp8 or (deepseek_v3 and None) or latent_kernels" 2>&1 | grep -v "site-packages\|^ *$" \
    | tee "$OUT/families_engine.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | tail -30
fi

if [[ " $PARTS " == *" gemma "* ]]; then
  # Prediction, written before any run: torch computes a Gemma norm in ~9 launches (float, pow, mean, add, rsqrt, mul,
  # the weight's float and 1 +, mul, the cast); Gemma 3 has six a layer (four of the hidden rows, q's and k's per head)
  # and two residual adds: ~56 launches of ~1.5-2 us a layer against 4 kernels (~6 us). Gemma-3-12B (48 layers) at
  # batch 1: -3.7 to -5 ms a step of GPU time (its weight floor ~7.8 ms on an H100), about the same at batch 64.
  for model in gemma-3-12b gemma-2-9b; do
    for ab in "X=1" "RADIXMESH_GEMMA_NORMS=0"; do
      echo "== $model $ab"
      echo "{\"label\": \"$model $ab\"}" >> "$OUT/gemma.jsonl"
      env $ab timeout ${GEMMA_S:-150} $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/$model \
        --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --batch-size 1 64 \
        --input-len 512 --output-len 16 --roofline --result-file "$OUT/gemma.jsonl" 2>&1 | tee -a "$OUT/gemma.log" \
        | grep -E "True|rror"
    done
  done
fi

if [[ " $PARTS " == *" moeunion "* ]]; then
  # issue 51's batch rows: the Qwen3-30B-A3B shape's steps at batch 1, 64 and 256 against floors of the experts each
  # batch's step reads (bench_one_batch counts them: the union of its tokens' top-k), the 8k prefill beside them; then
  # the batch-64 step's time by kernel (profile_decode: what the grouped expert GEMMs take against the rest)
  timeout ${MOEUNION_TIMEOUT:-240} $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/qwen3-30b-a3b \
    --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --batch-size 1 64 128 256 \
    --input-len 512 --output-len 16 --prefill-len 8192 --roofline --result-file "$OUT/moeunion.jsonl" 2>&1 \
    | tee "$OUT/moeunion.log" | grep -E "True|distinct|copy|prefill of|skipped|rror"
  [[ -n ${MOEUNION_PROFILE-1} ]] && timeout ${MOEUNION_TIMEOUT:-240} $PY -m radixmesh.benchmarks.profile_decode \
    --model-path benchmarks/configs/qwen3-30b-a3b --batch-size 64 --result-file "$OUT/moeunion_profile.jsonl" 2>&1 \
    | tee -a "$OUT/moeunion.log" | grep -v Warning | tail -30
fi

if [[ " $PARTS " == *" moetune "* ]]; then
  MOE_CFG=${MOETUNE_CFG:-benchmarks/configs/qwen3-30b-a3b}  # (MOETUNE_CFG=benchmarks/configs/gpt-oss-20b: its layer)
  tuner_ab moetune moe 300 "radixmesh.benchmarks.tune_moe --model-path $MOE_CFG --tokens 64 2048" \
    --model-path $MOE_CFG --batch-size 64
fi

if [[ " $PARTS " == *" deepseek "* ]]; then
  timeout ${DS_TEST_S:-330} $PY -m pytest -q -p no:cacheprovider --timeout 300 tests/kernels/test_mla_decode.py \
    tests/kernels/test_mla_extend.py tests/gpu/test_deepseek_cuda.py tests/kernels/test_moe.py tests/kernels/test_kv_pages.py \
    tests/kernels/test_elementwise.py tests/gpu/test_hicache_cuda.py tests/kernels/test_moe_gate.py \
    tests/kernels/test_mla_absorb.py \
    -k "mla or deepseek or grouped_route_kernel or latent or backups_equal or direct_loads or grouped_gate or absorb" 2>&1 | tee "$OUT/deepseek_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -8
  for decode in ${DEEPSEEK_DECODES:-triton}; do  # (DEEPSEEK_DECODES="triton torch_native": plain torch's too)
    echo "== decode $decode"
    timeout ${DS_BENCH_S:-200} $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/deepseek-v2-lite \
      --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --decode-attention-backend $decode \
      --batch-size 1 64 256 --input-len 512 --output-len 16 --prefill-len 8192 --roofline \
      --result-file "$OUT/deepseek_$decode.jsonl" 2>&1 | tee -a "$OUT/deepseek.log" \
      | grep -E "True|distinct|copy|prefill of|skipped|rror"
  done
  # The query's and key's rows in one launch (kernels.mla_rope) against torch's ~16 launches a layer (the twenty-ninth
  # session's profile: 1,007 kernels a batch-1 step, ~18 a layer torch's elementwise/copy/concatenation kernels of
  # 1.5-2.5 us). Prediction, written before any run: batch-1 GPU time 3.77 -> 3.2-3.4 ms (~15 links of 1.5-2 us a
  # layer x 27 layers, less the kernel's own ~3 us a layer); batches 64/256 0.2-0.5 ms shorter.
  # Measured (H100, 5dd61dd, batch 1 and 64 only): 3.770 -> 3.124 ms, 15.64 -> 14.73 ms: past the range both.
  echo "== decode triton, rows built by torch (RADIXMESH_MLA_FUSED_QK=0)"
  RADIXMESH_MLA_FUSED_QK=0 timeout ${DS_BENCH_S:-200} $PY -m radixmesh.engine.bench_one_batch \
    --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
    --log-level warning --batch-size 1 64 256 --input-len 512 --output-len 16 --roofline \
    --result-file "$OUT/deepseek_torch_rows.jsonl" 2>&1 | tee -a "$OUT/deepseek.log" | grep -E "True|rror"
  # The bias-routed gate in one launch (kernels.moe_gate.moe_gate_grouped: the residual add, the norm, the float32
  # router's product and the grouped routing) against its four launches (RADIXMESH_MOE_FUSED_GATE=0). Prediction,
  # written before any run: batch-1 GPU time 3.12 -> 2.90-3.00 ms (the float32 cast and cuBLAS's float32 product
  # ~5-7 us each, the routing ~3, the norm ~1.5, against the one launch's ~4-5 us, x 26 sparse layers); batch 64 the same.
  echo "== decode triton, the gate in four launches (RADIXMESH_MOE_FUSED_GATE=0)"
  RADIXMESH_MOE_FUSED_GATE=0 timeout ${DS_BENCH_S:-200} $PY -m radixmesh.engine.bench_one_batch \
    --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
    --log-level warning --batch-size 1 --input-len 512 --output-len 16 --roofline \
    --result-file "$OUT/deepseek_unfused_gate.jsonl" 2>&1 | tee -a "$OUT/deepseek.log" | grep -E "True|rror"
  # The absorbed products in kernels of their own (kernels.mla_absorb: the query's with its rows, the value's into
  # o_proj's input) against torch.bmm (RADIXMESH_MLA_ABSORB=0), and with their weights loaded before the PDL wait
  # (RADIXMESH_MLA_ABSORB_EARLY=1). The query's launch also norms the latent and stores the key rows into the pool.
  # Prediction, written before any run: cuBLAS's two bmms ~7-9 us each at one row (the twenty-ninth session's
  # profile: ~530 us a step of cuBLAS with the float32 router) against ~2-3 us each here, and three small launches
  # (~1.5 us each: the latent's copy, its norm, the KV store) gone: -12 to -17 us a layer x 27, batch-1 GPU time
  # -0.32 to -0.46 ms (3.12 -> 2.66-2.80 with the gate in four launches); batch 64 and up unchanged (torch.bmm).
  for ab in "RADIXMESH_MLA_ABSORB=0" "RADIXMESH_MLA_ABSORB_EARLY=1"; do
    echo "== decode triton, $ab"
    env $ab timeout ${DS_BENCH_S:-200} $PY -m radixmesh.engine.bench_one_batch \
      --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
      --log-level warning --batch-size 1 --input-len 512 --output-len 16 --roofline \
      --result-file "$OUT/deepseek_absorb_ab.jsonl" 2>&1 | tee -a "$OUT/deepseek.log" | grep -E "True|rror"
  done
  # The 8k prefill in the expanded form (engine.attention.mla_expanded) against the latent form just measured.
  # Prediction (written before any run): attention is ~47% of V2-Lite's 8k prefill FLOPs in the latent form and ~25%
  # in the expanded one (its keys and values rebuilt included): the prefill 1.2-1.5x faster if torch's attention runs
  # near the latent kernel's rate.
  echo "== prefill expanded"
  RADIXMESH_MLA_PREFILL=expanded timeout ${DS_EXP_S:-150} $PY -m radixmesh.engine.bench_one_batch \
    --model-path benchmarks/configs/deepseek-v2-lite --load-format dummy --dtype bfloat16 --skip-tokenizer-init \
    --log-level warning --batch-size 1 --input-len 512 --output-len 4 --prefill-len 8192 --roofline \
    --result-file "$OUT/deepseek_expanded.jsonl" 2>&1 | tee -a "$OUT/deepseek.log" | grep -E "prefill of|rror"
fi

if [[ " $PARTS " == *" mxfp4 "* ]]; then
  # gpt-oss-20b's few-token MXFP4 launches on CUDA cores (kernels.moe_mxfp4._row_times_words, thirty-fourth session):
  # their CUDA tests (the inline-PTX form too), benchmarks.moe_decode --mxfp4 (the products' form and tiles searched at
  # 1 token, the grouped GEMMs beside them at 1-8), then the model at batch 1, 2 and 4 with the shipped tiles against
  # tl.dot_scaled's. Prediction (written before any run of this part): the inline-PTX form 36-40 us a layer at one
  # token against the shipped 41.9: ~5% fewer instructions, and its gate/up launch holds 136 registers a thread
  # against 176 (cuobjdump of the sm_90 build), so 3 programs fit an SM where 2 did; the looped form (ScaledTiles.loop:
  # 32-64 registers, ~25% more instructions a weight) within 10% of the unrolled one either way; the word launches
  # beat the grouped GEMMs up to 4 tokens
  # (136 us a layer at 4 against ~190-230 for the grouped path, read off the model's batch-4 step: 6.5 ms against 2.24
  # at batch 1), about even at 8. If so, MXFP4 should take the few-token path up to 4 tokens (today: 2 at 32 experts):
  # with RADIXMESH_MXFP4_TILES='{"max_pairs": 16}' the model's batch-4 step 6.5 -> 4.3-4.9 ms of GPU time.
  timeout 90 $PY -m pytest -q -p no:cacheprovider --tb=short -rfE tests/kernels/test_moe_mxfp4.py 2>&1 \
    | tee "$OUT/mxfp4_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -5
  timeout ${MXFP4_S:-240} $PY -m radixmesh.benchmarks.moe_decode --model-path benchmarks/configs/gpt-oss-20b --mxfp4 \
    --tokens 1 2 4 8 --layers 4 --result-file "$OUT/moe_decode_mxfp4.jsonl" 2>&1 | tee "$OUT/moe_decode_mxfp4.log" \
    | grep -v "^  skipped" | tail -12
  dot='{"words": 0, "up_block_n": 32, "up_block_k": 256, "down_block_n": 64, "down_block_k": 256, "num_stages": 3}'
  # (thirty-fifth session: the search kept the shipped tiles, 40.3 us a layer; 16 pairs, now the default, took the
  # batch-4 step 6.50 -> 5.03 ms; the last run is the old limit of 2 tokens)
  for ab in "X=1" "RADIXMESH_MXFP4_TILES=$dot" 'RADIXMESH_MXFP4_TILES={"max_pairs": 8}'; do
    echo "{\"label\": \"gpt-oss-20b $(echo "${ab:0:40}" | tr -d '"{}')\"}" >> "$OUT/mxfp4_model.jsonl"
    env "$ab" timeout 120 $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/gpt-oss-20b \
      --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --batch-size 1 2 4 \
      --input-len 512 --output-len 16 --roofline --result-file "$OUT/mxfp4_model.jsonl" 2>&1 | grep -E "True|rror"
  done
fi

if [[ " $PARTS " == *" gptoss "* ]]; then
  timeout ${GPTOSS_TEST_S:-240} $PY -m pytest -q -p no:cacheprovider --timeout 200 tests/gpu/test_gpt_oss_cuda.py \
    tests/kernels/test_attention.py -k "gpt_oss or sinks" 2>&1 | tee "$OUT/gptoss_tests.log" \
    | grep -E "passed|failed|^E  |FAILED" | tail -8
  # Prediction (written before any run): batch 1 reads ~7.3 GB in bf16 (the dequantized experts) at 1.3-1.6x its
  # floor (the few-token expert launches add the biases and the clamped SwiGLU themselves; the router's product has
  # a bias, so kernels.moe_gate's one launch does not apply); batch 64 and 256 near the Qwen3-30B-A3B shape's 1.2-1.3x
  # of the experts they read (there the activation runs in torch between the grouped GEMMs); the 8k prefill at 35-45%
  # of the bf16 matmul peak. Measured (H100, 5e66916): 1.49x, 1.47x, 1.60x, 17%.
  # Prediction for kernels.moe.default_tiles (283bc32: 64-row blocks where an expert gets >= 64 slots, 32-row from 16,
  # written before any run): the 8k prefill 25-35% of the peak; batch 256 (~32 slots an expert) 1.40-1.50x; batch 1 and
  # 64 unchanged (the few-token launches; 8 slots an expert keep 16-row blocks). DeepSeek-V2-Lite: its latent 8k prefill
  # 11% -> 12-15% (attention is about half its FLOPs), batch 256 1.82x -> 1.6-1.7x.
  # Prediction for kernels.moe_extras' two launches on the grouped path (the gate/up bias with the clamped SwiGLU, the
  # weighted down bias: ~15 torch launches and ~10 passes over the slots' rows a layer become 2 launches and 3 passes;
  # written before any run): gpt-oss-20b's batch 64 step 0.3-0.8 ms shorter (1.47x -> 1.40-1.45x before the tiles'
  # change), the 8k prefill ~20 ms shorter (~5%).
  # Prediction for the experts held in MXFP4 (kernels.moe_mxfp4: benchmarks/configs/gpt-oss-20b declares mxfp4, so its
  # dummy experts are codes and scales now; written before any run): the batch-1 floor falls from 7.2 to ~3.7 GB
  # (~1.2 ms); the step 2.3-2.8 ms (from 3.57): the few-token launches decode ~2.4G weights a token with ~10 integer
  # operations each, which may bound them more than the bytes (1.9-2.3x the new floor); batch 64/256 within 10% of
  # the bf16 steps; the 8k prefill at 0.8-1.1x the bf16 rate (a decode per tile, two half-depth products a step).
  # Measured (H100, c5cf3d3): batch 1 6.81 ms, 64 23.6, 256 62.6, the prefill 987 ms (8%): the integer decoding bound
  # every launch. bfloat16 activations on Triton's tl.dot_scaled since (96e4d16): 4.65 ms (GPU 3.27), 15.4, 25.1, 311
  # ms (26%). Prediction for the few-token down launch's 64-column programs (the default after that run; written
  # before any run of it): batch 1 GPU time 3.0-3.1 ms (the sweep's 80 -> 68 us a layer), batches 64/256 unchanged.
  timeout ${GPTOSS_S:-200} $PY -m radixmesh.engine.bench_one_batch --model-path benchmarks/configs/gpt-oss-20b \
    --load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --batch-size 1 64 256 \
    --input-len 512 --output-len 16 --prefill-len 8192 --roofline --result-file "$OUT/gptoss.jsonl" 2>&1 \
    | tee "$OUT/gptoss.log" | grep -E "True|distinct|copy|prefill of|skipped|rror"
fi

if [[ " $PARTS " == *" moeprof "* ]]; then
  # GPT-OSS's and DeepSeek-V2-Lite's decode steps by kernel (batch 1 and 64, one step's timeline): where the first
  # GPU run's 1.49x and 2.55x of the batch-1 floor go
  for model in ${MOEPROF_MODELS:-gpt-oss-20b deepseek-v2-lite}; do
    echo "== $model"
    timeout ${MOEPROF_S:-120} $PY -m radixmesh.benchmarks.profile_decode --model-path benchmarks/configs/$model \
      --batch-size ${MOEPROF_BATCH:-1 64} --timeline --result-file "$OUT/moeprof_$model.jsonl" 2>&1 \
      | tee "$OUT/moeprof_$model.log" | grep -vE "share|Warning" | head -40
  done
fi

if [[ $PARTS == *spec* ]]; then
  # Issue 53. Dummy weights: whether their greedy text repeats enough for n-gram drafts is the model's to say, so the
  # record carries the acceptance length beside the speed; --verify-cost is the ceiling whatever the drafts.
  $PY -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_cuda.py 2>&1 | tee "$OUT/spec_tests.log" \
    | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -30
  $PY -m radixmesh.benchmarks.speculative --model-path build/llama-3.1-8b --dtype bfloat16 \
    --engine-args '{"load_format": "dummy"}' --draft-tokens ${SPEC_DRAFT_TOKENS:-4,8} --streams ${SPEC_STREAMS:-1,64} \
    --prompts ${SPEC_PROMPTS:-8} --max-new-tokens 256 --verify-cost --context 1024 --out "$OUT/speculative.json" 2>&1 \
    | tee "$OUT/speculative.log" | grep -E "^(plain|NGRAM|STANDALONE|verify)|Error|error" | tail -30
fi

if [[ $PARTS == *eagle* ]]; then
  # Issue 53, EAGLE: the 8B shape with an EAGLE-3 head of the published Llama-3.1-8B head's shape, both with dummy
  # weights: the drafts are random (nothing is kept), so the runs measure what a drafting step (the head's catch-up
  # and steps, then the verify) costs against a plain decode step; a trained head's acceptance length sets the speedup.
  $PY -m radixmesh.benchmarks.speculative --model-path build/llama-3.1-8b --dtype bfloat16 \
    --engine-args '{"load_format": "dummy"}' --eagle3-head benchmarks/configs/eagle3-llama-3.1-8b --skip-ngram \
    --draft-tokens ${EAGLE_DRAFT_TOKENS:-2,4} --streams ${SPEC_STREAMS:-1,64} --prompts ${SPEC_PROMPTS:-8} \
    --max-new-tokens 128 --out "$OUT/eagle.json" 2>&1 | tee "$OUT/eagle.log" \
    | grep -E "^(plain|EAGLE)|Error|error" | tail -20
fi

if [[ " $PARTS " == *" newgpu "* ]]; then
  # -v: each test's id and outcome lands in the log as it ends, so a run its bound cuts still names its failures.
  # pytest-xdist (carried in .whl) shares the GPU between processes: the kernel files, mostly Triton compiles on the
  # CPU, NEWGPU_WORKERS at a time (16 cores); the engine files two at a time (each engine takes 0.3 of the GPU's
  # memory: three at once ran out, 2026-12-05). NEWGPU_KERNELS / NEWGPU_ENGINES replace either list ("none": skip).
  # The MoE files (71 passed on an H100 on 2026-12-05) run only with NEWGPU_MOE=1.
  KERNEL_FILES=${NEWGPU_KERNELS:-"tests/kernels/test_tree_attention.py tests/kernels/test_lora.py
    tests/kernels/test_moe_fp8.py tests/kernels/test_fp8_quant.py tests/kernels/test_fp8_gemv.py
    tests/kernels/test_fp8_gemv_rows.py tests/kernels/test_fp8_gemm.py tests/kernels/test_attention.py"}
  ENGINE_FILES=${NEWGPU_ENGINES:-"tests/gpu/test_hybrid_swa_cuda.py tests/gpu/test_sliding_window_cuda.py
    tests/gpu/test_model_families_cuda.py tests/gpu/test_speculative_cuda.py tests/gpu/test_pd_speculative_cuda.py
    tests/gpu/test_lora_cuda.py tests/gpu/test_attention_backends_cuda.py tests/gpu/test_fp8_weights_cuda.py"}
  [[ -n ${NEWGPU_MOE:-} ]] && KERNEL_FILES="$KERNEL_FILES tests/kernels/test_moe_decode.py
    tests/kernels/test_rotary_qk_norm.py tests/kernels/test_moe_decode_fp8.py tests/kernels/test_moe.py" \
    && ENGINE_FILES="$ENGINE_FILES tests/gpu/test_moe_cuda.py"
  HAS_XDIST=$($PY -c "import xdist" 2> /dev/null && echo 1)
  END=$((SECONDS + ${NEWGPU_TIMEOUT:-480}))
  for group in kernels engines; do
    if [[ $group == kernels ]]; then files=$KERNEL_FILES; n=${NEWGPU_WORKERS:-6}; else files=$ENGINE_FILES; n=2; fi
    [[ $files == none ]] && continue
    left=$((END - SECONDS)); ((left > 10)) || { echo "newgpu: no time left for the $group"; continue; }
    timeout $left $PY -m pytest -v -p no:cacheprovider -rfE --tb=short ${HAS_XDIST:+-n $n --dist loadfile} \
      --junitxml="$OUT/newgpu_$group.xml" $files 2>&1 | tee "$OUT/newgpu_$group.log" \
      | grep -E "^(FAILED|ERROR)| FAILED| ERROR|passed|failed|Timeout" | tail -40
  done
fi

if [[ " $PARTS " == *" pending "* ]]; then
  # The GPU tests written on 2026-12-06 with no device time left (NOTES, fifteenth session), most needed first: draft
  # trees in CUDA graphs, FlashInfer's sliding lists, its tree page lists, an engine over fp8 pages, LoRA's side
  # stream, then the model families (3 of 24 never ran)
  for t in "tests/gpu/test_speculative_cuda.py -k trees" "tests/gpu/test_sliding_window_cuda.py -k lists" \
           "tests/gpu/test_attention_backends_cuda.py -k tree" "tests/gpu/test_attention_backends_cuda.py -k fp8_pages" \
           "tests/gpu/test_fp8_kv_cuda.py -k flashinfer" \
           "tests/gpu/test_lora_cuda.py -k peft" "tests/gpu/test_model_families_cuda.py"; do
    timeout ${PENDING_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider $t 2>&1 | tee -a "$OUT/pending.log" \
      | grep -E "passed|failed|^E  |FAILED" | tail -6
  done
fi

if [[ " $PARTS " == *" lora "* ]]; then
  # Issue 54: the decode step with 0, 1 and 8 rank-16 adapters against the base engine, each batch's decode steps
  # profiled; then (LORA_NOPDL=1) the profile with programmatic dependent launch off, where each kernel's time is its
  # own (under PDL a kernel's time includes its wait for the one before: the 2026-12-05 profile).
  timeout ${LORA_TIMEOUT:-300} $PY -m radixmesh.benchmarks.lora --model-path build/llama-3.1-8b --dtype bfloat16 \
    --engine-args '{"load_format": "dummy"}' --profile-steps 16 --out "$OUT/lora.json" 2>&1 | tee "$OUT/lora.log" \
    | grep -E "ms/token|goal|Error"
  [[ -n ${LORA_NOPDL:-} ]] && timeout ${LORA_TIMEOUT:-300} $PY -m radixmesh.benchmarks.lora \
    --model-path build/llama-3.1-8b --dtype bfloat16 --engine-args '{"load_format": "dummy", "disable_pdl": true}' \
    --batch-sizes 64 --adapters 0,8 --repeats 1 --profile-steps 16 --out "$OUT/lora_nopdl.json" 2>&1 \
    | tee "$OUT/lora_nopdl.log" | grep -E "ms/token|goal|Error"
  # every LoRA kernel on the one stream (no shrink beside the base products: engine.lora.batch), against the run above
  [[ -n ${LORA_NOSIDE:-} ]] && timeout ${LORA_TIMEOUT:-300} $PY -m radixmesh.benchmarks.lora \
    --model-path build/llama-3.1-8b --dtype bfloat16 --engine-args '{"load_format": "dummy"}' --no-side-stream \
    --out "$OUT/lora_noside.json" 2>&1 | tee "$OUT/lora_noside.log" | grep -E "ms/token|goal|Error"
fi

if [[ " $PARTS " == *" lorasweep "* ]]; then
  # first the kernels' correctness: their twins, and peft's tokens in CUDA graphs
  timeout ${LORA_TIMEOUT:-200} $PY -m pytest -q -p no:cacheprovider tests/kernels/test_lora.py \
    "tests/gpu/test_lora_cuda.py::test_adapters_and_the_base_in_cuda_graphs_match_peft" 2>&1 \
    | tee "$OUT/lora_tests.log" | grep -E "passed|failed|^E  |FAILED" | tail -8
  timeout ${LORA_TIMEOUT:-200} $PY -m radixmesh.benchmarks.lora_kernels --out "$OUT/lora_kernels.json" 2>&1 \
    | tee "$OUT/lora_kernels.log" | grep -E "^(shrink|expand)|Error"
  for tiling in ${LORA_TILINGS:-128x1x4 64x1x4}; do
    timeout ${LORA_TIMEOUT:-200} $PY -m radixmesh.benchmarks.lora --model-path build/llama-3.1-8b --dtype bfloat16 \
      --engine-args '{"load_format": "dummy"}' --expand-tiling $tiling \
      --batch-sizes 1,64 --adapters 0,1,8 --repeats 2 --out "$OUT/lora_$tiling.json" 2>&1 \
      | tee "$OUT/lora_$tiling.log" | grep -E "ms/token|goal|Error"
  done
fi

if [[ $PARTS == *meshprof* ]]; then
  # Where the mesh's time goes at 256 streams (issue 50 item 1): a mesh with metrics on, loaded by the serving
  # benchmark, while load_timeline records where requests wait (router in flight, worker held/queued/running) and
  # py-spy samples which thread of each mesh process holds the GIL (.whl/py_spy-*.whl carried). PROF_MODEL and
  # PROF_FLAGS let the same part run on a CPU with a tiny model.
  $PY -m pip install --no-deps --no-index --quiet .whl/py_spy-*.whl 2>&1 | tail -1
  MODEL=${PROF_MODEL:-build/llama-3.1-8b}
  FLAGS=${PROF_FLAGS:---load-format dummy --dtype bfloat16 --max-running-requests 256}
  CONC=${PROF_CONC:-256}
  PORT=30190
  $PY -m radixmesh.services.launch serve --host 127.0.0.1 --port $PORT --model-path $MODEL $FLAGS --log-level warning \
    --enable-metrics --metrics-sd-file "$OUT/targets.json" ${PROF_LAUNCH:-} > "$OUT/prof_mesh.log" 2>&1 &
  MESH=$!
  for _ in $(seq 600); do
    curl -sf localhost:$PORT/health > /dev/null && break
    kill -0 $MESH 2> /dev/null || { echo "the mesh exited:"; tail -20 "$OUT/prof_mesh.log"; break; }
    sleep 1
  done
  BENCH="$PY -m radixmesh.benchmarks.serving --backend radixmesh --port $PORT --model-path $MODEL
         --random-input-len 512 --random-output-len 128 --random-range-ratio 0.5 --disable-tqdm"
  $BENCH --max-concurrency $CONC --num-prompts $CONC > /dev/null 2>&1  # warm-up: every batch size's first use
  $PY -m radixmesh.benchmarks.load_timeline --targets "$OUT/targets.json" --output "$OUT/load.jsonl" \
    > "$OUT/load_summary.json" 2> "$OUT/load.err" &
  POLL=$!
  SPIES=()
  for svc in worker router tokenizer; do
    pid=$(pgrep -f "radixmesh.services.$svc" | head -1)
    [[ -n $pid ]] || continue
    py-spy record --pid $pid --gil --threads --nonblocking --rate 200 --format raw --duration ${PROF_SECONDS:-25} \
      -o "$OUT/gil_$svc.txt" > "$OUT/pyspy_$svc.log" 2>&1 &
    SPIES+=($!)
    py-spy record --pid $pid --threads --idle --nonblocking --rate 100 --format raw --duration ${PROF_SECONDS:-25} \
      -o "$OUT/all_$svc.txt" > "$OUT/pyspy_all_$svc.log" 2>&1 &
    SPIES+=($!)
  done
  (sleep 8; pid=$(pgrep -f radixmesh.services.worker | head -1); py-spy dump --pid $pid > "$OUT/dump_worker.txt" 2>&1) &
  $BENCH --max-concurrency $CONC --num-prompts ${PROF_PROMPTS:-1024} --thread-cpu --thread-cpu-pid $MESH --output-file "$OUT/prof.jsonl" \
    2>&1 | tee "$OUT/prof_bench.log" | tail -30
  kill -INT $POLL; wait $POLL; cat "$OUT/load_summary.json"
  wait "${SPIES[@]}" 2> /dev/null
  kill $MESH; wait $MESH 2> /dev/null
  for f in "$OUT"/gil_*.txt; do
    echo "== $f: GIL samples by thread"; $PY -m radixmesh.benchmarks.spy_summary "$f" --top 10
  done
fi

if [[ $PARTS == *servab* ]]; then
  # The mesh's overhead with and without GenerateStream, alternated with the offline engine on the same workload, so a
  # drift in the machine's speed falls on all three: ROUNDS x (engine, mesh, mesh with a call per request; CALLS=0
  # leaves the last out). BACKEND= (empty) runs the default attention backends.
  MODEL=build/llama-3.1-8b
  BACKEND=${BACKEND-triton}
  LOAD="--model-path $MODEL --load-format dummy --dtype bfloat16 --max-running-requests 256 --log-level warning
        ${BACKEND:+--attention-backend $BACKEND}"
  WORK="--num-prompts 512 --random-input-len 512 --random-output-len 128 --random-range-ratio 0.5 --max-concurrency 64
        --disable-tqdm --output-file $OUT/serving_ab.jsonl"
  # A throwaway engine run first: Triton compiles its kernels' variants on first use (cached on disk), which
  # otherwise lands in the first measured run (round 1 of the first H100 run: mean TTFT 291 ms against 112 after).
  $PY -m radixmesh.benchmarks.serving --backend engine $LOAD ${WORK/--output-file $OUT\/serving_ab.jsonl/} \
    --num-prompts 128 > "$OUT/serving_ab_warm.log" 2>&1
  for round in $(seq ${ROUNDS:-2}); do
    $PY -m radixmesh.benchmarks.serving --backend engine $LOAD $WORK 2>&1 | tee -a "$OUT/serving_ab.log" \
      | grep -E "Backend|Failed|Output token|ITL"
    $PY -m radixmesh.benchmarks.serving --backend radixmesh --launch $LOAD $WORK 2>&1 | tee -a "$OUT/serving_ab.log" \
      | grep -E "Backend|Failed|Output token|ITL"
    [[ ${CALLS:-1} == 0 ]] && continue
    $PY -m radixmesh.benchmarks.serving --backend radixmesh --launch --launch-args=--disable-generate-stream \
      $LOAD $WORK 2>&1 | tee -a "$OUT/serving_ab.log" | grep -E "Backend|Failed|Output token|ITL"
  done
fi

if [[ $PARTS == *router* ]]; then
  # the A/B against an earlier tree only where $BASE (default prev/) holds one
  BASE=${BASE:-prev}
  [[ -d $BASE ]] && { [[ -e $BASE/models ]] || ln -s "$PWD/models" "$BASE/models"; }
  SCEN="--scenarios generate_stream_16 chat_stream_16 generate_1 --repeats 3 --stream-requests 3000"
  [[ -d $BASE ]] && for round in $(seq ${ROUNDS:-2}); do
    for tree in . $BASE; do
      name=this; [[ $tree == $BASE ]] && name=base
      echo "round $round: $name" | tee -a "$OUT/router.log"
      (cd $tree && PYTHONPATH=$PWD $PY -m radixmesh.benchmarks.router $SCEN --out "$OUT/router-$name-$round.json" 2>&1 \
        | tee -a "$OUT/router.log" | grep -E "^(generate|chat)")
    done
  done
  # SGLang's Rust router beside ours (carry .whl/sglang: pip download sglang-router==0.3.2 and its dependencies for
  # this Python, and .whl/router with the grpcio/protobuf pins)
  if [[ -d .whl/sglang ]]; then
    $PY -m pip install --no-deps --no-index --quiet .whl/sglang/*.whl 2>&1 | tail -2
    for round in $(seq ${ROUNDS:-2}); do
      $PY -m radixmesh.benchmarks.router_vs_sglang --scenarios generate_1 generate_stream_16 chat_stream_16 \
        --repeats 3 --stream-requests 3000 --out "$OUT/vs-sglang-$round.json" 2>&1 | tee -a "$OUT/vs_sglang.log" \
        | tail -3
    done
  fi
  # tracing off against the default ratio and 1.0, per scenario (TRACE_SCEN); TRACE_PAIRS fresh router sets one
  # after another, rounds pooled
  for sc in ${TRACE_SCEN:-generate_1 chat_stream_16}; do
    $PY -m radixmesh.benchmarks.router --scenarios $sc --requests ${TRACE_REQUESTS:-500} --stream-requests 300 \
      --repeats ${TRACE_REPEATS:-20} --pairs ${TRACE_PAIRS:-1} --warmup 200 --trace-ab ${TRACE_ARGS:-} \
      --out "$OUT/trace-ab-$sc.json" 2>&1 | tee -a "$OUT/trace_ab.log" | tail -4
  done
fi

if [[ $PARTS == *meshab* ]]; then
  # A change to the serving path against the tree it replaces: ROUNDS x (engine, mesh of this tree, mesh of $BASE),
  # alternated. $BASE holds an earlier commit's engine, services, kernels and radixmesh stubs with this tree's
  # benchmarks, and a link build -> ../build (carry it).
  BASE=${BASE:-prev}
  MODEL=build/llama-3.1-8b
  LOAD="--model-path $MODEL --load-format dummy --dtype bfloat16 --max-running-requests 256 --log-level warning
        --attention-backend ${BACKEND:-triton}"
  WORK="--num-prompts 512 --random-input-len 512 --random-output-len 128 --random-range-ratio 0.5 --max-concurrency 64
        --disable-tqdm --thread-cpu --output-file $OUT/meshab.jsonl"
  SHOW="Backend|Failed|Output token|ITL|TTFT|main|other"
  # Throwaway runs first (the engine's, then a mesh's): the first mesh of a machine ran with a P90 TTFT of 2.3 s
  for backend in engine "radixmesh --launch"; do
    $PY -m radixmesh.benchmarks.serving --backend $backend $LOAD ${WORK/--output-file $OUT\/meshab.jsonl/} \
      --num-prompts 128 >> "$OUT/meshab_warm.log" 2>&1
  done
  for round in $(seq ${ROUNDS:-2}); do
    $PY -m radixmesh.benchmarks.serving --backend engine $LOAD $WORK 2>&1 | tee -a "$OUT/meshab.log" | grep -E "$SHOW"
    for tree in ${ORDER:-this base}; do  # ORDER="base this" swaps them
      dir=.; [[ $tree == base ]] && dir=$BASE
      (cd "$dir" && PYTHONPATH=$PWD $PY -m radixmesh.benchmarks.serving --backend radixmesh --launch $LOAD $WORK 2>&1 \
        | tee -a "$OUT/meshab.log" | grep -E "$SHOW")
    done
  done
fi

if [[ $PARTS == *tiles* ]]; then
  # Issue 11: kernels.extend_attention's tiles swept on this GPU over a round-5 wave's extend (benchmarks.extend_tiles);
  # TILES_APPLY=1 runs the later parts (multiturn) with the fastest (RADIXMESH_EXTEND_TILES)
  $PY -m radixmesh.benchmarks.extend_tiles --result-file "$OUT/extend_tiles.jsonl" 2>&1 | tee "$OUT/extend_tiles.log" \
    | tail -3
  best=$(sed -n 's/^best RADIXMESH_EXTEND_TILES=//p' "$OUT/extend_tiles.log")
  if [[ ${TILES_APPLY:-0} == 1 && -n $best ]]; then export RADIXMESH_EXTEND_TILES=$best; echo "using tiles $best"; fi
fi

if [[ $PARTS == *multiturn* ]]; then
  # Issue 11: multi-turn TTFT with the hierarchy off, with a host tier (L2), and with L2 + the kvstore (L3), on a
  # device pool about a fifth of the working set (32 clients x 4 turns of 1024 tokens + 64 answered, 1024 shared;
  # MAX_TOKENS=43008 makes it a quarter: the issue's "4x working set").
  MODEL=build/llama-3.1-8b
  # ATTN picks the attention backend (default triton); CLIENTS, ROUNDS, REQ_LEN, SHARED, MAX_PARALLEL and GRAPH_BS
  # reshape the workload (SGLang's bench_multiturn defaults: 256 clients, 5 rounds, 512-token turns, no shared prompt,
  # 128 in flight).
  W="--launch --model-path $MODEL --load-format dummy --dtype bfloat16 --attention-backend ${ATTN:-triton}
     --cuda-graph-max-bs ${GRAPH_BS:-32} --page-size 64 --max-total-tokens ${MAX_TOKENS:-32768}
     --num-clients ${CLIENTS:-32} --num-rounds ${ROUNDS:-4} --request-length ${REQ_LEN:-1024} --output-length 64
     --shared-system-prompt-len ${SHARED:-1024} --max-parallel ${MAX_PARALLEL:-8} --seed 1 --log-level warning"
  # A throwaway run first: Triton compiles its kernels' variants on first use (cached on disk), which otherwise
  # lands in the first measured configuration's first round (it added ~400 ms to round 1 of "hierarchy off").
  $PY -m radixmesh.benchmarks.multiturn ${W/--num-clients ${CLIENTS:-32}/--num-clients 8} --disable-tqdm \
    > "$OUT/multiturn-warm.log" 2>&1
  # and once more with a host tier on a pool half of that run's working set, so the hierarchy's copy kernels
  # (both directions) are compiled before a measured run evicts or loads anything
  $PY -m radixmesh.benchmarks.multiturn ${W/--num-clients ${CLIENTS:-32}/--num-clients 8} --disable-tqdm \
    --enable-hierarchical-cache --hicache-ratio 4 --max-total-tokens $((8 * ${ROUNDS:-4} * (${REQ_LEN:-1024} + 64) / 2 / 64 * 64)) \
    >> "$OUT/multiturn-warm.log" 2>&1
  CONFIGS=("" "--enable-hierarchical-cache --hicache-ratio 4 --hicache-io-backend kernel"
           "--enable-hierarchical-cache --hicache-ratio 1 --kvstore --kvstore-capacity-bytes 34359738368
            --hicache-storage-prefetch-policy timeout --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 1"
           "--enable-hierarchical-cache --hicache-ratio 4 --kvstore --kvstore-capacity-bytes 34359738368
            --hicache-storage-prefetch-policy timeout --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_back --kvstore
            --kvstore-capacity-bytes 34359738368 --hicache-storage-prefetch-policy timeout
            --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 1 --hicache-write-policy write_back --kvstore
            --kvstore-capacity-bytes 34359738368 --hicache-storage-prefetch-policy timeout
            --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_back"
           "--enable-hierarchical-cache --hicache-ratio 4 --kvstore --kvstore-transport mooncake
            --kvstore-capacity-bytes 34359738368 --hicache-storage-prefetch-policy timeout
            --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 1 --kvstore --kvstore-transport mooncake
            --kvstore-capacity-bytes 34359738368 --hicache-storage-prefetch-policy timeout
            --hicache-storage-backend-extra-config {\"prefetch_timeout_s\":2}"
           "--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_through_selective"
           "--enable-hierarchical-cache --hicache-ratio 4 --hicache-io-backend direct"
           "--attention-backend flashinfer"
           "--attention-backend flashinfer --enable-hierarchical-cache --hicache-ratio 4")
  # 0 off, 1 L2 4x (copy kernel), 2 L2 1x + L3, 3 L2 1x, 4 L2 4x + L3, 5-6 as 4 and 2 with write_back, 7 L2 4x write_back,
  # 8-9 as 4 and 2 with page bytes over the Mooncake transfer engine (TCP) instead of gRPC, 10 L2 4x
  # write_through_selective, 11 L2 4x with loads over the copy engine (--hicache-io-backend direct; the default where
  # the driver batches copies, so every L2 configuration but 1, which asks for the copy kernel, runs it), 12-13 off and
  # L2 4x on FlashInfer (its prefill kernel: RADIXMESH_FLASHINFER_PREFILL_KERNEL=fa2|fa3, default fa2)
  # MT_TREES="prev ." runs every configuration on an earlier tree too (a copy of its services, benchmarks, engine,
  # kernels and radixmesh stubs in that folder), alternated with this one; each tree's records go to a file of its own
  # MT_PLAN="TREE:CONFIG ..." runs exactly those pairs in that order instead (e.g. ".:0 alt:1 .:1 .:0 alt:1 .:1").
  # Make an earlier tree from files the machine gets (the device's .git may lack commits that have not landed:
  # `git archive REV services benchmarks engine kernels | tar x -C prev_tree` here), and link its stubs there
  # (`ln -s $PWD/radixmesh prev_tree/radixmesh`: an ignored folder inside an untracked one does not travel);
  # MT_PROFILE="EXTENDS:STEPS" (e.g. "4,52:140") profiles the workers' steps after those extend counts
  # (RADIXMESH_TORCH_PROFILE, radixmesh/engine/profiling.py) into $OUT/prof-TREE-CONFIG.tgz (traces, tables, and
  # benchmarks.timeline's reading of each)
  # a pair written "spy:TREE:CONFIG" runs under py-spy (every process of the mesh, 100 samples a second, never
  # pausing them; collapsed stacks in $OUT/pyspy-TREE-CONFIG.txt) and its records go to multiturn-spy.jsonl
  plan=${MT_PLAN:-}
  if [[ -z $plan ]]; then
    for round in $(seq ${MT_ROUNDS:-1}); do
      for tree in ${MT_TREES:-.}; do for i in ${MT_CONFIGS:-0 1 2}; do plan+=" $tree:$i"; done; done
    done
  fi
  for pair in $plan; do
    spy=; [[ $pair == spy:* ]] && spy=1 && pair=${pair#spy:}
    tree=${pair%%:*} i=${pair##*:}
    tag=${tree//[.\/]/}
    [[ $tree != . ]] && ln -sfn "$PWD/build" "$tree/build"
    extra=${CONFIGS[$i]}
    echo "== multiturn [${tag:-this tree}] ${extra:-hierarchy off}${spy:+ (under py-spy)}"
    run=($PY -m radixmesh.benchmarks.multiturn $W $extra)
    if [[ -n $spy ]]; then
      run=(py-spy record --subprocesses --nonblocking --rate 100 --format raw
           --output "$OUT/pyspy-${tag:-this}-$i.txt" -- "${run[@]}" --output-file "$OUT/multiturn-spy.jsonl")
    else
      run+=(--output-file "$OUT/multiturn${tag:+-$tag}.jsonl")
    fi
    prof=; [[ -n ${MT_PROFILE:-} ]] && prof="$OUT/prof-${tag:-this}-$i:$MT_PROFILE"
    (cd "$tree" && PYTHONPATH=$PWD RADIXMESH_TORCH_PROFILE=$prof "${run[@]}") 2>&1 | tee -a "$OUT/multiturn.log" \
      | grep -E "TTFT|hit|Working|throughput|py-spy|rror" | head -14
    if [[ -n $prof ]]; then
      dir=${prof%:*:*}
      for t in "$dir"/*.json.gz; do
        $PY -m radixmesh.benchmarks.timeline "$t" > "${t%.json.gz}.timeline.txt" 2>&1
        tail -3 "${t%.json.gz}.timeline.txt"
      done
      # one archive per run: the device returns a few files per call, and a lost trace cannot be read again
      tar czf "$dir.tgz" -C "$OUT" "$(basename "$dir")" && rm -rf "$dir"
    fi
  done
fi

if [[ $PARTS == *extend* ]]; then
  # Issue 11: a multi-turn wave's extend forward (10 turns of 512 new tokens) over the histories of rounds 3 and 5
  # against the same forward over none, per attention backend: what attending to the history costs
  for backend in ${BACKENDS:-triton flashinfer}; do
    for prefix in 1152 2304; do
      $PY -m radixmesh.engine.bench_one_batch $COMMON --attention-backend $backend --batch-size 1 --input-len 64 \
        --output-len 2 --extend-over $prefix 512 10 --result-file "$OUT/extend.jsonl" 2>&1 | grep -E "^extend" \
        | sed "s/^/$backend: /" | tee -a "$OUT/extend.log"
    done
  done
fi

if [[ $PARTS == *kvcopy* ]]; then
  # Issue 11: host <-> device page copies, staged against kernels.kv_pages (benchmarks.kv_copy), after their tests
  $PY -m pytest -q -p no:cacheprovider tests/kernels/test_kv_pages.py tests/gpu/test_hicache_cuda.py \
    tests/unit/test_hierarchy.py 2>&1 | tail -3 | tee "$OUT/kvcopy-tests.log"
  $PY -m radixmesh.benchmarks.kv_copy --result-file "$OUT/kv_copy.jsonl" 2>&1 | tail -40 | tee "$OUT/kv_copy.log"
fi

if [[ $PARTS == *transport* ]]; then
  # Issue 11: L3 page bytes between a host pool and the kvstore, gRPC against the Mooncake transfer engine (TCP,
  # loopback), through the worker's storage path; 8B-shaped pages of 64 and of 16 tokens.
  for ps in 64 16; do
    $PY -m radixmesh.benchmarks.kvstore_transport --shape 8b --page-size $ps --pages $((4096 / ps)) \
      --batch $((512 / ps)) --output-file $OUT/transport.jsonl 2>&1 | grep -v "^[IEW][0-9]\|InitGoogle" \
      | tee -a "$OUT/transport.log"
  done
fi

if [[ $PARTS == *routing* ]]; then
  # Issue 11: routing on the global index against cache_aware, two workers sharing the GPU (each with a host tier),
  # behind one router and behind two router replicas that turns alternate between. (mem_fraction_static is of the
  # whole GPU, as in SGLang: a worker needs free - total * (1 - fraction) > 0 after both loaded their weights.)
  # On two GPUs: GPU_IDS="--worker-gpu-ids 0 1" gives each worker its own.
  MODEL=build/llama-3.1-8b
  W="--launch --model-path $MODEL --load-format dummy --dtype bfloat16 --attention-backend triton --cuda-graph-max-bs 32
     --mem-fraction-static 0.8 --page-size 64 --max-total-tokens 32768 --num-clients ${CLIENTS:-32} --num-rounds 4
     --request-length 1024 --output-length 64 --shared-system-prompt-len 1024 --max-parallel 8 --seed 1
     --log-level warning --workers 2 --enable-hierarchical-cache --hicache-ratio 4 --disable-tqdm ${GPU_IDS:-}
     --output-file $OUT/routing.jsonl"
  POLICIES=("--policy cache_aware" "--kvstore --no-kvstore-l3 --policy kv_index"
            "--routers 2 --policy cache_aware" "--routers 2 --kvstore --no-kvstore-l3 --policy kv_index")
  for i in ${ROUTING:-0 1 2 3}; do
    extra=${POLICIES[$i]}
    echo "== routing $extra"
    $PY -m radixmesh.benchmarks.multiturn $W $extra 2>&1 | tee -a "$OUT/routing.log" \
      | grep -E "Mean TTFT|P90 TTFT|hit rate|rror" | head -5
  done
fi

if [[ " $PARTS " == *" fp8 "* ]]; then
  # Issue 52, fp8 weights. The floor of a batch-1 step is the weights it reads over the copy bandwidth: about 7.0 GB
  # of fp8 projections + 1.05 GB of the bf16 LM head = 8.0 GB (bench_roofline.decode_weight_bytes counts the fp8
  # weights' one byte). Prediction (written before any run): batch 1 at 2.1-2.3 ms per step per-channel (1.10-1.2x of
  # a ~1.9 ms floor at ~4.2 TB/s; bf16 was 3.93 ms), block-wise 0.05-0.1 ms slower (its scale loads); batch 64/256
  # near bf16's or better (W8A8 on torch._scaled_mm / the Triton block GEMM, plus one activation-quantization kernel
  # per product); the 8192-token prefill faster than bf16's by 1.3-1.6x where the fp8 GEMMs reach ~2x bf16's rate.
  [[ " $PARTS " == *" newgpu "* || -n ${SKIP_FP8_TESTS:-} ]] || $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_quant.py \
    tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemv_rows.py tests/kernels/test_fp8_gemm.py \
    tests/gpu/test_fp8_weights_cuda.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -8
  # The fp8 products of 2-16 rows (kernels.fp8_gemv_rows: each weight element read once for all rows) alone, per 8B
  # projection and summed per layer, at 1/2/4/8/16 rows against the fp8 weight-read floor (~51 us a layer at
  # ~4.3 TB/s): the one-row kernel once per row, the old tensor-core fp8_gemv, each fp8_gemv_rows tile, bf16 cuBLAS.
  # Prediction (before any run, H200, us a layer at 8 rows): fp8_gemv_rows on the tensor cores 60-75 (1.2-1.5x the
  # floor), on the CUDA cores 110-130; the one-row kernel x8 520-600; the old fp8_gemv ~200; bf16 cuBLAS 125-140.
  # At 2 rows the CUDA-core tiles 60-70; at 16 rows the tensor cores as at 8 (65-80).
  [[ -n ${SKIP_FP8_ROWS:-} ]] || $PY -m radixmesh.benchmarks.fp8_rows --scales ${FP8_ROWS_SCALES:-channel} \
    --result-file $OUT/fp8_rows.jsonl 2>&1 | tee "$OUT/fp8_rows.log" | grep -E "^rows|rror" | tail -60
  BLOCK_CFG=build/llama-3.1-8b-fp8-block
  block_fp8_config $CFG $BLOCK_CFG
  B="--load-format dummy --dtype bfloat16 --skip-tokenizer-init --log-level warning --batch-size 1 8 64 256
     --input-len 512 --output-len 32 --prefill-len 8192 --roofline --result-file $OUT/fp8.jsonl"
  for variant in "bf16:--model-path $CFG" "fp8-channel:--model-path $CFG --quantization fp8 --fp8-gemm-backend triton" \
                 "fp8-block:--model-path $BLOCK_CFG --fp8-gemm-backend triton"; do
    echo "== ${variant%%:*}" | tee -a "$OUT/fp8.log"
    $PY -m radixmesh.engine.bench_one_batch ${variant#*:} $B 2>&1 | tee -a "$OUT/fp8.log" | grep -v Warning | tail -10
  done
fi

if [[ -n ${PACK_TRITON:-} ]]; then
  # The compiled kernels (binaries, metadata, launchers; not the intermediate IR) for the next fresh machine, if they
  # fit what comes back from $OUT (16 MiB a file): copy $OUT's triton.tgz to .tcache/ and carry .tcache
  tar -czf "$OUT/triton.tgz" -C / --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' \
    --exclude='*.source' --exclude=.unpacked "${TRITON_CACHE_DIR#/}"
  size=$(stat -c %s "$OUT/triton.tgz")
  echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels, packed $((size / 1024)) KiB"
  (( size < 16 * 1024 * 1024 )) || { rm -f "$OUT/triton.tgz"; echo "triton cache: too large to bring back"; }
fi
