"""RoPE frequencies per `rope_type` of config.json's rope_scaling (or transformers 5's rope_parameters).

`rope_spec` reads a model's config the way transformers resolves it (which dict wins, the base, the original context
length, per-architecture defaults and aliases); `frequencies` gives the inverse frequencies [rotary dim / 2] in
float32 and the attention factor that scales cos and sin (YaRN's mscale, LongRoPE's). Each rule performs the same
float operations, in the same order, as transformers' rope init functions (modeling_rope_utils), so the tables are
bit for bit theirs (tests/unit/test_rope_scaling.py).

Two types change with the sequence length in transformers:
- dynamic: every frequency is recomputed from the forward's sequence length once it passes max_position_embeddings
  (and the enlarged base stays for later, shorter sequences down to that length), which a position-indexed table with
  a shared paged prefix cache cannot do; `exact_context` says up to which context length the table is still exactly
  theirs (plain RoPE up to max_position_embeddings) and longer contexts are refused.
- longrope: transformers rotates with short_factor while the forward's sequence (max position + 1) fits in
  original_max_position_embeddings and with long_factor once it does not: a prompt longer than that is rotated whole
  with long_factor; a shorter one keeps its short-rotated keys and rotates only the tokens it generates past it with
  long_factor. Which rotation a cached key holds would then depend on the length of the request that wrote it.
  Decision (the one vLLM takes, for the same reason; SGLang switches per batch, when any position in it passes the
  original context, so a key's rotation would depend on what it was batched with): the factors are chosen once per
  server by the context length it serves (`RopeSpec.context`): short_factor for every position when the context
  fits in the original one (every request token-exact with transformers), long_factor for every position when it
  is longer (every prompt longer than the original context token-exact with transformers, generation included; a
  prompt that fits in it is rotated with long_factor where transformers would use short_factor: `longrope_notice`
  says so at start-up, and --context-length set to the original context gives short_factor back). One rotation per
  position, so a cached prefix is reusable by every request and chunked prefill and CUDA graphs see a plain table.
  (Exact for every prompt would take a table per request, chosen by its prompt length, and prefix-cache namespaces
  apart: transformers' rotation of a prompt that fits is position-indexed too, short_factor before the original
  context and long_factor from it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from radixmesh.engine.model_config import ModelConfig

HF_DEFAULT_ROPE_THETA = 10000.0
# transformers' per-architecture defaults where they differ from the generic ones
_DEFAULT_THETA = {"MixtralForCausalLM": 1e6, "CohereForCausalLM": 500_000.0, "MiniMaxM2ForCausalLM": 5e6,
                  "GptOssForCausalLM": 150_000.0}
# StableLmConfig's, PhiConfig's, GlmConfig's, Glm4Config's and Glm4MoeConfig's partial_rotary_factor
_DEFAULT_PARTIAL_ROTARY = {"StableLmForCausalLM": 0.25, "PhiForCausalLM": 0.5, "GlmForCausalLM": 0.5,
                           "Glm4ForCausalLM": 0.5, "Glm4MoeForCausalLM": 0.5}
# architectures whose published configs give partial rotary as `rotary_dim` (MiniMaxM2Config reads it so)
_LEGACY_ROTARY_DIM = ("MiniMaxM2ForCausalLM",)
_DEFAULT_ORIGINAL_CONTEXT = {"Phi3ForCausalLM": 4096}  # Phi3Config.original_max_position_embeddings
# Phi3Config reads the old names of LongRoPE ("su", and "yarn" for Phi-3's LongRoPE) as longrope and refuses others
_TYPE_ALIASES = {"Phi3ForCausalLM": {"su": "longrope", "yarn": "longrope"}}
_ARCH_TYPES = {"Phi3ForCausalLM": ("default", "longrope")}
# types whose original_max_position_embeddings transformers resolves (the top-level field first)
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One model's RoPE, resolved: what every rule reads."""

    rope_type: str
    dim: int  # rotated dimensions per head
    theta: float
    params: dict = field(compare=False)  # the rope dict as config.json gives it
    where: str = "rope_scaling"  # its config.json field, for messages
    original_context: int | None = None  # original_max_position_embeddings as transformers resolves it
    max_position_embeddings: int | None = None
    # the longest sequence the table serves (the engine's context length; None: unknown, up to the original
    # context): longrope picks its factors by it (module docstring)
    context: int | None = None

    def require(self, key: str) -> Any:
        if self.params.get(key) is None:
            raise ValueError(f"{self.rope_type} RoPE scaling without {self.where}.{key} in config.json cannot be "
                             "computed (transformers refuses it too)")
        return self.params[key]

    def original(self) -> int:
        """original_max_position_embeddings (llama3, yarn and longrope read it)."""
        return self.original_context or self.require("original_max_position_embeddings")

    def factor(self) -> float:
        """`factor`; for yarn set to null, or longrope without one, max_position_embeddings / the original context
        (transformers refuses yarn without the field)."""
        optional = self.rope_type == "longrope" or (self.rope_type == "yarn" and "factor" in self.params)
        if self.params.get("factor") is None and optional and self.max_position_embeddings and self.original_context:
            return self.max_position_embeddings / self.original_context
        return self.require("factor")


