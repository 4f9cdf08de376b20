"""The hierarchical KV cache through the offline Engine, tiny model, float32 on CPU: greedy outputs are token-exact
with the hierarchy off for prompts served from the device, from the host pool (after forced eviction) and from an L3
file store (after an engine restart); tenants never share pages; a corrupt L3 page is recomputed; a store that is
unreachable only makes requests recompute; nothing leaks on any tier after a flush."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from radixmesh.engine.cache.build import kv_layout
from radixmesh.engine.cache.page_keys import prompt_keys
from radixmesh.engine.engine import Engine
from tests.engine_utils import converse

MODEL = "models/tiny-qwen2"
SP = {"max_new_tokens": 6, "temperature": 0}
# These tests check what L3 serves; the tiny model may prefill faster than a fetch, which would make the worker skip
# prefetches (engine.cache.hierarchy: skip_slow_fetches).
NO_SKIP = '{"skip_slow_fetches": false}'


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    """Outputs with the hierarchy off and a pool large enough that nothing is evicted."""
    memo: dict[tuple, list[int]] = {}
    engine = Engine(model_path=MODEL, page_size=4, max_total_tokens=1024, log_level="warning")

    def outputs(prompts):
        missing = [p for p in prompts if tuple(p) not in memo]
        for p in missing:
            memo[tuple(p)] = engine.generate(input_ids=p, sampling_params=SP)["output_ids"]
        return [memo[tuple(p)] for p in prompts]
    yield outputs
    engine.shutdown()


def _run(engine: Engine, prompts, tenant: str = "") -> tuple[list[list[int]], list[int]]:
    outs = [engine.generate(input_ids=p, sampling_params=SP, tenant=tenant) for p in prompts]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def _flush_and_check_leaks(engine: Engine) -> None:
    assert engine.flush_cache()
    cache = engine.cache
    assert cache.pages.num_free == cache.pages.num_pages, "device pages leaked"
    host = cache.hierarchy.host.allocator
    assert host.num_free == host.num_pages, "host pages leaked"
    assert cache.tree.total_size == 0 and cache.tree.host_size == 0


@pytest.mark.parametrize("page,policy", [(1, "write_through"), (4, "write_back"), (16, "write_through_selective")])
def test_host_tier_serves_evicted_prefixes_token_exact(reference, page, policy):
    prompts = _prompts(6, 40)
    # A device pool of 128 tokens holds ~2.5 of the six 46-token sequences: each round evicts the others to host.
    engine = Engine(model_path=MODEL, page_size=page, max_total_tokens=128, enable_hierarchical_cache=True,
                    hicache_ratio=4, hicache_write_policy=policy, log_level="warning")
    try:
        first, cached0 = _run(engine, prompts)
        again, cached1 = _run(engine, prompts)
        assert first == again == reference(prompts)
        assert cached0 == [0] * 6
        # the first run computed 45 tokens of KV (40 + 5 answered): whole pages into the tree, the rest a tail; the
        # same prompt again may take 39 (the last token is computed), from the tree and, where the tree's part ends
        # where the tail starts (16-token pages: 32), from the tail
        expect = 39 if 45 // page * page <= 39 else 39 // page * page
        assert cached1 == [expect] * 6, "every prompt should come back from the host pool"
        load = engine.get_load()
        assert load["host_hit_tokens"] > 0 and load["evicted_tokens"] > 0
        # the per-tier hit counters (metrics) split the reported cached tokens between device and host
        assert load["lookup_tokens"] == sum(len(p) for p in prompts) * 2
        assert load["host_loaded_hit_tokens"] > 0
        assert load["device_hit_tokens"] + load["host_loaded_hit_tokens"] == sum(cached1)
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def _file_l3(tmp_path: Path) -> dict:
    """A small device pool and host pool over an L3 file store in tmp_path; requests wait for their prefetch."""
    return dict(model_path=MODEL, page_size=4, max_total_tokens=96, enable_hierarchical_cache=True, hicache_ratio=1,
                hicache_storage_backend="file", hicache_storage_url=str(tmp_path / "l3"),
                hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend_extra_config=NO_SKIP,
                log_level="warning")


def _fill_l3(kwargs: dict, prompts) -> tuple[list[list[int]], object]:
    """Serve the prompts with an engine over the L3 store, wait for its write-backs (the flush does, then empties
    device and host) and stop it. Returns its outputs and KV layout."""
    engine = Engine(**kwargs)
    try:
        outs, _ = _run(engine, prompts)
        _flush_and_check_leaks(engine)
        return outs, kv_layout(engine.args, engine.model_config)
    finally:
        engine.shutdown()


def test_l3_file_store_survives_an_engine_restart(reference, tmp_path: Path):
    prompts = _prompts(5, 36, seed=1)
    kwargs = _file_l3(tmp_path)
    outs, _ = _fill_l3(kwargs, prompts)
    assert outs == reference(prompts)
    engine = Engine(**kwargs)  # a new worker process would start the same way: nothing on device or host
    try:
        outs, cached = _run(engine, prompts)
        assert outs == reference(prompts)
        assert cached == [32] * 5, "the whole aligned prefix should come from the L3 store"
        assert engine.get_load()["storage_hit_tokens"] >= 5 * 32
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def test_a_prefetch_waits_for_host_room_that_writes_in_flight_hold(reference, tmp_path: Path):
    """With wait_complete, a prefetch that finds the host pool full of pages held by L3 writes still in flight waits
    for that room instead of recomputing: the store's writes are held back while the first prompts run (their new
    pages stay pinned on the host until written), so the third prompt's fetch finds no room until they go through.
    (A full make test once saw such a prompt recompute: cached 0.)"""
    from radixmesh.engine.cache import storage
    from radixmesh.engine.cache.storage_backends.file import FileStorage

    gate = threading.Event()

    class HeldWrites(FileStorage):
        def set(self, pages):
            gate.wait(30)
            return super().set(pages)

    prompts = _prompts(5, 36, seed=3)
    kwargs = _file_l3(tmp_path)
    _fill_l3(kwargs, prompts)
    storage.register_storage_backend("held-writes", lambda options: HeldWrites(options.url))
    engine = Engine(**{**kwargs, "hicache_storage_backend": "held-writes"})
    try:
        outs, cached = _run(engine, prompts[:2])  # 2 x (8 fetched + 2 new host pages) of the host's 24
        opener = threading.Timer(1.0, gate.set)
        opener.start()
        more, cached_more = _run(engine, prompts[2:])
        opener.join()
        assert outs + more == reference(prompts)
        assert cached + cached_more == [32] * 5, "a prefetch recomputed instead of waiting for host room"
        _flush_and_check_leaks(engine)
    finally:
        gate.set()
        engine.shutdown()


def test_a_prefix_larger_than_the_host_pool_is_recomputed_without_emptying_the_host(reference, tmp_path: Path):
    """A prefetch that could never fit the host pool (8 pages of L3 hits, 6 host pages) is not tried, nor is the
    backup of the 9 pages computed then: the prompt is recomputed, token-exact, and no host copy is evicted to make
    room that can never be enough."""
    prompts = _prompts(1, 36, seed=4)
    kwargs = _file_l3(tmp_path)
    _fill_l3(kwargs, prompts)
    engine = Engine(**{**kwargs, "hicache_ratio": 0.25})
    tiers = engine.cache.hierarchy
    assert tiers.host.allocator.num_pages == 6
    dropped = []
    drop = tiers.tree.drop_host
    tiers.tree.drop_host = lambda node: dropped.append(len(node.key)) or drop(node)
    try:
        short = _prompts(1, 12, seed=5)
        _run(engine, short)  # its pages go to the host pool (write-through) and stay there
        assert tiers.tree.host_size > 0
        outs, cached = _run(engine, prompts)
        assert outs == reference(prompts) and cached == [0]
        assert dropped == [], f"host copies of {dropped} tokens evicted for room that could never be enough"
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def test_corrupt_l3_page_is_recomputed_not_used(reference, tmp_path: Path):
    prompts = _prompts(1, 36, seed=2)
    kwargs = _file_l3(tmp_path)
    _, layout = _fill_l3(kwargs, prompts)
    keys = prompt_keys(layout, "", prompts[0])
    assert len(keys) == 9
    victim = tmp_path / "l3" / keys[3].hex()[:2] / f"{keys[3].hex()}.page"
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0xFF  # flip bits in the KV data; the header's checksum no longer matches
    victim.write_bytes(bytes(raw))
    engine = Engine(**kwargs)
    try:
        outs, cached = _run(engine, prompts)
        assert outs == reference(prompts)
        assert cached[0] == 12, "the three pages before the corrupt one come from L3, the rest is recomputed"
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def test_unreachable_store_only_costs_recomputation(reference):
    prompts = _prompts(3, 24, seed=3)
    engine = Engine(model_path=MODEL, page_size=4, max_total_tokens=96, enable_hierarchical_cache=True,
                    hicache_storage_backend="redis", hicache_storage_url="redis://127.0.0.1:1/0",
                    hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_backend_extra_config='{"timeout_s": 0.2}', log_level="warning")
    try:
        for _ in range(2):
            outs, _ = _run(engine, prompts)
            assert outs == reference(prompts)
        assert engine.get_load()["storage_failed_calls"] >= 1
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def test_tenants_never_share_cached_pages(reference):
    prompt = _prompts(1, 40, seed=4)
    engine = Engine(model_path=MODEL, page_size=4, max_total_tokens=256, enable_hierarchical_cache=True,
                    log_level="warning")
    try:
        a1 = _run(engine, prompt, tenant="a")
        b1 = _run(engine, prompt, tenant="b")
        a2 = _run(engine, prompt, tenant="a")
        assert a1[0] == b1[0] == a2[0] == reference(prompt)
        assert a1[1] == [0] and b1[1] == [0], "tenant b must not get tenant a's cached tokens"
        assert a2[1] == [36]
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


def test_bad_hicache_flags_are_clear_errors():
    with pytest.raises(ValueError, match="hicache_write_policy"):
        Engine(model_path=MODEL, enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="needs enable_hierarchical_cache"):
        Engine(model_path=MODEL, hicache_storage_backend="file", hicache_storage_url="/tmp/x")
    with pytest.raises(ValueError, match="unknown storage backend"):
        Engine(model_path=MODEL, enable_hierarchical_cache=True, hicache_storage_backend="floppy")


def test_write_back_sends_pages_leaving_the_host_pool_to_l3(reference):
    """With write_back, L3 is the host pool's victim store: nothing is written until the host pool evicts, and a
    prompt evicted from both device and host comes back whole from L3."""
    prompts = _prompts(6, 40, seed=5)
    engine = Engine(model_path=MODEL, page_size=4, max_total_tokens=96, enable_hierarchical_cache=True,
                    hicache_ratio=1, hicache_write_policy="write_back", hicache_storage_backend="memory",
                    hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend_extra_config=NO_SKIP,
                  log_level="warning")
    try:
        first, _ = _run(engine, prompts[:1])
        assert engine.get_load()["storage_written_pages"] == 0, "nothing left the host pool yet"
        outs, _ = _run(engine, prompts[1:])
        again, cached = _run(engine, prompts)
        assert first + outs == again == reference(prompts)
        load = engine.get_load()
        assert load["storage_written_pages"] > 0 and load["storage_hit_tokens"] > 0
        assert cached == [36] * 6
        _flush_and_check_leaks(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tiers", [False, True])
def test_a_conversations_next_turn_reuses_the_last_partly_filled_page(tiers):
    """With 16-token pages a turn's last page is partly filled; the next turn (the whole conversation so far plus a
    new message) takes that page's tokens from the cache (engine.cache.tails), from the device or, after the pool was
    flushed by other traffic, from the host tier: the outputs are those of an engine without any cache, and the
    cached tokens cover every token whose KV was computed before."""
    plain = Engine(model_path=MODEL, page_size=16, max_total_tokens=1024, disable_radix_cache=True, log_level="warning")
    kwargs = dict(enable_hierarchical_cache=True, hicache_ratio=8) if tiers else {}
    # with the host tier, a device pool that holds about two of the three conversations: turns come back from host
    engine = Engine(model_path=MODEL, page_size=16, max_total_tokens=160 if tiers else 1024, log_level="warning",
                    **kwargs)
    try:
        converse(engine, plain, _prompts(3, 37, seed=7), SP, random.Random(7))
        if tiers:
            assert engine.get_load()["host_loaded_hit_tokens"] > 0
            _flush_and_check_leaks(engine)
        else:
            assert engine.flush_cache() and engine.cache.pages.num_free == engine.cache.pages.num_pages
    finally:
        engine.shutdown()
        plain.shutdown()
