"""Hybrid SWA memory (engine.cache.swa_pool, engine.cache.swa_hybrid): models that mix sliding-window and full
attention layers keep the sliding layers' KV in a pool of their own, swa_full_tokens_ratio times the full pool's
tokens, and give its pages back behind each request's window.

On the tiny checkpoints of tests/sliding_models.py (Gemma 2: layers 0 and 2 slide; Gemma 3: 0, 1 and 3; Qwen2: 1 and
2; a window of 12 tokens) outputs stay token-exact with transformers in float32 (greedy tokens and teacher-forced
logprobs) through chunked prefill, page sizes, radix-cache hits on prefixes longer than the window, a conversation's
second turn, hits cut back where the SWA pool dropped what a window needs, and retractions; every SWA page freed is
poisoned, so a window reading one moves the logprobs far past the tolerance. No page leaks from either pool, and a
long decode holds only its window's SWA pages while its full pages grow."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine import Engine
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.cache.swa_pool import HybridKVPool, HybridLayout, hybrid_layout
from tests.engine_utils import running_engine
from tests.parity.test_sliding_window_memory import check
from tests.reference import hf_greedy
from tests.sliding_models import VOCAB, WINDOW, build, prompts

KINDS = ("gemma2", "gemma3", "qwen2")
MAX_NEW = 32  # past the window after every prompt: every request slides
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
CONFIGS = [
    dict(chunked_prefill_size=16, page_size=1),
    dict(chunked_prefill_size=8, page_size=4),  # chunks shorter than the window
    dict(chunked_prefill_size=32, page_size=16, disable_radix_cache=True),  # a page longer than the window
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid-swa")
    return {kind: build(kind, root / kind) for kind in KINDS}


def poison_freed_swa(llm) -> None:
    """Every SWA page freed from now on gets K and V of 100 in every sliding layer (finite, so a masked read weighs
    0): a window reading one, or a page paired twice, moves the logprobs far past the tolerance."""
    pool = llm.cache.kv.swa
    allocator = pool.allocator
    free = allocator.free

    def poisoned(pages: torch.Tensor) -> None:
        if len(pages):
            rows = (pages[:, None] * pool.page_size + torch.arange(pool.page_size)).reshape(-1)
            for buf in pool.buffers():
                buf[rows] = 100.0
        free(pages)

    allocator.free = poisoned


def held_by_windows(llm) -> int:
    """SWA pages in use that some window holds (not free, not an evictable partner of a cached page)."""
    h = llm.cache.hybrid
    return h.swa.num_pages - h.swa.num_free - h.evictable


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_parity_with_a_hybrid_pool(checkpoints, kind, cfg):
    path = checkpoints[kind]
    with running_engine(path, skip_tokenizer_init=True, max_total_tokens=1024, **cfg) as llm:
        h, pool = llm.cache.hybrid, llm.cache.kv
        assert isinstance(pool, HybridKVPool) and h.window == WINDOW
        assert h.swa.num_pages == int(pool.allocator.num_pages * 0.8)
        sliding = {i for i, w in enumerate(llm.runner.attn_backend.shape.windows) if w is not None}
        assert pool.layout.swa_layers == sliding and 0 < len(sliding) < len(pool.k)
        assert all(pool.k[i].shape[0] == pool.swa.num_slots for i in sliding)
        poison_freed_swa(llm)
        for _ in range(2):  # the second pass over cached prefixes
            check(path, prompts(), llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True))
            h.check([])
        assert h.freed_tokens > 0


def _long_decode(path: str, prompt: list[int], max_new: int, page: int, radix: bool):
    """Greedy output and, after each decode step's allocation: (SWA pages windows hold, SWA pages in use, full pages
    in use); SWA tokens freed behind the window."""
    with running_engine(path, skip_tokenizer_init=True, page_size=page, chunked_prefill_size=16,
                        max_total_tokens=512, disable_radix_cache=not radix) as llm:
        cache, samples = llm.cache, []
        alloc_decode = cache.alloc_decode

        def counted(reqs):
            out = alloc_decode(reqs)
            h = cache.hybrid
            samples.append((held_by_windows(llm), h.swa.num_pages - h.swa.num_free,
                            cache.pages.num_pages - cache.pages.num_free))
            return out

        cache.alloc_decode = counted
        poison_freed_swa(llm)
        out = llm.generate(input_ids=[prompt], sampling_params={"max_new_tokens": max_new, "temperature": 0})
        return out[0]["output_ids"], samples, cache.hybrid.freed_tokens


def test_swa_pages_go_back_during_a_long_decode(checkpoints):
    """A 20-token prompt decoding 120 tokens (ten windows): its full pages grow to the whole sequence while the SWA
    pages its window holds stay within the window's pages (the page holding the window's first key up to the newest
    page); without the radix cache every other SWA page is back in the pool too."""
    path, page = checkpoints["gemma2"], 4
    prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(20)]
    max_new = 120
    want = hf_greedy(path, [prompt], max_new)[0]
    bound = -(-(WINDOW + 2 * page) // page)  # pages of [floor(end - w + 1), alloc_len]
    for radix in (True, False):
        output, samples, freed = _long_decode(path, prompt, max_new, page, radix)
        assert output == want
        windows, swa_used, full_used = zip(*samples)
        assert len(samples) >= max_new - 1 and max(windows) <= bound, (max(windows), bound)
        assert full_used[-1] >= (len(prompt) + max_new - 1) // page  # the full layers keep every token
        if not radix:  # (with it the prompt's pages stay paired in the tree, evictable, until room is needed)
            assert max(swa_used) <= bound
        assert freed >= max_new - WINDOW - 3 * page


@pytest.mark.parametrize("kind", ("gemma2", "gemma3"))
def test_hits_on_prefixes_longer_than_the_window(checkpoints, kind):
    """Prompts sharing a 40-token prefix (more than three windows) hit it whole; a conversation's second turn hits
    the whole first turn, its answer too (the answer's early pages lost their SWA partners as it was generated: only
    the last window's are read from the hit on)."""
    path, page = checkpoints[kind], 4
    shared, later = prompts()[2:5], prompts()[-1]
    with running_engine(path, skip_tokenizer_init=True, page_size=page, chunked_prefill_size=16,
                        max_total_tokens=1024) as llm:
        poison_freed_swa(llm)
        first = llm.generate(input_ids=shared[:1], sampling_params=GREEDY, return_logprob=True)
        check(path, shared[:1], first)
        rest = llm.generate(input_ids=shared[1:], sampling_params=GREEDY, return_logprob=True)
        check(path, shared[1:], rest)
        assert all(o["meta_info"]["cached_tokens"] >= 40 for o in rest)
        one = llm.generate(input_ids=[later], sampling_params=GREEDY, return_logprob=True)
        check(path, [later], one)
        turn = [later + one[0]["output_ids"] + [5, 6, 7]]
        two = llm.generate(input_ids=turn, sampling_params=GREEDY, return_logprob=True)
        check(path, turn, two)
        assert two[0]["meta_info"]["cached_tokens"] >= (len(later) + MAX_NEW - 1) // page * page
        assert llm.cache.hybrid.freed_tokens >= MAX_NEW - WINDOW  # the first turn's answer slid


def test_hits_cut_back_where_the_pool_dropped_a_window(checkpoints):
    """A small SWA pool drops the partners of cached pages no window holds, least recently used first. A prompt
    whose cached prefix lost the pages its window would read is computed from where the window is whole (here: the
    start); its recomputed window pages go back to the cached path, so the same prefix then hits whole again."""
    path, page = checkpoints["gemma2"], 4
    gen = torch.Generator().manual_seed(21)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    base = rand(60)
    sp = {"max_new_tokens": 8, "temperature": 0}
    with running_engine(path, skip_tokenizer_init=True, page_size=page, chunked_prefill_size=16,
                        max_total_tokens=1024, swa_full_tokens_ratio=0.05) as llm:
        h = llm.cache.hybrid
        assert h.swa.num_pages == 12  # 48 tokens: less than one prompt
        poison_freed_swa(llm)
        inputs = [[base + rand(3)], [rand(70)], [base + rand(4)], [base + rand(5)]]
        outs = [llm.generate(input_ids=x, sampling_params=sp, return_logprob=True) for x in inputs]
        for x, out in zip(inputs, outs):
            check(path, x, out, 8)
            h.check([])
        cached = [out[0]["meta_info"]["cached_tokens"] for out in outs]
        # the other prompt's pages pushed out the partners of base's window: cut back to nothing; recomputed, they
        # are the tree's again and the next prompt hits the whole of base
        assert cached[2] == 0 and cached[3] == 60 and h.evicted_tokens > 0, cached


@pytest.mark.parametrize("page", [1, 4])
def test_retractions_with_a_hybrid_pool(checkpoints, page):
    """Twelve requests outgrow a 200-token pool: some are retracted and recomputed, token-exact."""
    path = checkpoints["gemma3"]
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randint(1, VOCAB, (3 + 3 * i,), generator=gen).tolist() for i in range(12)]
    with running_engine(path, skip_tokenizer_init=True, page_size=page, max_total_tokens=200, max_running_requests=12,
                        chunked_prefill_size=16, schedule_conservativeness=0.05) as llm:
        poison_freed_swa(llm)
        outs = llm.generate(input_ids=inputs, sampling_params=GREEDY, return_logprob=True)
        check(path, inputs, outs)
        assert llm.get_server_info()["internal_states"][0]["retractions"] > 0