def rope_field(raw: dict) -> tuple[str, dict]:
    """The RoPE dict transformers reads (rope_scaling wins over transformers 5's rope_parameters) and its name."""
    if raw.get("rope_scaling"):
        return "rope_scaling", raw["rope_scaling"]
    return "rope_parameters", raw.get("rope_parameters") or {}


def rope_type(architecture: str, rope: dict) -> tuple[str, str]:
    """(the rope type transformers computes, the dict key that names it)."""
    key = "rope_type" if "rope_type" in rope else "type"  # transformers' order
    named = rope.get(key) or "default"
    return _TYPE_ALIASES.get(architecture, {}).get(named, named), key


def rope_theta(architecture: str, raw: dict, rope: dict) -> float:
    """The base: the rope dict's, else config.json's rope_theta, else the architecture's default."""
    return rope.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA.get(architecture, HF_DEFAULT_ROPE_THETA)))


def rope_spec(model: ModelConfig) -> RopeSpec:
    """The RoPE transformers computes for `model` (nested per-layer-type dicts, and partial rotary where the
    architecture does not compute it, are refused by engine.models.support before this is asked)."""
    raw, arch = model.raw, model.architecture
    where, rope = rope_field(raw)
    kind, _ = rope_type(arch, rope)
    original = None
    if kind in _ORIGINAL_CONTEXT_TYPES:  # the top-level field (Phi3Config: always one) wins over the rope dict's
        original = raw.get("original_max_position_embeddings", _DEFAULT_ORIGINAL_CONTEXT.get(arch))
        original = original or rope.get("original_max_position_embeddings") or model.max_position_embeddings
    return RopeSpec(kind, rotary_dim(model.rope_head_dim, partial_rotary_factor(raw, rope, arch)),
                    rope_theta(arch, raw, rope), rope, where, original, model.max_position_embeddings)


def partial_rotary_factor(raw: dict, rope: dict, architecture: str = "") -> float:
    """The share of each head's dimensions RoPE rotates: the rope dict's partial_rotary_factor, else config.json's
    (transformers' Phi3Config copies the top-level field into rope_parameters unless that has one), else the
    architecture's default (StableLM: 0.25; Phi, GLM: 0.5), else 1; MiniMax-M2's `rotary_dim` over its head_dim where
    neither field says."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None and architecture in _LEGACY_ROTARY_DIM and raw.get("rotary_dim"):
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        factor = raw["rotary_dim"] / head_dim
    return _DEFAULT_PARTIAL_ROTARY.get(architecture, 1.0) if factor is None else factor


def rotary_dim(head_dim: int, factor: float) -> int:
    """The leading dimensions of each head RoPE rotates (transformers: int(head_dim * partial_rotary_factor)); the rest
    pass through unrotated. ValueError where that is no even count in (0, head_dim]."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor={factor!r} in config.json: the share of each head RoPE rotates is a "
                         "number in (0, 1]")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} rotates {dim} of the {head_dim} dimensions of a head: "
                         "rotate-half RoPE needs an even count of at least 2")
    return dim


def spec_of_dict(dim: int, theta: float, scaling: dict | None) -> RopeSpec:
    """A RopeSpec from one rope dict alone (original_max_position_embeddings inside it; no max_position_embeddings,
    which dynamic, and yarn or longrope without a factor, need: rope_spec reads a whole config)."""
    scaling = scaling or {}
    kind, _ = rope_type("", scaling)
    return RopeSpec(kind, dim, theta, scaling, original_context=scaling.get("original_max_position_embeddings"))


# ---- the rules: (spec) -> (inverse frequencies [dim / 2] float32, attention factor) ---------------------------------

def _plain(spec: RopeSpec, theta: float | None = None) -> torch.Tensor:
    base = spec.theta if theta is None else theta
    return 1.0 / (base ** (torch.arange(0, spec.dim, 2, dtype=torch.int64).float() / spec.dim))


