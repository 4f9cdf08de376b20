"""Greedy reference outputs from Hugging Face transformers, cut after the first EOS as our engine stops there."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' model in its eager attention where the config soft-caps attention scores: SDPA has no soft-cap,
    and transformers 5.17 runs Gemma 2 through SDPA by default, silently uncapped (its greedy tokens then differed
    from the eager path's, which computes the model as defined; 5.25 refuses SDPA for Gemma 2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    capped = getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None
    kwargs = {"attn_implementation": "eager"} if capped else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


def eos_ids(model) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    extra = model.config.get_text_config().eos_token_id  # (a multimodal config holds it in its text config)
    ids += extra if isinstance(extra, list) else [extra]
    return {i for i in ids if i is not None}


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, dtype=torch.float32,
              device: str = "cpu") -> list[list[int]]:
    """Each prompt's greedy continuation, cut after its first EOS. Continuations already computed with this model
    object (hf_model's cache) are reused: greedy's first n tokens do not depend on how many more are asked for, and
    many test files ask for the same prompts' references (a tenth of a parity file's CPU went to them)."""
    model = hf_model(path, dtype, device)
    stops = eos_ids(model)
    memo = model.__dict__.setdefault("_greedy_memo", {})  # prompt -> (continuation so far, whether it ended)
    outs = []
    for p in prompts:
        known, ended = memo.get(tuple(p), ((), False))
        if len(known) < max_new_tokens and not ended:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            toks = gen[0, len(p):].tolist()
            cut = next((i + 1 for i, t in enumerate(toks) if t in stops), None)
            known, ended = tuple(toks[:cut]), cut is not None
            memo[tuple(p)] = (known, ended)
        outs.append(list(known[:max_new_tokens]))
    return outs


def _output_steps(path: str, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 reference model's log-softmax at each of `output`'s steps (fed prompt + output[:i]) [len(output),
    vocab], and each step's logprob of its output token."""
    logits = hf_model(path)(torch.tensor([prompt + output])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], dim=-1)
    return steps, steps.gather(1, torch.tensor(output)[:, None]).squeeze(1)


@torch.inference_mode()
def hf_token_logprobs(path: str, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under the float32 reference model."""
    return _output_steps(path, prompt, output)[1].tolist()


@torch.inference_mode()
def hf_argmax_gaps(path: str, prompt: list[int], output: list[int]) -> list[float]:
    """For each token of `output`, how far its logprob falls below the best token's under the float32 reference
    model, fed prompt + output[:i] (0.0 where it is the reference's greedy choice): a lower-precision run's tokens
    judged against near ties rather than against one greedy path."""
    steps, chosen = _output_steps(path, prompt, output)
    return (steps.max(dim=1).values - chosen).tolist()
