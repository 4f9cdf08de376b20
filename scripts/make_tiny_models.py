"""Write tiny seeded Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints for greedy parity tests, and a Qwen3-Embedding-shaped
one.
Usage: python scripts/make_tiny_models.py --out models [--check]  (~10 s; --check audits)

Random weights make greedy decoding a chain of near-ties, so each model is seeded
noise plus a hand-placed circuit that makes every greedy step decisive: each token
has a code c < 8 and a loudness v in {0, 1}; eight "slot" heads (two per layer, one
per kv group) attend to fixed relative offsets by RoPE geometry alone and vote for
TARGET[slot][c] of the token they see with weight r^(rank + 8 v). Votes use disjoint
lm_head directions and distinct exponents, so top-1 beats top-2 by a factor >= r =
1.12 in any context, and a token vetoes its own repeat. Noise (other heads, MLPs,
biases, norm weights) stays far below that margin: fp32 logits depend on every
weight, the argmax does not move. Weights sit on the bf16 grid (lossless bf16 cast).
"""

import argparse
import json
import logging
import math
import random
import sys
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, processors
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_corpus import (CHECK_CHATS, SPECIALS, TOKENIZER_SIZE, check_prompts,  # noqa: E402
                         corpus, dump_json, train_tokenizer, write_tokenizer)

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 4, 4, 2, 256
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
QWEN_TOKENS = dict(bos="<|endoftext|>", eos=["<|im_end|>", "<|endoftext|>"], pad="<|endoftext|>")
SPECS = {
    "tiny-llama": dict(arch="LlamaForCausalLM", model_type="llama", head_dim=32, vocab=1000,
                       tie=False, theta=1e4, rope_scaling=LLAMA3, eps=1e-5, seed=11,
                       bos="<|begin_of_text|>", eos=["<|eot_id|>"], pad="<|end_of_text|>"),
    "tiny-qwen2": dict(arch="Qwen2ForCausalLM", model_type="qwen2", head_dim=32, vocab=1024,
                       tie=True, theta=1e6, rope_scaling=None, eps=1e-6, seed=22, **QWEN_TOKENS),
    "tiny-qwen3": dict(arch="Qwen3ForCausalLM", model_type="qwen3", head_dim=48, vocab=1024,
                       tie=False, theta=1e6, rope_scaling=None, eps=1e-6, seed=33, **QWEN_TOKENS),
}
# Residual layout: [kappa | norm filler | 8 code dims | 54 noise dims | 64 vote dims].
KAPPA, COMP, CODE0, FILL0, VOTE0 = 0, 1, 2, 10, 64
N_CODES, RATIO, CODE_SCALE, KAPPA_VAL, FILL_SQ = 8, 1.12, 2.0, 3.0, 40.0
# (layer, head, offset): one slot per kv group per layer. Far offsets rank highest so
# chat prompts that share a template suffix (5 tokens) still diverge.
SLOTS = ((0, 0, 4), (0, 3, 0), (1, 1, 8), (1, 2, 2), (2, 0, 1), (2, 2, 10), (3, 1, 3), (3, 3, 6))
RANKS = [sorted(d for _, _, d in SLOTS).index(d) for _, _, d in SLOTS]
PEAK_SCORE, VOTE_W, FINAL_W, BETA = 100.0, 0.1, 12.0, 1.5
NOISE, WRITE, QUIET, SILENT = 0.02, 0.005, 0.002, 0.00002
F64 = torch.float64


def write_metadata(name: str, spec: dict, tok: Tokenizer, out: Path) -> None:
    """Hub-style config (rope_theta, rope_scaling, torch_dtype), generation config, tokenizer."""
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    eos = [ids[t] for t in spec["eos"]]
    cfg = dict(architectures=[spec["arch"]], model_type=spec["model_type"], hidden_size=HIDDEN,
               intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=spec["head_dim"], hidden_act="silu",
               max_position_embeddings=1024, rms_norm_eps=spec["eps"], rope_theta=spec["theta"],
               rope_scaling=spec["rope_scaling"], vocab_size=spec["vocab"],
               tie_word_embeddings=spec["tie"], bos_token_id=ids[spec["bos"]], eos_token_id=eos[0],
               torch_dtype="float32", attention_dropout=0.0, initializer_range=0.02, use_cache=True)
    if spec["model_type"] == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=LAYERS)
    dump_json(cfg, out / "config.json")
    dump_json({"bos_token_id": ids[spec["bos"]], "eos_token_id": eos if len(eos) > 1 else eos[0],
               "pad_token_id": ids[spec["pad"]]}, out / "generation_config.json")
    write_tokenizer(tok, out, name, spec["bos"], spec["eos"][0], spec["pad"])


