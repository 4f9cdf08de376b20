"""The decode side of a prefill/decode pair: per request (room), a Handoff stream to the prefill worker's bootstrap
port, run next to the engine request.

    bootstrapping   hello sent; `accepted` must come within --disaggregation-bootstrap-timeout
    waiting for KV  the engine pre-allocates pages (bounded queue); the destination goes to the prefill worker,
                    which prefills (a broken stream ends the wait at once: a dead prefill worker is not waited for)
    transferring    `transferring` arrived; `done` must follow within --disaggregation-transfer-timeout
    decoding        the KV (checksum verified with --disaggregation-verify-kv) and the first token are delivered

On failure the engine request is aborted with the reason and the caller gets ABORTED (the router may retry on
another pair: nothing was streamed yet). Its pages are freed at once, except when a write may still be in flight
(our timeout): then they stay pinned for one more transfer timeout. A caller leaving mid-transfer does not end
the handoff: it runs on until the prefill worker says its write returned (`done`, or its failure, which it sends only
after the write returned), then frees the pages at once; a timeout or a broken stream pins them as above."""

from __future__ import annotations

import asyncio
import logging

import grpc

from radixmesh.engine.disaggregation.handoff import DecodeRole
from radixmesh.v1 import bootstrap_pb2, bootstrap_pb2_grpc
from radixmesh.services.common import tracing
from radixmesh.services.common.kv_transfer import KvTransfer, room_log, set_once
from radixmesh.services.common.server import channel
from radixmesh.services.worker import convert

log = logging.getLogger(__name__)

WAITING = ("bootstrapping", "waiting for KV")


class HandoffFailed(Exception):
    """`reason` names the kind of failure for metrics (one of services.common.kv_transfer.FAILURE_REASONS)."""

    def __init__(self, message: str, reason: str = "peer_lost"):
        super().__init__(message)
        self.reason = reason


class Overloaded(Exception):
    """Too many requests wait for pre-allocation; the caller gets RESOURCE_EXHAUSTED."""


