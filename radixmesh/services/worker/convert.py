"""Proto <-> engine conversions for workers: GenerateRequest -> Engine.async_generate keyword arguments, and the
engine's typed outputs (engine.outputs.RequestOutput) -> GenerateStreamChunk / GenerateComplete; EmbedRequest ->
Engine.async_encode keyword arguments, and its results -> EmbedResponse."""

from __future__ import annotations

import math

from radixmesh.engine.outputs import Logprobs, RequestOutput
from radixmesh.engine.request import FinishKind, FinishReason, SpecCounts
from radixmesh.engine.sampling.params import FIELDS
from radixmesh.v1 import bootstrap_pb2, common_pb2, worker_pb2

# Every row of the sampling field table is a proto3 optional field of the same name.
_SCALARS = tuple(row.name for row in FIELDS)
_FINISH_TYPES = {FinishKind.STOP: common_pb2.FINISH_REASON_TYPE_STOP,
                 FinishKind.LENGTH: common_pb2.FINISH_REASON_TYPE_LENGTH,
                 FinishKind.ABORT: common_pb2.FINISH_REASON_TYPE_ABORT}


def sampling_dict(sp: common_pb2.SamplingParams) -> dict:
    """Only the fields the caller set: the engine fills the rest from the model's defaults, then SGLang's."""
    out = {name: getattr(sp, name) for name in _SCALARS if sp.HasField(name)}
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        out[constraint] = getattr(sp, constraint)
    return out


def engine_rid(req: worker_pb2.GenerateRequest) -> str:
    """The engine's id for a request: the request id, plus the bootstrap room for one side of a PD pair (a router
    retry reuses the request id with a new room, and the first attempt's pages may still be pinned)."""
    if req.HasField("disaggregated_params"):
        return f"{req.request_id}.{req.disaggregated_params.bootstrap_room:016x}"
    return req.request_id


def generate_kwargs(req: worker_pb2.GenerateRequest) -> dict:
    lp = req.logprob_options
    kwargs = {"input_ids": list(req.input_ids), "sampling_params": sampling_dict(req.sampling_params),
              "rid": engine_rid(req) or None, "tenant": req.tenant}
    if req.lora_path:
        kwargs["lora_path"] = req.lora_path
    if req.resume_output_ids:
        kwargs["resume_ids"] = list(req.resume_output_ids)
        kwargs["resume_text_chars"] = req.resume_text_chars
    if lp.return_logprob:
        kwargs.update(return_logprob=True, top_logprobs_num=lp.top_logprobs_num,
                      token_ids_logprob=list(lp.token_ids_logprob) or None,
                      return_text_in_logprobs=lp.return_text_in_logprobs,
                      logprob_start_len=lp.logprob_start_len if lp.HasField("logprob_start_len") else None)
    return kwargs


def embed_kwargs(req: worker_pb2.EmbedRequest) -> dict:
    """Always a batch (a list of id lists), so the engine answers with a list; each input's engine id is
    `<request_id>-<index>`."""
    return {"input_ids": [list(x.input_ids) for x in req.inputs],
            "dimensions": req.dimensions if req.HasField("dimensions") else None,
            "rid": [f"{req.request_id}-{i}" for i in range(len(req.inputs))], "tenant": req.tenant}


def embed_response(results: list[dict]) -> worker_pb2.EmbedResponse:
    return worker_pb2.EmbedResponse(embeddings=[
        worker_pb2.Embedding(values=r["embedding"], prompt_tokens=r["meta_info"]["prompt_tokens"],
                             cached_tokens=r["meta_info"]["cached_tokens"]) for r in results])


def _top(rows) -> list[common_pb2.TopLogprobs]:
    out = []
    for row in rows:
        if row is None:  # the first prompt token has no candidates
            out.append(common_pb2.TopLogprobs())
            continue
        out.append(common_pb2.TopLogprobs(token_ids=[t for _, t, _ in row], logprobs=[lp for lp, _, _ in row],
                                          texts=[x for _, _, x in row if x is not None]))
    return out


