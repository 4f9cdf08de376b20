"""--speculative-algorithm EAGLE / EAGLE3: a one-layer head in the published checkpoint formats drafts from the
target's hidden states. Heads are made here with random weights under the published tensor names (EAGLE: a
`LlamaForCausalLM` config with fc.weight/fc.bias and layers.0.* without an input norm; EAGLE-3:
`LlamaForCausalLMEagle3` with midlayer.*, hidden_norm, its own lm_head over a smaller vocabulary and d2t).

Greedy outputs equal transformers' (random heads draft mostly wrong: exactness does not hang on the drafts), and
every draft the engine proposes equals a reference twin's: the head computed from the checkpoint's tensors with
transformers' Llama attention, MLP and norms, fed transformers' hidden states of the target (output_hidden_states),
recomputed from scratch for each step. That shows the features reach the head at the right positions: from the
prefill, from the verify rows kept, and (second request) from the prefix-cache hit's mirrored draft KV."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.reference import hf_greedy, hf_model

NAME = "tiny-llama"
GREEDY = {"temperature": 0}
AUX_LAYERS = (0, 2, 3)  # EAGLE-3's target layers in these tests (0: the embedding's output)
DRAFT_VOCAB = 500


def write_head(path, target: str, kind: str, seed: int = 0) -> str:
    """A random EAGLE ("eagle") or EAGLE-3 ("eagle3") head for `target`, saved as the published formats are."""
    from safetensors.torch import save_file

    with open(f"{target}/config.json") as f:
        t = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    h, heads, kv, hd, inter, vocab = (t[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim", "intermediate_size", "vocab_size"))

    def rand(*shape):
        return (torch.rand(shape, generator=gen) - 0.5) * 0.2

    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "hidden_act",
            "torch_dtype", "bos_token_id", "eos_token_id", "rope_parameters")
    cfg = {k: t[k] for k in keep if k in t} | {"num_hidden_layers": 1, "model_type": "llama", "tie_word_embeddings": False}
    width, pre = (h, "layers.0.") if kind == "eagle" else (2 * h, "midlayer.")
    w = {pre + "self_attn.q_proj.weight": rand(heads * hd, width), pre + "self_attn.k_proj.weight": rand(kv * hd, width),
         pre + "self_attn.v_proj.weight": rand(kv * hd, width), pre + "self_attn.o_proj.weight": rand(h, heads * hd),
         pre + "mlp.gate_proj.weight": rand(inter, h), pre + "mlp.up_proj.weight": rand(inter, h),
         pre + "mlp.down_proj.weight": rand(h, inter), pre + "post_attention_layernorm.weight": 1 + rand(h),
         "embed_tokens.weight": rand(vocab, h)}  # (a copy of the target's in real heads: the target's is used)
    if kind == "eagle":
        cfg["architectures"] = ["LlamaForCausalLM"]
        w |= {"fc.weight": rand(h, 2 * h), "fc.bias": rand(h)}
    else:
        ids = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS)}}
        w |= {"fc.weight": rand(h, 3 * h), pre + "input_layernorm.weight": 1 + rand(h),
              pre + "hidden_norm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
              "lm_head.weight": rand(DRAFT_VOCAB, h), "d2t": ids - torch.arange(DRAFT_VOCAB),
              "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    target = model_path(NAME)
    return {"EAGLE": write_head(root / "eagle", target, "eagle"),
            "EAGLE3": write_head(root / "eagle3", target, "eagle3", seed=1)}


class ReferenceHead:
    """The head recomputed from its checkpoint with transformers' Llama modules, over the whole sequence each time."""

    def __init__(self, path: str, target: str, kind: str):
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama import modeling_llama as m

        self.kind = kind
        self.target = hf_model(target)
        self.w = load_file(os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            self.cfg = LlamaConfig(**{k: v for k, v in json.load(f).items() if k != "architectures"})
        self.cfg._attn_implementation = "eager"
        pre = "layers.0." if kind == "eagle" else "midlayer."
        self.attn = m.LlamaAttention(self.cfg, 0)
        for name in ("q_proj", "k_proj", "v_proj"):  # (EAGLE-3's read 2h: [embedding, feature])
            weight = self.w[f"{pre}self_attn.{name}.weight"]
            setattr(self.attn, name, torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
        self.attn.load_state_dict({k[len(pre) + 10:]: v for k, v in self.w.items() if k.startswith(pre + "self_attn.")})
        self.mlp = m.LlamaMLP(self.cfg)
        self.mlp.load_state_dict({k[len(pre) + 4:]: v for k, v in self.w.items() if k.startswith(pre + "mlp.")})
        self.rotary = m.LlamaRotaryEmbedding(self.cfg)
        self.norms = {n: self._norm(self.w[k]) for n, k in (
            ("post", pre + "post_attention_layernorm.weight"), ("input", pre + "input_layernorm.weight"),
            ("hidden", pre + "hidden_norm.weight"), ("final", "norm.weight")) if k in self.w}

    def _norm(self, weight):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm = LlamaRMSNorm(weight.shape[0], self.cfg.rms_norm_eps)
        norm.weight.data.copy_(weight)
        return norm

    def features(self, ids: list[int]) -> torch.Tensor:
        states = self.target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        if self.kind == "eagle":
            return states[-1][0]  # after the final norm
        return torch.cat([states[i][0] for i in AUX_LAYERS], dim=-1)  # states[i]: layer i's input

    def _layer(self, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        """The head's outputs (before any final norm) at positions 0.. for (token t + 1, feature t) pairs."""
        embed = self.target.model.embed_tokens(torch.tensor(tokens))
        if self.kind == "eagle":
            x = torch.cat([embed, feats], -1) @ self.w["fc.weight"].T + self.w["fc.bias"]
            residual, attn_in = x, x
        else:
            residual = feats
            attn_in = torch.cat([self.norms["input"](embed), self.norms["hidden"](feats)], -1)
        n = len(tokens)
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attended = self.attn(attn_in[None], self.rotary(attn_in[None], pos), mask)[0][0]
        hidden = residual + attended
        return hidden + self.mlp(self.norms["post"](hidden))

    def _next(self, out: torch.Tensor) -> int:
        if self.kind == "eagle":
            return int(self.target.lm_head(out).argmax())
        small = self.norms["final"](out) @ self.w["lm_head.weight"].T
        best = int(small.argmax())
        return best + int(self.w["d2t"][best])

    @torch.inference_mode()
    def drafts(self, fill: list[int], k: int) -> list[int]:
        """The k drafts a chain proposes after `fill` (prompt and output; its last token newest)."""
        feats = self.features(fill[:-1])
        if self.kind == "eagle3":
            feats = feats @ self.w["fc.weight"].T
        tokens, out = list(fill[1:]), []
        for _ in range(k):
            outs = self._layer(tokens, feats)
            out.append(self._next(outs[-1]))
            tokens.append(out[-1])
            feats = torch.cat([feats, outs[-1:]])  # the next step reads the head's own output
        return out


def record_proposals(llm) -> list[tuple[list[int], list[int]]]:
    """(fill_ids, drafts) of every request at every draft step of `llm`."""
    drafter = llm.scheduler.spec.model
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(reqs, ks):
        drafts, probs = propose(reqs, ks)
        seen.extend((list(r.fill_ids), d) for r, d in zip(reqs, drafts) if d)
        return drafts, probs

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("page", [1, 4])
def test_eagle_heads_are_token_exact_through_shared_prefixes(algorithm, page, heads):
    path = model_path(NAME)
    prompts = parity_prompts(path)
    refs = hf_greedy(path, prompts, 16)
    with running_engine(path, page_size=page, chunked_prefill_size=64, speculative_algorithm=algorithm,
                        speculative_draft_model_path=heads[algorithm], speculative_num_steps=3) as llm:
        first = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
        again = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
    assert [o["output_ids"] for o in first] == refs == [o["output_ids"] for o in again]
    assert all(o["meta_info"]["cached_tokens"] > 0 for p, o in zip(prompts, again) if len(p) > 2 * page)
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in first) > 0


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_every_draft_equals_the_reference_head_s(algorithm, heads):
    """One request at a time, twice (the second time its prompt is a prefix-cache hit)."""
    path = model_path(NAME)
    prompt = parity_prompts(path)[1][:40]
    reference = ReferenceHead(heads[algorithm], path, algorithm.lower())
    with running_engine(path, speculative_algorithm=algorithm, speculative_draft_model_path=heads[algorithm],
                        speculative_num_steps=3) as llm:
        seen = record_proposals(llm)
        for _ in range(2):
            out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})
            assert out["meta_info"]["spec_verify_ct"] > 0
    assert len(seen) >= 6
    for fill, drafts in seen:
        assert drafts == reference.drafts(fill, len(drafts)), len(fill)


