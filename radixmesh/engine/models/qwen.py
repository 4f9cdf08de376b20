"""Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm): Llama-family decoders with different flags."""

from __future__ import annotations

from radixmesh.engine.models.llama import DecoderSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    spec = DecoderSpec(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    spec = DecoderSpec(qk_norm=True)
