"""Cohere 2 (Cohere2ForCausalLM, transformers' modeling_cohere2: Command-R7B, Command-A): Cohere's parallel-residual
LayerNorm decoder (engine.models.cohere) whose layers alternate between sliding-window and global attention.

What sets it apart from Cohere:
- layer_types says which layers slide over sliding_window tokens; without it every sliding_window_pattern-th layer
  (default 4) is global (engine.models.attention_spec);
- only the sliding layers rotate q and k (interleaved pairs, in float32, as Cohere's); the global layers attend with
  no position encoding at all (transformers rotates where a layer has a window);
- no q/k norms; RoPE's base defaults to 10000; head_dim is hidden_size / num_attention_heads.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.attention_spec import sliding_layers
from radixmesh.engine.models.layernorm_decoder import LayerNormForCausalLM


class Cohere2ForCausalLM(LayerNormForCausalLM):
    interleaved_rope = True

    def body(self, cfg: ModelConfig) -> nn.Module:
        self.rotates = sliding_layers(cfg).sliding  # per layer: it slides, so it rotates
        return super().body(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]; Llama's forward with the
        global layers' q and k left unrotated."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, hidden.dtype)
        residual = None
        for layer, rotates in zip(self.model.layers, self.rotates):
            hidden, residual = layer(hidden, residual, rope if rotates else None)
        return self.model.norm(hidden, residual)[0]
