"""The Engine's embedding API edges (Engine.encode / async_encode): inputs into validated request specs, and
finished requests into SGLang-shaped results `{"embedding": [...], "meta_info": {...}}`."""

from __future__ import annotations

from radixmesh.engine.request import StepOutput
from radixmesh.engine.results import RequestSpec, all_ints


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all_ints(x)


def split_inputs(prompt, input_ids):
    """SGLang's encode takes text or token ids as `prompt`; `input_ids` names ids explicitly. Returns
    (prompt, input_ids) with exactly one set, token ids moved to input_ids; ValueError when both or neither."""
    if prompt is not None and input_ids is not None:
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is None:
        if input_ids is None:
            raise ValueError("give exactly one of prompt and input_ids")
        return None, input_ids
    if _is_ids(prompt) or (isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt)):
        return None, prompt
    return prompt, None


class EmbeddingCollector:
    """One encode call's outputs, by request index: done once every request has finished."""

    def __init__(self, specs: list[RequestSpec], dimensions: int | None):
        self.specs, self.dimensions = specs, dimensions
        self.outputs: list[StepOutput | None] = [None] * len(specs)
        self.remaining = len(specs)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def record(self, i: int, out: StepOutput) -> None:
        if out.finished and self.outputs[i] is None:
            self.outputs[i] = out
            self.remaining -= 1

    def results(self) -> list[dict]:
        """The finished requests' results, in order; RuntimeError when one was aborted (its reason)."""
        return [self._result(spec, out) for spec, out in zip(self.specs, self.outputs)]

    def _result(self, spec: RequestSpec, out: StepOutput) -> dict:
        if out.embedding is None:
            reason = out.finish_reason.message if out.finish_reason is not None else None
            raise RuntimeError(f"embedding request {spec.rid} did not finish: {reason or 'aborted'}")
        vector = out.embedding if self.dimensions is None else renormalized(out.embedding[:self.dimensions])
        return {"embedding": vector, "meta_info": {"id": spec.rid, "prompt_tokens": out.prompt_tokens,
                                                   "cached_tokens": out.cached_tokens}}


def renormalized(values: list[float]) -> list[float]:
    """A truncated (Matryoshka) vector scaled back to unit length."""
    import torch

    return torch.nn.functional.normalize(torch.tensor(values, dtype=torch.float32), dim=0).tolist()
