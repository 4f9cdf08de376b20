"""Attention through FlashInfer's paged kernels (CUDA only; written against flashinfer-python 0.6.18, imported when
the backend is built).

FlashInfer sees the pool as pages of ONE token, whatever the engine's page size: a layer's K (V) buffer
[num_slots, kv_heads, head_dim] is viewed as [num_slots, 1, kv_heads, head_dim] (layout NHD), so a request's page list
is its token slots req_to_token[row, :seq_len] and every last page holds one token (last_page_len 1).

Per batch, `plan` builds kv_indptr on the host from seq_lens_host, kv_indices on the device (kernels.kv_indices), and
plans one wrapper that every layer runs: the decode wrapper for decode batches, the paged prefill wrapper (causal) for
extend batches. FlashInfer aligns a causal query block to the end of its request's KV: query i of n new tokens over
kv_len keys sees keys [0, kv_len - n + i]. `forward` stores the new tokens' K and V before attending, so the pool holds
prefix + new tokens and one paged call covers both.

FlashInfer's plan copies the indptrs (qo and kv) and last_page_len to the CPU and schedules the work there, so they
are passed as pinned host tensors (device tensors would make every plan wait for the GPU); kv_indices stays on the
device.

A sliding window and the logit soft-cap are plan-time parameters of a wrapper (`window_left`, `logits_soft_cap`; its
run asserts the window it was planned with). So there is one wrapper per window the layers use (usually one; two for
models that alternate sliding and global layers), and each layer runs its window's. FlashInfer's window_left is
inclusive: the query at position p sees keys p - window_left .. p, so a window of w tokens (transformers: keys after
p - w) is window_left = w - 1; -1 means no window. Soft-capping follows transformers' formula:
cap * tanh(q.k * sm_scale / cap).

A sliding wrapper's page list holds only the keys its window can show: request b's first query is at position
prefix_b = seq_len_b - extend_len_b and sees keys after prefix_b - w, so its list is
req_to_token[row, start_b:seq_len_b] with start_b = max(0, prefix_b - w + 1). The causal alignment and window_left
are relative to the end of the list, so dropping keys from its front changes no score: the list shrinks from seq_len
to at most w - 1 + extend_len keys, and it never names a page that engine.cache.swa freed behind the window.

An fp8 KV cache (--kv-cache-dtype fp8_e4m3|fp8_e5m2): the wrappers are planned with the model's dtype for the queries
and fp8 for the pages, and each layer's run passes its per-tensor scales as floats (FlashInfer folds k_scale into the
score scale and multiplies the output by v_scale; floats, so a captured graph holds them and nothing is copied). The
pool stores the K and V (engine.cache.kv_pool: divided by the scale, clamped, rounded to fp8) as for every backend.
Prefill reads its new tokens back from the pool like the prefix, so it attends over their fp8 values, where Triton's
extend kernel and torch_native use the unrounded ones (a difference of fp8 rounding, the size of the cache's own).
FA3 has no kernels for bfloat16 queries over fp8 pages: fp8 caches prefill on FA2.

A draft tree's decode rows (speculative_eagle_topk > 1: batch.ForwardBatch.tree_mask) each list only the keys they
see, the request's KV before the tree's span and the row's ancestors and itself in it
(kernels.kv_indices.build_tree_kv_indices; the counts come from the host, ForwardBatch.tree_keys_host), so the plain
decode kernel computes the tree's attention with no mask. They run eagerly (the CUDA graphs of a tree engine are
Triton's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from radixmesh.engine.attention.base import AttentionBackend, AttentionShape
from radixmesh.engine.attention.registry import FLASHINFER_HEAD_DIMS
from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.cache.kv_pool import KVPool
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.kernels.kv_indices import build_kv_indices, build_tree_kv_indices

# Split-KV partial outputs live here: FA2 plans up to (2 * SMs / num_kv_heads) tiles per query head, each of up to 128
# query rows of head_dim floats: 69 MB for 32 heads over 8 KV heads of 128 on a 132-SM H100, so 256 MB leaves room for
# groups up to ~14 (FlashInfer raises at plan time when its workspace is too small).
WORKSPACE_BYTES = 256 << 20
INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's own size for a wrapper's schedule (plan info) buffer
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer has no float32 attention kernels
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # pages it reads under 16-bit queries
PAGE_SIZE = 1  # tokens per FlashInfer page (see the module docstring)
# The tensor-core decode kernel packs the group of query heads sharing a KV head into MMA rows: worth it from 4 up.
TENSOR_CORE_MIN_GROUP = 4
# FA3 paged prefill is slower than FA2 on batches that mix chunked prefill and decodes (flashinfer-ai/flashinfer#1340).
KERNEL_BACKEND = "fa2"
# The prefill kernel, for benchmarks that compare (FlashInfer's "fa2", "fa3" on Hopper, "auto"): its prefill over a
# long cached prefix is what multi-turn TTFT waits on (benchmarks/results/NOTES.md, 2026-11-28 afternoon).
PREFILL_KERNEL_ENV = "RADIXMESH_FLASHINFER_PREFILL_KERNEL"


@dataclass(slots=True)
class _GraphBuffers:
    # window -> [max_bs + 1] int32, bound to that window's captured decode wrappers
    kv_indptr: dict[int | None, torch.Tensor]
    # window -> [max_bs * min(row_len, window)] int32: a decode query sees at most `window` keys
    kv_indices: dict[int | None, torch.Tensor]
    last_page_len: torch.Tensor  # [max_bs] int32, all ones
    # window -> [INT_WORKSPACE_BYTES] uint8 schedule buffer shared by that window's captured wrappers (one per batch
    # size): graphs replay one at a time and each replay re-plans its wrappers first, rewriting the schedules. The
    # wrappers of one graph (one per window) are all planned before it runs, so each window has its own buffer.
    int_workspaces: dict[int | None, torch.Tensor]


def _window_left(window: int | None) -> int:
    """FlashInfer's inclusive left window for a window of `window` tokens (see the module docstring)."""
    return -1 if window is None else window - 1


