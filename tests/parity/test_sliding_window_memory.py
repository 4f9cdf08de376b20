"""The KV pages a sliding window frees (engine.cache.swa), for models whose layers all slide: Mistral (every layer)
and Qwen2 with use_sliding_window and max_window_layers=0. Outputs stay token-exact with transformers in float32
(greedy tokens and teacher-forced logprobs) through chunked prefill, page sizes, radix-cache hits and retractions;
no page leaks; and a long request's pool usage stays within its window plus the pages of one step, where keeping
every page would hold its whole length. A hybrid model (Gemma 2: local and global layers) keeps every page."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine_utils import running_engine
from tests.reference import hf_greedy, hf_token_logprobs
from tests.sliding_models import VOCAB, WINDOW, build, prompts

MAX_NEW = 32  # past the window and a 16-token page after each prompt: every request frees pages
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
LOGPROB_ATOL = 1e-4
KINDS = ("mistral", "qwen2")
_refs: dict[tuple, tuple[list[list[int]], list[list[float]]]] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("swa-memory")
    out = {kind: build(kind, root / kind) for kind in KINDS}
    _edit(out["qwen2"], max_window_layers=0, layer_types=["sliding_attention"] * 3)  # every layer slides
    out["mistral-wide"] = build("mistral", root / "wide")
    _edit(out["mistral-wide"], sliding_window=40)  # short requests never slide
    out["gemma2"] = build("gemma2", root / "gemma2")
    return out


def _edit(path: str, **fields) -> None:
    """Set `fields` in the checkpoint's config.json."""
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    raw.update(fields)
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)


def reference(path: str, inputs: list[list[int]], max_new: int = MAX_NEW):
    key = (path, max_new, tuple(map(tuple, inputs)))
    if key not in _refs:
        outs = hf_greedy(path, inputs, max_new)
        _refs[key] = outs, [hf_token_logprobs(path, p, o) for p, o in zip(inputs, outs)]
    return _refs[key]


def check(path: str, inputs: list[list[int]], outs: list[dict], max_new: int = MAX_NEW) -> None:
    want_ids, want_logprobs = reference(path, inputs, max_new)
    assert [o["output_ids"] for o in outs] == want_ids
    for out, want in zip(outs, want_logprobs):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=LOGPROB_ATOL)


def poison_freed(llm) -> None:
    """Every page freed from now on gets K and V of 100 in every layer (finite, so a masked read still weighs 0):
    a read of a freed page moves the logprobs far past LOGPROB_ATOL, even before another request reuses it."""
    cache = llm.cache
    free = cache._free_slots

    def poisoned(slots: torch.Tensor) -> None:
        if len(slots):
            pages = slots[slots % cache.page == 0] // cache.page
            rows = (pages[:, None] * cache.page + torch.arange(cache.page)).reshape(-1)
            for buf in cache.kv.buffers():
                buf[rows] = 100.0
        free(slots)

    cache._free_slots = poisoned
    if cache.swa is not None:
        cache.swa.free = poisoned


CONFIGS = [
    dict(chunked_prefill_size=16, page_size=1),
    dict(chunked_prefill_size=-1, page_size=4),
    dict(chunked_prefill_size=8, page_size=4, disable_radix_cache=True),
    dict(chunked_prefill_size=32, page_size=16),  # a page longer than the window
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_parity_while_freeing(checkpoints, kind, cfg):
    path = checkpoints[kind]
    with running_engine(path, skip_tokenizer_init=True, **cfg) as llm:
        assert llm.cache.swa is not None and llm.cache.swa.window == WINDOW
        poison_freed(llm)
        for _ in range(2):
            check(path, prompts(), llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True))
        assert llm.cache.swa.freed_tokens > 0