def _logprobs(msg_type, chosen, tops, by_ids):
    return msg_type(token_ids=[t for _, t, _ in chosen],
                    token_logprobs=[math.nan if lp is None else lp for lp, _, _ in chosen],
                    texts=[x for _, _, x in chosen if x is not None],
                    top_logprobs=_top(tops or []), token_ids_logprobs=_top(by_ids or []))


def output_logprobs(lp: Logprobs | None) -> common_pb2.OutputLogprobs | None:
    if lp is None:
        return None
    return _logprobs(common_pb2.OutputLogprobs, lp.output, lp.output_top, lp.output_by_id)


def input_logprobs(lp: Logprobs | None) -> common_pb2.InputLogprobs | None:
    if lp is None or not lp.input:
        return None
    return _logprobs(common_pb2.InputLogprobs, lp.input, lp.input_top, lp.input_by_id)


def finish_reason(reason: FinishReason | None) -> common_pb2.FinishReason | None:
    if reason is None:
        return None
    out = common_pb2.FinishReason(type=_FINISH_TYPES[reason.kind])
    if reason.kind is FinishKind.STOP:
        if isinstance(reason.matched, int):
            out.matched_token_id = reason.matched
        elif isinstance(reason.matched, str):
            out.matched_stop_str = reason.matched
    elif reason.kind is FinishKind.LENGTH:
        if reason.length is not None:
            out.length = reason.length
    elif reason.message:
        out.message = reason.message
    return out


def usage(out: RequestOutput) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                            cached_tokens=out.cached_tokens, spec=spec_info(out.spec))


def spec_info(spec: SpecCounts | None) -> common_pb2.SpecInfo | None:
    if spec is None:
        return None
    return common_pb2.SpecInfo(verify_ct=spec.verify_ct, draft_tokens=spec.draft_tokens,
                               accepted_tokens=spec.accepted_tokens)


def chunk(delta: RequestOutput, with_input_logprobs: bool) -> worker_pb2.GenerateStreamChunk:
    """A streamed segment (the engine runs with stream_output, so ids, text and logprobs are only the new ones)."""
    msg = worker_pb2.GenerateStreamChunk(token_ids=delta.output_ids, text=delta.text,
                                         prompt_tokens=delta.prompt_tokens,
                                         completion_tokens=delta.completion_tokens,
                                         cached_tokens=delta.cached_tokens)
    lp = delta.logprobs
    if lp is not None:
        msg.output_logprobs.CopyFrom(output_logprobs(lp))
    if delta.finish_reason is not None:
        msg.finish_reason.CopyFrom(finish_reason(delta.finish_reason))
    if delta.spec is not None:
        msg.spec.CopyFrom(spec_info(delta.spec))
    in_lp = input_logprobs(lp) if with_input_logprobs else None
    if in_lp is not None:
        msg.input_logprobs.CopyFrom(in_lp)
    return msg


def complete(output_ids: list[int], text: str, out: RequestOutput, with_logprobs: bool
             ) -> worker_pb2.GenerateComplete:
    """A sample's whole output (`output_ids` and `text`: a streamed sample's chunks joined); usage and finish reason
    from `out`, its last output; with_logprobs: `out`'s logprobs (a whole result's) too."""
    msg = worker_pb2.GenerateComplete(output_ids=output_ids, text=text, usage=usage(out),
                                      finish_reason=finish_reason(out.finish_reason))
    if with_logprobs:
        out_lp, in_lp = output_logprobs(out.logprobs), input_logprobs(out.logprobs)
        if out_lp is not None:
            msg.output_logprobs.CopyFrom(out_lp)
        if in_lp is not None:
            msg.input_logprobs.CopyFrom(in_lp)
    return msg


# ---- prefill/decode handoff: the first token and its logprobs in KvReady -------------------------------------------
def _pairs_msg(pairs) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=[t for _, t in pairs], logprobs=[lp for lp, _ in pairs])


def _msg_pairs(msg: common_pb2.TopLogprobs) -> list[tuple[float, int]]:
    return list(zip(msg.logprobs, msg.token_ids))


def draft_wanted_msg(wanted) -> bootstrap_pb2.DraftStateWanted:
    """engine.disaggregation.draft_state.DraftWanted -> DraftStateWanted."""
    return bootstrap_pb2.DraftStateWanted(format=wanted.format, layers=list(wanted.layers), width=wanted.width,
                                          kv_row_bytes=list(wanted.kv_row_bytes), start=wanted.start)


