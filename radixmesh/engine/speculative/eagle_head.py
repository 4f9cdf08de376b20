"""EAGLE draft heads in their published checkpoint formats: one decoder layer that reads the target's features.

A head predicts the token after next from a token and the target's hidden state one position before it: at draft
position t it reads the embedding of token t + 1 and the feature at t, and its output is both the next draft
logits' input and the feature its next step reads (a chain drafts on its own outputs; engine.speculative.draft_model).

- EAGLE (EAGLE-1/2; `LlamaForCausalLMEagle`, or a `LlamaForCausalLM` config given as an EAGLE draft): `fc` (2h -> h,
  bias where the checkpoint has one) over [embedding, feature], then `layers.0` without its input norm, no final
  norm; features are the target's final hidden states; the embedding and output layer are the target's.
- EAGLE-3 (`LlamaForCausalLMEagle3`): the feature is `fc` (3h -> h) over the inputs of three target layers
  (`eagle_config.eagle_aux_hidden_state_layer_ids`, else layers 2, L/2 and L-3); `midlayer` norms the embedding
  (`input_layernorm`) and the feature (`hidden_norm`) apart and attends over both concatenated (q/k/v read 2h);
  its output, normed (`norm`), goes to its own output layer over `draft_vocab_size` tokens, which `d2t` maps to
  the target's (target id = draft id + d2t[draft id]); the embedding is the target's.

The feature input: `features_in` (set by the drafter before an eager forward), else the static `step_features`
(what a CUDA graph of one-token steps reads). The feature output: `last_out` (eager) and `step_out` (static, first
rows), both before any final norm.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import QKVParallelLinear, vocab_logits
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderLayer, DecoderSpec, LlamaForCausalLM
from radixmesh.engine.models.loader import checkpoint_files, iter_checkpoint
from radixmesh.engine.speculative.whole_vocab import WholeVocab

EAGLE = "LlamaForCausalLMEagle"
EAGLE3 = "LlamaForCausalLMEagle3"


def eagle3_layers(cfg: ModelConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads (its config's, else SGLang's default)."""
    ids = (cfg.raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    return (2, target_layers // 2, target_layers - 3)


def checkpoint_has(cfg: ModelConfig, name: str) -> bool:
    try:
        checkpoint_files(cfg.path)
    except FileNotFoundError:
        return False
    return any(n == name for n, _ in iter_checkpoint(cfg.path))


class _Body(nn.Module):
    """The head's weights under `model.` (the checkpoint's names are bare: the loader prefixes them)."""


class EagleHead(nn.Module):
    """EAGLE-1/2."""

    skipped_tensors = ("embed_tokens.weight",)  # the target's embedding is used (the checkpoint holds a copy)
    uses_target_logits = True  # its logits are the target's output layer's (EAGLE-3 has its own)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp or TensorParallel.single()
        h = cfg.hidden_size
        self.model = _Body()
        self.feature_width = h  # the target's final hidden states
        self.model.fc = nn.Linear(2 * h, h, bias=checkpoint_has(cfg, "fc.bias") or cfg.raw.get("bias", False))
        layer = DecoderLayer(cfg, DecoderSpec(), 0, self.tp)
        layer.input_layernorm = nn.Identity()  # EAGLE's one layer has no input norm
        self.model.layers = nn.ModuleList([layer])
        self.rotary = None
        self._target: list[nn.Module] = []  # not a submodule: the target's weights are not the head's
        self.features_in: torch.Tensor | None = None
        self.step_features = self.step_out = self.last_out = None

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        LlamaForCausalLM.init_rotary(self, max_positions, device)

    def share_weights(self, target: nn.Module, rows: int) -> None:
        """Use `target`'s embedding (and output layer): whole copies of them on a tensor-parallel leader
        (engine.speculative.whole_vocab); static feature buffers for one-token steps of up to `rows` requests."""
        tp = getattr(target, "tp", None)
        self._target = [target if tp is None or tp.size == 1 else WholeVocab(target, self.uses_target_logits)]
        param = self.input_weight()
        h = self.config.hidden_size
        self.step_features = torch.zeros((rows, h), dtype=param.dtype, device=param.device)
        self.step_out = torch.zeros((rows, h), dtype=param.dtype, device=param.device)

    def input_weight(self) -> torch.Tensor:
        """The weight that first reads the feature: its dtype and device are the feature buffers'."""
        return self.model.fc.weight

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._target[0].model.embed_tokens(input_ids)

    def _features(self, n: int) -> torch.Tensor:
        return self.features_in if self.features_in is not None else self.step_features[:n]

    def _keep(self, out: torch.Tensor) -> None:
        self.last_out = out
        n = out.shape[0]
        if n <= self.step_out.shape[0]:
            self.step_out[:n].copy_(out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        hidden = self.model.fc(torch.cat([self._embed(input_ids), self._features(n)], dim=-1))
        rope = self.rotary.prepare(positions, hidden.dtype)
        out = _layer_output(self.model.layers[0], self.model.layers[0].self_attn(hidden, rope), hidden)
        self._keep(out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)


class Eagle3Head(EagleHead):
    """EAGLE-3."""

    skipped_tensors = ("embed_tokens.weight", "d2t", "t2d")  # (d2t is read by share_weights; t2d follows from it)
    uses_target_logits = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        nn.Module.__init__(self)
        self.config = cfg
        self.tp = tp or TensorParallel.single()
        h = cfg.hidden_size
        self.draft_vocab = int(cfg.raw.get("draft_vocab_size") or cfg.vocab_size)
        self.model = _Body()
        self.feature_width = 3 * h  # the inputs of three target layers
        self.model.fc = nn.Linear(3 * h, h, bias=checkpoint_has(cfg, "fc.bias"))
        layer = DecoderLayer(cfg, DecoderSpec(), 0, self.tp)
        attn = layer.self_attn  # q/k/v over [normed embedding, normed feature]
        attn.qkv_proj = QKVParallelLinear(2 * h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                          cfg.attention_bias, self.tp)
        layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.model.midlayer = layer
        self.model.layers = nn.ModuleList([layer])  # (the runner's view: one layer; its weights named midlayer.*)
        self.model.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.rotary = None
        self._target = []
        self.features_in = None
        self.step_features = self.step_out = self.last_out = None
        self.draft_ids: torch.Tensor | None = None

    def share_weights(self, target: nn.Module, rows: int) -> None:
        super().share_weights(target, rows)
        device = self.lm_head.weight.device
        d2t = _read_tensor(self.config, "d2t")
        ids = torch.arange(self.draft_vocab, dtype=torch.int64)
        if d2t is not None:
            if tuple(d2t.shape) != (self.draft_vocab,):
                raise ValueError(f"d2t in {self.config.path} has shape {tuple(d2t.shape)}, expected "
                                 f"({self.draft_vocab},): one offset per draft token")
            ids = ids + d2t.to(torch.int64)
        vocab = target.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"d2t in {self.config.path} maps draft tokens outside the target's vocabulary "
                             f"(0..{vocab - 1})")
        self.draft_ids = ids.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        features = self._features(n)
        if features.shape[-1] != self.config.hidden_size:  # the target's layers, concatenated
            features = self.model.fc(features)
        layer = self.model.midlayer
        both = torch.cat([layer.input_layernorm(self._embed(input_ids)), layer.hidden_norm(features)], dim=-1)
        rope = self.rotary.prepare(positions, both.dtype)
        out = _layer_output(layer, layer.self_attn(both, rope), features)
        self._keep(out)
        return self.model.norm(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: -inf where the draft vocabulary has no token."""
        small = vocab_logits(self.tp, hidden, self.lm_head.weight, self.draft_vocab)
        full = small.new_full((hidden.shape[0], self._target[0].config.vocab_size), float("-inf"))
        full[:, self.draft_ids] = small
        return full


def _layer_output(layer: DecoderLayer, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after attention: residual add, post-attention norm, MLP, residual add."""
    hidden, residual = layer.post_attention_layernorm(attended, residual)
    return layer.mlp(hidden) + residual


def _read_tensor(cfg: ModelConfig, name: str) -> torch.Tensor | None:
    try:
        checkpoint_files(cfg.path)
    except FileNotFoundError:
        return None
    for n, lazy in iter_checkpoint(cfg.path):
        if n == name:
            return lazy[:]
    return None


def as_draft_config(cfg: ModelConfig, algorithm: str) -> ModelConfig:
    """The draft's config with the head's architecture: EAGLE checkpoints often name their base (LlamaForCausalLM)."""
    arch = EAGLE3 if algorithm == "EAGLE3" else EAGLE
    if cfg.architecture not in (arch, "LlamaForCausalLM"):
        raise ValueError(f"speculative_algorithm {algorithm} reads {arch} heads (or a LlamaForCausalLM config in "
                         f"EAGLE's format); {cfg.path} is {cfg.architecture}")
    if cfg.num_layers != 1:
        raise ValueError(f"an {algorithm} head has one decoder layer; {cfg.path} has num_hidden_layers="
                         f"{cfg.num_layers}")
    return dataclasses.replace(cfg, architecture=arch)
