"""Gemma 1, Gemma 3 served text-only from Gemma3ForConditionalGeneration, Cohere (Command-R), StableLM and StarCoder2
token-exact with transformers (float32, CPU), each a tiny random checkpoint written here by transformers itself (no
download), with its norms drawn away from their neutral weights and its biases away from zero, so that every weight
shows: every generated token's logprob is compared too (tests/parity/test_model_families.py's method), and a weight
read from the wrong rows, a norm over the wrong span, a rotation of the wrong pairs or a missing scale moves those far
beyond the tolerance. Prompts of a few lengths, two of them sharing a prefix, go in one batch.

Also here: the configs these families' layers would compute otherwise are refused naming the field, and the Gemma 3
text defaults engine.model_config fills in for sparse text_configs are transformers'."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine_utils import force_rotary_kernel, running_engine
from tests.parity.test_model_families import COMMON, GREEDY, MAX_NEW, VOCAB
from tests.reference import hf_greedy, hf_token_logprobs

SHARED = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45]
PROMPTS = [[1, 17, 42, 99, 3], [1] + list(range(60, 100)), SHARED + [7, 8, 9], SHARED + [200, 201, 5, 5, 5, 7, 9, 11]]
WINDOW = 12  # tokens a sliding layer sees: shorter than most prompts
FAMILIES = {
    # head_dim 24 with 4 heads (96 != hidden 64), the legacy hidden_act "gelu" (read as the tanh GELU), q/k/v/o biases
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(head_dim=24, hidden_act="gelu", attention_bias=True, tie_word_embeddings=True)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.3, tie_word_embeddings=True)),
    # Command-R+'s per-head q/k LayerNorms, biases, another RoPE base, an output layer of its own
    "cohere-qk-norm": ("CohereConfig", "CohereForCausalLM",
                       dict(use_qk_norm=True, attention_bias=True, rope_theta=1000.0, logit_scale=2.0)),
    # 8 of each head's 16 dimensions rotate, q/k/v biases
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(use_qkv_bias=True, partial_rotary_factor=0.5)),
    # StableLM 2 12B's layout: parallel residual, per-head q/k LayerNorms; the default partial_rotary_factor (0.25)
    "stablelm-parallel": ("StableLmConfig", "StableLmForCausalLM",
                          dict(use_parallel_residual=True, qk_layernorm=True)),
    # every layer slides over WINDOW tokens; biases everywhere (use_bias's default)
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=True)),
}
MULTIMODAL = "gemma3-multimodal"


def _legacy_rope(raw: dict) -> None:
    """config.json as transformers 4 wrote it (rope_theta at the top level), without partial_rotary_factor: StableLM's
    default (0.25) applies."""
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]


CONFIG_EDITS = {"stablelm-parallel": _legacy_rope}


def _randomize(model: torch.nn.Module, norm_base: float) -> None:
    """Norm weights drawn from norm_base + [-0.5, 0.5), biases from N(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(norm_base - 0.5, norm_base + 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)


def write_checkpoint(path, config_cls: str, model_cls: str, fields: dict, seed: int) -> str:
    """A random transformers checkpoint of COMMON's shape with `fields`."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    model = getattr(transformers, model_cls)(config).float().eval()
    _randomize(model, 0.0 if model_cls.startswith("Gemma") else 1.0)  # Gemma's RMSNorm weighs by 1 + w
    model.save_pretrained(path)
    return str(path)


def _gemma3_text_config(**fields):
    from transformers import Gemma3TextConfig

    shape = {k: v for k, v in COMMON.items() if k not in ("tie_word_embeddings", "initializer_range")}
    return Gemma3TextConfig(**shape, head_dim=32, sliding_window=WINDOW, sliding_window_pattern=2,
                            query_pre_attn_scalar=40, rope_theta=500_000.0, rope_local_base_freq=5_000.0,
                            initializer_range=0.15, **fields)


def write_multimodal(path, seed: int) -> str:
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower and projector beside the language model), its config.json
    text_config cut to the fields that differ from Gemma3TextConfig's defaults, as the published 4B/12B/27B ones are."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=_gemma3_text_config().to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=VOCAB - 4, eoi_token_index=VOCAB - 3,
                          image_token_index=VOCAB - 2)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(model.model.language_model, 0.0)
    model.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    defaults = Gemma3TextConfig().to_dict()
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if defaults.get(k, object()) != v}
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    return str(path)


def build(name: str, path) -> str:
    """Writes the checkpoint `name` (of FAMILIES, or MULTIMODAL) to the folder `path`."""
    if name == MULTIMODAL:
        return write_multimodal(path, seed=300)
    return build_family(FAMILIES, CONFIG_EDITS, 200, name, path)


def build_family(families: dict, edits: dict, seed: int, name: str, path) -> str:
    """`families[name]`'s checkpoint written to `path` (its seed `seed` + its place in `families`), its config.json
    then edited by `edits[name]` where there is one."""
    write_checkpoint(path, *families[name], seed=seed + list(families).index(name))
    if name in edits:
        raw = json.loads((path / "config.json").read_text())
        edits[name](raw)
        (path / "config.json").write_text(json.dumps(raw, indent=1))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> its checkpoint's path, written on first use."""
    return functools.cache(lambda name: build(name, tmp_path_factory.mktemp(name)))


@functools.cache
def _reference(path: str) -> tuple[list[list[int]], list[list[float]]]:
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    return refs, [hf_token_logprobs(path, p, r) for p, r in zip(PROMPTS, refs)]


def _check(path: str, reference: str | None = None, atol: float = 1e-4, inspect=None, **serve) -> None:
    """`path` served greedily matches transformers' outputs for `reference` (default: the same checkpoint);
    `inspect(engine)`, when given, looks at the loaded engine first (how it holds its weights)."""
    refs, logprobs = _reference(reference or path)
    assert len({tuple(r) for r in refs}) == len(refs), "the reference does not depend on the prompt"
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=4, **serve) as llm:
        if inspect is not None:
            inspect(llm)
        outs = llm.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    assert [o["output_ids"] for o in outs] == refs
    for out, want in zip(outs, logprobs):
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == pytest.approx(want, abs=atol)