class DecodeRoom:
    def __init__(self, rooms: "DecodeRooms", rid: str, number: int, prefill: str):
        self.rooms, self.rid, self.number, self.prefill = rooms, rid, number, prefill
        loop = asyncio.get_running_loop()
        self.allocated: asyncio.Future = loop.create_future()
        self.role = DecodeRole(lambda pages, cached: loop.call_soon_threadsafe(set_once, self.allocated,
                                                                               (pages, cached)))
        self.state = "bootstrapping"
        self.error: str | None = None
        self.closed = False  # the Generate call ended while the handoff ran on (mid-transfer)
        self.handed_over = False  # the KV went to the engine: the transfer succeeded, whatever the call does next
        self.landing: list[int] = []  # mirror pages held for the KV to land in, from the destination to stage_in
        self.task = asyncio.create_task(self._run())

    def _enter(self, state: str, detail: str = "") -> None:
        self.state = state
        room_log(self.number, self.rid, state, detail)
        tracing.add_event(state, detail=detail or None)

    async def _read(self, call, expect: str):
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as e:
            raise HandoffFailed(f"prefill worker {self.prefill}: {e.code().name}: {e.details()}") from None
        if msg is grpc.aio.EOF or msg.WhichOneof("message") != expect:
            raise HandoffFailed(f"prefill worker {self.prefill} ended the handoff before `{expect}`")
        return getattr(msg, expect)

    async def _run(self) -> None:
        """The handoff, in the `kv_handoff` span (a child of the Generate call's: this task copied its context)."""
        with tracing.span("kv_handoff", "client", bootstrap_room=format(self.number, "016x"), prefill=self.prefill):
            await self._handoff()

    async def _handoff(self) -> None:
        s = self.rooms
        call = s.stub(self.prefill).Handoff()
        try:
            await self._handshake(call)
        except asyncio.CancelledError:
            self._give_back_landing(safe_now=not self.role.in_transfer)
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends the room with its reason
            reason = str(e) or type(e).__name__
            kind = e.reason if isinstance(e, HandoffFailed) else "peer_lost" if isinstance(e, grpc.aio.AioRpcError) \
                else "transfer_error"
            if isinstance(e, TimeoutError):
                limit = s.bootstrap_timeout if self.state == "bootstrapping" else s.transfer_timeout
                reason = f"no answer within {limit:g} s"
                kind = "bootstrap_timeout" if self.state == "bootstrapping" else "transfer_timeout"
            if not self.closed:  # (close counted it)
                s.transfer.failed(kind)
            tracing.set_attributes(error=kind)
            self.fail(f"KV handoff from prefill worker {self.prefill} failed in state '{self.state}': {reason}",
                      pinned=isinstance(e, TimeoutError) and self.role.in_transfer)
        finally:
            call.cancel()

    async def _handshake(self, call) -> None:
        s = self.rooms
        self._enter("bootstrapping", f"prefill worker {self.prefill}")
        async with asyncio.timeout(s.bootstrap_timeout):
            await call.write(bootstrap_pb2.HandoffRequest(hello=bootstrap_pb2.HandoffHello(
                bootstrap_room=self.number, request_id=self.rid, decode_address=s.address)))
            await self._read(call, "accepted")
        self._enter("waiting for KV", "pre-allocating")
        reading = asyncio.ensure_future(self._read(call, "transferring"))
        await asyncio.wait({self.allocated, reading}, return_when=asyncio.FIRST_COMPLETED)
        if not self.allocated.done():
            await reading  # raises: the prefill side ended the room first
        pages, cached = self.allocated.result()
        self.landing = s.transfer.hold(pages)  # the mirror pages the KV lands in (the pool's own off a GPU)
        self.role.in_transfer = True  # from here on the prefill worker may write into these pages
        wanted = self.role.draft_wanted  # (set by the engine before it told us the pages)
        await call.write(bootstrap_pb2.HandoffRequest(destination=bootstrap_pb2.KvDestination(
            session_id=s.transfer.session_id, buffer_bases=s.transfer.layout.bases,
            page_bytes=s.transfer.layout.page_bytes, pages=self.landing, cached_tokens=cached, verify=s.verify,
            tp_size=s.transfer.tp_size, kv_format=s.transfer.kv_format,
            draft_state=convert.draft_wanted_msg(wanted) if wanted is not None else None)))
        started = await reading
        self._enter("transferring", f"{started.bytes} bytes in {started.writes} writes")
        with tracing.span("kv_transfer", direction="receive", bootstrap_room=format(self.number, "016x"),
                          pages=len(pages), bytes=started.bytes, writes=started.writes, verify=s.verify):
            async with asyncio.timeout(s.transfer_timeout):
                done = await self._read(call, "done")
            self.role.in_transfer = False  # every write has landed
            if self.closed:
                raise HandoffFailed("its caller left mid-transfer; the write has landed", "cancelled")
            loop = asyncio.get_running_loop()
            if s.verify:
                mine = await loop.run_in_executor(None, s.transfer.checksum, self.landing)
                if mine != done.kv_checksum:
                    raise HandoffFailed(f"KV checksum mismatch on {len(pages)} pages (sent {done.kv_checksum}, "
                                        f"received {mine}): the transfer corrupted the KV", "checksum_mismatch")
            await loop.run_in_executor(None, s.transfer.stage_in, self.landing, pages)
            self._give_back_landing()
        first = self._first_token(done, wanted)
        s.transfer.record(done.bytes, done.transfer_ms / 1000)
        self.handed_over = True  # (the engine may stream and finish the request before this task runs again)
        if not await asyncio.wrap_future(s.engine.deliver_kv(self.rid, first)):
            raise HandoffFailed("the request was aborted while its KV arrived", "aborted")
        self._enter("decoding", f"{done.bytes} bytes in {done.transfer_ms:.1f} ms")
        await call.done_writing()

    def _first_token(self, done, wanted):
        """`done` as the engine's FirstToken, its draft state checked against what this worker asked for."""
        try:
            first = convert.first_token(done)
        except ValueError as e:
            raise HandoffFailed(f"malformed draft state from prefill worker {self.prefill}: {e}",
                                "transfer_error") from None
        if wanted is None:
            first.draft = None
        elif first.draft is None:  # a prefill worker that does not know the field: the head drafts from zeros
            log.warning("request %s: prefill worker %s sent no draft state for this worker's EAGLE head (an older "
                        "version?): its drafts of this request read zeros for the prompt", self.rid, self.prefill)
        elif (problem := first.draft.problem(wanted)) is not None:
            raise HandoffFailed(f"prefill worker {self.prefill} sent another EAGLE head's state: {problem}",
                                "transfer_error")
        return first

    def fail(self, message: str, pinned: bool = False) -> None:
        self.error = message
        self.role.in_transfer = pinned
        room_log(self.number, self.rid, "failed", message, logging.WARNING)
        self.rooms.engine.abort_request(self.rid, message)
        self._release_later()

    def _release_later(self) -> None:
        """Free the request's pages (and its landing pages) if the engine pinned them (an abort while a write could
        land): after one more transfer timeout while that may still be so, else now (queued after the abort: a
        no-op if nothing is held)."""
        engine = self.rooms.engine
        if self.role.in_transfer:  # a late write lands in pages nobody else uses yet
            asyncio.get_running_loop().call_later(self.rooms.transfer_timeout, engine.release_kv, self.rid)
        else:
            engine.release_kv(self.rid)
        self._give_back_landing(safe_now=not self.role.in_transfer)

    def _give_back_landing(self, safe_now: bool = True) -> None:
        """Return the landing pages to the mirror: now, or after one more transfer timeout while a write may still
        land in them."""
        landing, self.landing = self.landing, []
        if safe_now:
            self.rooms.transfer.release(landing)
        elif landing:
            asyncio.get_running_loop().call_later(self.rooms.transfer_timeout, self.rooms.transfer.release, landing)

    async def close(self) -> None:
        """The Generate call ended (finished, failed or cancelled): stop the handoff if it still runs, except
        mid-transfer, where it runs on to learn when the prefill worker's write returned (see the module doc)."""
        if not self.task.done():
            if self.handed_over:  # the KV was delivered; what is left is the handoff stream's closing
                self.task.cancel()
                self.rooms.open.pop(self.rid, None)
                return
            self.rooms.transfer.failed("cancelled")
            if self.role.in_transfer:
                self.closed = True
                room_log(self.number, self.rid, "cancelled mid-transfer",
                         "pages pinned until the prefill worker's write returns", logging.WARNING)
            else:
                self.task.cancel()
        self.rooms.open.pop(self.rid, None)


