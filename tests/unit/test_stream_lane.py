"""Stream lanes (services/common/stream_lane.py) in one process, over real TCP and a real gRPC server: frames that
arrive in any pieces come out whole and in order; a connection without a valid ticket is refused and a ticket
opens one lane only; a service without lanes (or with --disable-stream-lane, or whose lane port is taken) makes
open_lane give None, so the router stays on gRPC; OpenLane takes the internal token like any internal call; a client that goes away cancels
the handler; a draining service refuses new lanes and ends the open ones once their handler does."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest

from radixmesh.v1 import lane_pb2, lane_pb2_grpc, worker_pb2, worker_pb2_grpc
from radixmesh.services.common import auth, stream_lane
from radixmesh.services.common.server import GrpcService, LaneGrpcSettings
from radixmesh.services.launch import free_port

REQ, RESP = worker_pb2.GenerateStreamRequest, worker_pb2.GenerateStreamResponse


def _frame(msg) -> bytes:
    data = msg.SerializeToString()
    return struct.pack("<I", len(data)) + data


def test_frames_in_any_pieces_come_out_whole_and_in_order():
    async def run():
        conn = stream_lane.FrameConnection()
        msgs = [RESP(responses=[worker_pb2.GenerateResponse(request_id=f"r{i}" * (1 + 300 * i))]) for i in range(4)]
        stream = b"".join(_frame(m) for m in msgs) + struct.pack("<I", 0)  # and an empty frame
        for size in (1, 3, 7, len(stream)):
            for i in range(0, len(stream), size):
                conn.data_received(stream[i:i + size])
            got = [RESP.FromString(await conn.read_frame()) for _ in msgs]
            assert got == msgs and await conn.read_frame() == b"", size
        conn.connection_lost(None)
        assert await conn.read_frame() is None  # a clean close: the end of the stream
    asyncio.run(run())


def test_an_oversized_frame_breaks_the_connection():
    class Transport:
        aborted = False

        def abort(self):
            self.aborted = True

    conn = stream_lane.FrameConnection()
    conn.transport = Transport()
    conn.data_received(struct.pack("<I", stream_lane.MAX_FRAME + 1))
    assert conn.transport.aborted and "more than" in str(conn.error)


class Echo:
    """A stream handler: the handshake answer, then one response per request naming it; records its end."""

    def __init__(self):
        self.ended: asyncio.Future | None = None

    async def handle(self, requests, context):
        self.ended = asyncio.get_running_loop().create_future()
        try:
            yield RESP()
            async for req in requests:
                if req.WhichOneof("action") == "submit":
                    yield RESP(responses=[worker_pb2.GenerateResponse(request_id=req.submit.request_id)])
            self.ended.set_result("requests ended")
        except asyncio.CancelledError:
            self.ended.set_result("cancelled")
            raise


async def _service(echo: Echo, **settings) -> GrpcService:
    s = LaneGrpcSettings("127.0.0.1", free_port(), 2.0, "warning", **settings)
    service = GrpcService(s, lambda server: [], lanes={"GenerateStream": (echo.handle, REQ)})
    await service.start()
    return service


async def _round_trip(lane, rid: str) -> str:
    await lane.write(REQ(submit=worker_pb2.GenerateRequest(request_id=rid)))
    return (await asyncio.wait_for(lane.read(), 5)).responses[0].request_id


def test_a_lane_needs_a_fresh_ticket_and_a_gone_client_cancels_the_handler():
    async def run():
        echo = Echo()
        service = await _service(echo)
        url = f"127.0.0.1:{service.port}"
        try:
            async with grpc.aio.insecure_channel(url) as ch:
                lane = await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5)
                assert await asyncio.wait_for(lane.read(), 5) == RESP()  # the handshake answer
                assert [await _round_trip(lane, f"r{i}") for i in range(3)] == ["r0", "r1", "r2"]
                lane.cancel()  # the router closed it: the handler is cancelled (it would abort its requests)
                assert await asyncio.wait_for(echo.ended, 5) == "cancelled"

                # a ticket opens one lane; a made-up or used one gets the connection closed unanswered
                grant = await lane_pb2_grpc.StreamLaneServiceStub(ch).OpenLane(
                    lane_pb2.OpenLaneRequest(method="GenerateStream"))
                for ticket, served in ((b"x" * 32, False), (grant.ticket, True), (grant.ticket, False)):
                    reader, writer = await asyncio.open_connection("127.0.0.1", grant.port)
                    writer.write(struct.pack("<I", len(ticket)) + ticket)
                    writer.write(_frame(REQ()))
                    got = await asyncio.wait_for(reader.read(1 << 16), 5)  # b"": closed unanswered
                    writer.close()
                    assert (got == _frame(RESP())) is served and (got == b"") is not served, (ticket, got)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await lane_pb2_grpc.StreamLaneServiceStub(ch).OpenLane(lane_pb2.OpenLaneRequest(method="Other"))
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await service.stop()
    asyncio.run(run())


def test_without_lanes_open_lane_gives_none():
    async def run():
        for kwargs in ({"disable_stream_lane": True}, None):
            if kwargs is None:  # a service that has no lanes at all (an older release): OpenLane is UNIMPLEMENTED
                s = LaneGrpcSettings("127.0.0.1", free_port(), 2.0, "warning")
                service = GrpcService(s, lambda server: [])
                await service.start()
            else:
                service = await _service(Echo(), **kwargs)
            url = f"127.0.0.1:{service.port}"
            try:
                async with grpc.aio.insecure_channel(url) as ch:
                    assert await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5) is None
            finally:
                await service.stop()
    asyncio.run(run())


def test_a_taken_lane_port_leaves_the_service_serving_over_grpc():
    async def run():
        import socket

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            service = await _service(Echo(), stream_lane_port=taken.getsockname()[1])
            url = f"127.0.0.1:{service.port}"
            try:
                async with grpc.aio.insecure_channel(url) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await lane_pb2_grpc.StreamLaneServiceStub(ch).OpenLane(
                            lane_pb2.OpenLaneRequest(method="GenerateStream"))
                    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot listen" in e.value.details()
                    assert await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5) is None
            finally:
                await service.stop()
    asyncio.run(run())


def test_open_lane_takes_the_internal_token():
    async def run():
        auth.setup({"internal_token": "lane-secret"})
        try:
            echo = Echo()
            service = await _service(echo)
            url = f"127.0.0.1:{service.port}"
            try:
                async with grpc.aio.insecure_channel(url) as ch:  # no token sent
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                from radixmesh.services.common.auth_channel import aio_channel
                async with aio_channel(url, []) as ch:  # this process's credentials: the token
                    lane = await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5)
                    assert await asyncio.wait_for(lane.read(), 5) == RESP()
                    assert await _round_trip(lane, "ok") == "ok"
                    lane.cancel()
            finally:
                await service.stop()
        finally:
            auth.setup({})
    asyncio.run(run())


def test_a_draining_service_refuses_new_lanes_and_ends_open_ones_with_their_handler():
    async def run():
        echo = Echo()
        service = await _service(echo)
        url = f"127.0.0.1:{service.port}"
        async with grpc.aio.insecure_channel(url) as ch:
            lane = await stream_lane.open_lane(ch, url, "GenerateStream", RESP, 5)
            assert await asyncio.wait_for(lane.read(), 5) == RESP()
            grant = await lane_pb2_grpc.StreamLaneServiceStub(ch).OpenLane(
                lane_pb2.OpenLaneRequest(method="GenerateStream"))
            stopping = asyncio.create_task(service.stop())
            await asyncio.sleep(0.2)
            assert await _round_trip(lane, "during") == "during"  # the open lane still serves
            with pytest.raises(grpc.aio.AioRpcError):  # no new lane (nor any new call)
                await lane_pb2_grpc.StreamLaneServiceStub(ch).OpenLane(
                    lane_pb2.OpenLaneRequest(method="GenerateStream"), timeout=2)
            with pytest.raises(OSError):  # the listener is closed: the granted ticket is worthless now
                await asyncio.open_connection("127.0.0.1", grant.port)
            await asyncio.wait_for(stopping, 10)  # the grace period (2 s) ends the handler that never would
            assert await asyncio.wait_for(lane.read(), 5) is grpc.aio.EOF
            assert echo.ended.result() == "cancelled"
    asyncio.run(run())


def test_a_worker_without_generate_stream_or_lanes_is_found_out_at_the_first_open():
    """Regression: after OpenLane's UNIMPLEMENTED, the GenerateStream handshake's UNIMPLEMENTED reached grpc's
    Python client while the hello was still being written, and it reported INTERNAL ("Internal error from Core")
    instead: the router took a worker of an older release for a broken one. The link now asks once more."""
    from radixmesh.services.common.server import channel
    from radixmesh.services.router.mux import WorkerMux
    from tests.unit.test_router_tenants import RecordingWorker, serve_worker

    async def run(url):
        for _ in range(3):  # each a fresh channel: the first GenerateStream on it
            ch = channel(url)
            try:
                mux = WorkerMux(worker_pb2_grpc.WorkerServiceStub(ch), url, 5, ch)
                assert await mux.open() is False and mux.link.supported is False
            finally:
                await ch.close()

    with serve_worker(RecordingWorker()) as url:
        asyncio.run(run(url))
