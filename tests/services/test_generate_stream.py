"""WorkerService.GenerateStream (many requests over one stream) against the real worker process: outputs equal the
per-request Generate call's, token for token; one step's outputs of several requests share a message; a bad
request ends alone with the status Generate would give; `abort` and a closed stream free every KV page; a draining
worker ends it once idle. Each over gRPC and over the worker's stream lane (services.common.stream_lane), which
runs the same handler. And through the router: a worker without GenerateStream is served with a call per
request."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common import stream_lane
from tests.services.metrics_utils import start_grpc, stop
from tests.services.test_router_resilience import MODEL, Mesh, generate, post
from tests.services.test_worker_service import greedy, start, used_after_flush, worker  # noqa: F401 (fixture)


class Stream:
    """A GenerateStream driven from a test: submit/abort, then the batches as they come."""

    def __init__(self, stub):
        self.requests: queue.Queue = queue.Queue()
        self.call = stub.GenerateStream(iter(self.requests.get, None))
        self.batches: queue.Queue = queue.Queue()
        self.requests.put(worker_pb2.GenerateStreamRequest())  # the handshake
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next(10) == worker_pb2.GenerateStreamResponse()

    def _read(self):
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError as e:
            self.batches.put(e)
        self.batches.put(None)

    def submit(self, **kw):
        self.requests.put(worker_pb2.GenerateStreamRequest(submit=worker_pb2.GenerateRequest(**kw)))

    def abort(self, rid: str):
        self.requests.put(worker_pb2.GenerateStreamRequest(abort=rid))

    def next(self, timeout: float = 60):
        return self.batches.get(timeout=timeout)

    def collect(self, rids: set[str], timeout: float = 120) -> tuple[dict, dict, int]:
        """Until every rid of `rids` ended: (rid -> messages, rid -> (code, message), batches that carried outputs of
        several requests). Other requests' outputs are kept too."""
        msgs: dict[str, list] = {r: [] for r in rids}
        ends: dict[str, tuple[int, str]] = {}
        shared, deadline = 0, time.monotonic() + timeout
        while not rids <= set(ends):
            batch = self.next(max(deadline - time.monotonic(), 0.1))
            assert isinstance(batch, worker_pb2.GenerateStreamResponse), batch
            for m in batch.responses:
                msgs.setdefault(m.request_id, []).append(m)
            for e in batch.ended:
                ends[e.request_id] = (e.code, e.message)
            shared += len({m.request_id for m in batch.responses}) > 1
        return msgs, ends, shared

    def close(self):
        self.requests.put(None)

    def cancel(self):
        self.call.cancel()


class LaneStream(Stream):
    """The same over the worker's stream lane (services.common.stream_lane), driven from an event loop of its own.
    There is no half-close on a lane: close() ends the connection (what still runs on it is aborted)."""

    def __init__(self, url: str):
        self.batches = queue.Queue()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.lane = asyncio.run_coroutine_threadsafe(self._open(url), self.loop).result(30)
        assert isinstance(self.lane, stream_lane.LaneCall), "the worker offered no lane"
        self._send(worker_pb2.GenerateStreamRequest())
        assert self.next(10) == worker_pb2.GenerateStreamResponse()

    async def _open(self, url: str):
        self.channel = grpc.aio.insecure_channel(url)
        lane = await stream_lane.open_lane(self.channel, url, "GenerateStream", worker_pb2.GenerateStreamResponse,
                                           10)
        if lane is not None:
            self.reader = asyncio.ensure_future(self._read_lane(lane))
        return lane

    async def _read_lane(self, lane):
        try:
            while (batch := await lane.read()) is not grpc.aio.EOF:
                self.batches.put(batch)
        except grpc.aio.AioRpcError as e:
            self.batches.put(e)
        self.batches.put(None)

    def _send(self, msg):
        self.loop.call_soon_threadsafe(self.lane.write_nowait, msg)

    def submit(self, **kw):
        self._send(worker_pb2.GenerateStreamRequest(submit=worker_pb2.GenerateRequest(**kw)))

    def abort(self, rid: str):
        self._send(worker_pb2.GenerateStreamRequest(abort=rid))

    def close(self):
        self.cancel()

    def cancel(self):
        self.loop.call_soon_threadsafe(self.lane.cancel)


def open_stream(transport: str, stub) -> Stream:
    return Stream(stub) if transport == "grpc" else LaneStream(stub.url)


TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "lane"])


