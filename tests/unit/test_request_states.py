"""The scheduler's requests by state (engine.scheduler.requests): every live request is in exactly the collection of
its state, moves follow the table of edges, and a forbidden move is refused rather than corrupting the sets."""

from __future__ import annotations

import pytest

from radixmesh.engine.request import Req, ReqState
from radixmesh.engine.sampling.params import SamplingParams
from radixmesh.engine.scheduler.requests import Requests

S = ReqState


def _req(rid: str) -> Req:
    return Req(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4), stop_ids=frozenset(),
               sink=lambda out: None)


def _where(reqs: Requests, req: Req) -> list[str]:
    groups = {"waiting": reqs.waiting, "prefilling": reqs.prefilling, "running": reqs.running,
              "prealloc": reqs.prealloc, "receiving": list(reqs.receiving.values()), "held": list(reqs.held.values())}
    return [name for name, group in groups.items() if any(r is req for r in group)]


def test_a_colocated_request_walks_waiting_prefilling_running_finished():
    reqs = Requests()
    r = _req("a")
    reqs.add(r, decode_role=False)
    assert (r.state, _where(reqs, r)) == (S.WAITING, ["waiting"])
    reqs.admit([r])
    assert (r.state, _where(reqs, r)) == (S.PREFILLING, ["prefilling"])
    reqs.chunked = r
    reqs.move(r, S.RUNNING)
    assert (r.state, _where(reqs, r), reqs.chunked) == (S.RUNNING, ["running"], None)
    reqs.move(r, S.WAITING)  # retracted
    assert (r.state, _where(reqs, r)) == (S.WAITING, ["waiting"])
    reqs.admit([r])
    reqs.move(r, S.RUNNING)
    reqs.move(r, S.FINISHED)
    assert r.finished and _where(reqs, r) == [] and not reqs.has_work()


def test_pd_roles_walk_through_prealloc_receiving_and_held():
    reqs = Requests()
    d, p = _req("decode"), _req("prefill")
    reqs.add(d, decode_role=True)
    assert (d.state, _where(reqs, d)) == (S.PREALLOC, ["prealloc"])
    reqs.move(d, S.RECEIVING)
    assert _where(reqs, d) == ["receiving"] and reqs.find("decode") is d
    reqs.move(d, S.HELD)  # aborted while its peer may still write
    assert d.finished and _where(reqs, d) == ["held"] and reqs.counts()["held_rooms"] == 1
    reqs.move(d, S.FINISHED)
    reqs.add(p, decode_role=False)
    reqs.admit([p])
    reqs.move(p, S.HELD)  # handed over
    assert p.finished and reqs.find("prefill") is p
    reqs.move(p, S.FINISHED)
    assert reqs.held == {} and reqs.find("prefill") is None


@pytest.mark.parametrize("start,to", [(S.WAITING, S.RUNNING), (S.WAITING, S.HELD), (S.PREALLOC, S.RUNNING),
                                      (S.FINISHED, S.WAITING), (S.FINISHED, S.FINISHED)])
def test_a_forbidden_move_is_refused_and_changes_nothing(start, to):
    reqs = Requests()
    r = _req("x")
    reqs.add(r, decode_role=start is S.PREALLOC)
    if start is S.FINISHED:
        reqs.move(r, S.FINISHED)
    before = _where(reqs, r)
    with pytest.raises(RuntimeError, match=f"no move from {start.name} to {to.name}"):
        reqs.move(r, to)
    assert r.state is start and _where(reqs, r) == before
