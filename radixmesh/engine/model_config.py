"""What the engine reads of a Hugging Face checkpoint's `config.json` (and `generation_config.json`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixmesh.engine.model_source import resolve_model_dir

if TYPE_CHECKING:
    import torch


# transformers' rms_norm_eps for a config.json without the field, where an architecture's default is not 1e-6
_DEFAULT_RMS_NORM_EPS = {"MixtralForCausalLM": 1e-5, "Phi3ForCausalLM": 1e-5, "Olmo2ForCausalLM": 1e-5,
                         "GptOssForCausalLM": 1e-5,
                         "GlmForCausalLM": 1.5625e-7, "Glm4ForCausalLM": 1.5625e-7}
# architectures whose transformers config ties the output layer to the embedding when config.json does not say
_TIED_BY_DEFAULT = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                    "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM", "Ernie4_5ForCausalLM",
                    "Ernie4_5_MoeForCausalLM")
# NVIDIA ModelOpt's quantization file beside config.json (its exports' older form; newer ones say it in config.json)
HF_QUANT_FILE = "hf_quant_config.json"
# Multimodal architectures served text-only: config.json holds their language model's fields under text_config, often
# only those that differ from its config class's defaults (published Gemma 3 4B/12B/27B), which are these
# (Gemma3TextConfig's; tests/parity/test_model_families_more.py compares them with transformers')
TEXT_CONFIG_DEFAULTS = {
    "Gemma3ForConditionalGeneration": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    },
}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts model's expert layout (config.json's num_experts / num_local_experts / n_routed_experts,
    ...) and the fields of group-limited routing (GLM-4.5's, DeepSeek-V3's: n_group, topk_group,
    routed_scaling_factor), which only the models that route so read (engine.models.moe.BiasRoutedMoeBlock)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    first_dense: int = 0  # first_k_dense_replace (ERNIE: moe_layer_start_index): the first layers keep a dense MLP
    last_sparse: int | None = None  # ERNIE's moe_layer_end_index: no sparse layer after it (None: no bound)
    groups: int = 1  # n_group: the experts split into groups, a token's experts come from its best topk_group
    top_groups: int = 1  # topk_group
    scaling: float = 1.0  # routed_scaling_factor: multiplies the routing weights

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts (transformers' rule for Qwen-MoE; every layer for Mixtral; from
        first_k_dense_replace on for GLM-4.5)."""
        return (layer >= self.first_dense and (self.last_sparse is None or layer <= self.last_sparse)
                and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_raw(cls, raw: dict) -> "MoeConfig | None":
        experts = (raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts")
                   or raw.get("moe_num_experts"))
        if not experts:
            return None
        inter = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        shared = raw.get("shared_expert_intermediate_size") or inter * int(
            raw.get("n_shared_experts") or raw.get("moe_num_shared_experts") or 0)
        last = raw.get("moe_layer_end_index")
        dense = tuple(int(i) for i in raw.get("mlp_only_layers") or ()) + _listed_dense(raw)
        return cls(num_experts=int(experts), top_k=int(raw.get("num_experts_per_tok") or raw["moe_k"]),
                   intermediate_size=inter, norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=int(shared),
                   mlp_only_layers=dense,
                   decoder_sparse_step=int(raw.get("decoder_sparse_step") or raw.get("moe_layer_interval") or 1),
                   first_dense=int(raw.get("first_k_dense_replace") or raw.get("moe_layer_start_index") or 0),
                   last_sparse=None if last is None or int(last) < 0 else int(last),
                   groups=int(raw.get("n_group") or 1), top_groups=int(raw.get("topk_group") or 1),
                   scaling=float(raw.get("routed_scaling_factor") or 1.0))


# architectures whose attention is multi-head latent attention (engine.models.deepseek)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
# architectures whose transformers config lists each layer's MLP in mlp_layer_types ("dense" or "sparse"), and
# their default when config.json does not: a dense first layer, sparse after it
_MLP_LAYER_TYPES = ("Glm4MoeLiteForCausalLM",)


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention's ranks and head widths (DeepSeek-V2/V3's config.json). The KV cache holds one
    latent a token and layer: the normed `kv_lora_rank` compression and the shared rotated key part
    (`qk_rope_head_dim`), which is why such a model's ModelConfig says one KV head of their summed width."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q comes from one q_proj (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_raw(cls, raw: dict, architecture: str) -> "MlaConfig | None":
        if architecture not in MLA_ARCHITECTURES:
            return None
        q_rank = raw.get("q_lora_rank")
        return cls(kv_lora_rank=int(raw.get("kv_lora_rank", 512)), q_lora_rank=None if q_rank is None else int(q_rank),
                   qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
                   qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)), v_head_dim=int(raw.get("v_head_dim", 128)))