def _default(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    return _plain(spec), 1.0


def _linear(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Positions divided by `factor` (as frequencies divided by it)."""
    inv_freq = _plain(spec)
    inv_freq /= spec.require("factor")
    return inv_freq, 1.0


def _dynamic(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """NTK-aware base at the sequence length max_position_embeddings, where the enlarged base is the base itself:
    the frequencies of every sequence up to that length (exact_context refuses longer contexts)."""
    factor, seq_len, dim = spec.require("factor"), spec.max_position_embeddings, spec.dim
    if seq_len is None:
        raise ValueError("dynamic RoPE scaling needs the model's max_position_embeddings")
    base = spec.theta * ((factor * seq_len / spec.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return _plain(spec, base), 1.0


def _llama3(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Llama-3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    inv_freq = _plain(spec)
    factor, low, high = (spec.require(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_ctx = spec.original()
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention(spec: RopeSpec, factor: float) -> float:
    """`attention_factor`, else YaRN's mscale (the ratio of mscale to mscale_all_dim when both are set)."""
    given = spec.params.get("attention_factor")
    if given is not None:
        return given
    mscale, mscale_all_dim = spec.params.get("mscale"), spec.params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_dims(spec: RopeSpec, rotations: float) -> float:
    """The dimension (in [0, dim)) whose wavelength fits `rotations` times in the original context."""
    return (spec.dim * math.log(spec.original() / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))


def _yarn_ramp(spec: RopeSpec) -> torch.Tensor:
    """[dim / 2]: 0 where a frequency is kept (many rotations in the original context), 1 where it is interpolated
    (under beta_slow rotations), linear between beta_fast and beta_slow."""
    fast, slow = spec.params.get("beta_fast") or 32, spec.params.get("beta_slow") or 1
    low, high = _yarn_dims(spec, fast), _yarn_dims(spec, slow)
    if spec.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, spec.dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    return torch.clamp((torch.arange(spec.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies blended between kept and divided by `factor` along the ramp; cos/sin scaled by mscale."""
    factor = spec.factor()
    pos_freqs = spec.theta ** (torch.arange(0, spec.dim, 2).float() / spec.dim)
    kept, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - _yarn_ramp(spec)
    return interpolated * (1 - keep) + kept * keep, _yarn_attention(spec, factor)


def _longrope_factors(spec: RopeSpec, key: str) -> list[float]:
    factors = spec.require(key)
    if not isinstance(factors, list) or len(factors) != spec.dim // 2:
        raise ValueError(f"longrope RoPE scaling: {spec.where}.{key} in config.json must be a list of "
                         f"{spec.dim // 2} numbers (rotary dim / 2), got {factors!r}")
    return factors


def longrope_is_long(spec: RopeSpec) -> bool:
    """Whether a LongRoPE table serving `spec.context` positions rotates with long_factor (module docstring)."""
    return spec.context is not None and spec.context > spec.original()


def _longrope(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """LongRoPE: short_factor when the served context fits in original_max_position_embeddings, long_factor for
    every position when it does not (module docstring); cos/sin scaled by attention_factor, by default
    sqrt(1 + ln(factor) / ln(original context)), the same for both factors as in transformers."""
    short = _longrope_factors(spec, "short_factor")
    long = _longrope_factors(spec, "long_factor")
    factor = spec.factor()
    attention = spec.params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(spec.original()))
    ext = torch.tensor(long if longrope_is_long(spec) else short, dtype=torch.float32)
    shape = torch.arange(0, spec.dim, 2, dtype=torch.int64).float() / spec.dim
    return 1.0 / (ext * spec.theta ** shape), attention


_RULES: dict[str, Callable[[RopeSpec], tuple[torch.Tensor, float]]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn,
    "longrope": _longrope,
}
# The rope types this module computes; engine.models.support refuses any other at config time.
ROPE_TYPES = tuple(_RULES)


def frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, attention factor); ValueError for a type or dict we cannot compute."""
    if spec.rope_type not in _RULES:
        raise ValueError(f"unsupported rope_scaling type {spec.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    return _RULES[spec.rope_type](spec)


def types_for(architecture: str) -> tuple[str, ...]:
    """The rope types transformers accepts for `architecture` that we compute."""
    return _ARCH_TYPES.get(architecture, ROPE_TYPES)


def exact_context(spec: RopeSpec) -> tuple[int, str] | None:
    """(the longest context a position-indexed table serves exactly as transformers computes, why), or None when
    any length is exact."""
    if spec.rope_type == "dynamic" and spec.max_position_embeddings is not None:
        limit = spec.max_position_embeddings
        return limit, (f"dynamic NTK RoPE ({spec.where}.factor={spec.params.get('factor')}) recomputes every "
                       f"frequency from the sequence length once a sequence passes max_position_embeddings={limit} "
                       "(transformers keeps the enlarged base for later, shorter sequences too), while a paged KV "
                       "cache keeps each key as it was rotated when written; up to that length it is plain RoPE")
    return None


def longrope_notice(spec: RopeSpec) -> str | None:
    """What a LongRoPE model served past its original context does unlike transformers (module docstring), for the
    start-up log; None otherwise."""
    if spec.rope_type != "longrope" or not longrope_is_long(spec):
        return None
    original = spec.original()
    return (f"LongRoPE: the context length {spec.context} is longer than original_max_position_embeddings="
            f"{original}, so every position is rotated with {spec.where}.long_factor, for every request: prompts "
            f"longer than {original} tokens are rotated as transformers rotates them, shorter ones with long_factor "
            f"where transformers would use short_factor (one rotation per position keeps cached prefixes valid for "
            f"every request); pass --context-length {original} or less for short_factor")
