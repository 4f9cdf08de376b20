"""StableLM (StableLmForCausalLM, transformers' modeling_stablelm: StableLM 2, StableLM-3B-4E1T, Zephyr): a
LayerNorm decoder (engine.models.layernorm_decoder).

What sets it apart from Llama:
- LayerNorms with a bias (layer_norm_eps);
- RoPE rotates the first int(head_dim * partial_rotary_factor) dimensions of each head (default 0.25;
  engine.layers.rotary), head_dim being hidden_size / num_attention_heads;
- use_qkv_bias puts a bias on q, k and v (o has none); qk_layernorm LayerNorms q and k per head, each head with its
  own weight, stored as one tensor per head (q_layernorm.norms.<h>.weight);
- use_parallel_residual (StableLM 2 12B): one LayerNorm per layer read by attention and MLP, h = h + attn(x) + mlp(x).
"""

from __future__ import annotations

from radixmesh.engine.models.layernorm_decoder import LayerNormForCausalLM


class StableLmForCausalLM(LayerNormForCausalLM):
    per_head_norms = ("q_layernorm", "k_layernorm")
