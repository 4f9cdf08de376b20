"""Owns the model, the KV memory and the attention backend on one device; runs one ForwardBatch at a time.

Under tensor parallelism every rank has a runner holding its part of the model and of the KV cache; the leader's runner
publishes each batch before running it, and each follower's `follow` runs what is published (engine.distributed)."""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from radixmesh.engine.attention.registry import create_attention, supports_cuda_graph
from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.batch_invariant import row_products
from radixmesh.engine.cache.swa_pool import hybrid_layout, make_kv_pool, why_no_hybrid
from radixmesh.engine.cache.req_to_token import ReqToTokenPool
from radixmesh.engine.cache.swa import all_layers_window
from radixmesh.engine.config import EngineArgs, torch_dtype
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.cuda_graph_runner import (CudaGraphRunner, clip_batch_sizes, estimated_graph_bytes,
                                                graph_batch_sizes)
from radixmesh.engine.distributed import TensorParallel, TPConfig
from radixmesh.engine.forward_context import ForwardContext, forward_context
from radixmesh.engine.hidden_capture import HiddenCapture
from radixmesh.engine.decode_products import plan as decode_products_plan
from radixmesh.engine.device_memory import release, tensors_of
from radixmesh.engine.layers.triton_ops import pdl_available, set_pdl
from radixmesh.engine.models.attention_spec import attention_shape, layer_windows
from radixmesh.engine.models.loader import load_kv_scales, load_model
from radixmesh.engine.quantization.fp8 import checkpoint_scheme
from radixmesh.engine.quantization.mxfp4 import is_mxfp4
from radixmesh.engine.pooling import Pooling, pool
from radixmesh.engine.sampling.penalties import PenaltyState
from radixmesh.engine.sampling.sampler import SampleResult, SamplingBatch, sample, token_logprobs
from radixmesh.engine.lora.graph import GraphLora, graphs_supported
from radixmesh.engine.lora.manager import LoraManager
from radixmesh.engine.speculative.config import EAGLES, max_draft
from radixmesh.engine.speculative.verify import VerifyLayout, VerifyResult, verify

if TYPE_CHECKING:
    from radixmesh.engine.scheduler.step import PromptLogprobPlan

log = logging.getLogger(__name__)

# KV budget on CPU when max_total_tokens is not given: enough for many full-length requests of a small model.
CPU_KV_BUDGET_BYTES = 1 << 30
CPU_MAX_DEFAULT_TOKENS_PER_CONTEXT = 16


def _warn_dequantized(args, model_config, model) -> None:
    """A CUDA runner whose quantized checkpoint is held dequantized says so: its outputs are the checkpoint's, its
    memory and speed the model dtype's."""
    if is_mxfp4(model_config.raw):
        if any(getattr(getattr(m, "w13", None), "mxfp4", False) for m in model.modules()):
            return  # held as codes and scales (engine.models.gpt_oss, kernels.moe_mxfp4)
        log.warning("MXFP4 experts are held dequantized in %s (twice MXFP4's bytes a weight): the outputs are the "
                    "checkpoint's, the memory and speed bf16's", args.dtype)
    elif ((args.quantization or checkpoint_scheme(model_config.raw))
          and not any(getattr(m, "fp8", None) for m in model.modules())):
        log.warning("fp8 weights are held dequantized in %s: the outputs are fp8's, the memory and speed not "
                    "(--fp8-gemm-backend triton holds them in fp8 on GPUs of compute capability 8.9+)", args.dtype)


