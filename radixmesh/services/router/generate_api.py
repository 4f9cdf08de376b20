"""SGLang's native `POST /generate`: text or input_ids (one or a batch), sampling_params, stream, return_logprob,
logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs, rid. Output as SGLang's:
{"text", "output_ids", "meta_info"}; streams are SSE events of the cumulative output (SGLang's default), ending
with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.request import FinishReason
from radixmesh.engine.results import all_ints, sample_rids
from radixmesh.v1 import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.logs import request_id_var
from radixmesh.services.router import convert
from radixmesh.services.router.core import Router, RouterError, new_request_id

_KEYS = frozenset({"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "rid", "lora_path"})


@dataclass(slots=True)
class _Sample:
    """One sample's output as it accumulates (for cumulative streaming and the final dict)."""

    rid: str
    want_logprobs: bool = False  # the request asked for logprobs (only then can a message carry them)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    top: list = field(default_factory=list)
    by_id: list = field(default_factory=list)
    input_lp: list = field(default_factory=list)
    input_top: list = field(default_factory=list)
    input_by_id: list = field(default_factory=list)
    usage: tuple[int, int, int] = (0, 0, 0)
    finish: FinishReason | None = None  # None: still running
    spec: common_pb2.SpecInfo | None = None  # speculative decoding's totals, when the worker speculates

    def add_output(self, lp: common_pb2.OutputLogprobs) -> None:
        self.logprobs += convert.triples(lp.token_ids, lp.token_logprobs, lp.texts)
        self.top += convert.top_rows(lp.top_logprobs)
        self.by_id += convert.top_rows(lp.token_ids_logprobs)

    def set_input(self, lp: common_pb2.InputLogprobs) -> None:
        self.input_lp = convert.triples(lp.token_ids, lp.token_logprobs, lp.texts)
        self.input_top = convert.top_rows(lp.top_logprobs)
        self.input_by_id = convert.top_rows(lp.token_ids_logprobs)

    def on_message(self, msg: worker_pb2.GenerateResponse, kind: str) -> None:
        """`kind`: msg.WhichOneof("response"), which the caller has read (each upb field read costs; a repeated
        field is copied through a slice, a third of what iterating it costs)."""
        if kind == "chunk":
            c = msg.chunk
            self.ids += c.token_ids[:]
            self.text += c.text
            self.usage = (c.prompt_tokens, c.completion_tokens, c.cached_tokens)
            if self.want_logprobs:
                if c.HasField("output_logprobs"):
                    self.add_output(c.output_logprobs)
                if c.HasField("input_logprobs"):
                    self.set_input(c.input_logprobs)
            if c.HasField("finish_reason"):
                self.finish = convert.finish_reason(c.finish_reason)
            if c.HasField("spec"):
                self.spec = c.spec
        elif kind == "complete":
            c = msg.complete
            self.ids, self.text = c.output_ids[:], c.text
            self.usage = (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens)
            self.finish = convert.finish_reason(c.finish_reason)
            if c.usage.HasField("spec"):
                self.spec = c.usage.spec
            if c.HasField("output_logprobs"):
                self.logprobs, self.top, self.by_id = [], [], []
                self.add_output(c.output_logprobs)
            if c.HasField("input_logprobs"):
                self.set_input(c.input_logprobs)

    def result(self, lp: common_pb2.LogprobOptions) -> dict:
        finish = self.finish.to_dict() if self.finish is not None else None
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": finish, "prompt_tokens": self.usage[0],
                                "completion_tokens": self.usage[1], "cached_tokens": self.usage[2]}
        if self.spec is not None:
            meta.update(convert.spec_meta(self.spec))
        if lp.return_logprob:
            meta.update(output_token_logprobs=self.logprobs, input_token_logprobs=self.input_lp)
            if lp.top_logprobs_num:
                meta.update(output_top_logprobs=self.top, input_top_logprobs=self.input_top)
            if lp.token_ids_logprob:
                meta.update(output_token_ids_logprobs=self.by_id, input_token_ids_logprobs=self.input_by_id)
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