def slot_profiles(theta: torch.Tensor, deltas, steps: int = 800):
    """Amplitudes per slot of score(d) = sum_f A_f cos(w_f (d - delta)) + B_f sin(...), scaled
    by 1 / sum_f |A_f + iB_f|. Adam maximises a soft minimum of the peak's margin over all
    other d < 1024 and of each d < delta over all shorter d, so a query still too close to
    the sequence start for its offset attends decisively to the first token instead."""
    dist = torch.arange(1024, dtype=F64)
    delta = torch.tensor(deltas, dtype=F64)[:, None]
    phase = theta[None, :, None] * (dist[None, None, :] - delta[:, :, None])
    cos, sin = phase.cos(), phase.sin()
    masks = (torch.where(dist[None] == delta, 1e9, 0.0),
             torch.where(dist[None, 1:] < delta, 0.0, 1e9))
    amp_a = theta.sqrt().repeat(len(deltas), 1).requires_grad_()
    amp_b = torch.zeros_like(amp_a, requires_grad=True)
    opt = torch.optim.Adam([amp_a, amp_b], lr=0.01)

    def margins():  # [slot, constraint]; masked entries are +1e9
        score = (amp_a[..., None] * cos + amp_b[..., None] * sin).sum(1)
        score = score / amp_a.hypot(amp_b).sum(1, keepdim=True)
        rise = score[:, 1:] - score[:, :-1] + masks[1]
        return torch.cat([score.gather(1, delta.long()) - score + masks[0], rise], 1)

    for _ in range(steps):
        loss = (-200.0 * margins()).logsumexp(1).sum() / 200.0  # soft -min(margin)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return amp_a.detach(), amp_b.detach(), margins().min(1).values


def rope_vectors(theta, amp_a, amp_b, delta: int, head_dim: int):
    """Per RoPE pair (dims f, f + head_dim/2, rotated by w_f * pos): key (|c|^.5, 0), query
    c e^{-i w delta} / |c|^.5, c = A - iB; q.k / sqrt(head_dim) = PEAK_SCORE * score(dist)."""
    c = torch.complex(amp_a, -amp_b) * torch.polar(torch.ones_like(theta), -theta * delta)
    c = c * PEAK_SCORE * math.sqrt(head_dim) / amp_a.hypot(amp_b).sum()
    k_amp = c.abs().sqrt()
    q = c / k_amp.clamp_min(1e-12)
    return torch.cat([q.real, q.imag]), torch.cat([k_amp, torch.zeros_like(k_amp)])


def token_tables(spec: dict, tok: Tokenizer):
    """Per-token code and level; vote target of every (slot, code).

    The weakest slot's code-0/1 votes are the eos ids: that slot wins only when all
    others see quiet tokens and codes 0/1 are 5x rarer, so EOS is rare but reachable.
    """
    rng, vocab = random.Random(spec["seed"]), spec["vocab"]
    codes = torch.tensor(rng.choices(range(N_CODES), weights=[0.2, 0.2] + [1.0] * 6, k=vocab))
    levels = torch.tensor([rng.randrange(2) for _ in range(vocab)], dtype=F64)
    targets = torch.tensor(rng.sample(range(len(SPECIALS), TOKENIZER_SIZE), len(SLOTS) * N_CODES))
    for code, eos in enumerate(spec["eos"]):
        targets[RANKS.index(0) * N_CODES + code] = tok.token_to_id(eos)
    return codes, levels, targets


def noise_state(shapes: dict, gen: torch.Generator) -> dict:
    """Seeded noise for every tensor, drawn in sorted-name order so bytes are stable."""
    sd = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            sd[name] = 0.8 + 0.4 * torch.rand(shapes[name], generator=gen, dtype=F64)
        else:
            sd[name] = NOISE * torch.randn(shapes[name], generator=gen, dtype=F64)
    # Residual writers stay small: the residual rms divides every loudness value and
    # must drift < 1% over the layers; code and vote dims must stay clean.
    write = torch.full((HIDDEN,), SILENT / NOISE, dtype=F64)
    write[:CODE0], write[FILL0:VOTE0] = QUIET / NOISE, WRITE / NOISE
    for name, t in sd.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.mul_(write[:, None])
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t.mul_(1.0 / (NOISE * math.sqrt(HIDDEN)))
        elif name.endswith("bias"):
            t.mul_(5.0)
    return sd


