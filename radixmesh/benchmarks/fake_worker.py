"""`python -m radixmesh.benchmarks.fake_worker --port W [--tokens N]`: a WorkerService that answers at once, for
measuring the router alone. Generate returns N tokens (sampling_params.max_new_tokens caps N when set): with stream=true
one chunk per token (id i % 1000, text " tok") then one `complete`; with stream=false only the `complete`.
No model, no sleeping: per token it costs one protobuf message, far less than the router spends forwarding it. Between
tokens it yields to the event loop, so concurrent requests' tokens interleave as a scheduler's steps make them (one
token of each running request per step): GenerateStream then carries a step's tokens together, as a real worker's
does, not a whole answer in one message.

With --enable-lora it keeps LoRA adapters in memory (FakeLora): --lora-paths NAME=DIR at start, LoadLoraAdapter and
UnloadLoraAdapter at run time with a real worker's answers (ALREADY_EXISTS, NOT_FOUND, INVALID_ARGUMENT for a folder
that does not exist or LoRA off), a load taking --lora-load-delay-s (as reading the weights does); a Generate naming
an adapter not loaded is refused as the engine refuses it, and GetServerInfo counts the calls per adapter."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import grpc

from radixmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from radixmesh.services.common import generate_mux
from radixmesh.services.common.chat_render import template_sha256
from radixmesh.services.common.logs import setup_logging
from radixmesh.services.common.server import GrpcService, LaneGrpcSettings

TOKEN_TEXT = " tok"
VOCAB = 1000
_LENGTH = common_pb2.FINISH_REASON_TYPE_LENGTH


def token_ids(n: int) -> list[int]:
    """The ids the fake generates for an n-token answer (what the benchmark checks against)."""
    return [i % VOCAB for i in range(n)]


class FakeLora:
    """A worker's LoRA adapters, in memory: name -> the directory it was loaded from (no weights are read)."""

    def __init__(self, enabled: bool = False, paths: list[str] | None = None, load_delay_s: float = 0.0):
        self.enabled = enabled
        self.load_delay_s = load_delay_s
        self.paths: dict[str, str] = {}
        for entry in paths or ():  # SGLang's --lora-paths: NAME=DIR, or DIR named by itself
            name, sep, path = entry.partition("=")
            self.paths[name] = path if sep else entry
        self.calls: dict[str, int] = {}  # adapter -> Generate calls that ran with it

    def adapters(self) -> list[worker_pb2.LoraAdapter]:
        return [worker_pb2.LoraAdapter(lora_name=n, lora_path=p) for n, p in sorted(self.paths.items())]

    def use(self, name: str) -> None:
        """A Generate call runs with adapter `name` (""; the base model); ValueError for one not loaded."""
        if not name:
            return
        if name not in self.paths:
            loaded = ", ".join(sorted(self.paths)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        self.calls[name] = self.calls.get(name, 0) + 1

    async def load(self, request, context):
        name, path = request.lora_name, request.lora_path
        if not self.enabled:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoRA adapters need a worker started with "
                                "--enable-lora")
        if not name or not os.path.isdir(path):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"LoRA adapter {path}: no such directory")
        if name in self.paths:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a LoRA adapter named {name!r} is already loaded")
        await asyncio.sleep(self.load_delay_s)
        if name in self.paths:  # loaded by another call meanwhile (the engine checks again, too)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"a LoRA adapter named {name!r} is already loaded")
        self.paths[name] = path
        return worker_pb2.LoadLoraAdapterResponse(adapters=self.adapters())

    async def unload(self, request, context):
        path = self.paths.pop(request.lora_name, None)
        if path is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.lora_name!r} is loaded")
        return worker_pb2.UnloadLoraAdapterResponse(lora_path=path, adapters=self.adapters())

    def listing(self) -> worker_pb2.ListLoraAdaptersResponse:
        return worker_pb2.ListLoraAdaptersResponse(enabled=self.enabled, adapters=self.adapters())


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Also a stand-in for failure tests: `delay_s` before answering, the first `fail_first` Generate calls refused
    with UNAVAILABLE, a prefill or decode `mode` (PD routing); GetServerInfo reports the Generate calls it got."""

    def __init__(self, tokens: int, model_name: str, delay_s: float = 0.0, fail_first: int = 0, mode: str = "null",
                 no_generate_stream: bool = False, token_gap_s: float | None = 0.0,
                 die_after_last_chunk: bool = False, tokenizes_text: bool = False, chat_template_sha256: str = "",
                 lora: FakeLora | None = None):
        self.tokens = tokens
        self.model_name = model_name
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.mode = mode
        self.no_generate_stream = no_generate_stream
        self.token_gap_s = token_gap_s  # None: no step between tokens (an answer leaves in one message batch)
        self.die_after_last_chunk = die_after_last_chunk  # the process exits between a stream's last chunk and its end
        # takes text-only requests, as a worker with a tokenizer does (its words stand in for the prompt's tokens)
        self.tokenizes_text = tokenizes_text
        self.chat_template_sha256 = chat_template_sha256  # with tokenizes_text: it takes chat prompts rendered so
        self.lora = lora or FakeLora()
        self.draining: asyncio.Event | None = None
        self.calls = 0

    def _count(self, request: worker_pb2.GenerateRequest) -> int:
        sp = request.sampling_params
        return min(self.tokens, sp.max_new_tokens) if sp.HasField("max_new_tokens") else self.tokens

    async def Generate(self, request, context):
        async for msg in generate_mux.messages(self.generate, request, context):
            yield msg

    def generate(self, request, context, emit):
        """Counts the call as it arrives (a PD router cancels the prefill call once the fake decode side has
        answered, which can be before the answering coroutine first runs), then returns that coroutine."""
        self.calls += 1
        return self._answer(request, context, emit, self.calls)

    async def _answer(self, request, context, emit, call: int) -> None:
        if call <= self.fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"fake failure {call} of {self.fail_first}")
        self.lora.use(request.lora_path)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        n, rid, prompt = self._count(request), request.request_id, len(request.input_ids)
        if not prompt:
            if not self.tokenizes_text:
                raise ValueError("input_ids is empty (this fake tokenizes no text)")
            prompt = (sum(len(m.content.split()) for m in request.chat.messages) if request.HasField("chat")
                      else len(request.text.split()))
        ids = token_ids(n)
        if request.stream:
            for i, tok in enumerate(ids):
                chunk = worker_pb2.GenerateStreamChunk(token_ids=[tok], text=TOKEN_TEXT, prompt_tokens=prompt,
                                                       completion_tokens=i + 1)
                if i == n - 1 and self.die_after_last_chunk:  # the finish reason on the last chunk, as a worker's
                    chunk.finish_reason.CopyFrom(common_pb2.FinishReason(type=_LENGTH, length=n))
                emit(worker_pb2.GenerateResponse(request_id=rid, chunk=chunk))
                if self.token_gap_s is not None:
                    await asyncio.sleep(self.token_gap_s)  # the next "step"
            if self.die_after_last_chunk:
                await asyncio.sleep(0.3)  # the chunks leave; then the process dies before the `complete`
                os._exit(1)
        usage = common_pb2.Usage(prompt_tokens=prompt, completion_tokens=n)
        emit(worker_pb2.GenerateResponse(request_id=rid, complete=worker_pb2.GenerateComplete(
            output_ids=ids, text=TOKEN_TEXT * n, usage=usage,
            finish_reason=common_pb2.FinishReason(type=_LENGTH, length=n))))

    async def GenerateStream(self, requests, context):
        if self.no_generate_stream:  # as a worker of an older release would answer
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        async for batch in generate_mux.serve(requests, context, self.generate, self.draining):
            yield batch

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=False)

    async def GetLoads(self, request, context):
        return worker_pb2.GetLoadsResponse()

    async def HealthCheck(self, request, context):
        return worker_pb2.HealthCheckResponse(healthy=True, message="fake")

    async def GetModelInfo(self, request, context):
        return worker_pb2.GetModelInfoResponse(
            model_path=self.model_name, tokenizer_path=self.model_name, is_generation=True,
            served_model_name=self.model_name, max_context_length=4096, vocab_size=VOCAB, model_type="fake",
            eos_token_ids=[], preferred_sampling_params="{}", max_total_num_tokens=1 << 20,
            disaggregation_mode=self.mode, tokenizes_text=self.tokenizes_text,
            chat_template_sha256=self.chat_template_sha256)

    async def GetServerInfo(self, request, context):
        return worker_pb2.GetServerInfoResponse(server_info_json=json.dumps({"generate_calls": self.calls,
                                                                             "lora_calls": self.lora.calls}))

    async def LoadLoraAdapter(self, request, context):
        return await self.lora.load(request, context)

    async def UnloadLoraAdapter(self, request, context):
        return await self.lora.unload(request, context)

    async def ListLoraAdapters(self, request, context):
        return self.lora.listing()

    async def FlushCache(self, request, context):
        return worker_pb2.FlushCacheResponse(success=True)


def _template_sha256(model_dir: str) -> str:
    """The SHA-256 of a model folder's chat template, as a worker with its tokenizer reports it: chat_template.jinja,
    else tokenizer_config.json's chat_template (the one named "default" of several)."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return template_sha256(fh.read())
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as fh:
        template = json.load(fh).get("chat_template") or ""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default") or ""
    return template_sha256(template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer when max_new_tokens is unset")
    parser.add_argument("--served-model-name", default="fake")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait before each answer")
    parser.add_argument("--fail-first", type=int, default=0, help="refuse the first N Generate calls (UNAVAILABLE)")
    parser.add_argument("--token-gap-s", type=float, default=0.0,
                        help="wait between streamed tokens (0: just yield to the event loop, a step of its own)")
    parser.add_argument("--burst", action="store_true",
                        help="no step between streamed tokens: a whole answer leaves in one GenerateStream message")
    parser.add_argument("--disaggregation-mode", default="null", choices=("null", "prefill", "decode"))
    parser.add_argument("--no-generate-stream", action="store_true",
                        help="answer GenerateStream with UNIMPLEMENTED, as a worker of an older release")
    parser.add_argument("--die-after-last-chunk", action="store_true",
                        help="exit after a streamed answer's last chunk, before its `complete` (a fault)")
    parser.add_argument("--tokenizes-text", action="store_true",
                        help="take text-only requests, as a worker with a tokenizer does (the router then sends text)")
    parser.add_argument("--chat-template-of", default=None, metavar="MODEL_DIR",
                        help="with --tokenizes-text: take chat prompts too, reporting that model's chat template (the "
                             "router then sends chat prompts whose template is its tokenizer service's)")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (kept in memory: no weights)")
    parser.add_argument("--lora-paths", nargs="*", default=[], metavar="NAME=DIR", help="adapters loaded at start")
    parser.add_argument("--lora-load-delay-s", type=float, default=0.0, help="how long a LoadLoraAdapter takes")
    args = parser.parse_args(argv)
    setup_logging("fake-worker", args.log_level)
    servicer = FakeWorker(args.tokens, args.served_model_name, args.delay_s, args.fail_first,
                          args.disaggregation_mode, args.no_generate_stream, None if args.burst else args.token_gap_s,
                          args.die_after_last_chunk, args.tokenizes_text,
                          _template_sha256(args.chat_template_of) if args.chat_template_of else "",
                          FakeLora(args.enable_lora, args.lora_paths if args.enable_lora else [],
                                   args.lora_load_delay_s))

    def register(server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    settings = LaneGrpcSettings(args.host, args.port, shutdown_grace_s=1.0, log_level=args.log_level)
    asyncio.run(_serve(settings, register, servicer))


async def _serve(settings: LaneGrpcSettings, register, servicer) -> None:
    # a worker of an older release has no stream lanes either
    lanes = None if servicer.no_generate_stream else {
        "GenerateStream": (servicer.GenerateStream, worker_pb2.GenerateStreamRequest)}
    service = GrpcService(settings, register, lanes=lanes)
    servicer.draining = service.draining
    await service.run_until_signal()


if __name__ == "__main__":
    sys.exit(main())