def draft_wanted(msg: bootstrap_pb2.DraftStateWanted):
    from radixmesh.engine.disaggregation.draft_state import DraftWanted

    return DraftWanted(msg.start, tuple(msg.layers), msg.width, tuple(msg.kv_row_bytes), msg.format)


def draft_state_msg(state) -> bootstrap_pb2.DraftState:
    """engine.disaggregation.draft_state.DraftState -> DraftState (format 1)."""
    from radixmesh.engine.disaggregation.draft_state import DRAFT_FORMAT

    return bootstrap_pb2.DraftState(format=DRAFT_FORMAT, layers=list(state.layers), width=state.width,
                                    kv_row_bytes=list(state.kv_row_bytes), kv_start=state.kv_start,
                                    kv_rows=state.kv_rows, hidden_position=state.hidden_position, **state.to_wire())


def draft_state(msg: bootstrap_pb2.DraftState):
    """DraftState -> engine.disaggregation.draft_state.DraftState; ValueError when malformed."""
    from radixmesh.engine.disaggregation.draft_state import DraftState

    return DraftState.from_wire(msg.format, tuple(msg.layers), msg.width, tuple(msg.kv_row_bytes), msg.kv_start,
                                msg.kv_rows, msg.kv, msg.kv_read_features, msg.hidden_position, msg.dtype, msg.hidden)


def kv_ready(first, draft=None) -> bootstrap_pb2.KvReady:
    """engine.disaggregation.handoff.FirstToken -> KvReady (without checksum and transfer figures); `draft`: the
    draft state to send (engine.disaggregation.draft_state.DraftState), if any."""
    msg = bootstrap_pb2.KvReady(first_token_id=first.token_id, cached_tokens=first.cached_tokens,
                                top_logprobs=_pairs_msg(first.top_logprobs),
                                token_ids_logprobs=_pairs_msg(first.token_ids_logprobs),
                                input_logprobs=first.input_logprobs,
                                input_top_logprobs=[_pairs_msg(r) for r in first.input_top_logprobs],
                                input_token_ids_logprobs=[_pairs_msg(r) for r in first.input_token_ids_logprobs])
    if first.logprob is not None:
        msg.logprob = first.logprob
    if draft is not None:
        msg.draft_state.CopyFrom(draft_state_msg(draft))
    return msg


def first_token(msg) -> "FirstToken":
    """KvReady -> engine.disaggregation.handoff.FirstToken (with its draft state; ValueError when malformed)."""
    from radixmesh.engine.disaggregation.handoff import FirstToken

    return FirstToken(msg.first_token_id, msg.cached_tokens, msg.logprob if msg.HasField("logprob") else None,
                      _msg_pairs(msg.top_logprobs), _msg_pairs(msg.token_ids_logprobs), list(msg.input_logprobs),
                      [_msg_pairs(r) for r in msg.input_top_logprobs],
                      [_msg_pairs(r) for r in msg.input_token_ids_logprobs],
                      draft_state(msg.draft_state) if msg.HasField("draft_state") else None)


_TIERS = {1: worker_pb2.KV_TIER_DEVICE, 2: worker_pb2.KV_TIER_HOST}


def kv_event(event, sequence: int | None = None) -> worker_pb2.SubscribeKvEventsResponse:
    """An engine KvEvent as the SubscribeKvEvents message (`sequence` overrides the event's, for snapshots)."""
    from radixmesh.engine.cache.kv_events import EventKind

    out = worker_pb2.SubscribeKvEventsResponse(sequence=event.sequence if sequence is None else sequence)
    if event.kind is EventKind.STORED:
        out.stored.CopyFrom(worker_pb2.KvPagesStored(page_hashes=event.page_keys, parent_hash=event.parent_key,
                                                     token_ids=event.token_ids, page_size=event.page_size,
                                                     tier=_TIERS[int(event.tier)]))
    elif event.kind is EventKind.REMOVED:
        out.removed.CopyFrom(worker_pb2.KvPagesRemoved(page_hashes=event.page_keys, tier=_TIERS[int(event.tier)]))
    else:
        out.cleared.SetInParent()
    return out