def design_embeddings(sd: dict, spec: dict, tables, gen: torch.Generator) -> None:
    codes, levels, targets = tables
    vocab, n_vote = spec["vocab"], len(targets)
    fin = -FINAL_W * sd["model.norm.weight"][VOTE0:]  # negative: votes and vetoes flip sign
    small = 0.002 * (2 * torch.rand(VOTE0, generator=gen, dtype=F64) - 1)
    sd["model.norm.weight"] = torch.cat([small, fin])
    emb = torch.zeros(vocab, HIDDEN, dtype=F64)
    emb[:, KAPPA] = KAPPA_VAL
    emb[torch.arange(vocab), CODE0 + codes] = CODE_SCALE * RATIO ** (len(SLOTS) * levels)
    fill = torch.randn(vocab, VOTE0 - FILL0, generator=gen, dtype=F64)
    emb[:, FILL0:VOTE0] = fill * math.sqrt(FILL_SQ) / fill.norm(dim=1, keepdim=True)
    emb[:, VOTE0:] = SILENT * torch.randn(vocab, n_vote, generator=gen, dtype=F64)
    # A target's output row; dividing by |final norm weight| equalises vote logits. As
    # an input row it is the veto: -FINAL_W * BETA^2 beats any vote (<= ~9.8 logits).
    emb[targets, VOTE0 + torch.arange(n_vote)] = BETA * FINAL_W / fin.abs()
    emb[:, COMP] = (HIDDEN - emb.pow(2).sum(1)).sqrt()  # every row has rms exactly 1
    sd["model.embed_tokens.weight"] = emb
    if not spec["tie"]:
        head = NOISE * torch.randn(vocab, HIDDEN, generator=gen, dtype=F64)
        head[:, VOTE0:] = emb[:, VOTE0:]
        sd["lm_head.weight"] = head


def set_qk_norms(sd: dict, vecs: list) -> None:
    """Qwen3 q/k RMSNorm: a layer's two slot heads share one weight; its scale makes the
    raw vectors (vec / weight) about unit rms, so normed q, k are vec up to ~10%."""
    for layer in range(LAYERS):
        slots = [s for s, (lay, _, _) in enumerate(SLOTS) if lay == layer]
        for which, norm in enumerate(("q_norm", "k_norm")):
            name = f"model.layers.{layer}.self_attn.{norm}.weight"
            u = 0.2 + sd[name]  # random in [1, 1.4)
            rms = [(vecs[s][which] / u).pow(2).mean().sqrt() for s in slots]
            sd[name] = u * math.sqrt(rms[0] * rms[1])


def design_slot(sd: dict, spec: dict, slot: int, q: torch.Tensor, k: torch.Tensor) -> None:
    layer, head, _ = SLOTS[slot]
    p, hd = f"model.layers.{layer}.self_attn.", spec["head_dim"]
    group = head // (HEADS // KV_HEADS)
    w_in = sd[f"model.layers.{layer}.input_layernorm.weight"]
    for proj, norm, vec, idx in (("q_proj", "q_norm", q, head), ("k_proj", "k_norm", k, group)):
        rows, w = slice(idx * hd, (idx + 1) * hd), sd[p + proj + ".weight"]
        w[rows] *= QUIET / NOISE
        if spec["model_type"] == "qwen3":  # the per-dim norm weight is re-applied after rms
            vec = vec / sd[p + norm + ".weight"]
        if spec["model_type"] == "qwen2":  # positional query/key live in the (noisy) biases
            sd[p + proj + ".bias"][rows] = vec + sd[p + proj + ".bias"][rows] * (QUIET / NOISE)
        else:  # ... or come from the constant kappa dim of every embedding
            w[rows, KAPPA] = vec / (KAPPA_VAL * w_in[KAPPA])
    vrows = slice(group * hd, group * hd + N_CODES)  # value = loudness one-hot of the code
    sd[p + "v_proj.weight"][vrows] *= SILENT / NOISE
    sd[p + "v_proj.weight"][vrows, CODE0:FILL0] += torch.diag(1 / (CODE_SCALE * w_in[CODE0:FILL0]))
    if spec["model_type"] == "qwen2":
        sd[p + "v_proj.bias"][vrows] *= SILENT / NOISE
    vote = VOTE0 + slot * N_CODES + torch.arange(N_CODES)
    sd[p + "o_proj.weight"][vote, head * hd + torch.arange(N_CODES)] = -VOTE_W * RATIO**RANKS[slot]