def test_the_flags(checkpoints):
    """--swa-full-tokens-ratio sizes the SWA pool; --disable-hybrid-swa-memory, the hierarchical cache and a ratio
    outside (0, 1] keep one pool or are refused; models whose layers all slide or none keep one pool."""
    path = checkpoints["gemma2"]
    with running_engine(path, skip_tokenizer_init=True, page_size=4, max_total_tokens=400,
                        swa_full_tokens_ratio=0.5) as llm:
        assert llm.cache.hybrid.swa.num_pages == 50 and llm.cache.pages.num_pages == 100
    for off in (dict(disable_hybrid_swa_memory=True), dict(enable_hierarchical_cache=True)):
        with running_engine(path, skip_tokenizer_init=True, page_size=4, max_total_tokens=400, **off) as llm:
            assert llm.cache.hybrid is None and isinstance(llm.cache.kv, KVPool)
            check(path, prompts()[:2], llm.generate(input_ids=prompts()[:2], sampling_params=GREEDY,
                                                    return_logprob=True))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
            Engine(model_path=path, device="cpu", skip_tokenizer_init=True, swa_full_tokens_ratio=bad)
    assert hybrid_layout((None, None), 0.8, None) is None and hybrid_layout((12, 12), 0.8, None) is None
    assert hybrid_layout((12, None), 0.8, "off") is None