def _logprob_options(body: dict) -> common_pb2.LogprobOptions:
    lp = common_pb2.LogprobOptions(return_logprob=_bool(body, "return_logprob"),
                                   return_text_in_logprobs=_bool(body, "return_text_in_logprobs"))
    for key in ("logprob_start_len", "top_logprobs_num"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{key} must be an integer, got {v!r}")
            setattr(lp, key, v)
    ids = body.get("token_ids_logprob")
    if ids is not None:
        if not isinstance(ids, list) or not all_ints(ids):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {ids!r}")
        lp.token_ids_logprob.extend(ids)
    return lp


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """One prompt of a /generate call. `rid` is the client's id (meta_info.id); workers get an id the router mints,
    so two clients' ids can never collide there."""

    text: str | None
    input_ids: list[int] | None
    sampling: common_pb2.SamplingParams
    rid: str
    lora: str = ""  # the LoRA adapter's name (empty: the base model)

    @property
    def n(self) -> int:
        return self.sampling.n if self.sampling.HasField("n") else 1

    def sample_rid(self, index: int) -> str:
        """The engine's id for sample `index` of this rid (meta_info.id)."""
        return sample_rids(self.rid, self.n)[index]


def parse(body: Any) -> tuple[list[GenerateJob], bool, bool, common_pb2.LogprobOptions]:
    """Returns (jobs, is_batch, stream, logprob options); ValueError names what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    unknown = [] if _KEYS.issuperset(body) else sorted(set(body) - _KEYS)
    if unknown:
        raise ValueError(f"unsupported field(s): {', '.join(unknown)}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of text and input_ids")
    is_batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    texts = (text if isinstance(text, list) else [text]) if text is not None else None
    id_lists = (ids if is_batch else [ids]) if ids is not None else None
    n = len(texts if texts is not None else id_lists)
    if n == 0:
        raise ValueError("the batch is empty")
    if texts is not None and not all(isinstance(t, str) and t for t in texts):
        raise ValueError("text must be a non-empty string or a list of them")
    if id_lists is not None and not all(isinstance(x, list) and x and all_ints(x) for x in id_lists):
        raise ValueError("input_ids must be a non-empty list of token ids or a list of them")
    raw = body.get("sampling_params")
    raw_list = raw if isinstance(raw, list) else [raw] * n
    if len(raw_list) != n:
        raise ValueError(f"sampling_params has {len(raw_list)} entries for {n} prompts")
    rids = body.get("rid")
    rid_list = rids if isinstance(rids, list) else [rids] * n
    if len(rid_list) != n or (isinstance(rids, str) and n > 1) or not all(r is None or isinstance(r, str)
                                                                           for r in rid_list):
        raise ValueError("rid must be a string (a list of strings, one per prompt, for a batch)")
    loras = body.get("lora_path")
    lora_list = loras if isinstance(loras, list) else [loras] * n
    if len(lora_list) != n or not all(x is None or isinstance(x, str) for x in lora_list):
        raise ValueError("lora_path must be an adapter's name (a list of names or nulls, one per prompt, for a "
                         "batch)")
    jobs = [GenerateJob(texts[i] if texts else None, id_lists[i] if id_lists else None,
                        convert.sampling_params(raw_list[i]), rid_list[i] or new_request_id(), lora_list[i] or "")
            for i in range(n)]
    return jobs, is_batch, _bool(body, "stream"), _logprob_options(body)


async def worker_request(router: Router, job: GenerateJob, lp: common_pb2.LogprobOptions, stream: bool,
                         tenant: str) -> worker_pb2.GenerateRequest:
    worker_rid = new_request_id()
    request_id_var.set(worker_rid)
    tracing.set_attribute("request_id", worker_rid)
    ids = job.input_ids
    if ids is None and not router.routes_text():
        ids = list((await router.tokenize(tokenizer_pb2.TokenizeRequest(text=job.text))).input_ids)
    return worker_pb2.GenerateRequest(request_id=worker_rid, input_ids=ids, text=job.text or "",
                                      sampling_params=job.sampling, logprob_options=lp, stream=stream,
                                      tenant=tenant, lora_path=job.lora)


async def run_whole(router: Router, job: GenerateJob, lp: common_pb2.LogprobOptions, tenant: str) -> list[dict]:
    """Every sample's final dict (n > 1 gives several)."""
    samples: dict[int, _Sample] = {}
    request = await worker_request(router, job, lp, stream=False, tenant=tenant)
    want = lp.return_logprob
    async with contextlib.aclosing(router.generate(request)) as messages:  # (no generator of ours between)
        async for msg in messages:
            _feed(samples, job, msg, want)
    return [samples[i].result(lp) for i in sorted(samples)]


async def _updates(router: Router, job: GenerateJob, request: worker_pb2.GenerateRequest,
                   samples: dict[int, _Sample], want_logprobs: bool):
    """Feeds the worker's messages into `samples` (by index), yielding (index, message kind) after each."""
    async with contextlib.aclosing(router.generate(request)) as messages:
        async for msg in messages:
            yield _feed(samples, job, msg, want_logprobs)


def _feed(samples: dict[int, _Sample], job: GenerateJob, msg: worker_pb2.GenerateResponse,
          want_logprobs: bool) -> tuple[int, str]:
    """One worker message into its sample (made on its first message): (the sample's index, the message's kind)."""
    kind = msg.WhichOneof("response")
    if kind == "error":
        raise RouterError(msg.error.http_status_code or 500, msg.error.message)
    index = msg.index
    sample = samples.get(index)
    if sample is None:  # (not setdefault: that would build a _Sample for every message)
        sample = samples[index] = _Sample(job.sample_rid(index), want_logprobs)
    sample.on_message(msg, kind)
    return index, kind


async def run_batch(router: Router, jobs: list[GenerateJob], lp: common_pb2.LogprobOptions,
                    tenant: str) -> list[dict]:
    """Every prompt's results in order. When one prompt fails, the others are cancelled (their KV freed at once)
    and the failure is raised."""
    if len(jobs) == 1:
        return await run_whole(router, jobs[0], lp, tenant)
    tasks = [asyncio.create_task(run_whole(router, j, lp, tenant)) for j in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        return [r for t in tasks for r in t.result()]
    finally:
        for t in tasks:
            t.cancel()


async def stream_events(router: Router, job: GenerateJob, request: worker_pb2.GenerateRequest,
                        lp: common_pb2.LogprobOptions, index_offset: int | None = None):
    """Cumulative SGLang stream events for one prompt (`request` from worker_request(stream=True)): one per worker
    chunk, the last one with finish_reason. Events carry `index` (offset by index_offset) in a batch or when n > 1."""
    samples: dict[int, _Sample] = {}
    tag = index_offset is not None or job.n > 1
    finished: set[int] = set()
    async with contextlib.aclosing(_updates(router, job, request, samples, lp.return_logprob)) as updates:
        async for index, kind in updates:
            if kind == "complete" and index in finished:
                continue  # the last chunk already carried the finish reason
            sample = samples[index]
            if sample.finish is not None:
                finished.add(index)
            event = sample.result(lp)
            if tag:
                event["index"] = (index_offset or 0) + index
            yield event
