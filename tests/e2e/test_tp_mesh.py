"""Tensor parallelism through the launched mesh: `radixmesh serve --tp 2 --dp-size 2` (two workers, each two gloo
ranks on CPU) answers token-exact with the single-process mesh through the openai client, logprobs within 1e-5;
a rank killed mid-request takes its worker down within --dist-timeout, the client gets a clear error, no process is
left behind, and the mesh keeps serving on the other worker. With `--disaggregation pd --tp 2` each prefill rank's
KV shard goes to the matching decode rank over Mooncake (checksummed), token-exact too; a decode worker of another
tensor-parallel size is refused with the reason."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import openai
import pytest

from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import NOT_FORKED, alive, child_pids, cmdline, http_get, openai_client, running_mesh
from tests.e2e.test_pd import PD, assert_all_freed, assert_pair_refused, decode_worker_in_place, workers

NAME = model_path(MODEL)
PROMPTS = ["The history of the lighthouse keepers", "Once upon a time", "1 2 3 4 5", "def f(x):"]


@pytest.fixture(scope="module")
def tp_mesh(tmp_path_factory):
    # NOT_FORKED: each worker spawns its follower rank as its own child, as users run it (_ranks finds them there;
    # under the suite's fork server the ranks would be forked from it too)
    with running_mesh(NAME, tmp_path_factory.mktemp("tp"), "--tp", "2", "--dist-timeout", "20", num_workers=2,
                      env=NOT_FORKED) as m:
        yield m


_client = openai_client


def _answers(mesh) -> list[tuple[str, list[float]]]:
    with _client(mesh) as c:
        out = c.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=2)
    return [(ch.text, ch.logprobs.token_logprobs) for ch in sorted(out.choices, key=lambda ch: ch.index)]


def test_tp_mesh_matches_the_single_process_mesh(tp_mesh, mesh):
    got, want = _answers(tp_mesh), _answers(mesh)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])) < 1e-5


def _ranks(mesh) -> dict[int, list[int]]:
    """Worker pid -> its follower ranks' pids."""
    out = {}
    for pid in mesh.services().values():
        if "radixmesh.services.worker" in cmdline(pid):
            out[pid] = [c for c in child_pids(pid) if "spawn_main" in cmdline(c)]
    return out


def _wait_in_flight_on_every_worker(mesh, timeout_s: float = 60.0) -> None:
    """Until every worker runs a request (its scheduler's `running`, from /get_server_info): on a busy machine the
    first requests can take seconds to get there, and a rank killed before that kills an idle worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = http_get(mesh.url + "/get_server_info")
        workers = json.loads(body).get("workers", []) if status == 200 else []
        running = [sum(s.get("running", 0) for s in w.get("internal_states", [])) for w in workers]
        if len(running) >= 2 and all(running):
            return
        assert time.monotonic() < deadline, running
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not exited (an exited child keeps its pid until the launcher reaps it; its exe link is gone)."""
    return alive(pid) and os.path.exists(f"/proc/{pid}/exe")


def test_a_killed_rank_takes_its_worker_down_and_the_mesh_serves_on(tp_mesh):
    ranks = _ranks(tp_mesh)
    assert len(ranks) == 2 and all(len(r) == 1 for r in ranks.values()), ranks
    victim_worker, (victim,) = next(iter(ranks.items()))
    errors: list[BaseException] = []
    reasons: list[str] = []

    def long_requests():  # in flight on both workers when the rank dies (the first, long; the second, sent
        # after the death: its length does not matter)
        with _client(tp_mesh) as c:
            for max_tokens in (200, 12):
                try:
                    out = c.completions.create(model=NAME, prompt=PROMPTS, max_tokens=max_tokens, temperature=0, n=1)
                    reasons.extend(ch.finish_reason for ch in out.choices)
                except openai.APIError as e:
                    errors.append(e)
    t = threading.Thread(target=long_requests)
    t.start()
    _wait_in_flight_on_every_worker(tp_mesh)
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    while _running(victim_worker) and time.monotonic() - start < 30:
        time.sleep(0.2)
    assert not _running(victim_worker), "the worker outlived its rank by more than --dist-timeout"
    assert time.monotonic() - start < 20
    t.join(120)
    # the prompt on the broken worker was aborted (SGLang's finish_reason "abort"), its call failed naming why, or
    # the worker's stream ended before its scheduler aborted it and the router retried or migrated the open
    # requests on the other worker (a run here: "GenerateStream ... ended ...; failing its 2 open requests", then
    # every answer "length")
    moved = re.search(r"failing its [1-9]\d* open requests|mid-stream; migrating",
                      tp_mesh.log_path.read_text(errors="replace"))
    assert "abort" in reasons or errors or moved, (reasons, tp_mesh.log_tail())
    for e in errors:
        assert "tensor parallel" in str(e) or "worker" in str(e), e
    # the other worker answers everything, token-exact as before
    deadline = time.monotonic() + 30
    while True:
        try:
            texts = [t for t, _ in _answers(tp_mesh)]
            break
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert len(texts) == len(PROMPTS) and all(texts)


def test_pd_with_tp_matches_the_colocated_mesh_and_refuses_a_mixed_pair(tmp_path, mesh):
    # not forked: a decode worker is started again below with the old one's /proc environ
    with running_mesh(NAME, tmp_path, *PD, "--tp", "2", "--dist-timeout", "30", env=NOT_FORKED) as pd:
        got, want = _answers(pd), _answers(mesh)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])) < 1e-5
        roles = workers(pd)
        assert_all_freed(roles["prefill"] + roles["decode"])
        # the same decode worker at --tp-size 1 in place of the TP=2 one: the prefill worker refuses its rooms
        with decode_worker_in_place(pd, tmp_path, {"--tp-size": "1"}) as decode:
            assert_pair_refused(pd, roles["prefill"] + [decode], "same tensor parallel size")
