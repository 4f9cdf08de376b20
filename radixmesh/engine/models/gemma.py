"""Gemma 1, Gemma 2 and Gemma 3 (text) decoders over the paged KV cache.

What sets Gemma 2 and 3 apart from the Llama family (transformers' modeling_gemma2 / modeling_gemma3):
- RMSNorms weigh by (1 + weight), in float32 (engine.layers.norm.GemmaRMSNorm), and each sublayer's output is
  normed before it joins the residual stream (post_attention_layernorm, pre/post_feedforward_layernorm);
- the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype;
- the MLP gate is GELU with the tanh approximation;
- attention scores are scaled by query_pre_attn_scalar^-1/2; layers alternate between a sliding window and global
  attention (engine.models.attention_spec: the window reaches the attention backend through its AttentionShape);
- Gemma 2 soft-caps attention scores (in the backend) and the final logits: cap * tanh(x / cap);
- Gemma 3 norms q and k per head, and rotates its sliding layers with a local RoPE table (rope_local_base_freq) and
  its global layers with the global one (rope_theta, with rope scaling).
Configs they would compute otherwise are refused by engine.models.gemma_config.check_gemma before this is built.

Gemma 1 (modeling_gemma) is Llama's pre-norm decoder with Gemma's (1 + weight) RMSNorms, GELU-tanh MLP and
sqrt(hidden_size)-scaled embedding; scores scale by head_dim^-1/2 (head_dim need not be hidden_size / heads).

Gemma3ForConditionalGeneration (the 4B, 12B and 27B checkpoints) is served text-only: its language model is
Gemma3ForCausalLM's decoder, read from `language_model.model.*` (published checkpoints, and what transformers 5 saves)
or `model.language_model.*` (transformers 5's own module names), its config from text_config
(engine.model_config.text_config); the vision tower and projector are not loaded. Text-only prompts compute exactly
what transformers' Gemma3ForConditionalGeneration does (no image embedded: plain causal and sliding attention).
Images cannot reach the engine: requests carry token ids, and the router refuses image parts of chat messages.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.activation import gelu_tanh_and_mul
from radixmesh.engine.layers.linear import ParallelLMHead, VocabParallelEmbedding, vocab_logits
from radixmesh.engine.layers.norm import GEMMA_NORM_KERNELS, GemmaRMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.attention_spec import sliding_layers
from radixmesh.engine.models.gemma_config import gemma_config
from radixmesh.engine.models.llama import MLP, Attention, DecoderSpec, LlamaForCausalLM


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaAttention(Attention):
    """Llama's attention with Gemma's (1 + weight) norms on q and k (Gemma 3)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel, qk_norm: bool):
        super().__init__(cfg, DecoderSpec(), layer_id, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel, qk_norm: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_id, tp, qk_norm)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """hidden [num_tokens, hidden] -> the residual stream after this layer."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))

    def forward_normed(self, normed: torch.Tensor, hidden: torch.Tensor, rope: RopeInputs,
                       next_norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' form of `forward` (CUDA): from this layer's normed input and the residual stream to the next
        norm's output (`next_norm`: the next layer's input norm, or the model's final one) and the stream after this
        layer; each post-norm, residual sum and following norm one launch (kernels.norm.gemma_sandwich)."""
        from radixmesh.kernels.norm import gemma_sandwich

        eps = self.post_attention_layernorm.eps
        normed, hidden = gemma_sandwich(self.self_attn(normed, rope), hidden, self.post_attention_layernorm.weight,
                                        self.pre_feedforward_layernorm.weight, eps)
        return gemma_sandwich(self.mlp(normed), hidden, self.post_feedforward_layernorm.weight, next_norm.weight, eps)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, tp, qk_norm) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@functools.cache
def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as transformers applies it: a float32 scalar cast to the model's dtype (55.4256 is 55.5 in
    bfloat16), kept as a Python number (exact in that dtype) so the forward creates no tensor."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(dtype))


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.gemma = gemma_config(cfg)
        self.tp = tp or TensorParallel.single()
        self.model = GemmaModel(cfg, self.tp, self.qk_norm)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.sliding = sliding_layers(cfg).sliding  # per layer: a sliding (local) layer
        self.rotary: RotaryEmbedding | None = None  # global layers' table (Gemma 2: every layer's)
        self.rotary_local: RotaryEmbedding | None = None  # sliding layers'

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        cfg, ropes = self.config, self.gemma.ropes
        if ropes is None:
            self.rotary = self.rotary_local = RotaryEmbedding.for_model(cfg, max_positions, device)
            return
        full, local = ropes
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, full.theta, full.scaling, device)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_positions, local.theta, local.scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        hidden = hidden * _embed_scale(self.config.hidden_size, hidden.dtype)
        rope = self.rotary.prepare(positions, hidden.dtype)
        local = rope if self.rotary_local is self.rotary else self.rotary_local.prepare(positions, hidden.dtype)
        layers = self.model.layers
        # the norms' chain between sublayers in one launch each (forward_normed), unless a layer's output is hooked
        # (engine.hidden_capture: EAGLE-3's target features), which forward_normed does not return
        if GEMMA_NORM_KERNELS and use_kernels(hidden) and not any(layer._forward_hooks for layer in layers):
            normed = layers[0].input_layernorm(hidden)
            nexts = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
            for layer, sliding, next_norm in zip(layers, self.sliding, nexts):
                normed, hidden = layer.forward_normed(normed, hidden, local if sliding else rope, next_norm)
            return normed
        for layer, sliding in zip(layers, self.sliding):
            hidden = layer(hidden, local if sliding else rope)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, vocab], soft-capped when the config says so."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_logits(self.tp, hidden, weight, self.config.vocab_size)
        cap = self.gemma.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    # stored name prefix -> ours (module docstring); the lm_head is there only when untied
    _RENAMED = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."))
    _UNSERVED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A stored tensor's name in our modules (engine.models.loader.model_tensors); None: the vision parts."""
        cls = Gemma3ForConditionalGeneration
        for stored, ours in cls._RENAMED:
            if name.startswith(stored):
                return ours + name[len(stored):]
        return None if name.startswith(cls._UNSERVED) else name


class GemmaScaledEmbedding(VocabParallelEmbedding):
    """The token embedding times sqrt(hidden_size), rounded to the model dtype as transformers scales it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * _embed_scale(out.shape[-1], out.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1 (module docstring): Llama's layers with Gemma's norms, MLP and embedding."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.model.embed_tokens = GemmaScaledEmbedding(cfg.vocab_size, hidden, self.tp)
        for layer in self.model.layers:
            layer.mlp = GemmaMLP(hidden, cfg.intermediate_size, self.tp)
            layer.input_layernorm = GemmaRMSNorm(hidden, eps)
            layer.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.model.norm = GemmaRMSNorm(hidden, eps)
