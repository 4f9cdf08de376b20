"""Speculative decoding on the decode side of prefill/decode disaggregation, with two engines in one process (the
fake transfer backend moves the KV pages, and the services' own functions carry the rest: the decode side's
KvDestination, the prefill side's choice of hidden states, KvReady through its wire bytes).

An EAGLE/EAGLE-3 decode worker asks for the head state its prefix cache lacks; the prefill worker's head catches up
over the prompt and sends its KV of those positions and the target's hidden state at the last one, and every draft
the decode worker proposes equals the reference head's (transformers' target and head recomputed from scratch,
tests.parity.test_speculative_eagle), through chunked prefills and prefix-cache hits on both sides (the prefill
worker's hits are token-granular, the decode worker's page-aligned: the head KV of the positions in between comes
from the prefill worker's cache). Without the state, the head would draft from zeros. NGRAM and
STANDALONE need nothing from the prefill side (STANDALONE's draft KV of the prompt is built by the decode worker's
first catch-up): all four give the colocated engine's greedy tokens and, per request, the colocated speculative
engine's drafts and kept drafts. Every page comes back on both sides (running_engine's leak check)."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from radixmesh.engine.disaggregation.handoff import DecodeRole, FirstToken, PrefillRole
from radixmesh.engine.disaggregation.draft_state import DraftState, DraftWanted
from radixmesh.engine.disaggregation.kv_pages import KvLayout, kv_writes
from radixmesh.engine.disaggregation.registry import make_backend
from radixmesh.services.prefill.bootstrap import draft_to_send
from radixmesh.services.worker import convert
from radixmesh.v1 import bootstrap_pb2
from tests.conftest import model_path
from tests.engine_utils import parity_prompts, running_engine
from tests.parity.test_speculative_eagle import ReferenceHead, record_proposals, write_head

NAME = "tiny-llama"
OPTS = {"page_size": 16, "chunked_prefill_size": 64, "max_total_tokens": 4096}
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}  # several verifies a request
SPEC_KEYS = ("spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num")
_rids = itertools.count()


class Pair:
    """A prefill and a decode engine doing what services/prefill/bootstrap.py and services/worker/receive.py do."""

    def __init__(self, prefill, decode):
        self.p, self.d = prefill, decode
        self.bp, self.bd = make_backend("fake"), make_backend("fake")
        # Pages move between the engines' mirrors, as services.common.kv_transfer moves them: on a GPU, pinned host
        # twins of the pools (the fake backend copies host memory; a device address would crash it)
        self.mp, self.md = prefill.kv_mirror(), decode.kv_mirror()
        for backend, mirror in ((self.bp, self.mp), (self.bd, self.md)):
            for t in mirror.buffers:
                backend.register(t.data_ptr(), t.numel() * t.element_size())
        # (first position, positions) of the head KV sent for each request, its prompt's length, and whether the
        # head read the target's hidden state at every one of those positions
        self.sent: list[tuple[int, int, int, bool]] = []

    async def generate(self, ids: list[int], params: dict) -> dict:
        loop = asyncio.get_running_loop()
        ready, allocated = loop.create_future(), loop.create_future()
        rid = f"pd-spec-{next(_rids)}"
        prole = PrefillRole(lambda pages, first: loop.call_soon_threadsafe(ready.set_result, (pages, first)))
        drole = DecodeRole(lambda pages, cached: loop.call_soon_threadsafe(allocated.set_result, (pages, cached)))
        decoding = asyncio.create_task(self.d.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                             handoff=drole))
        prefilling = asyncio.create_task(self.p.async_generate(input_ids=ids, sampling_params=params, rid=rid,
                                                               handoff=prole))
        (src, first), (dst, cached) = await ready, await allocated
        wanted = drole.draft_wanted
        dest = bootstrap_pb2.KvDestination(cached_tokens=cached, draft_state=convert.draft_wanted_msg(wanted)
                                           if wanted is not None else None)
        try:
            draft = draft_to_send(first, dest)
            self._move(src[cached // self.p.args.page_size:], dst)
        finally:
            self.p.release_kv(rid).result(timeout=10)
        wire = bootstrap_pb2.KvReady.FromString(convert.kv_ready(first, draft).SerializeToString())
        got = convert.first_token(wire)
        if draft is not None:
            assert got.draft.hidden_position == len(ids) - 1 and got.draft.kv_start == wanted.start
            self.sent.append((got.draft.kv_start, got.draft.kv_rows, len(ids), bool(got.draft.read_features.all())))
        assert self.d.deliver_kv(rid, got).result(timeout=10) is True
        await prefilling
        return await decoding

    def _move(self, src: list[int], dst: list[int]) -> None:
        """The prefill pool's pages `src` into the decode pool's `dst`: staged out to free mirror pages, written to
        free mirror pages of the decode side, staged in (no copies where a pool is its own mirror, on a CPU)."""
        out, landing = self.mp.hold(src), self.md.hold(dst)
        try:
            self.mp.stage_out(src, out)
            self.bp.write(self.bd.session_id, kv_writes(_layout(self.mp), _layout(self.md), out, landing))
            self.md.stage_in(landing, dst)
        finally:
            self.mp.release(out)
            self.md.release(landing)


def _layout(mirror) -> KvLayout:
    return KvLayout(tuple(t.data_ptr() for t in mirror.buffers), mirror.pool.page_bytes)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    """Each algorithm's speculative_draft_model_path: random EAGLE and EAGLE-3 heads, and a random one-layer Llama
    (a STANDALONE draft that is mostly wrong)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("pd-drafts")
    target = model_path(NAME)
    with open(f"{target}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
                     ).save_pretrained(root / "standalone")
    return {"EAGLE": write_head(root / "eagle", target, "eagle"),
            "EAGLE3": write_head(root / "eagle3", target, "eagle3", seed=1),
            "STANDALONE": str(root / "standalone")}


