"""Speculative decoding (--speculative-algorithm NGRAM) keeps greedy outputs token-exact: against transformers, and
against the same engine without speculation when drafts are mostly right (an oracle drafter that knows the answer
and corrupts some of its drafts), through chunked prefill, shared prefixes, pages of 1 and 4 tokens, stop tokens and
length limits inside a draft, logprobs; the pages of rejected drafts go back at once and nothing leaks."""

from __future__ import annotations

import random

import pytest

from tests.conftest import model_path
from tests.engine_utils import assert_no_leak, parity_prompts, running_engine
from tests.reference import hf_greedy

NAME = "tiny-llama"
GREEDY = {"temperature": 0}


def repetitive_prompts(path: str) -> list[list[int]]:
    """Prompts whose tails repeat earlier spans, so n-gram lookup finds drafts, and the parity prompts' shared
    prefixes and chunked lengths."""
    base = parity_prompts(path)
    loop = base[2][:9]
    return [base[1] + base[1] + base[1][:5], loop * 6, base[4] + base[4][:30], base[5], base[7], base[0]]


class Oracle:
    """Drafts the answer the engine gives without speculation, with one drafted token in three wrong (from its own
    seeded generator), so verifies keep whole drafts, part of them and none."""

    def __init__(self, prompt_len: int, answer: list[int], seed: int):
        self.prompt_len, self.answer = prompt_len, answer
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - self.prompt_len
        draft = list(self.answer[done:done + k])
        if draft and self.rng.random() < 0.5:
            at = self.rng.randrange(len(draft))
            draft[at] = (draft[at] + 1 + self.rng.randrange(50)) % 256
        self.proposed += len(draft)
        return draft


_refs: dict[str, list[list[int]]] = {}


def use_oracle(llm, answers: dict[tuple, list[int]]) -> None:
    llm.scheduler.spec.new_drafter = lambda req: Oracle(len(req.input_ids), answers[tuple(req.input_ids)],
                                                        len(req.input_ids))


@pytest.mark.parametrize("page", [1, 4])
def test_ngram_greedy_matches_transformers(page):
    path = model_path(NAME)
    prompts = repetitive_prompts(path)
    if "ngram" not in _refs:  # transformers' answers, the same for either page size: computed once
        _refs["ngram"] = hf_greedy(path, prompts, 24)
    refs = _refs["ngram"]
    with running_engine(path, page_size=page, chunked_prefill_size=64, speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=5) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
        assert [o["output_ids"] for o in outs] == refs
        # the n-gram index drafted, and some drafts were kept
        assert sum(o["meta_info"]["spec_draft_token_num"] for o in outs) > 0
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        stats = llm.scheduler.load()
        assert stats["spec_accepted_tokens"] == sum(o["meta_info"]["spec_accept_token_num"] for o in outs)
        # asked again: the finished requests' outputs are in the n-gram corpus, so nearly every draft is kept
        again = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 24})
        assert [o["output_ids"] for o in again] == refs
        kept = sum(o["meta_info"]["spec_accept_token_num"] for o in again)
        assert kept >= 0.75 * sum(len(r) - 1 for r in refs)