def test_what_the_radix_cache_keeps(checkpoints):
    """A request's prompt is cached as it runs (so a second turn hits it); the answer of a request that freed pages
    is not (its prefix lacks them): the second turn hits the prompt's pages only, and recomputes the rest. Where the
    window is wider than the whole first turn, nothing is freed and the second turn hits the answer too."""
    page, max_new = 4, 24
    first = prompts()[-1]  # 90 tokens
    for name, slides in (("mistral", True), ("mistral-wide", False)):
        path = checkpoints[name]
        inputs = [first] if slides else [first[:10]]
        with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=16, page_size=page) as llm:
            poison_freed(llm)
            sp = {"max_new_tokens": max_new, "temperature": 0}
            out = llm.generate(input_ids=inputs, sampling_params=sp, return_logprob=True)
            check(path, inputs, out, max_new)
            turn = [inputs[0] + out[0]["output_ids"] + [5, 6, 7]]
            again = llm.generate(input_ids=turn, sampling_params=sp, return_logprob=True)
            check(path, turn, again, max_new)
            cached = again[0]["meta_info"]["cached_tokens"]
            if slides:
                assert cached == len(first) // page * page and llm.cache.swa.freed_tokens > 0
            else:
                assert cached >= (len(turn[0]) - 4) // page * page and llm.cache.swa.freed_tokens == 0


@pytest.mark.parametrize("radix", [False, True])
def test_long_request_usage_is_bounded_by_the_window(checkpoints, radix):
    """Without the radix cache a 300-token prompt decoding 40 tokens never holds more than the window plus one step's
    pages (a prefill chunk, or a decode page), the pages the step before slid (back to the pool at the next schedule,
    engine.cache.swa: up to a chunk) and the page that straddles the window's start, where keeping every page would
    reach 340 tokens. With it, the prompt is the cache's (locked while the request runs) and a 300-token answer to a
    20-token prompt holds the prompt, the window and two steps' pages."""
    path = checkpoints["mistral"]
    page, chunk = 4, 16
    prompt_len, max_new = (20, 300) if radix else (300, 40)
    long = [(7 * i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    with running_engine(path, skip_tokenizer_init=True, chunked_prefill_size=chunk, page_size=page,
                        disable_radix_cache=not radix) as llm:
        cache, peak = llm.cache, []
        alloc_tokens, alloc_decode = cache.alloc_tokens, cache.alloc_decode

        def used() -> int:
            return (cache.pages.num_pages - cache.pages.num_free) * page

        def tokens_and_count(req, n):
            out = alloc_tokens(req, n)
            peak.append(used())
            return out

        def decode_and_count(reqs):
            out = alloc_decode(reqs)
            peak.append(used())
            return out

        cache.alloc_tokens, cache.alloc_decode = tokens_and_count, decode_and_count
        poison_freed(llm)
        out = llm.generate(input_ids=[long], sampling_params={"max_new_tokens": max_new, "temperature": 0})[0]
        assert out["output_ids"] == hf_greedy(path, [long], max_new)[0]
        bound = (prompt_len if radix else 0) + WINDOW + 2 * chunk + 2 * page
        assert len(peak) > max_new and max(peak) <= bound, (max(peak), bound)
        assert cache.swa.freed_tokens >= prompt_len + max_new - bound


@pytest.mark.parametrize("page", [1, 4])
def test_retractions_while_freeing(checkpoints, page):
    """Twelve requests decoding at once outgrow a 64-token pool even though each holds only its window: some are
    retracted and recomputed, token-exact."""
    path = checkpoints["mistral"]
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randint(1, VOCAB, (3 + 2 * i,), generator=gen).tolist() for i in range(12)]
    max_new = 24
    with running_engine(path, skip_tokenizer_init=True, page_size=page, max_total_tokens=64, max_running_requests=12,
                        chunked_prefill_size=16, schedule_conservativeness=0.05) as llm:
        poison_freed(llm)
        outs = llm.generate(input_ids=inputs, sampling_params={"max_new_tokens": max_new, "temperature": 0},
                            return_logprob=True)
        check(path, inputs, outs, max_new)
        assert llm.get_server_info()["internal_states"][0]["retractions"] > 0


def test_hybrid_models_keep_every_page(checkpoints):
    """Gemma 2's global layers read every earlier token: no page may go (and outputs are what test_sliding_window
    checks)."""
    with running_engine(checkpoints["gemma2"], skip_tokenizer_init=True, page_size=4) as llm:
        assert llm.cache.swa is None
        llm.generate(input_ids=prompts()[-1:], sampling_params=GREEDY)