def test_a_freed_page_forgets_the_tokens_the_head_read_there(heads):
    """The head's per-slot records (which token it read from the target's features at each KV slot) decide which of
    a later prefix hit's draft KV is kept; a page freed and handed to another request must not keep them."""
    path = model_path(NAME)
    prompt = parity_prompts(path)[1][:40]
    with running_engine(path, page_size=4, disable_radix_cache=True, speculative_algorithm="EAGLE",
                        speculative_draft_model_path=heads["EAGLE"], speculative_num_steps=3) as llm:
        pairs = llm.scheduler.spec.model.pairs
        seen = []
        observe = llm.scheduler.spec.model.observe

        def observing(batch, hidden):
            observe(batch, hidden)
            seen.append(int((pairs >= 0).sum()))

        llm.scheduler.spec.model.observe = observing
        out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})
        assert out["meta_info"]["spec_verify_ct"] > 0
        assert max(seen) >= len(prompt), "the head recorded the prompt's slots while the request ran"
        assert int((pairs >= 0).sum()) == 0, "the finished request's pages were freed with their records"


@pytest.mark.parametrize("change,message", [
    ({"num_hidden_layers": 2}, "one decoder layer"),
    ({"architectures": ["Qwen2ForCausalLM"]}, "reads LlamaForCausalLMEagle heads"),
    ({"hidden_size": 64}, "hidden size .* differs from the target's"),
])
def test_heads_that_cannot_be_read_are_refused(change, message, heads, tmp_path):
    import shutil

    from radixmesh.engine import Engine

    head = tmp_path / "head"
    shutil.copytree(heads["EAGLE"], head)
    with open(head / "config.json") as f:
        cfg = json.load(f)
    with open(head / "config.json", "w") as f:
        json.dump(cfg | change, f)
    with pytest.raises(ValueError, match=message):
        Engine(model_path=model_path(NAME), device="cpu", speculative_algorithm="EAGLE",
               speculative_draft_model_path=str(head))


def test_a_head_is_not_served_as_a_model(heads):
    from radixmesh.engine import Engine

    with pytest.raises(ValueError, match="is an EAGLE draft head"):
        Engine(model_path=heads["EAGLE3"], device="cpu")
