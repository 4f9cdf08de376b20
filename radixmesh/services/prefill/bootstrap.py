"""The prefill side of a prefill/decode pair.

A room meets two calls: the router's Generate (the prompt and its sampling parameters) and the decode worker's
Handoff stream on the bootstrap port (where the KV goes). Whichever arrives first waits for the other for at most
--disaggregation-bootstrap-timeout. Then the prompt is prefilled (prefix cache and chunked prefill as usual), its
pages stay pinned, and once the decode worker's destination is known they are written there in batched page runs;
`done` carries the first token (and, for a decode worker drafting with an EAGLE head, the head's state of the prompt
it lacks: engine.disaggregation.draft_state). Waiting for the destination and the writes are bounded by
--disaggregation-transfer-timeout. Any failure frees the room's pages (only after an in-flight write returned) and
ends both calls with the reason."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from radixmesh.engine.disaggregation.handoff import PrefillRole
from radixmesh.engine.disaggregation.draft_state import DraftState, describe
from radixmesh.engine.disaggregation.kv_pages import KvLayout, check_kv_format
from radixmesh.engine.disaggregation.transfer import page_runs
from radixmesh.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.kv_transfer import KvTransfer, room_log, set_once
from radixmesh.services.common.server import MAX_MESSAGE_BYTES
from radixmesh.services.worker import convert
from radixmesh.services.worker.spans import trace_sample

log = logging.getLogger(__name__)

# The most bytes of an EAGLE head's KV one `done` carries (within gRPC's message limit, beside the logprobs): for a
# longer prompt none is sent, and the decode worker's head catches up over the prompt reading zeros (its drafts are
# worse; its outputs stay exact).
MAX_DRAFT_KV_BYTES = MAX_MESSAGE_BYTES // 2


class HandoffFailed(Exception):
    """A room could not complete; the message says which step and why, `reason` names the kind of failure for
    metrics (one of services.common.kv_transfer.FAILURE_REASONS)."""

    def __init__(self, message: str, reason: str = "peer_lost"):
        super().__init__(message)
        self.reason = reason


class Room:
    def __init__(self, number: int):
        self.number = number
        loop = asyncio.get_running_loop()
        self.request: asyncio.Future = loop.create_future()  # (request id) once the router's Generate arrived
        self.hello: asyncio.Future = loop.create_future()  # HandoffHello once the decode worker called
        self.destination: asyncio.Future = loop.create_future()  # KvDestination
        self.events: asyncio.Queue = asyncio.Queue()  # TransferStarted, KvReady, or a HandoffFailed to send
        self.write: asyncio.Future | None = None  # the KV write, once started

    def fail(self, error: HandoffFailed) -> None:
        """End the room with `error`. While a write is in flight the decode worker hears of it only once the write
        returned, so it never frees pages a write still targets (its own transfer timeout bounds its wait)."""
        if self.write is not None and not self.write.done():
            self.write.add_done_callback(lambda _: self.fail(error))
            return
        for fut in (self.request, self.hello, self.destination):
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: an unawaited one must not log "never retrieved"
        self.events.put_nowait(error)


async def _bounded(fut: asyncio.Future, timeout: float, what: str, reason: str):
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)
    except TimeoutError:
        raise HandoffFailed(f"{what} within {timeout:g} s", reason) from None


class PrefillRooms(bootstrap_pb2_grpc.KvBootstrapServiceServicer):
    def __init__(self, engine, transfer: KvTransfer, address: str, bootstrap_timeout: float,
                 transfer_timeout: float):
        self.engine = engine
        self.transfer = transfer
        self.address = address
        self.bootstrap_timeout = bootstrap_timeout
        self.transfer_timeout = transfer_timeout
        self.rooms: dict[int, Room] = {}
        self.transferring = 0
        self.bootstrap_port = 0  # where the bootstrap server listens, once it does

    def _room(self, number: int) -> Room:
        if number not in self.rooms:
            self.rooms[number] = Room(number)
        return self.rooms[number]

    def counts(self) -> dict:
        return {"rooms": len(self.rooms), "transferring": self.transferring}

    # ---- the decode worker's side: Handoff on the bootstrap port --------------------------------------------
    async def Handoff(self, request_iterator, context: grpc.aio.ServicerContext):
        it = request_iterator.__aiter__()
        first = await anext(it, None)
        if first is None or first.WhichOneof("message") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a handoff starts with hello")
        hello = first.hello
        room = self._room(hello.bootstrap_room)
        if room.hello.done():
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {hello.bootstrap_room:016x} is taken")
        room.hello.set_result(hello)
        reader = asyncio.create_task(self._read_destination(it, room))
        try:
            try:
                await _bounded(room.request, self.bootstrap_timeout, "no Generate for this room arrived",
                               "bootstrap_timeout")
            except HandoffFailed as e:
                self.transfer.failed(e.reason)  # no Generate will count it
                room.fail(e)
            while True:
                event = await room.events.get()
                if isinstance(event, HandoffFailed):
                    await context.abort(grpc.StatusCode.ABORTED, str(event))
                if isinstance(event, bootstrap_pb2.HandoffAccepted):
                    yield bootstrap_pb2.HandoffResponse(accepted=event)
                elif isinstance(event, bootstrap_pb2.TransferStarted):
                    yield bootstrap_pb2.HandoffResponse(transferring=event)
                else:
                    yield bootstrap_pb2.HandoffResponse(done=event)
                    return
        finally:
            reader.cancel()
            if not room.destination.done():  # the decode worker went away before saying where the KV goes
                room.fail(HandoffFailed(f"decode worker {hello.decode_address or '?'} closed the handoff"))
            if not room.request.done() or room.request.exception() is not None:  # no Generate will clean up
                self.rooms.pop(room.number, None)

    async def _read_destination(self, it, room: Room) -> None:
        try:
            msg = await anext(it, None)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            msg = None
        if msg is not None and msg.WhichOneof("message") == "destination" and not room.destination.done():
            room.destination.set_result(msg.destination)
        elif not room.destination.done():
            room.fail(HandoffFailed("the decode worker closed the handoff before sending its KV destination"))

    # ---- the router's side: Generate ------------------------------------------------------------------------
    async def generate(self, request: worker_pb2.GenerateRequest,
                       timings: dict | None = None) -> worker_pb2.GenerateResponse:
        """Prefill `request` and hand its KV to the decode worker that registered its room; `timings` (when given)
        receives the engine's RequestTiming under key 0 once the prefill finished (its queue time for metrics)."""
        params = request.disaggregated_params
        rid, number = convert.engine_rid(request), params.bootstrap_room
        room = self._room(number)
        if room.request.done():
            ended = room.request.exception()
            if ended is None:
                raise ValueError(f"room {number:016x} already has a request")
            # The decode worker's handoff ended before this call arrived (it died, or gave up waiting); its
            # Handoff counted the failure. ABORTED: the router retries the request on another pair.
            self.rooms.pop(number, None)
            room_log(number, rid, "failed", str(ended), logging.WARNING)
            raise ended
        room.request.set_result(rid)
        room_log(number, rid, "bootstrapping", "waiting for the decode worker")
        try:
            return await self._serve(room, rid, request, {} if timings is None else timings)
        except HandoffFailed as e:
            self.transfer.failed(e.reason)
            room.fail(e)
            room_log(number, rid, "failed", str(e), logging.WARNING)
            raise
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                self.transfer.failed("cancelled")
            why = "cancelled by its caller" if isinstance(e, asyncio.CancelledError) else repr(e)
            room_log(number, rid, "failed", why, logging.WARNING)
            room.fail(HandoffFailed(f"the prefill request ended: {why}"))
            raise
        finally:
            self.rooms.pop(number, None)

    async def _serve(self, room: Room, rid: str, request, timings: dict) -> worker_pb2.GenerateResponse:
        hello = await _bounded(room.hello, self.bootstrap_timeout, "no decode worker registered the room",
                               "bootstrap_timeout")
        room.events.put_nowait(bootstrap_pb2.HandoffAccepted(prefill_address=self.address))
        room_log(room.number, rid, "prefilling", f"decode worker {hello.decode_address}")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        role = PrefillRole(lambda pages, first: loop.call_soon_threadsafe(set_once, ready, (pages, first)))
        kwargs = convert.generate_kwargs(request)
        kwargs["on_finish"] = timings.__setitem__
        try:
            (result,) = await self.engine.async_generate_outputs(**kwargs, handoff=role)
        except BaseException:
            # Cancelled or failed around the hand-over: queued after the engine's own abort, this frees pages
            # the request may hold by now (a no-op otherwise).
            self.engine.release_kv(rid)
            raise
        if not ready.done():
            reason = result.finish_reason.to_dict() if result.finish_reason is not None else {}
            raise HandoffFailed(f"prefill did not complete: {reason.get('message', reason)}", "prefill_failed")
        pages, first = ready.result()
        if 0 in timings and tracing.enabled():
            trace_sample("prefill", 0, {"prompt_tokens": len(request.input_ids), "cached_tokens": first.cached_tokens},
                         timings[0])
        try:
            room_log(room.number, rid, "waiting for KV destination")
            dest = await _bounded(room.destination, self.transfer_timeout, "the decode worker sent no destination",
                                  "transfer_timeout")
        except BaseException:
            self.engine.release_kv(rid)
            raise
        done = await self._send(room, rid, self._source(pages, dest), first, dest)
        room.events.put_nowait(done)
        usage = common_pb2.Usage(prompt_tokens=len(request.input_ids), completion_tokens=1,
                                 cached_tokens=first.cached_tokens)
        return worker_pb2.GenerateResponse(request_id=rid, complete=worker_pb2.GenerateComplete(
            output_ids=[first.token_id], usage=usage))

    def _written(self, write: asyncio.Future, number: int, rid: str) -> None:
        """The write returned (whoever still waits for it): unpin the source pages."""
        self.engine.release_kv(rid)
        if not write.cancelled() and write.exception() is not None:
            room_log(number, rid, "write failed", str(write.exception()), logging.WARNING)

    def _source(self, pages: list[int], dest) -> list[int]:
        """The pinned pages the decode worker lacks (it holds the first `cached_tokens` already)."""
        return pages[dest.cached_tokens // self.engine.args.page_size:]

    async def _send(self, room: Room, rid: str, src: list[int], first, dest) -> bootstrap_pb2.KvReady:
        """Write `src` into the destination pages; returns `done`. Releases the request's pinned pages once no
        write can still read them (after a timeout too: the release waits for the write to return)."""
        try:
            if dest.tp_size and dest.tp_size != self.transfer.tp_size:
                raise ValueError(f"the decode worker runs --tp-size {dest.tp_size} and this prefill worker "
                                 f"--tp-size {self.transfer.tp_size}: the workers of a prefill/decode pair must use "
                                 "the same tensor parallel size (each rank's KV shard goes to the matching rank)")
            check_kv_format(self.transfer.kv_format, dest.kv_format)
            draft = draft_to_send(first, dest, rid)
            layout = KvLayout(tuple(dest.buffer_bases), dest.page_bytes)
            room.write = pending = self.transfer.write(dest.session_id, layout, src, list(dest.pages), dest.verify)
        except ValueError as e:
            self.engine.release_kv(rid)
            raise HandoffFailed(str(e), "transfer_error") from None
        started = time.perf_counter()
        nbytes = len(src) * layout.page_bytes * len(layout.bases)
        writes = len(page_runs(range(len(src)), dest.pages)) * len(layout.bases)  # per run of destination pages
        room.events.put_nowait(bootstrap_pb2.TransferStarted(bytes=nbytes, writes=writes))
        room_log(room.number, rid, "transferring", f"{len(src)} pages, {nbytes} bytes in {writes} writes "
                 f"to {dest.session_id}")
        self.transferring += 1
        pending.add_done_callback(lambda f: self._written(f, room.number, rid))
        try:
            with tracing.span("kv_transfer", direction="send", bootstrap_room=format(room.number, "016x"),
                              pages=len(src), bytes=nbytes, writes=writes, peer=dest.session_id):
                checksum = await _bounded(pending, self.transfer_timeout, "the KV write did not finish",
                                          "transfer_timeout")
        except HandoffFailed:
            raise
        except Exception as e:
            raise HandoffFailed(f"KV transfer to {dest.session_id} failed: {e}", "transfer_error") from None
        finally:
            self.transferring -= 1
        done = await asyncio.get_running_loop().run_in_executor(None, convert.kv_ready, first, draft)
        done.bytes, done.transfer_ms = nbytes, 1000 * (time.perf_counter() - started)
        done.kv_checksum = checksum
        room_log(room.number, rid, "sent", f"{done.transfer_ms:.1f} ms")
        return done


def draft_to_send(first, dest, rid: str = "?") -> DraftState | None:
    """The draft state the decode worker asked for (None: it asked for none). ValueError when this worker has none,
    or another head's."""
    if not dest.HasField("draft_state"):
        return None
    wanted = convert.draft_wanted(dest.draft_state)
    same_flags = "give both workers the same --speculative-algorithm and --speculative-draft-model-path"
    if first.draft is None:
        raise ValueError(f"the decode worker drafts with an EAGLE head reading {describe(wanted.layers)} of the "
                         f"target, and this prefill worker runs none: {same_flags}")
    problem = first.draft.problem(wanted)
    if problem is not None:
        raise ValueError(f"the decode worker's EAGLE head is not this prefill worker's ({problem}): {same_flags}")
    sent = first.draft.since(wanted.start, MAX_DRAFT_KV_BYTES)
    if sent.kv_start + sent.kv_rows < first.draft.kv_start + first.draft.kv_rows:
        log.warning("request %s: the draft head's KV of its %d-token prompt exceeds %d MiB; the decode worker's "
                    "head recomputes it reading zeros", rid, sent.hidden_position + 1,
                    MAX_DRAFT_KV_BYTES >> 20)
    return sent