def test_an_fp8_cache_answers_as_with_one_pool(checkpoints):
    """With --kv-cache-dtype fp8_e4m3 each pool stores its layers' KV rounded alike: the hybrid pool's answers and
    logprobs are those of one pool, to the bit."""
    path, runs = checkpoints["gemma3"], []
    for off in (False, True):
        with running_engine(path, skip_tokenizer_init=True, page_size=4, chunked_prefill_size=16, max_total_tokens=512,
                            kv_cache_dtype="fp8_e4m3", disable_hybrid_swa_memory=off) as llm:
            assert (llm.cache.hybrid is None) == off
            runs.append(llm.generate(input_ids=prompts(), sampling_params=GREEDY, return_logprob=True))
    hybrid, one = ([(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in run] for run in runs)
    assert hybrid == one


def test_disaggregated_requests_are_refused(checkpoints):
    """Prefill/decode transfers move whole pages of one pool: a hybrid engine refuses a request with a role."""
    import asyncio

    with running_engine(checkpoints["gemma2"], skip_tokenizer_init=True, max_total_tokens=256) as llm:
        with pytest.raises(ValueError, match="--disable-hybrid-swa-memory"):
            asyncio.run(llm.async_generate(input_ids=[1, 2, 3], sampling_params=GREEDY, handoff=object()))


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_pd_workers_keep_one_pool(checkpoints, mode):
    """A prefill or decode worker's engine keeps one pool, so its disaggregated requests are served (above: refused
    under the hybrid pool); a colocated worker's has the hybrid pool."""
    from radixmesh.services.worker.__main__ import pd_engine_kwargs
    from radixmesh.services.worker.settings import WorkerSettings

    kwargs = pd_engine_kwargs(WorkerSettings(disaggregation_mode=mode), {"max_total_tokens": 256})
    with running_engine(checkpoints["gemma2"], skip_tokenizer_init=True, **kwargs) as llm:
        assert (llm.cache.hybrid is None) == (mode != "null")


def test_command_line_flags():
    """SGLang's flag names reach EngineArgs (every service and the launcher parse them so)."""
    from radixmesh.engine.config import EngineArgs
    from radixmesh.settings import build_parser, resolve

    ns = build_parser("t", EngineArgs).parse_args(["--model-path", "m", "--swa-full-tokens-ratio", "0.5",
                                                   "--disable-hybrid-swa-memory"])
    assert resolve(ns, EngineArgs) == [{"model_path": "m", "swa_full_tokens_ratio": 0.5,
                                        "disable_hybrid_swa_memory": True}]


def test_sizes_split_the_budget():
    """T full tokens and ratio * T SWA tokens fill the bytes of T * (full layers + ratio * sliding layers)."""
    layout = HybridLayout(frozenset({0, 1, 3}), 4, 12, 0.5)
    assert layout.bytes_per_token(4 * 1000) == 1000 * (1 + 0.5 * 3)
    assert layout.swa_pages(100) == 50


def test_pool_and_table_follow_the_pairing():
    """Writes and reads of a sliding layer land in its partner page; the SWA page table translates each entry as it
    is written; a page without a partner reads the SWA scratch page."""
    layout = HybridLayout(frozenset({1}), 2, 4, 0.5)
    pool = HybridKVPool(layout, 8, 2, 1, 4, torch.float32, torch.device("cpu"))
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    table.add_swa_table(pool.translate, layout.swa_layers)
    full = pool.allocator.alloc(2)  # pages 1, 2
    pool.pair(full, pool.swa_allocator.alloc(2))
    slots = (full[:, None] * 2 + torch.arange(2)).reshape(-1)
    table.write(0, 0, slots)
    k = torch.arange(16, dtype=torch.float32).view(4, 1, 4)
    for layer in (0, 1):
        pool.write(layer, slots, k, -k)
        assert torch.equal(pool.read(layer, slots, torch.float32)[0], k)
    swa_slots = (pool.swa_of[full][:, None] * 2 + torch.arange(2)).reshape(-1)
    assert torch.equal(table.table(1)[0, :4], swa_slots) and torch.equal(table.table(0)[0, :4], slots)
    assert torch.equal(pool.k[1][swa_slots], k) and torch.equal(pool.k[0][slots], k)
    freed = pool.unpair(full[:1])
    assert torch.equal(pool.translate(slots[:2]), torch.arange(2)) and len(freed) == 1
    assert torch.equal(table.window_table(4), table.swa_device) and table.window_table(None) is table.device
