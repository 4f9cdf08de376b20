"""Router-side conversions between SGLang's JSON (`sampling_params`, `meta_info`) and the protobuf contract; a
worker's finish reason becomes the engine's typed FinishReason, a dict only in the JSON the router writes; a public
gRPC Generate request becomes the worker's GenerateRequest."""

from __future__ import annotations

import json
import math
from typing import Any

from radixmesh.engine.request import FinishKind, FinishReason, SpecCounts
from radixmesh.v1 import common_pb2, router_pb2, worker_pb2
from radixmesh.services.router.openai_request import sample_seed_error
from radixmesh.services.router.request_fields import token_key
from radixmesh.services.router.sampling_fields import GENERATE_ROWS, checked_int, finite_float, generate_value

# The scalar fields come from the field table; these have shapes of their own.
_STRUCTURED = ("stop", "stop_token_ids", "logit_bias", "json_schema", "regex", "ebnf")
SUPPORTED = frozenset((*GENERATE_ROWS, *_STRUCTURED))
_FINISH = {common_pb2.FINISH_REASON_TYPE_STOP: FinishKind.STOP, common_pb2.FINISH_REASON_TYPE_LENGTH: FinishKind.LENGTH,
           common_pb2.FINISH_REASON_TYPE_ABORT: FinishKind.ABORT}
INT32_MAX = 2**31 - 1


def _int(name: str, v: Any, lo: int = -INT32_MAX, hi: int = INT32_MAX) -> int:
    return checked_int(f"sampling_params.{name}", v, lo, hi)


def _float(name: str, v: Any) -> float:
    return finite_float(f"sampling_params.{name}", v)


def sampling_params(d: Any) -> common_pb2.SamplingParams:
    """SGLang's sampling_params dict -> proto. Types are checked here; value ranges by the engine."""
    if d is None:
        return common_pb2.SamplingParams()
    if not isinstance(d, dict):
        raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
    unknown = [] if SUPPORTED.issuperset(d) else sorted(k for k in d if k not in SUPPORTED)
    if unknown:
        raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}; supported: "
                         f"{', '.join(sorted(SUPPORTED))}")
    sp = common_pb2.SamplingParams()
    for k, v in d.items():
        if v is None:
            continue
        row = GENERATE_ROWS.get(k)
        if row is not None:
            setattr(sp, k, generate_value(row, v))
        elif k in ("json_schema", "regex", "ebnf"):
            setattr(sp, k, json.dumps(v) if k == "json_schema" and isinstance(v, dict) else _str(k, v))
        elif k == "stop":
            stops = [v] if isinstance(v, str) else v
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {v!r}")
            sp.stop.extend(stops)
        elif k == "stop_token_ids":
            if not isinstance(v, list):
                raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got {v!r}")
            sp.stop_token_ids.extend(_int(k, t, 0) for t in v)
        elif k == "logit_bias":
            _logit_bias(sp, v)
    seed_error = sample_seed_error(sp)
    if seed_error:
        raise ValueError(f"sampling_params: {seed_error}")
    return sp


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"sampling_params.{name} must be a string, got {v!r}")
    return v


def _logit_bias(sp: common_pb2.SamplingParams, v: Any) -> None:
    if not isinstance(v, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {v!r}")
    for tok, bias in v.items():
        tok_id = token_key(tok)
        if tok_id is None:
            raise ValueError(f"logit_bias key {tok!r} is not a token id")
        sp.logit_bias[_int("logit_bias", tok_id, 0)] = _float("logit_bias", bias)


def finish_reason(fr: common_pb2.FinishReason) -> FinishReason:
    """The engine's FinishReason of a worker's message (an unspecified type reads as an abort)."""
    kind = _FINISH.get(fr.type, FinishKind.ABORT)
    if kind is FinishKind.STOP:
        which = fr.WhichOneof("matched")
        return FinishReason(kind, matched=getattr(fr, which) if which else None)
    if kind is FinishKind.LENGTH:
        return FinishReason(kind, length=fr.length)
    return FinishReason(kind, message=fr.message)


def spec_meta(spec: common_pb2.SpecInfo) -> dict:
    """meta_info's spec_* keys from a worker's totals, as the engine writes them."""
    return SpecCounts(spec.verify_ct, spec.draft_tokens, spec.accepted_tokens).meta_info()


def _texts(texts, n: int) -> list:
    return list(texts) if len(texts) == n else [None] * n


def triples(ids, logprobs, texts) -> list[list]:
    """SGLang's [logprob, token id, text-or-None] rows; NaN (the first prompt token) becomes None."""
    return [[None if math.isnan(lp) else lp, t, x] for lp, t, x in zip(logprobs, ids, _texts(texts, len(ids)))]


def top_rows(rows) -> list:
    """Per position a list of triples; an empty row (the first prompt token) becomes None."""
    return [triples(r.token_ids, r.logprobs, r.texts) if len(r.token_ids) else None for r in rows]


def worker_request(req: router_pb2.RouterServiceGenerateRequest, request_id: str, input_ids: list[int], tenant: str,
                   model_lora: str = "") -> worker_pb2.GenerateRequest:
    """The worker's request for a public gRPC Generate call, its prompt tokenized (`input_ids`; empty: the worker
    tokenizes `text`), in `tenant`'s
    namespace, with its LoRA adapter: `lora_path`, else `model_lora`, the one its `model` names (ValueError when
    the two name different adapters)."""
    if req.lora_path and model_lora and req.lora_path != model_lora:
        raise ValueError(f"lora_path {req.lora_path!r} and model {req.model!r} name different LoRA adapters")
    return worker_pb2.GenerateRequest(
        request_id=request_id, input_ids=input_ids, text=req.text, sampling_params=req.sampling_params,
        logprob_options=req.logprob_options, stream=req.stream, tenant=tenant, lora_path=req.lora_path or model_lora)
