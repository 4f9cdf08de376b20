"""Builds the prefix cache from resolved engine args: the radix tree (with page keys when anything outside the
worker names pages), the cache manager, KV events, and the host and storage tiers."""

from __future__ import annotations

import functools
import logging
import os

from radixmesh.engine.cache.kv_events import KvEventLog
from radixmesh.engine.cache.manager import CacheManager
from radixmesh.engine.cache.page_keys import chain_keys, namespace_root
from radixmesh.engine.cache.radix_tree import RadixTree
from radixmesh.engine.cache.storage import KvLayout, StorageOptions, check_storage_backend, open_storage
from radixmesh.engine.cache.swa import all_layers_window
from radixmesh.engine.config import EngineArgs, hicache_extra
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.loader import load_kv_scales
from radixmesh.engine.quantization import kv_scales

log = logging.getLogger(__name__)


def kv_layout(args: EngineArgs, model: ModelConfig) -> KvLayout:
    """The layout every page key binds: the model (directory name and architecture), page size, dtype, shape. Under
    tensor parallelism a stored page holds every rank's shard, rank after rank (KV heads replicated on ranks when
    fewer than them are counted once per rank), and the model name says so: its keys never meet one rank's pages.
    An fp8 cache binds a digest of its scales (every rank's, from the checkpoint or a --quantization-param-path
    file) where any is not 1.0: the same model's pages stored under other scales would read back wrong."""
    name = f"{os.path.basename(os.path.normpath(model.path))}:{model.architecture}"
    tp, heads = args.tp_size, model.num_kv_heads
    if tp > 1 and not replicated_kv(args, model):  # (a latent is whole on every rank: its page is any rank's)
        name, heads = f"{name}:tp{tp}", tp * max(1, heads // tp)
    if args.kv_cache_dtype.startswith("fp8"):
        read = functools.partial(load_kv_scales, model, args.kv_cache_dtype, args.load_format,
                                 args.quantization_param_path, tp_size=tp, quiet=True)
        # (a file gives each rank its own; the checkpoint's are every rank's, read once)
        per_rank = [read(tp_rank=r) for r in range(tp)] if args.quantization_param_path else [read()] * tp
        digest = kv_scales.digest(per_rank)
        name = f"{name}:kv-scales-{digest}" if digest else name
    return KvLayout(name, args.page_size, args.kv_cache_dtype, model.num_layers, heads, model.head_dim,
                    model.kv_buffers)


def replicated_kv(args: EngineArgs, model: ModelConfig) -> bool:
    """Whether every tensor-parallel rank holds the same KV: a latent cache (multi-head latent attention), whole on
    every rank. A stored page is then one rank's copy; with a store the host tier is one copy all ranks map (the
    leader alone backs pages up), and a PD transfer moves one rank's pages."""
    return args.tp_size > 1 and model.mla is not None


def swa_window(args: EngineArgs, runner) -> int | None:
    """The window behind which running requests free their pages (engine.cache.swa), or None: pages are kept. Only
    when every layer slides; not with the host tier (its copies and loads run on a stream of their own, and its
    tree would need paths with pages missing) nor with speculative decoding (draft models read the rows too)."""
    window = all_layers_window(runner.attn_backend.shape.windows)
    if window is None or args.enable_hierarchical_cache or args.speculative_algorithm:
        return None
    log.info("every layer slides over at most %d tokens: requests free the pages behind the window", window)
    return window


def build_cache(args: EngineArgs, model: ModelConfig, runner) -> CacheManager:
    window = swa_window(args, runner)
    if args.disable_radix_cache:
        return CacheManager(runner.kv_pool, runner.req_to_token, None, window=window)
    layout = kv_layout(args, model)
    named = args.kv_events_config is not None or args.hicache_storage_backend is not None
    page = args.page_size
    tree = RadixTree(page, (lambda parent, tokens: chain_keys(parent, tokens, page)) if named else None,
                     (lambda ns: namespace_root(layout, ns)) if named else None)
    events = KvEventLog(page) if args.kv_events_config is not None else None
    cache = CacheManager(runner.kv_pool, runner.req_to_token, tree, events, window)
    if args.enable_hierarchical_cache:
        cache.hierarchy = _hierarchy(args, model, cache, layout, events)
    return cache


def _hierarchy(args: EngineArgs, model: ModelConfig, cache: CacheManager, layout: KvLayout,
               events: KvEventLog | None):
    from radixmesh.engine.cache.hierarchy import CacheHierarchy

    device_pages = cache.pages.num_pages
    extra = hicache_extra(args)
    storage = None
    if args.hicache_storage_backend is not None:
        options = StorageOptions(url=args.hicache_storage_url or "", layout=layout,
                                 **{k: v for k, v in extra.items()
                                    if k in ("timeout_s", "capacity_bytes", "ttl_s", "transport", "transfer_host")})
        name = args.hicache_storage_backend
        check_storage_backend(name)
        storage = functools.partial(open_storage, name, options)  # opened (and reopened) on the storage thread
    # Under tensor parallelism with a store the ranks' host pages are one shared file (the store keeps a page of every
    # rank's), and a replicated latent's are one copy in it that every rank maps. Without a store each rank keeps
    # pinned pages of its own (the copy kernels and the copy engine read them in place; a shared file is not pinned).
    shared = storage is not None and args.tp_size > 1
    replicated = shared and replicated_kv(args, model)
    # --hicache-size is per rank, as the pool: a rank holds 1 / tp_size of a stored page, or of a replicated latent's
    # shared pages; a rank's own copy of a latent page (no store) is a whole page of the layout
    if args.hicache_size:
        per_rank = 1 if replicated_kv(args, model) and not replicated else args.tp_size
        host_pages = args.hicache_size * (1 << 30) * per_rank // layout.page_bytes
    else:
        host_pages = int(device_pages * args.hicache_ratio)
    log.info("hierarchical cache: %d host pages (%.2f GB) beside %d device pages, %s, io %s; L3: %s", host_pages,
             host_pages * layout.page_bytes / 1e9, device_pages, args.hicache_write_policy,
             args.hicache_io_backend or "default", args.hicache_storage_backend or "none")
    return CacheHierarchy(cache, host_pages, args.hicache_write_policy, events, storage,
                          args.hicache_storage_prefetch_policy, float(extra.get("prefetch_timeout_s", 2.0)),
                          bool(extra.get("skip_slow_fetches", True)),
                          host_ranks=args.tp_size if shared else 1, io_backend=args.hicache_io_backend,
                          host_replicated=replicated)