@pytest.fixture(scope="module")
def plain():
    with running_engine(model_path(NAME), **OPTS) as c:
        yield c


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts sharing no prefix with one another (a chunked 300-token one, and ones whose tails repeat: n-gram lookup
    drafts from them), then prompts that share one with earlier prompts and go on differently."""
    base = parity_prompts(model_path(NAME))
    return [base[1] * 3, base[2][:9] * 6, base[3], base[4], base[7]], [base[5], base[6], base[8]]


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"])
def test_a_speculative_decode_worker_drafts_as_a_colocated_one(algorithm, drafts, plain):
    path = model_path(NAME)
    spec = {"speculative_algorithm": algorithm}
    if algorithm == "NGRAM":
        spec["speculative_num_draft_tokens"] = 6
    else:
        spec |= {"speculative_num_steps": 3, "speculative_draft_model_path": drafts[algorithm]}
    eagle = algorithm.startswith("EAGLE")
    apart, sharing = _prompts()
    prompts = apart * 2 + sharing  # the second round finds each prompt cached on both sides
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, **OPTS, **spec) as p, running_engine(path, **OPTS, **spec) as d, \
            running_engine(path, **OPTS, **spec) as colocated:
        pair = Pair(p, d)
        seen = record_proposals(d) if eagle else []

        async def run():  # one at a time, as the colocated engine runs them
            return [await pair.generate(ids, GREEDY) for ids in prompts]
        got = asyncio.run(run())
        alone = [colocated.generate(input_ids=ids, sampling_params=GREEDY) for ids in prompts]
    assert [o["output_ids"] for o in got] == want == [o["output_ids"] for o in alone]
    n = 2 * len(apart)
    assert [[o["meta_info"][k] for k in SPEC_KEYS] for o in got[:n]] == \
        [[o["meta_info"][k] for k in SPEC_KEYS] for o in alone[:n]]
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in got) > 0
    if not eagle:
        assert pair.sent == []  # (they ask for nothing)
        return
    first, again = pair.sent[:len(apart)], pair.sent[len(apart):n]
    # fresh: all but the last position's (the decode worker recomputes that one); then from its cached prefix on
    # (page-aligned, where the prefill worker's hit is not: the rows between come from its cache)
    assert all(start == 0 and rows == length - 1 and read for start, rows, length, read in first), first
    assert all(0 < start and start + rows == length - 1 and read for start, rows, length, read in again), again
    assert any(start % OPTS["page_size"] == 0 and rows for start, rows, _, _ in again), again
    assert all(start + rows == length - 1 for start, rows, length, _ in pair.sent[n:]), pair.sent
    # Each draft as the reference computes it, for the prompts sharing no prefix. (A prompt that goes on from another's
    # prefix mid-page has a position whose head KV read the other's next token, and whose hidden state neither
    # worker's cache holds: a colocated engine's head, too, reads zeros there.)
    reference = ReferenceHead(drafts[algorithm], path, algorithm.lower())
    ours = [(fill, proposed) for fill, proposed in seen if any(fill[:len(ids)] == ids for ids in apart)]
    assert len(ours) >= n
    for fill, proposed in ours:
        assert proposed == reference.drafts(fill, len(proposed)), len(fill)


def test_a_decode_worker_drafting_trees_keeps_what_a_colocated_one_keeps(drafts, plain):
    """An EAGLE-3 head drafting trees (speculative_eagle_topk 2) from the prefill worker's state: per request, the
    colocated engine's verifies, drafts and kept drafts."""
    path = model_path(NAME)
    spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": drafts["EAGLE3"],
            "speculative_eagle_topk": 2, "speculative_num_steps": 3, "decode_attention_backend": "torch_native"}
    prompts = _prompts()[0] * 2
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    with running_engine(path, **OPTS, **spec) as p, running_engine(path, **OPTS, **spec) as d, \
            running_engine(path, **OPTS, **spec) as colocated:
        pair = Pair(p, d)

        async def run():
            return [await pair.generate(ids, GREEDY) for ids in prompts]
        got = asyncio.run(run())
        alone = [colocated.generate(input_ids=ids, sampling_params=GREEDY) for ids in prompts]
    assert [o["output_ids"] for o in got] == want == [o["output_ids"] for o in alone]
    assert [[o["meta_info"][k] for k in SPEC_KEYS] for o in got] == \
        [[o["meta_info"][k] for k in SPEC_KEYS] for o in alone]
    assert all(read for *_, read in pair.sent) and len(pair.sent) == len(prompts)