def _listed_dense(raw: dict) -> tuple[int, ...]:
    """The layers mlp_layer_types says are dense (GLM-4.7-Flash's field; its default where the architecture reads it
    and config.json does not say); () elsewhere."""
    archs = raw.get("architectures") or [None]
    if archs[0] not in _MLP_LAYER_TYPES:
        return ()
    layers = int(raw["num_hidden_layers"])
    types = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types in config.json must say 'dense' or 'sparse' for each of the "
                         f"{layers} layers, got {types!r}")
    return tuple(i for i, t in enumerate(types) if t == "dense")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of a Hugging Face `config.json` (and `generation_config.json`) the engine uses."""

    path: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    moe: MoeConfig | None = None  # a mixture-of-experts model's experts
    # multi-head latent attention (DeepSeek-V2/V3): num_kv_heads is 1 and head_dim the latent's width (MlaConfig)
    mla: MlaConfig | None = None
    # Sampling parameters recommended by generation_config.json (used when sampling_defaults == "model").
    generation_defaults: dict = field(default_factory=dict, compare=False)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_path(cls, path: str, revision: str | None = None) -> "ModelConfig":
        """The config of the model at `path`: a folder, or a Hugging Face model id in the local cache at `revision`
        (engine.model_source); `path` of the result is the folder the files are read from."""
        path = resolve_model_dir(path, revision)
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"model config not found: {cfg_file}")
        with open(cfg_file) as f:
            raw = with_quant_file(with_defaults(text_config(json.load(f))), path)
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file} has no 'architectures' entry")
        heads = raw["num_attention_heads"]
        mla = MlaConfig.from_raw(raw, archs[0])
        rope_params = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default"
                                                   else None)
        return cls(
            path=path,
            architecture=archs[0],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if mla else raw.get("num_key_value_heads") or heads,
            head_dim=mla.latent_dim if mla else raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS.get(archs[0], 1e-6)),
            rope_theta=raw.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", archs[0] in _TIED_BY_DEFAULT)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=frozenset(_eos_ids(raw, path)),
            moe=MoeConfig.from_raw(raw),
            mla=mla,
            generation_defaults=_generation_defaults(path),
            raw=raw,
        )

    @property
    def rope_head_dim(self) -> int:
        """The width RoPE's table is built for: a head's, or MLA's rotated part (qk_rope_head_dim)."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_buffers(self) -> int:
        """Buffers a layer's KV cache keeps: K and V, or one where V is read from K's latent (MLA)."""
        return 1 if self.mla else 2

    def kv_bytes_per_token(self, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        """KV bytes of one token: all the model's KV heads, or `num_kv_heads` (one tensor-parallel rank's)."""
        import torch

        elem = torch.tensor([], dtype=dtype).element_size()
        return self.kv_buffers * self.num_layers * (num_kv_heads or self.num_kv_heads) * self.head_dim * elem


def with_quant_file(raw: dict, path: str) -> dict:
    """config.json's fields with NVIDIA ModelOpt's hf_quant_config.json (the file its exports put beside config.json,
    `{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", ...}}`) as its quantization_config
    (quant_method "modelopt" and the file's `quantization` fields), where config.json declares none; else as it is."""
    file = os.path.join(path, HF_QUANT_FILE)
    if raw.get("quantization_config") or not os.path.isfile(file):
        return raw
    try:
        with open(file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is not a readable JSON file: {e}") from None
    fields = doc.get("quantization") if isinstance(doc, dict) else None
    return {**raw, "quantization_config": {"quant_method": "modelopt", **(fields if isinstance(fields, dict) else {})}}


# Fields a config class fills in where config.json leaves them out and its default differs from what a field's absence
# means here (GptOssConfig's; tests/parity/test_gpt_oss_parity.py compares them with transformers'); a RoPE dict too,
# where config.json has none
CONFIG_DEFAULTS = {
    "GptOssForCausalLM": {"attention_bias": True, "sliding_window": 128, "head_dim": 64, "num_experts_per_tok": 4,
                          "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}
ROPE_DEFAULTS = {
    "GptOssForCausalLM": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096},
}


def with_defaults(raw: dict) -> dict:
    """config.json with its architecture's CONFIG_DEFAULTS (and ROPE_DEFAULTS, where it has no RoPE dict) filled in
    where it says nothing."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    out = {**CONFIG_DEFAULTS.get(arch, {}), **raw}
    if arch in ROPE_DEFAULTS and not raw.get("rope_scaling") and not raw.get("rope_parameters"):
        out["rope_parameters"] = dict(ROPE_DEFAULTS[arch])
    return out


def text_config(raw: dict) -> dict:
    """config.json's fields as the language model reads them: for an architecture of TEXT_CONFIG_DEFAULTS, its
    defaults, then text_config's fields, then the top level's (what the whole model declares: architectures, dtype,
    tie_word_embeddings, which transformers reads from the top-level config, quantization), without the sub-configs;
    any other config as it is."""
    archs = raw.get("architectures") or []
    defaults = TEXT_CONFIG_DEFAULTS.get(archs[0]) if archs else None
    if defaults is None:
        return raw
    top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    return {**defaults, **(raw.get("text_config") or {}), **top}


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _eos_ids(raw: dict, path: str) -> list[int]:
    ids = _as_list(raw.get("eos_token_id"))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids += _as_list(json.load(f).get("eos_token_id"))
    return ids


_GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_defaults(path: str) -> dict:
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_file):
        return {}
    with open(gen_file) as f:
        gen = json.load(f)
    return {k: gen[k] for k in _GENERATION_SAMPLING_KEYS if gen.get(k) is not None}