@TRANSPORTS
def test_outputs_equal_per_call_generate(worker, transport):
    prompts = {f"s{i}": list(range(20 + i, 50 + 2 * i)) for i in range(4)}
    expected = {}
    for rid, ids in prompts.items():
        msgs = list(worker.Generate(worker_pb2.GenerateRequest(request_id="ref-" + rid, input_ids=ids,
                                                               sampling_params=greedy(10), stream=True)))
        expected[rid] = [t for m in msgs for t in m.chunk.token_ids], msgs[-1].complete.text
    s = open_stream(transport, worker)
    for rid, ids in prompts.items():
        s.submit(request_id=rid, input_ids=ids, sampling_params=greedy(10), stream=True)
    s.submit(request_id="whole", input_ids=prompts["s0"], sampling_params=greedy(10))
    msgs, ends, shared = s.collect(set(prompts) | {"whole"})
    for rid in prompts:
        assert ends[rid] == (0, "")
        got = [t for m in msgs[rid] for t in m.chunk.token_ids]
        assert (got, msgs[rid][-1].complete.text) == expected[rid], rid
    assert [m.WhichOneof("response") for m in msgs["whole"]] == ["complete"]
    assert list(msgs["whole"][0].complete.output_ids) == expected["s0"][0]
    assert shared > 0, "no message carried outputs of several requests"
    s.close()
    assert used_after_flush(worker) == 0


@TRANSPORTS
def test_bad_request_ends_alone_and_abort_frees_pages(worker, transport):
    assert used_after_flush(worker) == 0
    s = open_stream(transport, worker)
    s.submit(request_id="long", input_ids=list(range(30, 90)), sampling_params=greedy(900, ignore_eos=True),
             stream=True)
    s.submit(request_id="", input_ids=[1, 2, 3], sampling_params=greedy(4))  # no request_id
    s.submit(request_id="ok", input_ids=[5, 6, 7], sampling_params=greedy(3))
    msgs, ends, _ = s.collect({"", "ok"})
    assert ends[""][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in ends[""][1]
    assert ends["ok"] == (0, "") and msgs["ok"][-1].complete.usage.completion_tokens == 3
    assert worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests == 1
    s.abort("long")
    deadline = time.monotonic() + 10
    while worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests:
        assert time.monotonic() < deadline, "the aborted request kept running"
        time.sleep(0.05)
    assert used_after_flush(worker) == 0
    # a closed stream aborts what is still running on it
    s.submit(request_id="left", input_ids=list(range(30, 90)), sampling_params=greedy(900, ignore_eos=True),
             stream=True)
    while worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests == 0:
        time.sleep(0.02)
    s.cancel()
    assert used_after_flush(worker) == 0
    assert worker.GetLoads(worker_pb2.GetLoadsRequest()).num_running_requests == 0


def test_router_falls_back_to_calls_for_a_worker_without_generate_stream(tmp_path):
    proc, tok = start_grpc("radixmesh.services.tokenizer", "--model-path", MODEL, "--served-model-name", "fake",
                           log=tmp_path / "tokenizer.log")
    mesh = Mesh(tok, tmp_path)
    try:
        old = mesh.worker("--no-generate-stream")
        base = mesh.router()
        for _ in range(3):
            status, body, _ = generate(base)
            assert status == 200 and body["output_ids"] == [0, 1, 2, 3], body
        status, body, _ = post(base, "/generate", {"text": "hi", "stream": True,
                                                   "sampling_params": {"max_new_tokens": 4}})
        assert status == 200 and body.count("data: ") == 6, body  # 4 tokens, the finish event, [DONE]
        assert mesh.calls(old) == 4  # each request came as a Generate call
    finally:
        mesh.close()
        stop(proc)


def test_sigterm_finishes_the_running_requests_then_ends_the_stream():
    """A draining worker answers what runs on the stream, refuses new submits (UNAVAILABLE: the router retries
    elsewhere) and ends the stream once idle, so it exits long before its 30 s grace period. One worker, a stream
    over gRPC and one over the stream lane side by side (each with its running request): both drained alike."""
    import signal

    proc, url = start("radixmesh.services.worker", "--shutdown-grace-s", "30")
    with grpc.insecure_channel(url) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        stub.url = url
        streams = {t: open_stream(t, stub) for t in ("grpc", "lane")}
        for t, s in streams.items():
            s.submit(request_id=f"running-{t}", input_ids=list(range(30, 60)),
                     sampling_params=greedy(800, ignore_eos=True), stream=True)
        for t, s in streams.items():
            first = s.next()
            assert first.responses[0].request_id == f"running-{t}"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for t, s in streams.items():
            s.submit(request_id=f"late-{t}", input_ids=[1, 2, 3], sampling_params=greedy(2))
        for t, s in streams.items():
            running, late = f"running-{t}", f"late-{t}"
            msgs, ends, _ = s.collect({running, late})
            assert ends[running] == (0, "")
            assert msgs[running][-1].complete.usage.completion_tokens == 800
            assert ends[late][0] == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in ends[late][1]
            assert s.next(30) is None, t  # the worker ended the stream
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 20, "the drain waited for the stream's grace period"