class FlashInferBackend(AttentionBackend):
    """Metadata is {window: planned FlashInfer wrapper}; the eager wrappers are re-planned by every `plan`, so a
    batch's metadata is valid until the next call to `plan`."""

    name = "flashinfer"
    supports_cuda_graph = True
    fuses_rope_store = True
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, shape: AttentionShape, kv_pool: KVPool, req_to_token: ReqToTokenPool):
        super().__init__(shape, kv_pool, req_to_token)
        k0 = kv_pool.k[0]
        if k0.device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, not {k0.device}")
        if shape.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"flashinfer's attention kernels take head sizes {FLASHINFER_HEAD_DIMS}, not this model's "
                             f"{shape.head_dim}; use attention_backend triton")
        q_dtype = shape.dtype or k0.dtype
        if q_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer attends with float16 or bfloat16 queries, not {q_dtype}; "
                             "use attention_backend torch_native for float32")
        if k0.dtype != q_dtype and k0.dtype not in FP8_KV_DTYPES:
            raise ValueError(f"flashinfer reads KV caches of the model's dtype ({q_dtype}) or fp8, not {k0.dtype}")
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError("the flashinfer attention backend needs flashinfer-python==0.6.18.post1 and "
                              "apache-tvm-ffi (pip install --no-deps; see DESIGN.md)") from e
        self._fi = flashinfer
        self.device, self.dtype, self.kv_dtype = k0.device, q_dtype, k0.dtype
        self.fp8 = k0.dtype in FP8_KV_DTYPES
        # [num_slots, 1, kv_heads, head_dim] views of each layer's buffers: pages of one token.
        self._k_pages = [t.view(t.shape[0], PAGE_SIZE, *t.shape[1:]) for t in kv_pool.k]
        self._v_pages = [t.view(t.shape[0], PAGE_SIZE, *t.shape[1:]) for t in kv_pool.v]
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)  # zeroed for first use
        # (fp8 pages: always the tensor-core kernel, FA2's prefill kernel, as SGLang does; its fp8 GPU tests ran there)
        self.use_tensor_cores = shape.num_heads // shape.num_kv_heads >= TENSOR_CORE_MIN_GROUP or self.fp8
        # One wrapper per window and mode; they share the float workspace (their kernels run one after another on
        # one stream) and each keeps its own schedule buffer.
        prefill_kernel = KERNEL_BACKEND if self.fp8 else os.environ.get(PREFILL_KERNEL_ENV) or KERNEL_BACKEND
        self.decode_wrappers = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend=KERNEL_BACKEND)
            for w in shape.distinct_windows()}
        self.prefill_wrappers = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_kernel) for w in shape.distinct_windows()}
        self._ones_host = torch.ones(req_to_token.host.shape[0], dtype=torch.int32, pin_memory=True)
        self._graph: _GraphBuffers | None = None
        # Per wrapper: an event after its last plan's host-to-device copy of the schedule. A wrapper's plan rewrites
        # one pinned host buffer; with overlap scheduling the host plans step N+1 while step N may still be queued,
        # so the next plan waits for the previous copy to have run (already true in the steady state: no stall).
        self._planned: dict[int, torch.cuda.Event] = {}

    def plan(self, batch: ForwardBatch) -> dict[int | None, Any]:
        if batch.mode is ForwardMode.DECODE:
            for window, wrapper in self.decode_wrappers.items():
                self._plan_decode(wrapper, *self._kv_indices(batch, window, None), window)
            return self.decode_wrappers
        qo_indptr = _host_indptr(batch.extend_lens_host)
        for window, wrapper in self.prefill_wrappers.items():
            self._plan_prefill(wrapper, batch, qo_indptr, *self._kv_indices(batch, window, None), window)
        return self.prefill_wrappers

    def forward(self, layer_id, q, k, v, batch, metadata: Any) -> torch.Tensor:
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        return self.attend_stored(layer_id, q, batch, metadata)

    def attend_stored(self, layer_id, q, batch, metadata: dict[int | None, Any]) -> torch.Tensor:
        # [num_tokens, num_heads, head_dim] in q's dtype (the dtype planned: the model's)
        wrapper = metadata[self.shape.window(layer_id)]
        pages = (self._k_pages[layer_id], self._v_pages[layer_id])
        if not self.fp8:
            return wrapper.run(q.contiguous(), pages)
        pool = self.kv_pool
        return wrapper.run(q.contiguous(), pages, k_scale=pool.k_scale[layer_id], v_scale=pool.v_scale[layer_id])

    # ---- CUDA graphs (decode) -------------------------------------------------------------------------------
    def init_cuda_graph(self, max_bs: int) -> None:
        # A request's KV never exceeds a table row. The pool size is no bound on the total: requests sharing a cached
        # prefix list the same slots.
        dev, windows, row_len = self.device, self.shape.distinct_windows(), self.req_to_token.row_len
        self._graph = _GraphBuffers(
            kv_indptr={w: torch.zeros(max_bs + 1, dtype=torch.int32, device=dev) for w in windows},
            kv_indices={w: torch.zeros(max_bs * (row_len if w is None else min(row_len, w)), dtype=torch.int32,
                                       device=dev) for w in windows},
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=dev),
            int_workspaces={w: torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev) for w in windows})
        self._last_page_lens(max_bs)

    def capture_metadata(self, bs: int, batch: ForwardBatch) -> dict[int | None, Any]:
        """A decode wrapper per window bound to the static buffers (its batch size fixed to `bs`), planned for
        `batch`. Waits for the planned buffers (once per size, at start-up), so any stream may warm up and capture
        the graph."""
        g = self._graph
        if g is None:
            raise RuntimeError("init_cuda_graph must run before capture_metadata")
        wrappers = {}
        for window, int_workspace in g.int_workspaces.items():
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g.kv_indptr[window][:bs + 1], paged_kv_indices_buffer=g.kv_indices[window],
                paged_kv_last_page_len_buffer=g.last_page_len[:bs], backend=KERNEL_BACKEND)
            wrapper.reset_workspace_buffer(self.workspace, int_workspace)
            wrappers[window] = wrapper
        self.replay_metadata(bs, batch, wrappers)
        torch.cuda.current_stream(self.device).synchronize()
        return wrappers

    def replay_metadata(self, bs: int, batch: ForwardBatch, metadata: dict[int | None, Any]) -> None:
        """Refills each window's static kv_indices on the device and re-plans its wrapper in `metadata` (a plan
        copies the host indptr into the window's static kv_indptr): nothing is reallocated."""
        for window, wrapper in metadata.items():
            self._plan_decode(wrapper, *self._kv_indices(batch, window, self._graph.kv_indices[window]), window)

    # ---- helpers --------------------------------------------------------------------------------------------
    def _kv_indices(self, batch: ForwardBatch, window: int | None,
                    out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The page list of the wrappers of `window`: (kv_indptr [batch + 1] int32 on the pinned host, kv_indices
        int32 on the device, a prefix of `out` when given): every key of each request, or under a window only the
        keys it can show (module docstring)."""
        if batch.tree_mask is not None:  # a draft tree's rows: each lists only the keys it sees (module docstring)
            if window is not None:
                raise ValueError("draft trees with sliding windows are not implemented")
            return self._tree_indices(batch, out)
        if window is None:
            starts, lens = None, batch.seq_lens_host
        else:
            new = [1] * batch.batch_size if batch.mode is ForwardMode.DECODE else batch.extend_lens_host
            starts = window_starts(batch.seq_lens_host, new, window)
            lens = (torch.tensor(batch.seq_lens_host, dtype=torch.int64) - starts).tolist()
        indptr = _host_indptr(lens)
        total = int(indptr[-1])
        if out is None:
            out = torch.empty(total, dtype=torch.int32, device=self.device)
        elif total > out.numel():
            raise RuntimeError(f"{total} KV tokens do not fit the CUDA-graph index buffer ({out.numel()})")
        indptr_dev = indptr.to(self.device, non_blocking=True)
        if starts is None:
            build_kv_indices(self.req_to_token.device, batch.req_pool_indices, batch.seq_lens, indptr_dev, out)
        else:  # (a hybrid SWA pool's sliding layers: their own page table, engine.cache.swa_pool)
            _window_indices(self.req_to_token.window_table(window), batch.req_pool_indices, starts, indptr_dev, out,
                            total)
        return indptr, out[:total]

    def _tree_indices(self, batch: ForwardBatch, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        indptr = _host_indptr(batch.tree_keys_host)
        total = int(indptr[-1])
        if out is None:
            out = torch.empty(total + 1, dtype=torch.int32, device=self.device)
        elif total + 1 > out.numel():
            raise RuntimeError(f"{total} KV tokens do not fit the CUDA-graph index buffer ({out.numel()})")
        build_tree_kv_indices(self.req_to_token.device, batch.req_pool_indices, batch.seq_lens, batch.tree_mask,
                              indptr.to(self.device, non_blocking=True), out)
        return indptr, out[:total]

    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, window: int | None) -> None:
        s = self.shape
        self._before_plan(wrapper)
        wrapper.plan(indptr, indices, self._last_page_lens(indptr.numel() - 1), s.num_heads, s.num_kv_heads,
                     s.head_dim, PAGE_SIZE, q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=s.scale,
                     window_left=_window_left(window), logits_soft_cap=s.softcap, non_blocking=True)
        self._after_plan(wrapper)

    def _plan_prefill(self, wrapper: Any, batch: ForwardBatch, qo_indptr: torch.Tensor, indptr: torch.Tensor,
                      indices: torch.Tensor, window: int | None) -> None:
        s = self.shape
        self._before_plan(wrapper)
        wrapper.plan(qo_indptr, indptr, indices, self._last_page_lens(batch.batch_size), s.num_heads, s.num_kv_heads,
                     s.head_dim, PAGE_SIZE, causal=True, sm_scale=s.scale, window_left=_window_left(window),
                     logits_soft_cap=s.softcap, q_data_type=self.dtype, kv_data_type=self.kv_dtype, non_blocking=True,
                     max_token_per_sequence=max(batch.extend_lens_host))
        self._after_plan(wrapper)

    def _before_plan(self, wrapper: Any) -> None:
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()

    def _after_plan(self, wrapper: Any) -> None:
        done = self._planned.setdefault(id(wrapper), torch.cuda.Event())
        done.record()

    def _last_page_lens(self, bs: int) -> torch.Tensor:
        """[bs] int32 ones on the pinned host (every page of one token is full); never written, so pending
        asynchronous copies of it stay valid."""
        if bs > self._ones_host.numel():
            self._ones_host = torch.ones(bs, dtype=torch.int32, pin_memory=True)
        return self._ones_host[:bs]


def window_starts(seq_lens: list[int], extend_lens: list[int], window: int) -> torch.Tensor:
    """[batch] int64 (host): the first key position a layer of `window` tokens can show each request's queries, the
    first of which is at seq_len - extend_len (module docstring)."""
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    return (seq - torch.tensor(extend_lens, dtype=torch.int64) - window + 1).clamp(min=0)


def _window_indices(table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, indptr_dev: torch.Tensor,
                    out: torch.Tensor, total: int) -> None:
    """out[indptr[b]:indptr[b + 1]] = table[rows[b], starts[b]:starts[b] + n_b] as int32 for every request b, where
    n_b = indptr[b + 1] - indptr[b]; `starts` [batch] int64 on the host, `indptr_dev` [batch + 1] on the table's
    device, `total` = indptr[-1] (known on the host). A handful of launches; the host never waits for the GPU (the
    starts travel from pinned memory)."""
    if total == 0:
        return
    dev = table.device
    lens = indptr_dev[1:] - indptr_dev[:-1]
    pinned = torch.empty(starts.shape, dtype=torch.int64, pin_memory=dev.type == "cuda").copy_(starts)
    shift = pinned.to(dev, non_blocking=True) - indptr_dev[:-1]  # column = output index + shift, per request
    cols = torch.arange(total, device=dev) + torch.repeat_interleave(shift, lens, output_size=total)
    out[:total] = table[torch.repeat_interleave(rows, lens, output_size=total), cols].to(torch.int32)


def _host_indptr(lens: list[int]) -> torch.Tensor:
    """[len(lens) + 1] int32 exclusive prefix sums in pinned memory (so copies to the device are asynchronous; the
    host allocator keeps the block until they finish)."""
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, pin_memory=True)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=indptr[1:])
    return indptr
