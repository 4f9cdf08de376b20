"""Different backends for prefill and decode (SGLang's --prefill-attention-backend / --decode-attention-backend):
extend batches go to one, decode batches to the other. Both read and write the same KV pool."""

from __future__ import annotations

from typing import Any

from radixmesh.engine.attention.base import AttentionBackend
from radixmesh.engine.batch import ForwardBatch, ForwardMode


class HybridBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        self.name = f"{prefill.name}+{decode.name}"
        self.supports_sliding_window = prefill.supports_sliding_window and decode.supports_sliding_window
        self.supports_softcap = prefill.supports_softcap and decode.supports_softcap
        self.supports_sinks = prefill.supports_sinks and decode.supports_sinks
        super().__init__(prefill.shape, prefill.kv_pool, prefill.req_to_token)
        self.prefill, self.decode = prefill, decode
        self.supports_cuda_graph = decode.supports_cuda_graph

    def attach_sinks(self, sinks: list) -> None:
        super().attach_sinks(sinks)
        self.prefill.attach_sinks(sinks)
        self.decode.attach_sinks(sinks)

    def _pick(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.mode is ForwardMode.DECODE else self.prefill

    def plan(self, batch: ForwardBatch) -> Any:
        return self._pick(batch).plan(batch)

    def forward(self, layer_id, q, k, v, batch, metadata):
        return self._pick(batch).forward(layer_id, q, k, v, batch, metadata)

    def forward_rope(self, layer_id, q, k, v, rope, batch, metadata):
        return self._pick(batch).forward_rope(layer_id, q, k, v, rope, batch, metadata)

    def init_cuda_graph(self, max_bs: int) -> None:
        self.decode.init_cuda_graph(max_bs)

    def capture_metadata(self, bs: int, batch: ForwardBatch) -> Any:
        return self.decode.capture_metadata(bs, batch)

    def replay_metadata(self, bs: int, batch: ForwardBatch, metadata: Any) -> None:
        self.decode.replay_metadata(bs, batch, metadata)