def build(name: str, spec: dict, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_metadata(name, spec, tok, out)
    torch.manual_seed(spec["seed"])  # only HF's throwaway init draws from this
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    gen = torch.Generator().manual_seed(spec["seed"])
    sd = noise_state({n: tuple(t.shape) for n, t in model.state_dict().items()}, gen)
    design_embeddings(sd, spec, token_tables(spec, tok), gen)
    theta = model.model.rotary_emb.inv_freq.to(F64)  # exact HF frequencies, llama3 scaling included
    amp_a, amp_b, worst = slot_profiles(theta, [d for _, _, d in SLOTS])
    assert worst.min() > 0.04, f"{name}: RoPE slot margins too small: {worst.tolist()}"
    vecs = [rope_vectors(theta, a, b, d, spec["head_dim"])
            for a, b, (_, _, d) in zip(amp_a, amp_b, SLOTS)]
    if spec["model_type"] == "qwen3":
        set_qk_norms(sd, vecs)
    for slot, (q, k) in enumerate(vecs):
        design_slot(sd, spec, slot, q, k)
    sd = {n: t.to(torch.bfloat16).to(torch.float32).contiguous() for n, t in sd.items()}
    if spec["tie"]:  # HF keeps lm_head as an alias of the embedding; the file omits it
        sd.pop("lm_head.weight")
    model.load_state_dict({"lm_head.weight": sd["model.embed_tokens.weight"], **sd}, strict=True)
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})


EMBED_NAME, EMBED_SEED = "tiny-qwen3-embed", 44


def build_embedding(tok: Tokenizer, out: Path) -> None:
    """A Qwen3-Embedding-shaped checkpoint for embedding parity: Qwen3ForCausalLM config with tied embeddings and
    `is_matryoshka`, weights saved as the bare backbone (no `model.` prefix, no lm_head), the tiny Qwen3 tokenizer
    with <|endoftext|> appended to every input, and sentence-transformers files that ask for last-token pooling
    and normalisation. Weights are seeded noise at unit gain (no circuit: embeddings need no decisive argmax), so
    every layer mixes context and different prompts get clearly different vectors."""
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(SPECS["tiny-qwen3"], tie=True, seed=EMBED_SEED)
    write_metadata("tiny-qwen3", spec, tok, out)
    cfg_json = json.loads((out / "config.json").read_text())
    dump_json({**cfg_json, "is_matryoshka": True}, out / "config.json")
    cfg = AutoConfig.from_pretrained(out)
    eos = "<|endoftext|>"
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                       special_tokens=[(eos, raw.token_to_id(eos))])
    raw.save(str(out / "tokenizer.json"))
    gen = torch.Generator().manual_seed(EMBED_SEED)
    backbone = AutoModel.from_config(cfg)
    sd = {}
    for name, t in sorted(backbone.state_dict().items()):
        if name.endswith("norm.weight"):
            sd[name] = 0.8 + 0.4 * torch.rand(t.shape, generator=gen)
        elif name.endswith("bias"):
            sd[name] = 0.1 * torch.randn(t.shape, generator=gen)
        else:  # unit gain: rows of a [out, in] weight ~ N(0, 1 / in); embeddings ~ N(0, 1)
            fan_in = t.shape[1] if t.dim() == 2 and "embed" not in name else 1
            sd[name] = torch.randn(t.shape, generator=gen) / math.sqrt(fan_in)
    save_file({n: t.contiguous() for n, t in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    dump_json([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
              out / "modules.json")
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    dump_json({"word_embedding_dimension": HIDDEN, **{f"pooling_mode_{m}": m == "lasttoken" for m in modes},
               "include_prompt": True}, out / "1_Pooling" / "config.json")


MOE_NAME, MOE_SEED, MOE_EXPERTS, MOE_TOP_K = "tiny-qwen3-moe", 55, 4, 2


def build_moe(out: Path, dense: Path) -> None:
    """A Qwen3-MoE checkpoint made from tiny-qwen3 (same tokenizer, attention, norms and circuit): every MLP becomes
    four experts, each the dense MLP's weights times (1 + 5% noise), two of them picked per token by a seeded router
    with norm_topk_prob; layer 1 stays dense (mlp_only_layers). The picked experts' weights sum to one, so a layer
    computes close to the dense MLP and the circuit's greedy margins hold, while which experts a token takes (and how
    much each weighs) changes every logit: a wrong route or weight shows in the parity tests' logprobs."""
    out.mkdir(parents=True, exist_ok=True)
    for f in dense.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=MOE_EXPERTS,
               num_experts_per_tok=MOE_TOP_K, moe_intermediate_size=FFN, norm_topk_prob=True, mlp_only_layers=[1],
               decoder_sparse_step=1, output_router_logits=False, router_aux_loss_coef=0.0)
    dump_json(cfg, out / "config.json")
    from safetensors.torch import load_file

    sd = load_file(str(dense / "model.safetensors"))
    gen = torch.Generator().manual_seed(MOE_SEED)
    for layer in range(LAYERS):
        if layer == 1:
            continue
        mlp = f"model.layers.{layer}.mlp"
        dense_w = {p: sd.pop(f"{mlp}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")}
        for e in range(MOE_EXPERTS):
            for p, w in dense_w.items():
                sd[f"{mlp}.experts.{e}.{p}.weight"] = w * (1 + 0.05 * torch.randn(w.shape, generator=gen))
        sd[f"{mlp}.gate.weight"] = torch.randn(MOE_EXPERTS, HIDDEN, generator=gen) * HIDDEN ** -0.5
    sd = {n: t.to(torch.bfloat16).to(torch.float32).contiguous() for n, t in sd.items()}
    save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})