def _state(n: int = 5, width: int = 12, layers: tuple[int, ...] = ()) -> DraftState:
    import torch

    kv = [torch.randint(0, 256, (n, 8), dtype=torch.uint8), torch.randint(0, 256, (n, 8), dtype=torch.uint8)]
    return DraftState(layers, 0, kv, torch.arange(n) % 2 == 0, n, torch.randn(width))


def _first(draft: DraftState | None) -> FirstToken:
    return FirstToken(7, draft=draft)


def _dest(wanted: DraftWanted | None) -> bootstrap_pb2.KvDestination:
    return bootstrap_pb2.KvDestination(draft_state=convert.draft_wanted_msg(wanted) if wanted else None)


def test_a_prefill_worker_without_the_decode_worker_s_head_refuses_the_room():
    state = _state()
    assert draft_to_send(_first(None), _dest(None)) is None
    assert draft_to_send(_first(state), _dest(None)) is None  # the decode worker asked for nothing
    with pytest.raises(ValueError, match="runs none: give both workers the same --speculative-algorithm"):
        draft_to_send(_first(None), _dest(DraftWanted(0, (), 12, (8, 8))))
    with pytest.raises(ValueError, match=r"inputs of layers \[0, 2, 3\] .* reads the final hidden states"):
        draft_to_send(_first(state), _dest(DraftWanted(0, (0, 2, 3), 36, (8, 8))))
    with pytest.raises(ValueError, match=r"KV rows are \[16, 16\] bytes"):
        draft_to_send(_first(state), _dest(DraftWanted(0, (), 12, (16, 16))))
    with pytest.raises(ValueError, match="format 2 asked for"):
        draft_to_send(_first(state), _dest(DraftWanted(0, (), 12, (8, 8), format=2)))
    sent = draft_to_send(_first(state), _dest(DraftWanted(3, (), 12, (8, 8))))
    assert (sent.kv_start, sent.kv_rows, [t.shape for t in sent.kv]) == (3, 2, [(2, 8), (2, 8)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_draft_state_crosses_the_wire_bit_exact(dtype):
    import torch

    from radixmesh.engine.disaggregation.draft_state import DTYPES

    state = _state(6, 10, (0, 2, 3))
    state.hidden = state.hidden.to(DTYPES[dtype])
    msg = bootstrap_pb2.KvReady.FromString(convert.kv_ready(_first(None), state).SerializeToString())
    assert msg.draft_state.dtype == dtype and len(msg.draft_state.kv) == 6 * 16
    back = convert.first_token(msg).draft
    assert (back.layers, back.kv_start, back.kv_rows, back.hidden_position) == ((0, 2, 3), 0, 6, 6)
    assert all(torch.equal(a, b) for a, b in zip(back.kv, state.kv, strict=True))
    assert torch.equal(back.read_features, state.read_features)
    assert back.hidden.dtype == state.hidden.dtype and torch.equal(back.hidden.view(torch.uint8),
                                                                   state.hidden.view(torch.uint8))
    assert convert.first_token(bootstrap_pb2.KvReady.FromString(
        convert.kv_ready(_first(None)).SerializeToString())).draft is None
    msg.draft_state.kv = msg.draft_state.kv[:-1]
    with pytest.raises(ValueError, match="kv needs 96 bytes"):
        convert.first_token(msg)


def test_what_a_state_sends_from_a_position_on():
    state = _state(100)  # 16 bytes of KV a position
    got = [(s.kv_start, s.kv_rows) for s in (state.since(0), state.since(40), state.since(200), state.since(0, 1600),
                                             state.since(0, 1599), state.since(90, 160))]
    assert got == [(0, 100), (40, 60), (100, 0), (0, 100), (100, 0), (90, 10)]
    state.kv_start = 10  # rows starting after the position asked for are not sent (they would leave a gap)
    assert (state.since(5).kv_start, state.since(5).kv_rows) == (110, 0)
