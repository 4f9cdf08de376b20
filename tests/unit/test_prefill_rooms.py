"""The prefill worker's rooms, without engines: a Generate for a room whose decode-side handoff already ended is
told why (ABORTED at the service, so the router retries on another pair), while a second Generate for a live room
is still refused as a duplicate."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.v1 import worker_pb2
from radixmesh.services.prefill.bootstrap import HandoffFailed, PrefillRooms


def _request(room: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=f"r{room}", input_ids=[5, 6, 7],
                                      disaggregated_params=worker_pb2.DisaggregatedParams(bootstrap_room=room))


def test_a_generate_after_its_handoff_ended_gets_the_handoffs_reason_and_frees_the_room():
    async def go():
        rooms = PrefillRooms(engine=None, transfer=None, address="127.0.0.1:1", bootstrap_timeout=1.0,
                             transfer_timeout=1.0)
        # The decode worker registered room 5 and died before the router's Generate arrived (a CI run: the call
        # was refused as "already has a request", INVALID_ARGUMENT, which the router does not retry).
        rooms._room(5).fail(HandoffFailed("decode worker 127.0.0.1:2 closed the handoff"))
        with pytest.raises(HandoffFailed, match="closed the handoff"):
            await rooms.generate(_request(5))
        assert rooms.counts()["rooms"] == 0

        rooms._room(6).request.set_result("someone else's request")
        with pytest.raises(ValueError, match="room 0000000000000006 already has a request"):
            await rooms.generate(_request(6))

    asyncio.run(go())