@pytest.mark.parametrize("page,radix", [(1, True), (4, True), (4, False)])
def test_mostly_right_drafts_are_token_exact(page, radix):
    """Oracle drafts: whole drafts kept, the rejected tails' pages returned; stop tokens and length limits falling
    inside a draft end the request right there. Outputs and logprobs as without speculation."""
    path = model_path(NAME)
    prompts = parity_prompts(path)
    lengths = [3, 17, 40, 9, 33, 25, 40, 12, 30]
    params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
    common = dict(page_size=page, chunked_prefill_size=64, disable_radix_cache=not radix)
    with running_engine(path, **common) as plain:
        want = plain.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        answers = {tuple(p): o["output_ids"] for p, o in zip(prompts, want)}
        # a stop token in the middle of one answer: it must end that request there, whatever the draft says after it
        # (asked of the same plain engine: a greedy answer does not depend on what its cache holds)
        stop_at = want[6]["output_ids"][20]
        stopped = {**params[6], "stop_token_ids": [stop_at]}
        want[6] = plain.generate(input_ids=prompts[6], sampling_params=stopped, return_logprob=True,
                                 top_logprobs_num=2)
    params[6] = stopped
    with running_engine(path, **common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6) as llm:
        use_oracle(llm, answers)
        got = llm.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        again = llm.generate(input_ids=prompts, sampling_params=params)  # over the prefix cache this time
    for g, w, a in zip(got, want, again):
        assert g["output_ids"] == w["output_ids"] == a["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        lp_g = [x[0] for x in g["meta_info"]["output_token_logprobs"]]
        lp_w = [x[0] for x in w["meta_info"]["output_token_logprobs"]]
        assert lp_g == pytest.approx(lp_w, abs=1e-4)
        tops_g = [[t[1] for t in row] for row in g["meta_info"]["output_top_logprobs"]]
        assert tops_g == [[t[1] for t in row] for row in w["meta_info"]["output_top_logprobs"]]
    accepted = sum(g["meta_info"]["spec_accept_token_num"] for g in got)
    drafted = sum(g["meta_info"]["spec_draft_token_num"] for g in got)
    assert drafted > accepted > drafted // 3, (drafted, accepted)
    # fewer target forwards than tokens: the point of it
    assert sum(g["meta_info"]["spec_verify_ct"] for g in got) < sum(len(g["output_ids"]) - 1 for g in got)


def test_the_triton_backend_verifies_as_torch_native_does():
    """A verify forward through the Triton extend kernel (on CPU in Triton's interpreter) over a cached prefix and
    pages of 4 tokens: transformers' greedy tokens, drafts kept whole and in part."""
    path = model_path(NAME)
    shared = parity_prompts(path)[4:6]  # 120 shared tokens and 5 and 13 of their own
    # 21 and 29 tokens, a shared 16-token prefix (four pages): every verify still attends over the request's cached
    # pages; short prompts keep the interpreted prefill and each verify's walk over the prefix small
    prompts = [p[:16] + p[120:] for p in shared]
    refs = hf_greedy(path, prompts, 10)
    with running_engine(path, page_size=4, chunked_prefill_size=64, attention_backend="triton",
                        speculative_algorithm="NGRAM", speculative_num_draft_tokens=5) as llm:
        use_oracle(llm, {tuple(p): r for p, r in zip(prompts, refs)})
        outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert [o["output_ids"] for o in outs] == refs
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0


def test_rejected_pages_go_back_at_once():
    """While a request decodes with drafts, it holds pages only for the tokens it has: after each step its
    allocation ends where its KV does (no page held for rejected drafts)."""
    path = model_path(NAME)
    prompt = parity_prompts(path)[3]
    with running_engine(path, page_size=4, disable_radix_cache=True) as plain:
        answer = plain.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})["output_ids"]
    with running_engine(path, page_size=4, disable_radix_cache=True, speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=8) as llm:
        use_oracle(llm, {tuple(prompt): answer})
        seen = []
        spec = llm.scheduler.spec
        verified = spec.verified

        def check(req, drafted, tokens):
            verified(req, drafted, tokens)
            seen.append((drafted, len(tokens) - 1, req.kv_len, req.alloc_len))

        spec.verified = check
        out = llm.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30})
        assert out["output_ids"] == answer
        assert any(d > a for d, a, _, _ in seen) and any(d == a > 0 for d, a, _, _ in seen)
        assert all(alloc == kv for _, _, kv, alloc in seen), seen
        assert_no_leak(llm)


@pytest.mark.parametrize("page", [1, 4])
def test_grammars_penalties_and_min_tokens_apply_at_every_drafted_position(page):
    """A drafted position is sampled as if the drafted tokens before it were output: the grammar's state after them
    (its matcher walked along the draft, then rolled back), penalty counts that include them, min_new_tokens
    counting them. With mostly right drafts (the oracle), outputs equal the plain engine's and drafts are kept."""
    import json

    path = model_path(NAME)
    prompts = repetitive_prompts(path)[:4]
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                         "required": ["a", "b"]})
    params = [{**GREEDY, "max_new_tokens": 40, "json_schema": schema},
              {**GREEDY, "max_new_tokens": 24, "regex": "(ab|cd)+x"},
              {**GREEDY, "max_new_tokens": 24, "frequency_penalty": 1.5, "presence_penalty": 0.5,
               "repetition_penalty": 1.3},
              {**GREEDY, "max_new_tokens": 24, "min_new_tokens": 20, "stop_token_ids": [2, 3]}]
    with running_engine(path, page_size=page) as plain:
        want = plain.generate(input_ids=prompts, sampling_params=params)
    with running_engine(path, page_size=page, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6) as llm:
        use_oracle(llm, {tuple(p): w["output_ids"] for p, w in zip(prompts, want)})
        got = llm.generate(input_ids=prompts, sampling_params=params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert all(g["meta_info"]["spec_accept_token_num"] > 0 for g in got), [g["meta_info"] for g in got]
    if got[0]["meta_info"]["finish_reason"]["type"] == "stop":  # the grammar ended it: whole JSON
        json.loads(got[0]["text"])


def test_sampled_requests_run_and_seeds_reproduce():
    """Sampled rows verify by rejection sampling (its distribution: tests/unit/test_spec_verify.py); a seeded
    request gives the same output each time, alone or beside others."""
    path = model_path(NAME)
    prompts = repetitive_prompts(path)[:3]
    seeded = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "sampling_seed": 7}
    with running_engine(path, speculative_algorithm="NGRAM") as llm:
        answers = {tuple(p): llm.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 20})["output_ids"]
                   for p in prompts}
        use_oracle(llm, answers)  # drafts the greedy answer: a sampled row keeps some of it, rejects some
        alone = llm.generate(input_ids=prompts[0], sampling_params=seeded)
        batch = llm.generate(input_ids=prompts, sampling_params=[seeded, {**seeded, "sampling_seed": None},
                                                                  {**GREEDY, "max_new_tokens": 20}])
    assert alone["output_ids"] == batch[0]["output_ids"]
    assert len(batch[1]["output_ids"]) == 20
    assert batch[2]["output_ids"] == answers[tuple(prompts[2])]
    assert alone["meta_info"]["spec_accept_token_num"] > 0


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_algorithm": "EAGLE"}, "drafts with an EAGLE head: give speculative_draft_model_path"),
    ({"speculative_algorithm": "NEXTN"}, "has none \\(num_nextn_predict_layers\\)"),
    ({"speculative_algorithm": "MEDUSA"}, "must be one of"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "draft trees"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, ">= 2"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"}, "takes no"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 2}, "min <= max"),
    ({"speculative_algorithm": "NGRAM", "speculative_accept_threshold_single": 0.5}, "verifies exactly"),
    ({"speculative_algorithm": "NGRAM", "speculative_token_map": "map.pt"}, "FR-Spec"),
    ({"speculative_algorithm": "NGRAM", "speculative_attention_mode": "prefill"}, "'prefill' .* not implemented"),
])
def test_bad_speculative_flags_are_refused(kwargs, message):
    from radixmesh.engine import Engine

    with pytest.raises(ValueError, match=message):
        Engine(model_path=model_path(NAME), device="cpu", **kwargs)