class ModelRunner:
    deterministic = False  # --enable-deterministic-inference (engine.batch_invariant); set per runner in __init__

    def __init__(self, args: EngineArgs, model_config: ModelConfig, tp: TPConfig | None = None,
                 extra_kv_bytes_per_token: int = 0, table: ReqToTokenPool | None = None,
                 capture_layers: tuple[int, ...] | None = None, shared_with: nn.Module | None = None,
                 draft_topk: int = 1):
        """`tp`: this rank's place in its tensor-parallel group (default: alone). `extra_kv_bytes_per_token`: KV
        memory another model keeps per token of this one's pool (a speculative draft model's, slot for slot), left
        out of this pool's budget. `table`: another runner's request-to-token table, whose slots this runner's pool
        mirrors (a draft model's; its pool then holds exactly args.max_total_tokens tokens). `capture_layers`: the
        hidden states each forward keeps in `captured` for an EAGLE draft (engine.hidden_capture; empty: the final
        ones; None: none). `shared_with`: the target model whose embedding (and output layer) an EAGLE head uses.
        `draft_topk`: K > 1 for an EAGLE head drafting trees (its steps forward K rows per request under a tree
        mask)."""
        self.extra_kv_bytes_per_token = extra_kv_bytes_per_token
        self.args = args
        self.model_config = model_config
        # decode rows a request may take in one forward (a verify's drafts, a tree step's frontier), and whether the
        # CUDA graphs take a draft tree's mask (the target's tree verifies, a head's tree steps: Triton's kernels read
        # it; FlashInfer's tree rows, listed per row, run eagerly)
        self.rows_per_request = draft_topk if draft_topk > 1 else 1 + max_draft(args)
        trees = draft_topk > 1 or (args.speculative_algorithm in EAGLES and (args.speculative_eagle_topk or 1) > 1)
        self.tree_graphs = trees and args.decode_attention_backend == "triton"
        self.device = torch.device(args.device)
        self.dtype = torch_dtype(args.dtype)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            if table is None:  # (a draft model's runner leaves the process-wide kernel choices to the target's)
                set_pdl(not args.disable_pdl, gemv=args.decode_gemm == "gemv")
        self.tp = TensorParallel(tp or TPConfig(), self.device)
        self.model = load_model(model_config, args.load_format, self.dtype, self.device,
                                max_positions=args.context_length, seed=args.random_seed, tp=self.tp,
                                quantization=args.quantization, fp8_gemm_backend=args.fp8_gemm_backend)
        if shared_with is not None:  # before any CUDA graph is captured: the graphs read the shared weights
            self.model.share_weights(shared_with, (args.max_running_requests or 256) * draft_topk)
        self.capture = HiddenCapture(self.model, capture_layers) if capture_layers is not None else None
        self.captured: torch.Tensor | None = None  # the last forward's kept hidden states (`capture`)
        if self.device.type == "cuda":
            _warn_dequantized(args, model_config, self.model)
        # LoRA adapters' device slots (engine.lora), attached to the projections; adapters are loaded by the engine
        self.lora = LoraManager(self.model, model_config, args.max_loaded_loras, args.max_lora_rank,
                                frozenset(args.lora_target_modules) if args.lora_target_modules else None,
                                self.device, self.dtype, args.max_loras_per_batch) if args.enable_lora else None
        self.expert_counts = None  # layer -> tokens per expert (--enable-expert-distribution-metrics)
        if args.moe_runner_backend == "triton":
            from radixmesh.engine.layers.moe import FusedMoE

            for module in self.model.modules():
                if isinstance(module, FusedMoE):
                    module.backend = "triton"
        if args.enable_expert_distribution_metrics:
            from radixmesh.engine.models.moe import expert_counters

            self.expert_counts = expert_counters(self.model)
        attn = self.model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads  # this rank's
        graph_sizes = self._graph_sizes()
        graph_reserve = self._graph_reserve(graph_sizes)
        # sliding layers' KV in a pool of their own (engine.cache.swa_pool), or None: one pool
        self.swa_layout = hybrid_layout(layer_windows(model_config, args.context_length), args.swa_full_tokens_ratio,
                                        why_no_hybrid(args, table is not None))
        self.max_total_tokens = args.max_total_tokens if table is not None else \
            self.tp.all_min(self._kv_capacity_tokens(graph_reserve))
        page = args.page_size
        self.kv_pool = make_kv_pool(self.swa_layout, self.max_total_tokens // page, page, model_config.num_layers,
                                    self.num_kv_heads, model_config.head_dim, torch_dtype(args.kv_cache_dtype),
                                    self.device, load_kv_scales(model_config, args.kv_cache_dtype, args.load_format,
                                                                args.quantization_param_path, self.tp.rank,
                                                                self.tp.size), shared_kv=model_config.mla is not None)
        self.max_running_requests = self._max_running()
        # a request holds at most the pool, unless every layer slides: then it frees pages as it goes
        # (engine.cache.swa) and only the context bounds its length
        longest = args.context_length if all_layers_window(layer_windows(model_config, args.context_length)) else \
            min(args.context_length, self.kv_pool.capacity_tokens)
        row_len = longest + page
        self.req_to_token = table or ReqToTokenPool(self.max_running_requests, row_len, self.device)
        if self.swa_layout is not None:
            self.req_to_token.add_swa_table(self.kv_pool.translate, self.swa_layout.swa_layers)
        self.owns_table = table is None
        # The leader's writes to state the followers mirror (request-to-token rows, host-tier copies) since its last
        # forward, in order; published with the next forward.
        self.journal: list[tuple] = []
        if self.lora is not None and self.tp.size > 1 and self.tp.rank == 0:
            self.lora.journal = self.journal  # the followers load and unload the adapters the leader does
        if self.tp.size > 1 and self.tp.rank == 0:
            self.req_to_token.journal = self.journal
        self.mover = None  # a follower's host tier (engine.cache.host_pool), once the leader's setup says so
        # the hierarchical cache's queued host -> device loads: issues them, returns per-layer events (the engine
        # sets it; engine.cache.manager.CacheManager.issue_loads)
        self.kv_loads: Callable[[], list | None] | None = None
        self.kv_channel = None  # KV staging for transfers (engine.disaggregation.mirror), once asked for
        self._published = time.monotonic()  # the leader's last step message
        # the score scale, soft-cap and per-layer sliding windows the model's attention computes
        shape = attention_shape(model_config, self.num_heads, self.num_kv_heads, args.context_length, self.dtype)
        self.attn_backend = create_attention(args.prefill_attention_backend, args.decode_attention_backend, shape,
                                             self.kv_pool, self.req_to_token)
        if shape.sinks:  # (GPT-OSS) each layer's sinks, read in place by the kernels
            self.attn_backend.attach_sinks(self.model.attention_sinks())
        # --enable-deterministic-inference: each attention row alone, each product a row at a time (engine.config
        # refuses what engine.batch_invariant does not cover)
        self.deterministic = args.enable_deterministic_inference
        if self.deterministic:
            self.attn_backend.rows_alone = True
        self.generator = torch.Generator(device=self.device).manual_seed(args.random_seed)
        self.penalties = PenaltyState(self.max_running_requests, model_config.vocab_size, self.device)
        log.info("model %s on %s (%s): KV pool %d tokens, page %d, max running %d, attention %s",
                 model_config.architecture, self.device, args.dtype, self.kv_pool.capacity_tokens, page,
                 self.max_running_requests, self.attn_backend.name)
        self.graphs: CudaGraphRunner | None = None
        graph_sizes = clip_batch_sizes(graph_sizes, self.max_running_requests * self.rows_per_request)
        # (a draft model's runner leaves the process-wide product choices to the target's, planned first)
        if graph_sizes and args.decode_gemm == "auto" and table is None and pdl_available(self.device):
            gemv, rows = decode_products_plan(self.model, self.device, self.dtype)
            set_pdl(True, gemv=gemv, row=rows)
        if graph_sizes:
            lora = GraphLora(self.lora, max(graph_sizes), self.device) if self.lora is not None else None
            self.graphs = CudaGraphRunner(self.model, self.attn_backend, self.device, model_config.vocab_size,
                                          self.req_to_token.pad_row, graph_sizes, self.capture, lora=lora,
                                          tree=self.tree_graphs)
            self.graphs.capture()
            if self.graphs.capture_bytes > graph_reserve:
                log.warning("CUDA graphs used %.0f MiB, more than the %.0f MiB set aside for them: the GPU may run "
                            "short of memory; lower --mem-fraction-static or --cuda-graph-max-bs",
                            self.graphs.capture_bytes / 2**20, graph_reserve / 2**20)
        for counts in (self.expert_counts or {}).values():  # what the start's own forwards routed is not traffic
            counts.zero_()

    def _max_running(self) -> int:
        return self.args.max_running_requests or min(256, max(1, self.max_total_tokens // 16))

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture; none on CPU, with --disable-cuda-graph, or when the decode attention
        backend cannot run inside a graph (said in the log)."""
        args = self.args
        if args.disable_cuda_graph or self.device.type != "cuda":
            return []
        if args.enable_lora and not graphs_supported(self.device):
            log.info("CUDA graphs off: LoRA's kernels need Triton")
            return []
        if not supports_cuda_graph(args.decode_attention_backend):
            log.info("CUDA graphs off: the %s attention backend cannot run inside one",
                     args.decode_attention_backend)
            return []
        if self.model_config.moe is not None and args.moe_runner_backend != "triton":
            log.info("CUDA graphs off: --moe-runner-backend %s picks each step's experts on the host",
                     args.moe_runner_backend)
            return []
        # a speculative verify is a decode batch of one row per token (batch_builder.build_verify), a tree step one
        # of K rows per request
        cap = (args.max_running_requests or 256) * self.rows_per_request
        return graph_batch_sizes(args.cuda_graph_bs, args.cuda_graph_max_bs, cap)

    def _graph_reserve(self, graph_sizes: list[int]) -> int:
        """Bytes to keep out of the KV pool for the CUDA graphs (0 without graphs)."""
        if not graph_sizes:
            return 0
        cfg = self.model_config
        return estimated_graph_bytes(max(graph_sizes), cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size,
                                     self.dtype.itemsize)

    def _kv_capacity_tokens(self, graph_reserve: int) -> int:
        """KV tokens that fit in the static budget (mem_fraction_static of the GPU, after the weights and the
        `graph_reserve` bytes set aside for CUDA graphs)."""
        per_token = self.model_config.kv_bytes_per_token(torch_dtype(self.args.kv_cache_dtype), self.num_kv_heads)
        if self.swa_layout is not None:  # the SWA pool's share per full-pool token
            per_token = self.swa_layout.bytes_per_token(per_token)
        per_token += self.extra_kv_bytes_per_token
        page = self.args.page_size
        if self.device.type == "cuda":
            # an engine shut down earlier in this process may still hold its pool through a reference cycle that no
            # collection has reached yet (a GPU test building two engines in a row found 42 GiB still in use)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.args.mem_fraction_static) - graph_reserve
            tokens = int(budget // per_token)
            if tokens <= page:
                raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                                   f"{total / 2**30:.1f} GiB with mem_fraction_static={self.args.mem_fraction_static}")
            if self.args.max_total_tokens:
                tokens = min(tokens, self.args.max_total_tokens)
        elif self.args.max_total_tokens:
            tokens = self.args.max_total_tokens
        else:
            tokens = min(CPU_KV_BUDGET_BYTES // per_token,
                         CPU_MAX_DEFAULT_TOKENS_PER_CONTEXT * self.args.context_length)
        if tokens < page:
            raise ValueError(f"max_total_tokens ({tokens}) must hold at least one page ({page} tokens)")
        return tokens // page * page

    def close(self) -> None:
        """Give this runner's device memory back (CUDA graphs, KV pool, weights, rotary tables, request table,
        penalty counts, attention workspaces): each large tensor's storage is released in place, so the memory is
        freed even where something still refers to the runner or its parts. The runner is unusable afterwards."""
        if self.model is None:
            return
        if self.graphs is not None:
            self.graphs.close()
        rotary = self.model.rotary
        tensors = [*self.kv_pool.buffers(), *self.model.parameters(), *self.model.buffers(),
                   *(tensors_of(self.req_to_token) if self.owns_table else ()), *tensors_of(self.penalties),
                   *tensors_of(self.attn_backend), *(self.lora.tensors() if self.lora is not None else ())]
        if rotary is not None:
            tensors += [rotary.cos, rotary.sin]
        release(tensors)
        self.graphs = self.model = self.attn_backend = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model over the batch (a captured graph when one fits); returns float32 logits
        [batch + extra, vocab]: each request's last new token, then the tokens of batch.extra_logit_indices.
        Launches work on the device and returns without waiting for it."""
        self._publish("logits", batch)
        with row_products(self.deterministic):
            return self._logits(batch)

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        ready = self._kv_ready()
        if self.graphs is not None and self.graphs.can_run(batch):
            if ready is not None:  # a graph waits for every layer's pages before it starts
                torch.cuda.current_stream().wait_event(ready[-1])
            logits = self.graphs.replay(batch)
            if self.capture is not None:  # (the static buffer is rewritten by the next replay)
                self.captured = self.graphs.hidden[:batch.batch_size].clone()
            return logits
        try:
            hidden = self._hidden(batch, ready)
        except Exception:
            if ready is not None:
                self._settle_loads(ready)
            raise
        if self.capture is not None:
            self.captured = self.capture.take(hidden)
        if batch.mode is ForwardMode.DECODE and batch.extra_logit_indices is None:
            return self.model.compute_logits(hidden)  # one token per request: every row is wanted
        rows = batch.logits_indices
        if batch.extra_logit_indices is not None:
            rows = torch.cat([rows, batch.extra_logit_indices])
        return self.model.compute_logits(hidden[rows])

    # ---- tensor parallelism -------------------------------------------------------------------------------------
    def _publish(self, kind: str, batch: ForwardBatch) -> None:
        """The leader's half of a step: the followers get the batch, and the table writes since the last one."""
        if self.tp.size == 1 or self.tp.rank != 0:
            return
        batch.fill_pending()
        header, packed = batch.packed()
        self._step_message((kind, header, self._take_journal()))
        self.tp.broadcast_tensor(packed)

    def _take_journal(self) -> list[tuple]:
        journal = list(self.journal)
        self.journal.clear()
        return journal

    def _step_message(self, message: tuple) -> None:
        self.tp.broadcast_object(message)
        self._published = time.monotonic()

    def heartbeat(self) -> None:
        """The leader, between steps: an idle group hears from it within `tp.heartbeat_s` (with the journal so far),
        and so does an idle staging channel, so no follower times out waiting."""
        if self.tp.size == 1 or self.tp.rank != 0:
            return
        now = time.monotonic()
        if now - self._published >= self.tp.heartbeat_s:
            self._step_message(("idle", None, self._take_journal()))
        if self.kv_channel is not None and now - self.kv_channel.last_used >= self.tp.heartbeat_s:
            self.kv_channel.ping()

    def publish_setup(self, host) -> None:
        """The leader's host tier (hierarchical cache, engine.cache.host_pool): each follower makes one of the same
        number of pages, or maps its slice of the leader's shared one (an L3 store on)."""
        if self.tp.size == 1 or self.tp.rank != 0:
            return
        from radixmesh.engine.shared_memory import unlink

        try:
            self._step_message(("setup", (host.allocator.num_pages, host.path, host.replicated), None))
            if host.path is not None:
                self.tp.all_min(0)  # every follower mapped it
        finally:
            if host.path is not None:
                unlink([host.path])

    def sync_followers(self) -> None:
        """The leader: returns once every follower applied the journal so far (its host copies are done)."""
        if self.tp.size > 1 and self.tp.rank == 0:
            self._step_message(("sync", None, self._take_journal()))
            self.tp.all_min(0)

    def kv_mirror(self, staged: bool | None = None, shared: bool = False):
        """Host memory for KV transfers (engine.disaggregation.mirror); under tensor parallelism every rank's (the
        leader's scheduler thread calls this, between steps). `shared`: in shared-memory files a peer maps."""
        from radixmesh.engine.disaggregation import mirror

        if self.tp.size == 1:
            return mirror.KvMirror.for_pool(self.kv_pool, staged, shared)
        if shared:
            raise ValueError("the shm transfer backend moves one rank's KV (tp_size 1); with tensor parallelism use "
                             "--disaggregation-transfer-backend mooncake")
        if self.kv_channel is not None:
            raise RuntimeError("this engine's KV transfer mirrors exist already")
        mirrors = mirror.lead(self)
        self.kv_channel = mirrors.channel
        self._published = time.monotonic()
        return mirrors

    def mirror_kv_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The leader copied its KV at slots `src` into slots `dst` (a draft tree's kept path,
        engine.speculative.tree_verify): each follower copies its heads' KV alike before its next forward."""
        if self.tp.size > 1 and self.tp.rank == 0:
            keep = src != dst  # (the rows past a request's accepted depth copy onto themselves)
            src, dst = src[keep].cpu(), dst[keep].cpu()
            if src.numel():
                self.journal.append(("copy_kv", src, dst))

    def _replay(self, journal: list[tuple]) -> None:
        """A follower applies the leader's writes since its last forward, in order, before running the next one."""
        for op, *rest in journal:
            if op == "write":
                self.req_to_token.write(*rest)
            elif op == "scatter":
                self.req_to_token.scatter(*rest)
            elif op == "to_host":
                self.mover.to_host(*rest).wait()
            elif op == "copy_pages":
                self.kv_pool.copy_page_prefix(*rest)
            elif op == "copy_kv":
                from radixmesh.engine.speculative.tree_verify import copy_slots

                copy_slots(self.kv_pool, *(t.to(self.device) for t in rest))
            elif op == "lora_load":
                self.lora.load(*rest)
            elif op == "lora_unload":
                self.lora.unload(*rest)
            else:
                self.mover.to_device(*rest).wait()

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower's loop: run every forward the leader publishes, until it says stop (`stop_followers`)."""
        while True:
            step = self.tp.broadcast_object()
            if step is None:
                return
            kind, header, journal = step
            if kind == "setup":
                from radixmesh.engine.cache.host_pool import HostKVPool, KVMover

                pages, path, replicated = header
                ranks = self.tp.size if path is not None else 1
                host = HostKVPool(pages, self.kv_pool, self.tp.rank if path else 0, ranks, path, replicated)
                self.mover = KVMover(self.kv_pool, host, self.args.hicache_io_backend)
                if path is not None:
                    self.tp.all_min(0)
                continue
            if kind == "kv_mirror":
                from radixmesh.engine.disaggregation import mirror

                self.kv_channel = mirror.follow(self, header)
                continue
            self._replay(journal)
            if kind == "sync":
                self.tp.all_min(0)
            if kind in ("idle", "sync"):
                continue
            packed = self.tp.broadcast_tensor(torch.empty(ForwardBatch.packed_size(header), dtype=torch.int64,
                                                          device=self.device))
            batch = ForwardBatch.unpacked(header, packed)
            if kind == "logits":
                self.forward(batch)
            else:
                self._hidden(batch)

    def stop_followers(self) -> None:
        if self.tp.size > 1 and self.tp.rank == 0:
            if self.kv_channel is not None:
                self.kv_channel.close()
            self.tp.broadcast_object(None)

    @staticmethod
    def _settle_loads(ready) -> None:
        """A forward that failed part-way: issue the loads of the layers it never reached (host_pool._LayerLoads
        queues a layer's copies as the forward reaches it) and wait for all of them, before the failed requests'
        device pages are freed and handed to others (a copy still to come would overwrite their new owner's KV)."""
        try:
            ready[-1].synchronize()
        except Exception:  # noqa: BLE001 - the forward's own error is the one to raise
            log.exception("waiting for a failed forward's KV loads failed")

    def _kv_ready(self) -> list | None:
        """Issue the host -> device page loads queued since the last forward (the hierarchical cache's); the events
        each layer waits for, or None."""
        return self.kv_loads() if self.kv_loads is not None else None

    def _hidden(self, batch: ForwardBatch, ready: list | None = None) -> torch.Tensor:
        """The model's final hidden states (after the final norm), [num_tokens, hidden]; layer l first waits for
        ready[l] (loads of its pages from the host tier)."""
        try:
            batch.fill_pending()
            metadata = self.attn_backend.plan(batch)
            lora = self.lora.batch(batch.lora_slots, batch.extend_lens_host) \
                if self.lora is not None and batch.lora_slots is not None else None
            with forward_context(ForwardContext(batch, self.attn_backend, metadata, ready, lora)):
                return self.model(batch.input_ids, batch.positions)
        finally:
            if ready is not None:  # whatever runs next is ordered after every load, even if the forward failed
                torch.cuda.current_stream().wait_event(ready[-1])

    @torch.inference_mode()
    def forward_pooled(self, batch: ForwardBatch, pooling: Pooling) -> torch.Tensor:
        """An embedding engine's forward (extend batches): float32 [batch, hidden], each request's pooled final
        hidden states over this forward's tokens (engine.pooling.pool). Launches work and returns without waiting."""
        self._publish("hidden", batch)
        with row_products(self.deterministic):
            return pool(self._hidden(batch, self._kv_ready()), batch, pooling)

    @torch.inference_mode()
    def forward_and_sample(self, batch: ForwardBatch, sampling: SamplingBatch,
                           prompt: PromptLogprobPlan | None = None) -> SampleResult:
        return self.sample(self.forward(batch), batch.batch_size, sampling, prompt)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch_size: int, sampling: SamplingBatch,
               prompt: PromptLogprobPlan | None = None) -> SampleResult:
        """Each request's next token from the first `batch_size` rows of `logits`, and (with a prompt plan) the
        logprobs of the planned prompt tokens from the extra rows."""
        result = sample(logits[:batch_size], sampling, self.generator, self.penalties)
        if prompt is not None:
            def dev(x):
                return torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True) if x else None

            extra = token_logprobs(logits[batch_size:], dev(prompt.targets), prompt.top_k, dev(prompt.token_ids))
            result = result._replace(prompt=extra)
        return result

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, layout: VerifyLayout, sampling: SamplingBatch,
               draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """A speculative verify forward's drafts checked against its logits (engine.speculative.verify)."""
        return verify(logits, layout, sampling, self.generator, self.penalties, draft_probs)