@pytest.mark.parametrize("name", FAMILIES)
def test_families_match_transformers(checkpoint, name):
    _check(checkpoint(name))


def test_gemma_norm_kernels_with_a_residual_match_transformers(checkpoint, monkeypatch):
    """Gemma 1's pre-norm decoder with its (1 + weight) norms in the kernel (kernels.norm.gemma_rmsnorm, the
    residual added in the same launch), forced on here in Triton's interpreter: transformers' tokens and logprobs."""
    from radixmesh.engine.layers import norm

    monkeypatch.setattr(norm, "use_kernels", lambda t: True)
    _check(checkpoint("gemma"))


@pytest.mark.parametrize("name", ["cohere-qk-norm", "stablelm-parallel"])
def test_the_rotary_kernel_matches_transformers(checkpoint, name, monkeypatch):
    """The rotation in kernels.rotary, as on CUDA (forced here in Triton's interpreter): Cohere's interleaved pairs
    in float32 after Command-R+'s per-head LayerNorms, StableLM 2's partial heads after its, both norms computed in
    the same launch."""
    launches = force_rotary_kernel(monkeypatch)
    _check(checkpoint(name))
    assert launches and all(norm is not None and norm.layer and norm.q_weight.dim() == 2 for norm in launches)


@pytest.mark.parametrize("name", ["cohere-qk-norm", "stablelm-parallel", "starcoder2"])
def test_families_shard_over_tensor_parallel_ranks(checkpoint, name):
    """tp_size 2: each rank reads its heads' rows of the per-head q/k norms (Cohere's one tensor, StableLM's tensor
    per head), its rows of c_fc and its columns of c_proj with the biases where they belong."""
    _check(checkpoint(name), tp_size=2, atol=1e-5)


def test_gemma3_multimodal_serves_its_language_model(checkpoint):
    """Text-only prompts through transformers' Gemma3ForConditionalGeneration (its sliding and global layers, two
    RoPE tables, a sparse text_config), served from the published tensor names with the vision tower left unread."""
    path = checkpoint(MULTIMODAL)
    assert any(n.startswith("vision_tower.") for n in load_file(f"{path}/model.safetensors"))
    _check(path)


