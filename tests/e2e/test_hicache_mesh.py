"""The whole hierarchy through the launched mesh (`radixmesh serve --kvstore --enable-hierarchical-cache --policy
kv_index`, two workers): greedy outputs equal the offline engine's whether prompts come from the device, the host
pool or the kvstore (L3); two routers over one index send every prompt to the same worker, and the survivor keeps
the hit rate when one dies; with the kvstore killed, every request still answers correctly."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from radixmesh.engine.cache.storage import StorageOptions
from radixmesh.services.common import auth
from radixmesh.services.common.auth import InternalAuth
from radixmesh.services.kvstore.client import KvStoreStorage
from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.e2e.mesh import INTERNAL_TOKEN, REPO, cmdline, launch, stop_and_check
from tests.engine_utils import running_engine

MODEL = model_path("tiny-llama")
PAGE = 4
SP = {"max_new_tokens": 4, "temperature": 0}
# The tiny model prefills faster than loopback gRPC fetches: without this the workers would (rightly) stop
# prefetching from L3 after measuring that, and these tests want to see L3 serve.
NO_SKIP = ("--hicache-storage-backend-extra-config", '{"skip_slow_fetches": false}')


def _post(base: str, path: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _flush(base: str) -> None:
    req = urllib.request.Request(base + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200, r.read()


def _generate(base: str, ids: list[int]) -> tuple[list[int], int]:
    out = _post(base, "/generate", {"input_ids": ids, "sampling_params": SP})
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = launch(MODEL, tmp_path_factory.mktemp("hicache"), "--kvstore", "--enable-hierarchical-cache",
               "--hicache-ratio", "4", "--page-size", str(PAGE), "--max-total-tokens", "160", "--policy", "kv_index",
               "--hicache-storage-prefetch-policy", "wait_complete", *NO_SKIP, num_workers=2)
    try:
        yield m
    finally:
        stop_and_check(m)


@pytest.fixture(scope="module")
def reference():
    with running_engine(MODEL) as llm:
        yield lambda prompts: [llm.generate(input_ids=p, sampling_params=SP)["output_ids"] for p in prompts]


def _aligned(n: int) -> int:
    return (n - 1) // PAGE * PAGE


def test_device_host_and_l3_hits_are_token_exact(mesh, reference):
    prompts = _prompts(8, 40, seed=11)
    want = reference(prompts)
    first = [_generate(mesh.url, p) for p in prompts]
    assert [o for o, _ in first] == want
    # 8 x 44 tokens over two 160-token pools: most prompts were evicted to the host pools meanwhile.
    again = [_generate(mesh.url, p) for p in prompts]
    assert [o for o, _ in again] == want
    assert all(c == _aligned(40) for _, c in again), "each prompt returns to the worker (device or host) it used"
    _flush(mesh.url)
    from_l3 = [_generate(mesh.url, p) for p in prompts]
    assert [o for o, _ in from_l3] == want
    assert all(c == _aligned(40) for _, c in from_l3), "after a flush the pages come back from the kvstore"


def _second_router(mesh) -> tuple[subprocess.Popen, str]:
    pid = mesh.services()["radixmesh.services.router"]
    argv = cmdline(pid).split()
    argv = argv[argv.index("-m"):]
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    if "--grpc-port" in argv:
        i = argv.index("--grpc-port")
        del argv[i:i + 2]
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, auth.TOKEN_ENV: INTERNAL_TOKEN})  # the mesh's internal token
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("second router not healthy")


def _index_holds(mesh):
    """held(ids, tokens): waits (up to 10 s) until the kvstore's index shows some worker holding `tokens` of the
    prompt; False if it never does."""
    from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
    from tests.e2e.mesh import internal_channel

    port = cmdline(mesh.services()["radixmesh.services.kvstore"]).split("--port ")[1].split()[0]
    channel = internal_channel(f"127.0.0.1:{port}")
    stub = kvstore_pb2_grpc.KvStoreServiceStub(channel)

    def held(ids: list[int], tokens: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = stub.MatchPrefix(kvstore_pb2.MatchPrefixRequest(token_ids=ids), timeout=5)
            if max((m.matched_tokens for m in r.matches), default=0) >= tokens:
                return True
            time.sleep(0.01)
        return False
    return held, channel


def test_two_routers_agree_and_the_survivor_keeps_the_hit_rate(mesh):
    prompts = _prompts(40, 20, seed=12)  # 40 fresh prompts: the two routers' choices are compared 40 times
    proc, other = _second_router(mesh)
    held, channel = _index_holds(mesh)
    try:
        cached = []
        for p in prompts:
            _generate(mesh.url, p)
            # The worker's KV events reach the index on a stream of their own, after its answer: a request sent at
            # once through another router may ask the index before they land (under CI's load, once in a few
            # hundred). What is asserted is the choice two routers make over the same index.
            assert held(p, _aligned(20)), "the index never learned of the first router's request"
            cached.append(_generate(other, p)[1])
        # The second router's request found the prompt's pages: it went to the worker the first router chose.
        assert cached == [_aligned(20)] * len(prompts)
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    survivor = [_generate(mesh.url, p)[1] for p in prompts]
    assert survivor == [_aligned(20)] * len(prompts)


def test_kvstore_killed_mid_load_every_request_still_answers(mesh, reference):
    prompts = _prompts(6, 40, seed=13)
    want = reference(prompts)
    for p in prompts:
        _generate(mesh.url, p)
    _flush(mesh.url)
    os.kill(mesh.services()["radixmesh.services.kvstore"], signal.SIGKILL)
    outs = [_generate(mesh.url, p)[0] for p in prompts]
    assert outs == want


def test_pd_with_the_hierarchy_is_token_exact(tmp_path, reference):
    """Prefill and decode workers with host tiers and the kvstore: outputs stay exact from every tier."""
    pd = launch(MODEL, tmp_path, "--disaggregation", "pd", "--disaggregation-transfer-backend", "mooncake",
                "--kvstore", "--enable-hierarchical-cache", "--hicache-ratio", "4", "--page-size", str(PAGE),
                "--max-total-tokens", "160", "--hicache-storage-prefetch-policy", "wait_complete", *NO_SKIP)
    try:
        prompts = _prompts(6, 40, seed=14)
        want = reference(prompts)
        assert [_generate(pd.url, p)[0] for p in prompts] == want
        again = [_generate(pd.url, p) for p in prompts]  # from the prefill worker's device or host pool
        assert [o for o, _ in again] == want and all(c == _aligned(40) for _, c in again)
        _flush(pd.url)
        from_l3 = [_generate(pd.url, p) for p in prompts]
        assert [o for o, _ in from_l3] == want and all(c == _aligned(40) for _, c in from_l3), from_l3
    finally:
        stop_and_check(pd)


def test_l3_over_the_mooncake_transfer_engine_is_token_exact(tmp_path, reference):
    """`--kvstore-transport mooncake`: pages move between the host pool and the kvstore by the transfer engine."""
    m = launch(MODEL, tmp_path, "--kvstore", "--kvstore-transport", "mooncake", "--enable-hierarchical-cache",
               "--hicache-ratio", "4", "--page-size", str(PAGE), "--max-total-tokens", "160",
               "--hicache-storage-prefetch-policy", "wait_complete", *NO_SKIP)
    try:
        prompts = _prompts(6, 40, seed=15)
        want = reference(prompts)
        assert [_generate(m.url, p)[0] for p in prompts] == want
        _flush(m.url)
        from_l3 = [_generate(m.url, p) for p in prompts]
        assert [o for o, _ in from_l3] == want and all(c == _aligned(40) for _, c in from_l3), from_l3
        port = cmdline(m.services()["radixmesh.services.kvstore"]).split("--port ")[1].split()[0]
        auth.configure(InternalAuth((INTERNAL_TOKEN,)))  # the mesh's kvstore wants its token
        try:
            store = KvStoreStorage(StorageOptions(url=f"127.0.0.1:{port}"))
        finally:
            auth.configure(InternalAuth())
        stats = store.stats()
        store.close()
        assert stats["transfer_session"] and stats["pages"] > 0
        # every stored page came by the transfer engine, and the L3 hits left by it
        assert stats["transfer_bytes_in"] >= stats["bytes"] > 0 and stats["transfer_bytes_out"] > 0, stats
    finally:
        stop_and_check(m)