class DecodeRooms:
    def __init__(self, engine, transfer: KvTransfer, address: str, bootstrap_timeout: float,
                 transfer_timeout: float, verify: bool, queue_size: int):
        self.engine = engine
        self.transfer = transfer
        self.address = address
        self.bootstrap_timeout = bootstrap_timeout
        self.transfer_timeout = transfer_timeout
        self.verify = verify
        self.queue_size = queue_size
        self.open: dict[str, DecodeRoom] = {}
        self._stubs: dict[str, bootstrap_pb2_grpc.KvBootstrapServiceStub] = {}

    def stub(self, address: str) -> bootstrap_pb2_grpc.KvBootstrapServiceStub:
        if address not in self._stubs:
            self._stubs[address] = bootstrap_pb2_grpc.KvBootstrapServiceStub(channel(address))
        return self._stubs[address]

    def start(self, request) -> DecodeRoom:
        """Open the room of a decode-role Generate. Overloaded (RESOURCE_EXHAUSTED) when the pre-allocation queue
        is full."""
        waiting = sum(not r.allocated.done() for r in self.open.values())
        if waiting >= self.queue_size:
            raise Overloaded(f"{waiting} requests are already waiting for KV pre-allocation on this decode "
                                  f"worker (--disaggregation-prealloc-queue-size {self.queue_size})")
        p = request.disaggregated_params
        if not p.bootstrap_host or not p.bootstrap_port:
            raise ValueError("a decode worker needs disaggregated_params with the prefill worker's bootstrap "
                             "host and port")
        room = DecodeRoom(self, convert.engine_rid(request), p.bootstrap_room,
                          f"{p.bootstrap_host}:{p.bootstrap_port}")
        self.open[room.rid] = room
        return room

    def counts(self) -> dict:
        """Rooms waiting for pre-allocation, pre-allocated (waiting for the prefill worker), transferring."""
        rooms = list(self.open.values())
        waiting = sum(not r.allocated.done() and r.state in WAITING for r in rooms)
        transferring = sum(r.state == "transferring" for r in rooms)
        allocated = sum(r.allocated.done() and r.state == "waiting for KV" for r in rooms)
        return {"waiting": waiting, "preallocated": allocated, "transferring": transferring}