def test_ngram_resolves_sglang_defaults():
    from radixmesh.engine.config import EngineArgs, resolve_args
    from radixmesh.engine.model_config import ModelConfig

    path = model_path(NAME)
    args = resolve_args(EngineArgs(model_path=path, device="cpu", speculative_algorithm="ngram"),
                        ModelConfig.from_path(path))
    assert args.speculative_algorithm == "NGRAM" and args.disable_overlap_schedule
    assert args.speculative_num_draft_tokens == 8 and args.speculative_eagle_topk == 1


_plain: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_a_mixed_load_on_a_small_pool_with_aborts_is_exact_and_leaks_nothing(algorithm, tmp_path):
    """Everything at once on a pool small enough to retract: greedy requests with length limits, stop tokens and
    min_new_tokens, a regex, penalties, seeded and unseeded sampled ones, and streams aborted mid-answer; every greedy
    output equals the plain engine's on the same pool, and once all is done every page is back (running_engine)."""
    import threading

    path = model_path(NAME)
    prompts = repetitive_prompts(path) + parity_prompts(path)[4:9]
    greedy = [{**GREEDY, "max_new_tokens": 8 + 5 * i} for i in range(len(prompts))]
    greedy[1]["stop_token_ids"] = [7, 11]
    greedy[2]["min_new_tokens"] = 15
    greedy[3]["regex"] = "[a-z ]+\\."
    greedy[4].update(frequency_penalty=0.7, repetition_penalty=1.2)
    sampled = [{"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30, "sampling_seed": s} for s in (1, None)]
    common = dict(page_size=4, max_total_tokens=512, chunked_prefill_size=32, schedule_conservativeness=0.05)
    if "mixed" not in _plain:  # the plain engine's answers are the same for every algorithm: computed once
        with running_engine(path, **common) as plain:
            _plain["mixed"] = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
    want = _plain["mixed"]
    extra = {"speculative_draft_model_path": path} if algorithm == "STANDALONE" else {}
    if algorithm == "EAGLE3":
        from tests.parity.test_speculative_eagle import write_head

        extra = {"speculative_draft_model_path": write_head(tmp_path / "head", path, "eagle3")}
    with running_engine(path, **common, speculative_algorithm=algorithm, speculative_num_draft_tokens=5,
                        **extra) as llm:
        if algorithm == "NGRAM":
            use_oracle(llm, {tuple(p): w for p, w in zip(prompts, want)})
        aborted = []

        def abort_mid_stream(i: int) -> None:
            rid = f"abort-{i}"
            for n, _ in enumerate(llm.generate(input_ids=prompts[i], sampling_params={**GREEDY, "max_new_tokens": 60},
                                               stream=True, rid=rid)):
                if n == 3:
                    llm.abort_request(rid)
            aborted.append(rid)

        threads = [threading.Thread(target=abort_mid_stream, args=(i,)) for i in (0, 5)]
        for t in threads:
            t.start()
        got = llm.generate(input_ids=prompts + prompts[:2], sampling_params=greedy + sampled)
        for t in threads:
            t.join(timeout=120)
        assert len(aborted) == 2
        assert llm.scheduler.stats["retractions"] > 0  # the pool was small enough to retract
    assert [o["output_ids"] for o in got[:len(prompts)]] == want
    assert all(len(o["output_ids"]) > 0 for o in got[len(prompts):])
    counted = "spec_draft_token_num" if algorithm == "EAGLE3" else "spec_accept_token_num"  # (a random head's
    assert sum(o["meta_info"][counted] for o in got) > 0  # drafts are wrong: there, drafting is what to see)