def test_gemma3_multimodal_reads_transformers5_module_names(checkpoint, tmp_path):
    """The same weights stored under transformers 5's module names (model.language_model.*, model.vision_tower.*)
    answer the same."""
    src = checkpoint(MULTIMODAL)
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    renamed = {}
    for name, tensor in load_file(f"{src}/model.safetensors").items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        renamed[name] = tensor
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _check(str(tmp_path), reference=src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rotary_is_coheres(dtype):
    """engine.layers.rotary's interleaved pairs rotate q and k bit for bit as transformers' Cohere does (in float32,
    rounded once), where rotate-half pairs would not."""
    from transformers import CohereConfig
    from transformers.models.cohere import modeling_cohere as hf

    from radixmesh.engine.layers.rotary import RotaryEmbedding

    config = CohereConfig(hidden_size=64, num_attention_heads=4, rope_theta=1000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(40, n, 16, generator=gen).to(dtype) for n in (4, 2))
    positions = torch.arange(40)
    cos, sin = hf.CohereRotaryEmbedding(config)(q, positions[None])
    want = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for interleaved, equal in ((True, True), (False, False)):
        table = RotaryEmbedding(16, 40, 1000.0, None, torch.device("cpu"), interleaved=interleaved)
        got = table.prepare(positions, dtype).apply(q, k)
        assert all(torch.equal(g, w[0].transpose(0, 1)) == equal for g, w in zip(got, want))


# ---- refusals and defaults -----------------------------------------------------------------------------------------

def _config_dir(tmp_path, config_cls: str, **fields) -> str:
    import transformers

    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def _refused(path: str, *words: str, **args) -> None:
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    with pytest.raises(ValueError) as err:
        resolve_args(EngineArgs(model_path=path, device="cpu", **args), ModelConfig.from_path(path))
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("config_cls,fields,words", [
    ("GemmaConfig", dict(hidden_act="relu"), ["hidden_act='relu'"]),
    ("GemmaConfig", dict(use_bidirectional_attention=True), ["use_bidirectional_attention=true"]),
    ("CohereConfig", dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    ("CohereConfig", dict(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    ("StableLmConfig", dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    ("StableLmConfig", dict(head_dim=32), ["head_dim=32"]),
    ("Starcoder2Config", dict(hidden_act="gelu_new"), ["hidden_act='gelu_new'"]),
    ("Starcoder2Config", dict(mlp_bias=True), ["mlp_bias=true"]),
])
def test_configs_the_layers_would_compute_otherwise_are_refused(tmp_path, config_cls, fields, words):
    _refused(_config_dir(tmp_path, config_cls, **fields), *words)


def test_lora_is_refused_where_adapters_cannot_be_placed(tmp_path):
    """Starcoder2's MLP has no gate/up/down projections; a Gemma 3 multimodal adapter names its vision tower's
    projections too."""
    from transformers import Gemma3Config

    _refused(_config_dir(tmp_path / "starcoder2", "Starcoder2Config"), "LoRA on Starcoder2ForCausalLM", "c_fc",
             enable_lora=True)
    config = Gemma3Config(text_config=_gemma3_text_config().to_dict())
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path / "gemma3")
    _refused(str(tmp_path / "gemma3"), "LoRA on Gemma3ForConditionalGeneration", "vision tower", enable_lora=True)


def test_gemma3_multimodal_final_softcap_is_refused(tmp_path):
    """transformers' Gemma3ForConditionalGeneration does not soft-cap its logits whatever text_config says."""
    from transformers import Gemma3Config

    config = Gemma3Config(text_config=_gemma3_text_config(final_logit_softcapping=30.0).to_dict())
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    _refused(str(tmp_path), "final_logit_softcapping=30.0")


def test_gemma3_text_defaults_are_transformers():
    from transformers import Gemma3TextConfig

    from radixmesh.engine.model_config import TEXT_CONFIG_DEFAULTS

    theirs = Gemma3TextConfig().to_dict()
    assert {k: theirs[k] for k in TEXT_CONFIG_DEFAULTS["Gemma3ForConditionalGeneration"]} == \
        TEXT_CONFIG_DEFAULTS["Gemma3ForConditionalGeneration"]
