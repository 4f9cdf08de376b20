"""Cohere Command-R (CohereForCausalLM, transformers' modeling_cohere): a parallel-residual LayerNorm decoder
(engine.models.layernorm_decoder).

What sets it apart from Llama:
- LayerNorm without a bias (layer_norm_eps), one per layer, read by attention and MLP alike: h = h + attn(x) + mlp(x);
- RoPE rotates interleaved pairs (GPT-J's layout) in float32 (engine.layers.rotary); its base defaults to 500000;
- under use_qk_norm (Command-R+), q and k are LayerNormed per head, each head with its own weight, before RoPE;
- the logits are multiplied by logit_scale (default 0.0625); the output layer is tied to the embedding by default;
- attention_bias puts a bias on q, k, v and o.
"""

from __future__ import annotations

from radixmesh.engine.models.layernorm_decoder import LayerNormForCausalLM


class CohereForCausalLM(LayerNormForCausalLM):
    interleaved_rope = True
