"""A model's own multi-token-prediction layer as a speculative draft head (SGLang's NEXTN: EAGLE with the model's
MTP module): DeepSeek-V3's (GLM-4.7-Flash's is the same) and GLM-4.5's, the layer published after the last decoder
layer, `model.layers.<num_hidden_layers>.*` of the model's own checkpoint (GLM-4.x publish it in an
`mtp.safetensors` their index does not list: engine.models.loader reads it too).

At draft position t it reads the embedding of token t + 1 and the target's final hidden state at t (after the final
norm, as EAGLE heads read it): both normed apart (`enorm`, `hnorm`), concatenated (embedding first) and projected
back to the hidden size (`eh_proj`), then one whole sparse decoder layer of the model's (DeepSeek's: multi-head
latent attention over a latent cache of its own; GLM-4.5's: its grouped-query attention; then the experts); its
output is the feature its next step reads, and,
normed (`shared_head.norm`), its own output layer's input (`shared_head.head`). The embedding is the target's (the
checkpoint's `embed_tokens` copy in the layer is skipped). Everything else in the checkpoint (the model itself) is
skipped at load.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.layers.linear import vocab_logits
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RotaryEmbedding
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.deepseek import mla_decoder_layer, v3_rope_options
from radixmesh.engine.models.glm4_moe import glm_decoder_layer
from radixmesh.engine.speculative.eagle_head import EagleHead, _Body

NEXTN_HEAD = "DeepseekV3ForCausalLMNextN"  # (SGLang's name for it)
# the models whose MTP layer this head is, and how their layer is built: DeepSeek-V3's (GLM-4.7-Flash's is the same),
# GLM-4.5's; each with its RoPE options (RotaryEmbedding.for_model's)
_LATENT_LAYER = (lambda cfg, tp: mla_decoder_layer(cfg, tp, sparse=True), v3_rope_options)
NEXTN_MODELS = {
    "DeepseekV3ForCausalLM": _LATENT_LAYER,
    "Glm4MoeLiteForCausalLM": _LATENT_LAYER,
    "Glm4MoeForCausalLM": (glm_decoder_layer, lambda cfg: {}),
}


def nextn_config(cfg: ModelConfig) -> ModelConfig | None:
    """A checkpoint's config as its multi-token-prediction head's (one layer, at index num_hidden_layers; the model's
    architecture kept as `nextn_of`), or None when it has no such layer; a model whose MTP layers this head is not
    is refused with its name."""
    if not cfg.raw.get("num_nextn_predict_layers"):
        return None
    if cfg.architecture not in NEXTN_MODELS:
        raise ValueError(f"{cfg.architecture}'s multi-token-prediction layers are not implemented by radixmesh yet "
                         f"({', '.join(NEXTN_MODELS)}'s are)")
    return dataclasses.replace(cfg, architecture=NEXTN_HEAD, num_layers=1,
                               raw={**cfg.raw, "nextn_layer": cfg.num_layers, "nextn_of": cfg.architecture})


class _AtIndex(nn.ModuleDict):
    """The head's one layer under its checkpoint index (`model.layers.<i>.`), read as a list of one by the runner."""

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)

    def __iter__(self):
        return iter(self.values())


class _OnlyLayer:
    """Checkpoint names outside the head's layer (the model itself), and the layer's copy of the embedding."""

    def __init__(self, index: int):
        self.prefix = f"model.layers.{index}."

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (not name.startswith(self.prefix)
                                          or name == self.prefix + "embed_tokens.weight")


class _SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class NextnHead(EagleHead):
    uses_target_logits = False  # its own output layer (shared_head.head)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        nn.Module.__init__(self)
        self.config = cfg
        self.tp = tp or TensorParallel.single()
        index, h = int(cfg.raw["nextn_layer"]), cfg.hidden_size
        self.skipped_tensors = _OnlyLayer(index)
        self.feature_width = h  # the target's final hidden states
        build, self._rope_options = NEXTN_MODELS[cfg.raw["nextn_of"]]
        layer = build(cfg, self.tp)
        layer.enorm, layer.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        layer.eh_proj = nn.Linear(2 * h, h, bias=False)
        layer.shared_head = _SharedHead(cfg)
        self.model = _Body()
        self.model.layers = _AtIndex({str(index): layer})
        self.rotary = None
        self._target = []
        self.features_in = None
        self.step_features = self.step_out = self.last_out = None

    @property
    def layer(self) -> nn.Module:
        """The one layer (registered once, under its checkpoint index)."""
        return self.model.layers[0]

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device, **self._rope_options(self.config))

    def input_weight(self) -> torch.Tensor:
        return self.layer.eh_proj.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        joined = torch.cat([layer.enorm(self._embed(input_ids)), layer.hnorm(self._features(input_ids.shape[0]))],
                           dim=-1)
        hidden = layer.eh_proj(joined)
        out, residual = layer(hidden, None, self.rotary.prepare(positions, hidden.dtype))
        out = out + residual
        self._keep(out)
        return layer.shared_head.norm(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_logits(self.tp, hidden, self.layer.shared_head.head.weight, self.config.vocab_size)