def load_quietly(path: Path):
    """Model, tokenizer, and every warning, loading complaint or tokenizer disagreement."""
    log, handler = logging.getLogger("transformers"), logging.Handler(logging.WARNING)
    records, handler.emit = [], lambda r: records.append(r.getMessage())
    log.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(path)
    log.removeHandler(handler)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    drift = sum(tok(t).input_ids != raw.encode(t).ids for t in check_prompts() + corpus(7, 200))
    records += [f"{k}={v}" for k, v in info.items() if v] + [str(w.message) for w in caught]
    return model, tok, records + [f"tokenizer drift {drift}"] * bool(drift)


def greedy(model, ids: list[int], n: int):
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=n, output_logits=True, return_dict_in_generate=True)
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
    return out.sequences[0, len(ids):].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


def audit(path: Path) -> str:
    model, tok, problems = load_quietly(path)
    eos = set(torch.tensor(model.generation_config.eos_token_id).view(-1).tolist())
    bf16, model = model.to(torch.bfloat16), type(model).from_pretrained(path)  # .to() is in place
    prompts = [tok(p).input_ids for p in check_prompts()] + [tok(
        tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False).input_ids for c in CHECK_CHATS]
    gaps, stops, bad, firsts, spread = [], 0, 0, set(), []
    for ids in prompts:
        new, gap = greedy(model, ids, 48)
        gaps.append(gap)
        stops += any(t in eos for t in new)
        bad += greedy(bf16, ids, 16)[0] != new[:16]
        firsts.add(tuple(new[:8]))
        spread.append(len(set(new)))
    return (f"min_gap={min(gaps):.3f} eos_hit={stops}/{len(prompts)} bf16_first16_diff={bad} "
            f"distinct_first8={len(firsts)} distinct_tokens/48={min(spread)}..{max(spread)} "
            f"prompt_len={min(map(len, prompts))}..{max(map(len, prompts))} problems={problems}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--check", action="store_true", help="also load and audit greedy decoding")
    args = parser.parse_args()
    start = time.time()
    torch.set_num_threads(1)  # identical float reductions whatever the core count
    tok = train_tokenizer()
    for name, spec in SPECS.items():
        build(name, spec, tok, args.out / name)
    build_embedding(tok, args.out / EMBED_NAME)
    build_moe(args.out / MOE_NAME, args.out / "tiny-qwen3")
    print(f"wrote {', '.join([*SPECS, EMBED_NAME, MOE_NAME])} to {args.out} in {time.time() - start:.1f}s")
    if args.check:
        for name in [*SPECS, MOE_NAME]:
            print(f"{name}: {audit(args.out / name)}")


if __name__ == "__main__":
    main()
