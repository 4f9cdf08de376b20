"""CUDA graphs for decode forwards (SGLang's --cuda-graph-max-bs, --cuda-graph-bs, --disable-cuda-graph).

At start-up the decode forward (embedding, every layer, final norm, lm_head) is captured once per batch size of a
list. A decode batch of n requests replays the smallest captured size >= n: its inputs are copied into the graph's
static input block and the rows past n are padding (token 0 at position 0, writing its KV into scratch slot 0 and
attending over the padding table row, so it touches no request's memory). Larger batches run eagerly.
All graphs share one memory pool and write their logits into one static buffer: graphs replay one at a time.
With LoRA enabled each row's adapter slot is a static input as well (engine.lora.graph), so the graphs serve any mix
of adapters; each size is captured a second time without the LoRA kernels, for batches of the base model only.
An engine drafting trees (speculative_eagle_topk > 1) captures its graphs with a draft tree's mask as two more static
input rows (batch.ForwardBatch.tree_mask): its verifies and its head's tree steps replay them; a row without a tree
sees every key up to its length (its span starts at seq_len).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.device_memory import release, tensors_of
from radixmesh.engine.forward_context import ForwardContext, forward_context
from radixmesh.engine.hidden_capture import HiddenCapture

log = logging.getLogger(__name__)

# SGLang-like ladder: exact sizes where batches are small, then steps of 8 and 16 (padding wastes at most ~1/9).
_DEFAULT_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128,
                  144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512]


def graph_batch_sizes(explicit: tuple[int, ...] | None, max_bs: int | None, max_running: int) -> list[int]:
    """The sizes to capture: --cuda-graph-bs if given, else the default ladder up to --cuda-graph-max-bs (default:
    max_running_requests, at most 256)."""
    if explicit:
        return sorted(set(explicit))
    cap = max_bs if max_bs is not None else min(256, max_running)
    sizes = [s for s in _DEFAULT_SIZES if s <= cap]
    return sizes if cap in sizes or cap > _DEFAULT_SIZES[-1] else sizes + [cap]


def clip_batch_sizes(sizes: list[int], cap: int) -> list[int]:
    """The sizes up to `cap` (the engine's max_running_requests, known only after the KV pool is sized), with `cap`
    itself as the largest when some size was above it."""
    if not sizes or max(sizes) <= cap:
        return sizes
    return [s for s in sizes if s < cap] + [cap]


def estimated_graph_bytes(max_bs: int, vocab: int, hidden: int, intermediate: int, dtype_size: int) -> int:
    """Memory to set aside for the graphs before sizing the KV pool: the static logits, one capture's transient
    activations at the largest size (logits in the model dtype and in float32, hidden and MLP tensors), and slack
    for the graph pool's fragmentation and the attention backend's graph buffers (FlashInfer's index buffer and
    schedule: capture measured 516 MB for 28 sizes up to 256 on the 8B shape, where the rest comes to 367 MB)."""
    logits = max_bs * vocab * 4
    transient = max_bs * (vocab * (dtype_size + 4) + (8 * hidden + 3 * intermediate) * dtype_size)
    return logits + transient + (256 << 20)


class CudaGraphRunner:
    """Holds the model and attention backend, never the ModelRunner (no reference cycle: a shut-down engine's GPU
    memory is freed as soon as its last reference goes)."""

    def __init__(self, model, backend, device: torch.device, vocab_size: int, pad_row: int, sizes: list[int],
                 keep: HiddenCapture | None = None, lora=None, tree: bool = False):
        """`keep`: hidden states the forwards keep (engine.hidden_capture), copied to `hidden` by the graphs.
        `lora`: the LoRA adapters' static inputs (engine.lora.graph.GraphLora) when LoRA is enabled. `tree`: the
        graphs read a draft tree's mask (the decode attention kernels' tree variant)."""
        self.lora = lora
        self.tree = tree
        self.model = model
        self.keep = keep
        self.backend = backend
        self.device = device
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        dev = device
        # Rows: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens (ForwardBatch.decode_block order),
        # with trees each row's tree span start and bits (ForwardBatch.tree_mask; padding sees its one key)
        self.pad = torch.zeros((7 if tree else 5, self.max_bs), dtype=torch.int64, device=dev)
        self.pad[3].fill_(pad_row)
        self.pad[4:].fill_(1)
        self.static = self.pad.clone()
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.arange = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.empty((self.max_bs, vocab_size), dtype=torch.float32, device=dev)
        self.hidden = None if keep is None else torch.empty(
            (self.max_bs, keep.width(model.config.hidden_size)), dtype=next(model.parameters()).dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with LoRA enabled: graphs without its kernels
        self.batches: dict[int, ForwardBatch] = {}
        self.metadata: dict = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def _static_batch(self, bs: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(mode=ForwardMode.DECODE, input_ids=s[0, :bs], positions=s[1, :bs],
                            out_cache_loc=s[2, :bs], req_pool_indices=s[3, :bs], seq_lens=s[4, :bs],
                            extend_lens=self.ones[:bs], logits_indices=self.arange[:bs], seq_lens_host=[1] * bs,
                            extend_lens_host=[1] * bs, decode_block=s[:5, :bs],
                            tree_mask=s[5:7, :bs] if self.tree else None)

    def _forward(self, bs: int, with_lora: bool = True) -> None:
        batch = self.batches[bs]
        model = self.model
        lora = self.lora.batch(bs) if with_lora and self.lora is not None else None  # (its row grouping too)
        with forward_context(ForwardContext(batch, self.backend, self.metadata[bs], lora=lora)):
            hidden = model(batch.input_ids, batch.positions)
        if self.keep is not None:
            self.hidden[:bs].copy_(self.keep.take(hidden))
        self.logits[:bs].copy_(model.compute_logits(hidden))

    def capture(self) -> None:
        """Capture every size, largest first (later, smaller graphs reuse the pool's blocks)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        self.backend.init_cuda_graph(self.max_bs)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                self.batches[bs] = self._static_batch(bs)
                self.metadata[bs] = self.backend.capture_metadata(bs, self.batches[bs])
                for with_lora in (True, False) if self.lora is not None else (True,):
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # compile Triton kernels, create library handles: nothing lazy in capture
                            self._forward(bs, with_lora)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._forward(bs, with_lora)
                    (self.graphs if with_lora else self.base_graphs)[bs] = graph
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = free_before - torch.cuda.mem_get_info(dev)[0]
        log.info("captured CUDA graphs for %d decode batch sizes (%d..%d) in %.1f s, using %.0f MiB of GPU memory",
                 len(self.sizes), self.sizes[0], self.max_bs, self.capture_seconds, self.capture_bytes / 2**20)

    def close(self) -> None:
        """Destroy the graphs (their pool's memory goes back to the caching allocator) and the static buffers."""
        for graph in (*self.graphs.values(), *self.base_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.base_graphs.clear()
        self.batches.clear()
        self.metadata.clear()
        release([*tensors_of(self), *(tensors_of(self.lora) if self.lora is not None else ())])

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.DECODE and batch.batch_size <= self.max_bs
                and batch.extra_logit_indices is None and batch.decode_block is not None
                and (batch.tree_mask is None or self.tree))

    def load(self, batch: ForwardBatch) -> int:
        """Copy a decode batch into the static inputs of the graph of the next size up (its rows past the batch:
        padding); returns that size."""
        bs = batch.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        batch.fill_pending()
        static = self.static
        static[:5, :bs].copy_(batch.decode_block)
        if batch.tree_mask is not None:
            static[5:, :bs].copy_(batch.tree_mask)
        elif self.tree:  # no tree: a span from seq_len on leaves every key seen
            static[5, :bs].copy_(static[4, :bs])
        if padded > bs:
            static[:, bs:padded].copy_(self.pad[:, bs:padded])
        return padded

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run a decode batch through the graph of the next size up; returns float32 logits [batch, vocab] (a view
        of the static buffer, valid until the next replay)."""
        bs = batch.batch_size
        padded = self.load(batch)
        static_batch = self.batches[padded]
        static_batch.seq_lens_host = batch.seq_lens_host + [1] * (padded - bs)
        self.backend.replay_metadata(padded, static_batch, self.metadata[padded])
        graphs = self.graphs
        if self.lora is not None:
            self.lora.fill(batch)
            graphs = self.graphs if batch.lora_slots is not None else self.base_graphs
        graphs[padded].replay()
        return self.logits[:bs]
