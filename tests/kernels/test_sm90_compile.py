"""The GPU-only paths of the kernels compiled for an H100/H200 (sm_90) on any machine, GPU or not: programmatic
dependent launch (every kernel of the decode step that takes part in it) and the L2 prefetches exist only in
compiled kernels (Triton's interpreter skips them), so without this a mistake in them would wait for the next GPU
session to show. Triton compiles to PTX and runs its bundled ptxas without a driver; the test reads the PTX for the
instructions each path must produce (a child process: this one's kernels were decorated for the interpreter)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Compiles each kernel with explicit argument types (pointers, int32 sizes and strides, constexprs) for sm_90 and
# prints {name: ptx} as JSON.
_COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixmesh.kernels import (activation, decode_attention, extend_attention, gemv, kv_store, lora, mla_decode,
                               mla_absorb, mla_extend, mla_rope, moe, moe_activation, moe_decode, moe_decode_fp8, moe_gate, moe_mxfp4, moe_shared, norm,
                               rotary)

def ptx(fn, pointers, floats, constexprs, warps, stages, aligned=(), fusion=True):
    sig = {n: pointers.get(n) or ("fp32" if n in floats else "constexpr" if n in constexprs else "i32")
           for n in fn.arg_names}
    # `aligned`: arguments a launch would find divisible by 16 (pointers, sizes), as Triton's JIT marks them
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": fusion}).asm["ptx"]

attn = dict(Q="*bf16", K="*bf16", V="*bf16", ReqToToken="*i32", ReqPoolIdx="*i64", SeqLens="*i64", Positions="*i64",
            TreeStart="*i64", TreeBits="*i64", Sinks="*bf16", Out="*bf16", PartialO="*fp32", PartialLse="*fp32")
stage1 = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, NUM_SPLITS=64, PRECISION="tf32",
              UPCAST=False, CAPPED=False, PDL=True, PREFETCH_LINES=2, LINE_ELEMS=64, TREE=False, V_SCALED=False,
              SINK=False)
scales = {"scale_log2", "prefix_scale_log2", "cap_log2", "v_scale"}  # the float arguments of the attention kernels
out = {
    "stage1": ptx(decode_attention._decode_stage1, attn, scales, stage1, 4, 2),
    "gemv": ptx(gemv._gemv_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16"), set(),
                dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, PREFETCH_LINES=16, LINE_ELEMS=64, PDL=True, UPCAST=False,
                     PRECISION="tf32", HAS_BIAS=False), 4, 4),
    "gemv_row": ptx(gemv._gemv_row_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16"), set(),
                    dict(K=4096, BLOCK_N=2, BLOCK_K=1024, PREFETCH_LINES=64, LINE_ELEMS=64, PDL=True,
                         HAS_BIAS=False), 4, 1, aligned=("X", "W", "B", "Y", "N", "stride_wn")),
    "gemv_row_wait": ptx(gemv._gemv_row_kernel, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16"), set(),
                         dict(K=14336, BLOCK_N=2, BLOCK_K=1024, PREFETCH_LINES=0, LINE_ELEMS=64, PDL=True,
                              HAS_BIAS=False), 4, 1, aligned=("X", "W", "B", "Y", "N", "stride_wn")),
}
# decode over DeepSeek-V3's latent cache (512 + 64 a token, 128 heads in programs of 16; kernels.mla_decode)
mla_args = dict(Q="*bf16", KV="*bf16", ReqToToken="*i32", ReqPoolIdx="*i64", SeqLens="*i64", TreeStart="*i64",
                TreeBits="*i64", Out="*bf16", PartialO="*fp32", PartialLse="*fp32")
mla_stage1 = dict(HEADS=128, RANK=512, ROPE=64, BLOCK_H=16, BLOCK_N=32, BLOCK_R=512, BLOCK_P=64, NUM_SPLITS=4,
                  PRECISION="tf32", UPCAST=False, V_SCALED=False, TREE=False, PDL=True)
out["mla_stage1"] = ptx(mla_decode._latent_stage1, mla_args, {"scale_log2", "v_scale"}, mla_stage1, 4, 2)
# (NEXTN's draft trees: the tree rows' span bits masking the keys)
out["mla_stage1_tree"] = ptx(mla_decode._latent_stage1, mla_args, {"scale_log2", "v_scale"},
                             dict(mla_stage1, TREE=True), 4, 2)
# DeepSeek-V3's query and key rows (128 heads in blocks of 16, the latent of 512 and 64 rope dims, interleaved)
out["mla_query_key"] = ptx(mla_rope._mla_query_key_kernel,
                           dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", latent_ptr="*bf16", k_pe_ptr="*bf16",
                                cos_ptr="*bf16", sin_ptr="*bf16", query_ptr="*bf16", key_ptr="*bf16"), set(),
                           dict(RANK=512, ROPE=64, BLOCK_H=16, BLOCK_R=512, BLOCK_HALF=32, INTERLEAVED=True,
                                ROUND=triton.language.bfloat16, MID=triton.language.bfloat16, PDL=True), 4, 1,
                           fusion=False)
out["mla_extend"] = ptx(mla_extend._latent_extend_kernel,
                        dict(Q="*bf16", KvNew="*bf16", Out="*bf16", KvBuf="*bf16", ReqToToken="*i32",
                             ReqPoolIdx="*i64", PrefixLens="*i64", ExtendLens="*i64", QoStarts="*i64"),
                        {"scale_log2", "prefix_scale_log2", "kv_scale"},
                        dict(RANK=512, ROPE=64, BLOCK_M=32, BLOCK_N=16, BLOCK_R=512, BLOCK_P=64, PRECISION="tf32",
                             UPCAST=False), 8, 2)
# Gemma's attention: soft-capped scores (decode), a sliding window and soft-capped scores (extend), head_dim 256
out["stage1_tree"] = ptx(decode_attention._decode_stage1, attn, scales,
                        dict(stage1, TREE=True), 4, 2)
out["stage1_capped"] = ptx(decode_attention._decode_stage1, attn, scales,
                           dict(stage1, HEAD_DIM=256, BLOCK_N=32, BLOCK_D=256, CAPPED=True), 4, 2)
ext = dict(Q="*bf16", KNew="*bf16", VNew="*bf16", Out="*bf16", KBuf="*bf16", VBuf="*bf16", ReqToToken="*i32",
           ReqPoolIdx="*i64", PrefixLens="*i64", ExtendLens="*i64", QoStarts="*i64", Sinks="*bf16")
out["extend_windowed"] = ptx(extend_attention._extend_kernel, ext, scales,
                             dict(GROUP=4, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=32, BLOCK_D=256, PRECISION="tf32",
                                  UPCAST=False, CAPPED=True, WINDOWED=True, V_SCALED=False, SINK=False), 4, 2)
# GPT-OSS's attention: 64-wide heads in groups of 8, each head's sink, every other layer windowed
out["stage1_sinks"] = ptx(decode_attention._decode_stage1, attn, scales,
                          dict(stage1, GROUP=8, HEAD_DIM=64, BLOCK_D=64, NUM_SPLITS=1, SINK=True), 4, 2)
out["extend_sinks"] = ptx(extend_attention._extend_kernel, ext, scales,
                          dict(GROUP=8, HEAD_DIM=64, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, PRECISION="tf32",
                               UPCAST=False, CAPPED=False, WINDOWED=True, V_SCALED=False, SINK=True), 4, 3)
# an fp8 cache with per-layer K and V scales (--kv-cache-dtype fp8_e4m3 and a checkpoint's k_scale / v_scale)
fp8 = dict(K="*fp8e4nv", V="*fp8e4nv")
out["stage1_fp8_scaled"] = ptx(decode_attention._decode_stage1, dict(attn, **fp8), scales,
                               dict(stage1, V_SCALED=True), 4, 2)
out["extend_fp8_scaled"] = ptx(extend_attention._extend_kernel, dict(ext, KBuf="*fp8e4nv", VBuf="*fp8e4nv"), scales,
                               dict(GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, PRECISION="tf32",
                                    UPCAST=False, CAPPED=False, WINDOWED=False, V_SCALED=True, SINK=False), 4, 3)
# kernels that begin with runtime.pdl_enter: the wait comes before any load
bf16 = "*bf16"
stage2_args = dict(PartialO="*fp32", PartialLse="*fp32", Out=bf16, SeqLens="*i64", Sinks=bf16)
out["stage2"] = ptx(decode_attention._decode_stage2, stage2_args, set(),
                    dict(HEAD_DIM=128, NUM_SPLITS=64, BLOCK_N=64, BLOCK_S=16, BLOCK_D=128, PDL=True, SINK=False), 4, 1)
out["stage2_sinks"] = ptx(decode_attention._decode_stage2, stage2_args, set(),
                          dict(HEAD_DIM=64, NUM_SPLITS=16, BLOCK_N=64, BLOCK_S=16, BLOCK_D=64, PDL=True, SINK=True),
                          4, 1)
out["silu_and_mul"] = ptx(activation._silu_and_mul_kernel, dict(x_ptr=bf16, out_ptr=bf16), set(),
                          dict(BLOCK=1024, PDL=True, GELU=False), 4, 1)
# (Gemma's GELU, libdevice's tanh)
out["gelu_and_mul"] = ptx(activation._silu_and_mul_kernel, dict(x_ptr=bf16, out_ptr=bf16), set(),
                          dict(BLOCK=1024, PDL=True, GELU=True), 4, 1)
norm_args = dict(x_ptr=bf16, res_ptr=bf16, w_ptr=bf16, out_ptr=bf16, res_out_ptr=bf16, post_w_ptr=bf16)
out["rmsnorm"] = ptx(norm._rmsnorm_kernel, norm_args, {"eps"},
                     dict(HAS_RESIDUAL=True, ROWS=1, BLOCK=4096, PDL=True, OFFSET=False, POST=False,
                          FLOAT_WEIGHT=False, FINAL=True), 8, 1)
# Gemma 2/3 between sublayers (kernels.norm.gemma_sandwich): the post-norm, the residual sum, the next norm
out["gemma_sandwich"] = ptx(norm._rmsnorm_kernel, norm_args, {"eps"},
                            dict(HAS_RESIDUAL=True, ROWS=1, BLOCK=4096, PDL=True, OFFSET=True, POST=True,
                                 FLOAT_WEIGHT=False, FINAL=True), 8, 1)
# OLMo 2 between sublayers (kernels.norm.olmo2_post_add): the post-norm with its float32 weight, the residual sum
out["olmo2_post_add"] = ptx(norm._rmsnorm_kernel, norm_args, {"eps"},
                            dict(HAS_RESIDUAL=True, ROWS=1, BLOCK=4096, PDL=True, OFFSET=False, POST=True,
                                 FLOAT_WEIGHT=True, FINAL=False), 8, 1)
out["store_kv"] = ptx(kv_store._store_kv_kernel, dict(k_ptr=bf16, v_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16,
                                                      loc_ptr="*i64"), set(),
                      dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, STORE_V=True, PDL=True), 4, 1)
# (with Qwen3's q/k norms, whose weights it loads after the wait too)
out["rotary"] = ptx(rotary._rotary_kernel, dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, q_out_ptr=bf16, k_dst_ptr=bf16,
                                                v_dst_ptr=bf16, cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64",
                                                loc_ptr="*i64", q_norm_ptr=bf16, k_norm_ptr=bf16), {"eps"},
                    dict(HALF=64, BLOCK_H=8, BLOCK_HALF=64, STORE=True, NORM=True, PDL=True, TAIL=0, BLOCK_TAIL=1,
                         BLOCK_HEAD=128, OFFSET=False, MAPPED=False, INTERLEAVED=False, UPCAST=False, LAYER=False,
                         BIAS=False, W_HEADS=False), 4, 1, fusion=False)
# (partial rotary with q/k norms: 64 of 128 dimensions rotate, offset norms, the store through a slot map,
# interleaved pairs in float32)
out["rotary_partial"] = ptx(rotary._rotary_kernel, dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, q_out_ptr=bf16,
                                                        k_dst_ptr=bf16, v_dst_ptr=bf16, cos_ptr="*fp32",
                                                        sin_ptr="*fp32", pos_ptr="*i64", loc_ptr="*i64",
                                                        q_norm_ptr=bf16, k_norm_ptr=bf16, map_ptr="*i64"),
                            {"eps"},
                            dict(HALF=32, BLOCK_H=8, BLOCK_HALF=32, STORE=True, NORM=True, PDL=True, TAIL=64,
                                 BLOCK_TAIL=64, BLOCK_HEAD=128, OFFSET=True, MAPPED=True, INTERLEAVED=True,
                                 UPCAST=True, LAYER=False, BIAS=False, W_HEADS=False), 4, 1, fusion=False)
# (Command-R+'s per-head LayerNorms, a float32 weight row a head, before interleaved pairs; Phi's with a bias)
layer_args = dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, q_out_ptr=bf16, k_dst_ptr=bf16, v_dst_ptr=bf16, cos_ptr="*fp32",
                  sin_ptr="*fp32", pos_ptr="*i64", loc_ptr="*i64", q_norm_ptr="*fp32", k_norm_ptr="*fp32")
layer_tiles = dict(HALF=64, BLOCK_H=8, BLOCK_HALF=64, STORE=True, NORM=True, PDL=True, TAIL=0, BLOCK_TAIL=1,
                   BLOCK_HEAD=128, OFFSET=False, MAPPED=False, INTERLEAVED=True, UPCAST=True, LAYER=True, BIAS=False,
                   W_HEADS=True)
out["rotary_layer"] = ptx(rotary._rotary_kernel, layer_args, {"eps"}, layer_tiles, 4, 1, fusion=False)
out["rotary_layer_bias"] = ptx(rotary._rotary_kernel, dict(layer_args, q_norm_ptr=bf16, k_norm_ptr=bf16,
                                                           q_bias_ptr=bf16, k_bias_ptr=bf16), {"eps"},
                               dict(layer_tiles, HALF=16, BLOCK_HALF=16, TAIL=32, BLOCK_TAIL=32, BLOCK_HEAD=64,
                                    INTERLEAVED=False, UPCAST=False, BIAS=True, W_HEADS=False), 4, 1, fusion=False)
# Qwen2-MoE's gated shared expert joined to the routed output (Qwen2-57B-A14B's hidden 3584)
out["moe_shared_add"] = ptx(moe_shared._gated_shared_add_kernel, dict(routed_ptr=bf16, shared_ptr=bf16, x_ptr=bf16,
                                                                      gate_ptr=bf16, out_ptr=bf16), set(),
                            dict(BLOCK=4096, PDL=True), 8, 1, fusion=False)
out["moe_shared_add_fused"] = ptx(moe_shared._gated_shared_add_kernel, dict(routed_ptr=bf16, shared_ptr=bf16,
                                                                            x_ptr=bf16, gate_ptr=bf16, out_ptr=bf16),
                                  set(), dict(BLOCK=4096, PDL=True), 8, 1)
# (each kernel above compiled as it is launched: those that round a product before a sum, op for op as torch, with
# enable_fp_fusion=False)
# the few-token MoE path's two launches (a batch-1 decode of a mixture of experts runs them in CUDA graphs)
tiles = moe_decode.DecodeTiles()
gate_up_args = dict(x_ptr=bf16, w_ptr=bf16, ids_ptr="*i32", act_ptr=bf16, b_ptr=bf16)
gate_up_tiles = dict(TOP_K=8, K=2048, BLOCK_N=tiles.up_block_n, BLOCK_K=tiles.up_block_k, PDL=True, HAS_BIAS=False,
                     SWIGLU=False)
out["moe_gate_up"] = ptx(moe_decode._gate_up_kernel, gate_up_args, {"alpha", "limit"}, gate_up_tiles,
                         tiles.up_warps, 1)
down_args = dict(act_ptr=bf16, w_ptr=bf16, ids_ptr="*i32", weights_ptr="*fp32", out_ptr=bf16, b_ptr=bf16)
out["moe_down"] = ptx(moe_decode._down_sum_kernel, down_args, set(),
                      dict(TOP_K=8, K=768, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k, PDL=True,
                           HAS_BIAS=False), tiles.down_warps, 1)
stacked_args = dict(down_args, ids_ptr="*i64", weights_ptr=bf16)
out["moe_down_stacked"] = ptx(moe_decode._down_stacked_kernel, stacked_args, set(),
                              dict(TOP_K=8, KB=8, K=768, BLOCK_N=4, BLOCK_K=256, PDL=True, HAS_BIAS=False), 4, 1)
# GPT-OSS's experts (gpt-oss-20b's layer: top 4 of 32, hidden and intermediate 2880): biases, the clamped SwiGLU
out["moe_gate_up_gpt_oss"] = ptx(moe_decode._gate_up_kernel, gate_up_args, {"alpha", "limit"},
                                 dict(gate_up_tiles, TOP_K=4, K=2880, HAS_BIAS=True, SWIGLU=True), tiles.up_warps, 1)
out["moe_down_stacked_gpt_oss"] = ptx(moe_decode._down_stacked_kernel, stacked_args, set(),
                                      dict(TOP_K=4, KB=4, K=2880, BLOCK_N=4, BLOCK_K=256, PDL=True, HAS_BIAS=True),
                                      4, 1)
# the grouped path's GPT-OSS steps around its products: the gate/up bias with the clamped SwiGLU, the weighted down bias
out["moe_biased_act"] = ptx(moe_activation._biased_act_kernel, dict(gu_ptr=bf16, ids_ptr="*i64", b_ptr=bf16, out_ptr=bf16),
                            {"alpha", "limit"}, dict(BLOCK=1024, HAS_BIAS=True, PDL=True), 4, 1)
out["moe_weighted_bias"] = ptx(moe_activation._weighted_bias_kernel,
                               dict(out_ptr=bf16, ids_ptr="*i64", w_ptr="*fp32", b_ptr=bf16), set(),
                               dict(BLOCK=1024, PDL=True), 4, 1)
# GPT-OSS's experts in MXFP4 (gpt-oss-20b's layer): the few-token launches and the grouped GEMM decoding the codes
mx = dict(q_ptr="*u8", s_ptr="*u8")
out["moe_mxfp4_gate_up"] = ptx(moe_mxfp4._mxfp4_gate_up_kernel, dict(mx, x_ptr=bf16, ids_ptr="*i64", act_ptr=bf16,
                                                                     b_ptr=bf16), {"alpha", "limit"},
                               dict(TOP_K=4, K=2880, BLOCK_N=1, BLOCK_K=1024, PDL=True, HAS_BIAS=True, SWIGLU=True),
                               4, 1)
out["moe_mxfp4_down"] = ptx(moe_mxfp4._mxfp4_down_kernel, dict(mx, act_ptr=bf16, ids_ptr="*i64", weights_ptr=bf16,
                                                               out_ptr=bf16, b_ptr=bf16), set(),
                            dict(TOP_K=4, K=2880, BLOCK_N=4, BLOCK_K=256, PDL=True, HAS_BIAS=True), 4, 1)
grouped_mx = dict(mx, a_ptr=bf16, out_ptr=bf16, slots_ptr="*i64", block_experts_ptr="*i64", weights_ptr=bf16)
grouped_cx = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, WEIGHTED=True, UPCAST=False, PRECISION="tf32")
out["moe_mxfp4_grouped"] = ptx(moe_mxfp4._mxfp4_grouped_kernel, grouped_mx, set(), dict(grouped_cx, SCALED=False),
                               4, 3)
# and for bfloat16 activations: Triton's microscaled products (tl.dot_scaled)
out["moe_mxfp4_grouped_scaled"] = ptx(moe_mxfp4._mxfp4_grouped_kernel, grouped_mx, set(),
                                      dict(grouped_cx, BLOCK_N=64, BLOCK_K=256, SCALED=True), 4, 3)
out["moe_mxfp4_gate_up_scaled"] = ptx(moe_mxfp4._mxfp4_gate_up_scaled_kernel,
                                      dict(mx, x_ptr=bf16, ids_ptr="*i64", act_ptr=bf16, b_ptr=bf16),
                                      {"alpha", "limit"}, dict(TOP_K=4, K=2880, BLOCK_N=32, BLOCK_K=256, PDL=True,
                                                               HAS_BIAS=True, SWIGLU=True, WORDS=0, LOOP=False),
                                      4, 3)
out["moe_mxfp4_down_scaled"] = ptx(moe_mxfp4._mxfp4_down_scaled_kernel,
                                   dict(mx, act_ptr=bf16, ids_ptr="*i64", weights_ptr=bf16, terms_ptr=bf16,
                                        b_ptr=bf16), set(), dict(K=2880, BLOCK_N=16, BLOCK_K=256, PDL=True,
                                                                 HAS_BIAS=True, WORDS=0, LOOP=False), 4, 3)
# and on CUDA cores (the codes as 32-bit words, the halves widened by inline PTX), as gpt-oss-20b's batch 1 launches
# with a shorter K (1088: a whole chunk and a masked one, as 2880 has; ~1 s of compiling instead of ~4)
mx_aligned = ("x_ptr", "act_ptr", "q_ptr", "s_ptr", "stride_x", "stride_qe", "stride_qn", "stride_se")
out["moe_mxfp4_gate_up_words"] = ptx(moe_mxfp4._mxfp4_gate_up_scaled_kernel,
                                     dict(mx, x_ptr=bf16, ids_ptr="*i64", act_ptr=bf16, b_ptr=bf16),
                                     {"alpha", "limit"}, dict(TOP_K=4, K=1088, BLOCK_N=8, BLOCK_K=1024, PDL=True,
                                                              HAS_BIAS=True, SWIGLU=True, WORDS=2, LOOP=False),
                                     4, 1,
                                     aligned=mx_aligned)
out["moe_mxfp4_down_words"] = ptx(moe_mxfp4._mxfp4_down_scaled_kernel,
                                  dict(mx, act_ptr=bf16, ids_ptr="*i64", weights_ptr=bf16, terms_ptr=bf16,
                                       b_ptr=bf16), set(), dict(K=1088, BLOCK_N=16, BLOCK_K=1024, PDL=True,
                                                                HAS_BIAS=True, WORDS=2, LOOP=False), 4, 1,
                                  aligned=mx_aligned)
out["moe_mxfp4_down_words_loop"] = ptx(moe_mxfp4._mxfp4_down_scaled_kernel,
                                       dict(mx, act_ptr=bf16, ids_ptr="*i64", weights_ptr=bf16, terms_ptr=bf16,
                                            b_ptr=bf16), set(), dict(K=1088, BLOCK_N=16, BLOCK_K=256, PDL=True,
                                                                     HAS_BIAS=True, WORDS=2, LOOP=True), 4, 2,
                                       aligned=mx_aligned)
out["moe_mxfp4_terms_sum"] = ptx(moe_mxfp4._terms_sum_kernel, dict(terms_ptr=bf16, out_ptr=bf16), set(),
                                dict(TOP_K=4, BLOCK=1024, PDL=True), 4, 1)
# and over fp8 experts, block-wise (Qwen3-30B-A3B-FP8's 128 x 128 scales) and per row
fp8_down = dict(act_ptr=bf16, w_ptr="*fp8e4nv", s_ptr="*fp32", ids_ptr="*i64", weights_ptr=bf16, out_ptr=bf16)
for name, blockwise, sub in (("moe_fp8_down_stacked_block", True, 128), ("moe_fp8_down_stacked_row", False, 256)):
    out[name] = ptx(moe_decode_fp8._fp8_down_stacked_kernel, fp8_down, set(),
                    dict(TOP_K=8, KB=8, K=768, BLOCK_N=8, BLOCK_K=256, SUB=sub, BN=128, BK=128,
                         BLOCKWISE=blockwise, PDL=True), 4, 1)
out["moe_route"] = ptx(moe._route_kernel, dict(logits_ptr=bf16, weights_ptr=bf16, ids_ptr="*i64"), set(),
                      dict(TOP_K=8, KB=8, EB=128, RENORM=True, PDL=True), 4, 1)
# GLM-4.5's group-limited sigmoid routing (one group, 160 experts) and DeepSeek-V3's shape of it (8 groups, 4 picked)
route = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64")
out["moe_route_grouped"] = ptx(moe._route_grouped_kernel, route, {"scale", "norm_min"},
                               dict(TOP_K=8, KB=8, EB=256, GROUPS=1, GB=1, GROUP_SIZE=160, TOP_GROUPS=1, RENORM=True,
                                    SOFTMAX=False, CLAMP=False, GROUP_BEST=2, PDL=True), 1, 1)
out["moe_route_groups"] = ptx(moe._route_grouped_kernel, route, {"scale", "norm_min"},
                              dict(TOP_K=8, KB=8, EB=256, GROUPS=8, GB=8, GROUP_SIZE=32, TOP_GROUPS=4, RENORM=True,
                                   SOFTMAX=False, CLAMP=False, GROUP_BEST=2, PDL=True), 1, 1)
# DeepSeek-V2's group_limited_greedy: softmax scores, a group scored by its best expert (160 experts, 8 groups, 3)
out["moe_route_group_max"] = ptx(moe._route_grouped_kernel, route, {"scale", "norm_min"},
                                 dict(TOP_K=6, KB=8, EB=256, GROUPS=8, GB=8, GROUP_SIZE=20, TOP_GROUPS=3,
                                      RENORM=False, SOFTMAX=True, CLAMP=False, GROUP_BEST=1, PDL=True), 1, 1)
# ERNIE 4.5's: softmax scores, the sum clamped below
out["moe_route_softmax_biased"] = ptx(moe._route_grouped_kernel, route, {"scale", "norm_min"},
                                      dict(TOP_K=6, KB=8, EB=64, GROUPS=1, GB=1, GROUP_SIZE=64, TOP_GROUPS=1,
                                           RENORM=True, SOFTMAX=True, CLAMP=True, GROUP_BEST=2, PDL=True), 1, 1)
# a sparse layer's norm, router and routing at one token (Qwen3-30B-A3B's shape)
gate_args = dict(H=bf16, R=bf16, G=bf16, W=bf16, Bias=bf16, ResOut=bf16, XOut=bf16, Logits=bf16, Weights=bf16,
                 Ids="*i64", Counter="*i32")
softmax_gate = dict(GROUPED=False, GROUPS=1, GB=1, GROUP_SIZE=128, TOP_GROUPS=1, GROUP_BEST=1, SOFTMAX=True,
                    CLAMP=False)
out["moe_gate"] = ptx(moe_gate._gate_kernel, gate_args, {"eps", "scale", "norm_min"},
                      dict(D=2048, BLOCK_D=2048, BLOCK_N=2, TOP_K=8, KB=8, EB=128, RENORM=True, **softmax_gate,
                           PDL=True, ROUTER_BIAS=False), 1, 1)
# GPT-OSS's biased router (gpt-oss-20b: hidden 2,880, 32 experts, top 4)
out["moe_gate_router_bias"] = ptx(moe_gate._gate_kernel, dict(gate_args, RouterBias=bf16),
                                  {"eps", "scale", "norm_min"},
                                  dict(D=2880, BLOCK_D=4096, BLOCK_N=2, TOP_K=4, KB=4, EB=32, RENORM=True,
                                       **softmax_gate, PDL=True, ROUTER_BIAS=True), 1, 1)
# the bias-routed blocks' gate (kernels.moe_gate.moe_gate_grouped): DeepSeek-V2-Lite's (softmax, 64 experts, hidden
# 2,048: one warp) and DeepSeek-V3's (sigmoid with the bias, 8 groups, top 4, 256 experts, hidden 7,168: four warps)
grouped_args = dict(gate_args, W="*fp32", Bias="*fp32", Logits="*fp32", Weights="*fp32")
out["moe_gate_grouped"] = ptx(moe_gate._gate_kernel, grouped_args, {"eps", "scale", "norm_min"},
                              dict(D=2048, BLOCK_D=2048, BLOCK_N=2, TOP_K=6, KB=8, EB=64, RENORM=False,
                                   GROUPED=True, GROUPS=1, GB=1, GROUP_SIZE=64, TOP_GROUPS=1, GROUP_BEST=1,
                                   SOFTMAX=True, CLAMP=False, PDL=True, ROUTER_BIAS=False), 1, 1)
out["moe_gate_grouped_v3"] = ptx(moe_gate._gate_kernel, grouped_args, {"eps", "scale", "norm_min"},
                                 dict(D=7168, BLOCK_D=8192, BLOCK_N=2, TOP_K=8, KB=8, EB=256, RENORM=True,
                                      GROUPED=True, GROUPS=8, GB=8, GROUP_SIZE=32, TOP_GROUPS=4, GROUP_BEST=2,
                                      SOFTMAX=False, CLAMP=False, PDL=True, ROUTER_BIAS=False), 4, 1)
# DeepSeek's absorbed products (kernels.mla_absorb), DeepSeek-V2-Lite's per-head shape, weights loaded after the wait
# (the default) and before it
absorb_q = dict(q_nope_ptr="*bf16", w_ptr="*bf16", q_pe_ptr="*bf16", latent_ptr="*bf16", k_pe_ptr="*bf16",
                cos_ptr="*fp32", sin_ptr="*fp32", query_ptr="*bf16", key_ptr="*bf16", loc_ptr="*i64",
                norm_w_ptr="*bf16")
for early in (False, True):
    name = "_early" if early else ""
    out["mla_absorb_query" + name] = ptx(mla_absorb._absorb_query_kernel, absorb_q, {"eps"},
                                         dict(NOPE=128, RANK=512, ROPE=64, AT_SLOTS=True, NORM=True, BLOCK_RANK=512,
                                              BLOCK_NOPE=128, BLOCK_R=32,
                                              BLOCK_HALF=32,
                                              INTERLEAVED=True, ROUND=triton.language.float32,
                                              MID=triton.language.bfloat16, PDL=True, EARLY=early), 4, 1,
                                         aligned=("w_ptr", "stride_wh"))
    out["mla_absorb_value" + name] = ptx(mla_absorb._absorb_value_kernel,
                                         dict(o_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16"), set(),
                                         dict(NOPE=128, RANK=512, V_DIM=128, BLOCK_V=4, BLOCK_RANK=512, PDL=True,
                                              EARLY=early), 4, 1, aligned=("w_ptr", "stride_wh"))
# LoRA's decode-step kernels (kernels.lora: the shrink's sum of its K parts, the expand as decode batches tile it)
out["lora_sum_partials"] = ptx(lora._sum_partials_kernel, dict(part_ptr="*fp32", out_ptr="*fp32"), set(),
                               dict(SPLIT=16, BLOCK=1024, PDL=True), 4, 1)
out["lora_expand"] = ptx(lora._expand_kernel, dict(part_ptr="*fp32", b_ptr=bf16, scale_ptr="*fp32", out_ptr=bf16,
                                                  tiles_ptr="*i32"), set(),
                         dict(NUM_SLOTS=8, BLOCK_M=16, BLOCK_PR=64, BLOCK_N=128, BLOCKS=1, UPCAST=False,
                              PRECISION="tf32", PDL=True, SPLIT=1), 4, 1)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compiled here, not found in a cache
    done = subprocess.run([sys.executable, "-c", _COMPILE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _lines(ptx: str, pattern: str) -> list[int]:
    return [i for i, line in enumerate(ptx.splitlines()) if re.search(pattern, line)]


@pytest.mark.parametrize("kernel", ["stage1", "gemv", "gemv_row"])
def test_pdl_and_prefetch_are_compiled_in(ptx, kernel):
    """Under PDL each kernel lets its dependents launch, prefetches into L2, and then waits, in that order."""
    code = ptx[kernel]
    launch, prefetch, wait = (_lines(code, p) for p in
                              (r"griddepcontrol\.launch_dependents", r"prefetch\.global\.L2", r"griddepcontrol\.wait"))
    assert launch and prefetch and wait, (len(launch), len(prefetch), len(wait))
    assert launch[0] < prefetch[0] < wait[0]


@pytest.mark.parametrize("kernel,early_loads", [("stage2", 1), ("stage2_sinks", 1), ("silu_and_mul", 0),
                                                 ("gelu_and_mul", 0), ("rmsnorm", 0), ("gemma_sandwich", 0),
                                                 ("olmo2_post_add", 0), ("store_kv", 0), ("rotary", 0),
                                                 ("rotary_partial", 0), ("rotary_layer", 0),
                                                 ("rotary_layer_bias", 0), ("moe_shared_add", 0), ("moe_route", 0),
                                                 ("moe_route_grouped", 0),
                                                 ("moe_route_groups", 0), ("moe_route_softmax_biased", 0),
                                                 ("moe_route_group_max", 0), ("mla_stage1", 2),
                                                 ("mla_stage1_tree", 2),
                                                 ("moe_gate_up", 0), ("moe_down", 0),
                                                 ("moe_down_stacked", 0), ("moe_gate_up_gpt_oss", 0),
                                                 ("moe_down_stacked_gpt_oss", 0), ("moe_fp8_down_stacked_block", 0),
                                                 ("moe_fp8_down_stacked_row", 0), ("moe_biased_act", 0),
                                                 ("moe_weighted_bias", 0), ("moe_mxfp4_gate_up", 0),
                                                 ("moe_mxfp4_down", 0), ("moe_mxfp4_gate_up_scaled", 0),
                                                 ("moe_mxfp4_down_scaled", 0), ("moe_mxfp4_gate_up_words", 0),
                                                 ("moe_mxfp4_down_words", 0), ("moe_mxfp4_down_words_loop", 0),
                                                 ("moe_mxfp4_terms_sum", 0),
                                                 ("mla_query_key", 0),
                                                 ("lora_sum_partials", 0), ("lora_expand", 0)])
def test_pdl_enter_waits_before_reading_what_the_kernel_before_wrote(ptx, kernel, early_loads):
    """A kernel that calls runtime.pdl_enter lets its dependents launch, then waits for the kernel before, and reads
    global memory only after that (what it reads may be that kernel's output). Stage 2 alone reads one value before
    its wait: the request's length, an input of the step (one 64-bit load); the latent decode two (the length and
    the request's table row)."""
    code = ptx[kernel]
    launch, wait, loads = (_lines(code, p) for p in
                           (r"griddepcontrol\.launch_dependents", r"griddepcontrol\.wait", r"ld\.global"))
    assert launch and wait and loads, (len(launch), len(wait), len(loads))
    assert launch[0] < wait[0]
    assert len([i for i in loads if i < wait[0]]) == early_loads



@pytest.mark.parametrize("kernel", ["moe_gate", "moe_gate_router_bias", "moe_gate_grouped", "moe_gate_grouped_v3"])
def test_the_moe_gate_loads_its_weights_before_its_wait_and_counts_arrivals_at_gpu_scope(ptx, kernel):
    """kernels.moe_gate under PDL: the router's rows and the norm's weight load before the wait (no kernel writes
    them), the hidden row after it; each program arrives by an acquire-release atomic at GPU scope, and the last one
    reads the logits past L1."""
    code = ptx[kernel]
    launch, wait, loads = (_lines(code, p) for p in
                           (r"griddepcontrol\.launch_dependents", r"griddepcontrol\.wait", r"ld\.global"))
    assert launch and wait and launch[0] < wait[0]
    assert [i for i in loads if i < wait[0]] and [i for i in loads if i > wait[0]]
    arrive = _lines(code, r"atom\.global\.(acq_rel\.gpu|gpu\.acq_rel)\.add")
    assert arrive and arrive[0] > wait[0]
    assert [i for i in _lines(code, r"ld\.global\.cg") if i > arrive[0]]


@pytest.mark.parametrize("kernel", ["mla_absorb_query", "mla_absorb_value"])
def test_the_absorbed_products_load_their_weights_after_their_wait_or_before_it_when_asked(ptx, kernel):
    """kernels.mla_absorb under PDL: dependents launched, then the wait, then every load (the default); with
    `early`, the head's block of kv_b_proj loads before the wait (in 16-byte loads), the rows after it."""
    late, early = ptx[kernel], ptx[kernel + "_early"]
    for code in (late, early):
        launch, wait = _lines(code, r"griddepcontrol\.launch_dependents"), _lines(code, r"griddepcontrol\.wait")
        assert launch and wait and launch[0] < wait[0]
    assert not [i for i in _lines(late, r"ld\.global") if i < _lines(late, r"griddepcontrol\.wait")[0]]
    wait = _lines(early, r"griddepcontrol\.wait")[0]
    assert [i for i in _lines(early, r"ld\.global\S*\.v4\.b32") if i < wait]
    assert [i for i in _lines(early, r"ld\.global") if i > wait]


def test_gemv_row_reads_x_only_after_its_wait_and_its_weights_in_wide_loads(ptx):
    """gemv_row under PDL: no global load before the wait (the weights go to L2 by prefetch), x and the weights
    after it, the weights 16 bytes a load (a block's whole rows, unrolled)."""
    for kernel, k in (("gemv_row", 4096), ("gemv_row_wait", 14336)):  # with and without the L2 pull (the default)
        code = ptx[kernel]
        launch, wait, loads, wide = (_lines(code, p) for p in (r"griddepcontrol\.launch_dependents",
                                     r"griddepcontrol\.wait", r"ld\.global", r"ld\.global\S*\.v4\.b32"))
        assert launch and wait and loads and launch[0] < wait[0] and not [i for i in loads if i < wait[0]]
        assert len(wide) >= k * 2 * 2 // 16 // 128  # the block's bytes over 16-byte loads of 128 threads
    assert not _lines(ptx["gemv_row_wait"], r"prefetch\.global\.L2")


def test_an_empty_split_returns_before_its_wait(ptx):
    """Decode attention's stage 1: a program whose split the length leaves empty lets its dependents launch and then
    branches straight to the kernel's return, so it neither waits for the kernel before nor loads or stores."""
    code = ptx["stage1"].splitlines()
    launch = _lines(ptx["stage1"], r"griddepcontrol\.launch_dependents")[0]
    wait = _lines(ptx["stage1"], r"griddepcontrol\.wait")[0]
    labels = {m.group(1): i for i, line in enumerate(code) if (m := re.match(r"(\$L\w+):", line))}
    branches = [m.group(1) for line in code[launch:wait] if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", line))]

    def returns(label: str) -> bool:  # the label's first instruction (past .loc lines) is the return
        after = [ln.strip() for ln in code[labels[label] + 1:labels[label] + 4] if not ln.strip().startswith(".loc")]
        return labels[label] > wait and bool(after) and after[0] == "ret;"

    # Triton 3.9 branches on the negated test, 3.6 (the GPU machine's) falls through to an unconditional branch
    assert any(returns(label) for label in branches), branches


@pytest.mark.parametrize("kernel", ["stage1_sinks", "stage2_sinks", "extend_sinks"])
def test_attention_with_sinks_compiles_and_reads_them(ptx, kernel):
    """GPT-OSS's sinks (decode with one split, the merge of several, windowed extend) compile for sm_90, each
    reading the sink (a 16-bit load) after the keys' walk."""
    code = ptx[kernel]
    assert _lines(code, r"ld\.global(\.\w+)*\.b16") and _lines(code, r"ex2\.approx")


@pytest.mark.parametrize("kernel", ["stage1_capped", "extend_windowed"])
def test_windowed_and_soft_capped_attention_compiles(ptx, kernel):
    """The sliding-window and soft-cap paths (Triton's interpreter runs them on CPU) compile for sm_90: the cap's
    tanh is exp2-based (one ex2 more per score than the plain kernel's softmax)."""
    assert _lines(ptx[kernel], r"ex2\.approx")


def test_the_tree_masked_decode_compiles(ptx):
    """A draft tree's verify rows (engine.speculative.tree; the interpreter runs them on CPU) compile for sm_90 and
    read their two mask words once per row."""
    assert _lines(ptx["stage1_tree"], r"ld\.global.*\.b64") and ptx["stage1_tree"] != ptx["stage1"]


@pytest.mark.parametrize("kernel", ["stage1_fp8_scaled", "extend_fp8_scaled"])
def test_the_scaled_fp8_cache_paths_compile(ptx, kernel):
    """Decode and extend over an e4m3 cache with its per-layer scales (the interpreter runs them on CPU) compile for
    sm_90, converting the cached bytes from e4m3 in registers."""
    assert _lines(ptx[kernel], r"cvt\S*\.e4m3x2")


@pytest.mark.parametrize("kernel", ["moe_mxfp4_grouped", "moe_mxfp4_grouped_scaled", "moe_mxfp4_gate_up_scaled",
                                    "moe_mxfp4_down_scaled"])
def test_the_mxfp4_products_are_bfloat16_tensor_core_products(ptx, kernel):
    """The MXFP4 experts' grouped GEMM (its own decoding, or Triton's microscaled product) and the few-token launches
    for bfloat16 activations decode their codes into bfloat16 operands of tensor-core products."""
    assert _lines(ptx[kernel], r"(mma|wgmma)\S*\.bf16"), "no bfloat16 MMA"


@pytest.mark.parametrize("kernel", ["moe_mxfp4_gate_up_words", "moe_mxfp4_down_words", "moe_mxfp4_down_words_loop"])
def test_the_mxfp4_word_products_widen_codes_on_cuda_cores(ptx, kernel):
    """The few-token MXFP4 launches in their CUDA-core form (ScaledTiles.words = 2): codes read 16 bytes a load,
    two a float16 pattern widened by cvt.f32.f16 in place, float32 FMAs, no tensor-core product and no 16-bit
    arithmetic on the values."""
    code = ptx[kernel]
    assert _lines(code, r"ld\.global\S*\.v4\.b32"), "the codes are not read as 16-byte vectors"
    assert len(_lines(code, r"cvt\.f32\.f16")) >= 16 * len(_lines(code, r"ld\.global\S*\.v4\.b32"))
    assert _lines(code, r"fma\.rn\.f32")
    assert not _lines(code, r"mma|wgmma|(fma|mul|add)\.rn\.(bf16|f16)")


def test_the_lora_expand_is_a_tensor_core_product(ptx):
    """kernels.lora.lora_expand, as a decode batch tiles it, compiles for sm_90 with its product on tensor cores
    (bfloat16 MMAs)."""
    assert _lines(ptx["lora_expand"], r"(mma|wgmma)\S*\.bf16"), "no bfloat16 MMA"


@pytest.mark.parametrize("kernel", ["mla_stage1", "mla_stage1_tree", "mla_extend"])
def test_the_latent_attention_kernels_take_tensor_core_products(ptx, kernel):
    """DeepSeek's latent (512 + 64) decode and prefill compile for sm_90 with bfloat16 tensor-core products for both
    parts of the scores and the weighted sum."""
    assert _lines(ptx[kernel], r"(mma|wgmma)\S*\.bf16"), "no bfloat16 MMA"


def test_no_kernel_rounds_a_16_bit_product_and_sum_once(ptx):
    """A kernel that rounds a product to the dtype and then adds it (torch's two ops) must not be compiled into a
    16-bit fused multiply-add, which rounds once: Triton narrows such float32 arithmetic on 16-bit values to 16-bit
    instructions and fuses them unless the launch sets enable_fp_fusion=False (the rotary, latent-rope and shared
    expert kernels do). Every kernel here is compiled as it is launched; the one counter-example is on purpose."""
    fused = sorted(name for name, code in ptx.items() if _lines(code, r"fma\.rn(\.ftz)?\.(bf16|f16)(x2)?\b"))
    assert fused == ["moe_shared_add_fused"]


def test_the_shared_expert_add_rounds_its_product_before_the_sum(ptx):
    """kernels.moe_shared launches without fused multiply-adds: its product and sum are two 16-bit operations, each
    rounded as torch's are; with fusion on (the default) Triton emits one fma.rn.bf16 for them, a single rounding
    (an H100 run found a fifth of a bf16 row an ulp off the twin that way)."""
    assert _lines(ptx["moe_shared_add_fused"], r"fma\.rn\.bf16")
    code = ptx["moe_shared_add"]
    assert not _lines(code, r"fma\.rn") and _lines(code, r"mul\.rn\.bf16") and _lines(code, r"add\.rn\.bf16")
