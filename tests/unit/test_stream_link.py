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
