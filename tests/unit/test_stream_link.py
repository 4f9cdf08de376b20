"""StreamLink's handshake reads the status the peer ended the call with where grpc's client reports the failed
write as INTERNAL (a race a CI run lost four times in a row on one handshake, against a worker without
GenerateStream: the router then answered 503 instead of falling back to a call per request)."""

from __future__ import annotations

import asyncio

import grpc

from radixmesh.services.router import stream_link


class _Ended:
    """A call whose own status is `code` (after `delay` seconds; None: it never comes)."""

    def __init__(self, code, delay: float = 0.0):
        self._code, self._delay = code, delay

    async def code(self):
        if self._code is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self._delay)
        return self._code


def test_a_handshake_that_raised_internal_takes_the_calls_own_status():
    async def run():
        unimplemented = grpc.StatusCode.UNIMPLEMENTED
        assert await stream_link._final_code(_Ended(unimplemented, 0.01), grpc.StatusCode.INTERNAL) == unimplemented
        # other errors are what they say; a call with no better status (or none in time) stays INTERNAL
        assert await stream_link._final_code(_Ended(unimplemented), grpc.StatusCode.UNAVAILABLE) == \
            grpc.StatusCode.UNAVAILABLE
        assert await stream_link._final_code(_Ended(grpc.StatusCode.OK), grpc.StatusCode.INTERNAL) == \
            grpc.StatusCode.INTERNAL
        stream_link._STATUS_WAIT_S = 0.05
        assert await stream_link._final_code(_Ended(None), grpc.StatusCode.INTERNAL) == grpc.StatusCode.INTERNAL
    saved = stream_link._STATUS_WAIT_S
    try:
        asyncio.run(run())
    finally:
        stream_link._STATUS_WAIT_S = saved


class _LostRace:
    """A handshake call whose write always loses grpc's race: INTERNAL, and the call's own status INTERNAL too."""

    starts = 0

    def __init__(self):
        type(self).starts += 1

    async def write(self, msg):
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Internal error from Core")

    async def code(self):
        return grpc.StatusCode.INTERNAL

    def cancel(self):
        pass


def test_a_failed_handshake_sends_its_requests_as_calls_then_tries_the_stream_again(monkeypatch):
    """However often the race is lost, the waiters get False (a call each), not UNAVAILABLE (the router would mark
    a healthy worker failed and answer 503); the stream is not asked for again until the pause has passed, and
    the peer is not taken for one without the method."""
    monkeypatch.setattr(stream_link, "_STATUS_WAIT_S", 0.01)
    monkeypatch.setattr(stream_link, "_REOPEN_AFTER_S", 0.3)

    def unavailable(why):
        raise AssertionError(f"raised unavailable: {why}")

    async def run():
        link = stream_link.StreamLink("w:1", "GenerateStream", _LostRace, object(), 5.0, unavailable, None)
        assert await asyncio.gather(link.open(), link.open()) == [False, False]  # both waiters of one handshake
        assert _LostRace.starts == stream_link._HANDSHAKE_ATTEMPTS and link.supported is None
        assert await link.open() is False and _LostRace.starts == stream_link._HANDSHAKE_ATTEMPTS  # in the pause
        await asyncio.sleep(0.35)
        assert await link.open() is False and _LostRace.starts == 2 * stream_link._HANDSHAKE_ATTEMPTS
    asyncio.run(run())
