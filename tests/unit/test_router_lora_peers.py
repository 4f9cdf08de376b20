"""Run-time LoRA changes among router processes (services/router/lora_peers.py), each side on its own: the hub's
ledger (one turn at a time in the order asked, given up when the holder's link breaks; an announced change reaches
every other process and is answered once all applied it; the intent kept for a process that joins), and a
process's side (a turn that does not come in time is a 503 and is given back; a sibling's change applied to the
intent and the workers' LoRA state, and acknowledged; the hub's intent taken on joining)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.lora_directory import LoraDirectory
from radixmesh.services.router.lora_peers import LoraLedger, LoraPeer
from radixmesh.services.router.lora_state import LoraState
from radixmesh.services.router.workers import WorkerRegistry


class Link:
    """A process's link as the hub sees it: what the hub wrote to it."""

    def __init__(self, name: str):
        self.name, self.got = name, []

    def ops(self) -> list[tuple]:
        out, self.got = [(m["op"], m.get("id", m.get("seq"))) for m in self.got], []
        return out


def ledger() -> LoraLedger:
    return LoraLedger(lambda link, msg: link.got.append(msg))


def test_turns_are_granted_one_at_a_time_in_order_and_freed_by_a_broken_link():
    hub, a, b, c = ledger(), Link("a"), Link("b"), Link("c")
    hub.handle({"op": "lora_lock", "id": 0}, a, [b, c])
    hub.handle({"op": "lora_lock", "id": 0}, b, [a, c])
    hub.handle({"op": "lora_lock", "id": 0}, c, [a, b])
    assert a.ops() == [("lora_granted", 0)] and b.ops() == [] and c.ops() == []
    hub.handle({"op": "lora_unlock", "id": 0}, b, [a, c])  # b gives up waiting: c is next
    hub.handle({"op": "lora_unlock", "id": 7}, a, [b, c])  # not the turn a holds: nothing changes
    assert c.ops() == []
    hub.handle({"op": "lora_unlock", "id": 0}, a, [b, c])
    assert c.ops() == [("lora_granted", 0)] and b.ops() == []
    hub.handle({"op": "lora_lock", "id": 1}, a, [b, c])
    hub.left(c)  # c died holding the turn
    assert a.ops() == [("lora_granted", 1)]
    hub.handle({"op": "lora_lock", "id": 1}, b, [a])
    hub.left(b)  # b died waiting: a's unlock grants nobody
    hub.handle({"op": "lora_unlock", "id": 1}, a, [])
    assert hub.holder is None and not hub.waiting and b.ops() == []


def test_a_change_reaches_the_others_and_is_answered_once_all_applied_it():
    hub, a, b, c = ledger(), Link("a"), Link("b"), Link("c")
    hub.handle({"op": "lora", "id": 5, "change": "load", "name": "x", "path": "/x", "workers": ["w:1"]}, a, [b, c])
    sent = b.got[0]
    assert sent == c.got[0] and sent["op"] == "lora" and sent["name"] == "x" and "id" not in sent
    assert a.ops() == []
    hub.handle({"op": "lora_ack", "seq": sent["seq"]}, b, [a, c])
    assert a.ops() == []
    hub.left(c)  # c died before it applied it: it is no longer waited for
    assert a.ops() == [("lora_applied", 5)]
    hub.handle({"op": "lora", "id": 6, "change": "unload", "name": "x", "path": "", "workers": []}, a, [])
    assert a.ops() == [("lora_applied", 6)]  # nobody else to tell
    hub.handle({"op": "lora", "id": 7, "change": "load", "name": "y", "path": "/y", "workers": []}, a, [])
    assert hub.snapshot() == {"loaded": {"y": "/y"}, "unloaded": ["x"]}


def peer(workers: dict | None = None) -> tuple[LoraPeer, list[dict]]:
    sent: list[dict] = []
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60.0, probing=False)
    registry.workers = workers or {}
    router = SimpleNamespace(registry=registry, lora=LoraDirectory(registry, 1.0))
    return LoraPeer(sent.append, router), sent


async def test_a_turn_not_granted_in_time_is_a_503_and_is_given_back():
    p, sent = peer()
    with pytest.raises(RouterError) as err:
        async with p.turn(0.05):
            raise AssertionError("entered without the hub's grant")
    assert err.value.status == 503 and "try again" in err.value.message
    assert [m["op"] for m in sent] == ["lora_lock", "lora_unlock"] and sent[0]["id"] == sent[1]["id"]
    entered = []

    async def change() -> None:
        async with p.turn(5.0):
            entered.append(True)
    task = asyncio.ensure_future(change())
    await asyncio.sleep(0.01)
    assert not entered
    p.handle({"op": "lora_granted", "id": sent[2]["id"]})
    await task
    assert entered and sent[-1] == {"op": "lora_unlock", "id": sent[2]["id"]}


async def test_a_siblings_change_is_applied_here_and_acknowledged():
    w1, w2 = SimpleNamespace(lora=LoraState(enabled=True)), SimpleNamespace(lora=LoraState(enabled=True))
    w2.lora.refused["x"] = "rank too high"
    p, sent = peer({"w:1": w1, "w:2": w2})
    intent = p.router.lora.intent
    p.handle({"op": "lora", "seq": 3, "change": "load", "name": "x", "path": "/x", "workers": ["w:1", "gone:1"]})
    assert intent.loaded == {"x": "/x"} and w1.lora.adapters == {"x": "/x"} and w2.lora.adapters == {}
    assert "x" not in w2.lora.refused and sent == [{"op": "lora_ack", "seq": 3}]
    epoch = w1.lora.epoch
    p.handle({"op": "lora", "seq": 4, "change": "unload", "name": "x", "path": "", "workers": ["w:1", "w:2"]})
    assert intent.loaded == {} and intent.unloaded == {"x"} and w1.lora.adapters == {}
    assert w1.lora.epoch > epoch  # a poll sent before it is not taken
    # announcing: answered once the hub says every other process applied it
    announcing = asyncio.ensure_future(p.announce("load", "y", "/y", ["w:1"]))
    await asyncio.sleep(0.01)
    assert not announcing.done() and sent[-1]["op"] == "lora" and sent[-1]["workers"] == ["w:1"]
    p.handle({"op": "lora_applied", "id": sent[-1]["id"]})
    await announcing


async def test_a_joining_process_takes_the_hubs_intent():
    p, _ = peer()
    p.router.lora.intent.did_load("stale", "/s")
    p.restore({"loaded": {"x": "/x"}, "unloaded": ["flag"]})
    assert p.router.lora.intent.loaded == {"x": "/x"} and p.router.lora.intent.unloaded == {"flag"}
    await asyncio.sleep(0)
