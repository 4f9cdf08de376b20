"""DecodeRoom.close (the decode worker's Generate call ended) against the state its KV handoff is in: a handoff that
already delivered the KV and only has the stream's closing write left is not a failed transfer; one still waiting
for its KV is (`cancelled`), and is stopped. The room's handoff task is a real task parked where that state's
await would be; the transfer metrics are the counters' own calls."""

from __future__ import annotations

import asyncio

from radixmesh.engine.disaggregation.handoff import DecodeRole
from radixmesh.services.worker.receive import DecodeRoom


class Counted:
    def __init__(self):
        self.failures: list[str] = []

    def failed(self, reason: str) -> None:
        self.failures.append(reason)


class Rooms:
    def __init__(self):
        self.transfer = Counted()
        self.open: dict = {}


def room_in(state: str, rooms: Rooms) -> DecodeRoom:
    room = DecodeRoom.__new__(DecodeRoom)  # its handoff task is made below, parked where `state` awaits
    room.rooms, room.rid, room.number, room.prefill = rooms, "r1", 7, "127.0.0.1:1"
    room.role = DecodeRole(lambda pages, cached: None)
    room.state, room.error, room.closed = state, None, False
    room.handed_over = state == "decoding" or state == "handed over"
    room.task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    rooms.open[room.rid] = room
    return room


def test_a_call_ending_after_its_kv_was_delivered_is_no_failed_transfer():
    async def main():
        rooms = Rooms()
        for state in ("decoding", "handed over"):
            # deliver_kv done, `await call.done_writing()` still out; or deliver_kv called, the task not yet resumed
            # (the engine streamed and finished the request first)
            room = room_in(state, rooms)
            await room.close()
            await asyncio.sleep(0)
            assert rooms.transfer.failures == [] and room.task.cancelled() and rooms.open == {}

        waiting = room_in("waiting for KV", rooms)
        await waiting.close()
        await asyncio.sleep(0)
        assert rooms.transfer.failures == ["cancelled"] and waiting.task.cancelled() and rooms.open == {}

    asyncio.run(main())
