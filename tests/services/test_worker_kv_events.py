"""A real worker process streams its KV events: a snapshot (after `cleared`) of what its prefix cache holds, then
pages as they enter and leave each tier, with keys that any process derives from the same tokens (page_keys)."""

from __future__ import annotations

import queue
import threading

import grpc

from radixmesh.engine.cache.page_keys import prompt_keys
from radixmesh.engine.cache.storage import KvLayout
from radixmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.conftest import model_path
from tests.services.test_worker_service import start

MODEL = model_path("tiny-llama")
PAGE = 4


def _layout() -> KvLayout:
    # tiny-llama: 2 layers, 2 KV heads of 16 (models/tiny-llama/config.json), float32 on CPU
    import json

    cfg = json.load(open(f"{MODEL}/config.json"))
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return KvLayout(f"tiny-llama:{cfg['architectures'][0]}", PAGE, "float32", cfg["num_hidden_layers"], heads,
                    cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _reader(stub, after: int, out: queue.Queue) -> grpc.Future:
    stream = stub.SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(after_sequence=after))

    def pump():
        try:
            for msg in stream:
                out.put(msg)
        except grpc.RpcError:
            pass
    threading.Thread(target=pump, daemon=True).start()
    return stream


def _collect(out: queue.Queue, until, timeout: float = 20.0) -> list:
    got = []
    while not until(got):
        got.append(out.get(timeout=timeout))
    return got


def test_snapshot_then_stored_and_removed_events_with_tiers():
    proc, url = start("radixmesh.services.worker", "--page-size", str(PAGE), "--max-total-tokens", "64",
                      "--kv-events-config", "{}", "--enable-hierarchical-cache", "--hicache-ratio", "4")
    try:
        with grpc.insecure_channel(url) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            prompt = list(range(10, 42))  # 32 tokens: 8 pages
            sp = common_pb2.SamplingParams(max_new_tokens=1, temperature=0.0)
            list(stub.Generate(worker_pb2.GenerateRequest(request_id="a", input_ids=prompt, sampling_params=sp)))
            events: queue.Queue = queue.Queue()
            stream = _reader(stub, 0, events)
            keys = prompt_keys(_layout(), "", prompt + [0])[:8]
            first = _collect(events, lambda got: sum(len(m.stored.page_hashes) for m in got) >= 8)
            assert first[0].HasField("cleared")
            snapshot = [h for m in first if m.HasField("stored") for h in m.stored.page_hashes]
            assert snapshot == keys, "a worker's page keys must equal the ones any process derives"
            assert all(m.stored.tier == worker_pb2.KV_TIER_DEVICE for m in first[1:])
            # Other prompts fill the 64-token pool: the first prompt's pages move to the host pool.
            for i in range(3):
                other = list(range(100 + 40 * i, 132 + 40 * i))
                list(stub.Generate(worker_pb2.GenerateRequest(request_id=f"o{i}", input_ids=other,
                                                              sampling_params=sp)))
            moved = _collect(events, lambda got: any(m.HasField("removed") and keys[-1] in m.removed.page_hashes
                                                     for m in got))
            host = {h for m in moved if m.HasField("stored") and m.stored.tier == worker_pb2.KV_TIER_HOST
                    for h in m.stored.page_hashes}
            assert keys[-1] in host, "an evicted page is demoted to the host tier, announced before its removal"
            seqs = [m.sequence for m in moved]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            stream.cancel()
            # Resuming after the last seen sequence gives only newer events (no snapshot).
            resumed: queue.Queue = queue.Queue()
            stream = _reader(stub, seqs[-1], resumed)
            assert stub.FlushCache(worker_pb2.FlushCacheRequest()).success
            after = _collect(resumed, lambda got: bool(got) and got[-1].HasField("cleared"))
            assert all(m.sequence > seqs[-1] for m in after), "a resumed stream starts after its sequence"
            assert sum(m.HasField("cleared") for m in after) == 1
            stream.cancel()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_an_empty_worker_sends_one_cleared_then_waits():
    """A subscriber of a worker with nothing cached gets one `cleared` (an empty snapshot), then events only when
    pages arrive; a sequence from an earlier process of the worker gets a snapshot, not silence."""
    proc, url = start("radixmesh.services.worker", "--page-size", str(PAGE), "--kv-events-config", "{}")
    try:
        with grpc.insecure_channel(url) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            events: queue.Queue = queue.Queue()
            stream = _reader(stub, 0, events)
            assert events.get(timeout=20).HasField("cleared")
            try:
                extra = events.get(timeout=1.0)
            except queue.Empty:
                extra = None
            assert extra is None, "nothing happened, so nothing more may be sent"
            sp = common_pb2.SamplingParams(max_new_tokens=1, temperature=0.0)
            list(stub.Generate(worker_pb2.GenerateRequest(request_id="a", input_ids=list(range(10, 30)),
                                                          sampling_params=sp)))
            assert events.get(timeout=20).HasField("stored")
            stream.cancel()
            stale: queue.Queue = queue.Queue()
            stream = _reader(stub, 10**9, stale)
            assert stale.get(timeout=20).HasField("cleared")
            stream.cancel()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
