"""Engine configuration: SGLang's server-argument names, resolved once into frozen values.

`EngineArgs` is what a user passes (keyword names are SGLang's flags in snake_case). `resolve_args` turns every
`None`/"auto" into a concrete value for the device and model at hand; the scheduler and runner only see resolved args.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixmesh.engine.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

# dtype names users may give -> torch attribute names. torch is imported only where a dtype is resolved, so the
# services that only parse EngineArgs (the launcher) stay free of it.
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# --kv-cache-dtype's fp8 values (SGLang's names): K and V stored rounded to fp8 (half the bytes of bf16, twice the
# tokens) divided by the checkpoint's per-layer k_scale / v_scale (1.0 without them: engine.quantization.kv_scales),
# read back to the model dtype times them by the attention backends
_FP8_KV = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    model_path: str  # a folder, or a Hugging Face model id in the local cache (engine.model_source)
    tokenizer_path: str | None = None
    revision: str | None = None  # the cached snapshot of a model id: a branch, tag or commit hash (default main)
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    load_format: str = "auto"
    # SGLang's: fp8 (or w8a8_fp8) rounds an unquantized checkpoint's linear weights to fp8 at load (one scale per
    # output row); fp8 checkpoints are read whatever this says (engine.quantization.fp8); modelopt / modelopt_fp8
    # insist on an NVIDIA ModelOpt FP8 checkpoint (QUANTIZATIONS)
    quantization: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # SGLang's: a JSON file of an fp8_e4m3 KV cache's per-layer scales for each TP rank, used instead of the
    # checkpoint's (engine.quantization.kv_scales)
    quantization_param_path: str | None = None
    device: str | None = None
    context_length: int | None = None
    page_size: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    num_reserved_decode_tokens: int = 512
    enable_mixed_chunk: bool = False
    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    disable_overlap_schedule: bool = False
    # Speculative decoding (SGLang's flags; engine.speculative): NGRAM drafts from the request's own prompt and
    # output (no second model), STANDALONE with a smaller model sharing the tokenizer (speculative_draft_model_path,
    # speculative_num_steps draft forwards), EAGLE and EAGLE3 with a one-layer head reading the target's hidden
    # states (engine.speculative.eagle_head). Each decode step then verifies the newest token and up to
    # num_draft_tokens - 1 drafted ones in one forward, keeping the longest prefix the target model agrees with
    # (greedy: token-exact; sampled: rejection sampling, which keeps the target distribution). EAGLE heads draft
    # trees with speculative_eagle_topk > 1 (engine.speculative.tree: the target verifies every node under a tree
    # mask and keeps the longest accepted path). NEXTN is EAGLE with the model's own multi-token-prediction layer
    # (DeepSeek-V3's, engine.speculative.nextn) as the head, from the model's checkpoint unless a draft path is given.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = field(default=None, metadata={"aliases": ("--speculative-draft-model",)})
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 10_000_000
    # SGLang's relaxed acceptance (a draft kept above a probability threshold) changes the output distribution: only
    # its defaults (1.0: exact verification) are taken; its FR-Spec vocabulary map is not implemented; verify runs as
    # a decode batch of a row per token ("decode" attention mode; SGLang's default, "prefill", is refused)
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_token_map: str | None = None
    speculative_attention_mode: str = "decode"
    # SGLang's multi-LoRA flags (engine.lora): adapters in peft's format, `name=path` entries; max_loaded_loras of
    # them stay loaded in host memory (default max(max_loras_per_batch, the adapters given)); at most
    # max_loras_per_batch run at once (requests of another wait for admission), each in one of that many device
    # slots, copied in when a batch needs it over the least recently used one no admitted request uses
    enable_lora: bool = False
    lora_paths: tuple[str, ...] | None = None
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    max_loaded_loras: int | None = None
    enable_expert_distribution_metrics: bool = False  # SGLang's: tokens routed to each expert (MoE models)
    # SGLang's: how MoE layers run their experts: torch (the plain-PyTorch twin, any device; no CUDA graphs: it picks
    # each step's experts on the host), triton (kernels.moe's grouped GEMMs, CUDA), auto (triton on a GPU, else torch)
    moe_runner_backend: str = "auto"
    # SGLang's: what runs fp8 weights' products (engine.quantization.fp8_load): auto (held in fp8 on CUDA GPUs of
    # compute capability 8.9+, dequantized elsewhere: fp8_load.AUTO_HOLDS_FP8), triton (the weights stay fp8 and
    # Triton's kernels and torch._scaled_mm run them: CUDA, or on CPU in Triton's interpreter for tests)
    fp8_gemm_backend: str = "auto"
    # Programmatic dependent launch (Hopper and later): inside CUDA graphs each Triton kernel may start while the one
    # before it finishes (kernels/runtime.py). Off: every kernel waits for the one before, and cuBLAS runs every
    # product.
    disable_pdl: bool = False
    # What runs products of up to 8 rows (decode batches) under PDL: `gemv` (kernels.gemv, which pulls its weights into
    # L2 before waiting on the kernel before), `cublas`, or `auto`: both timed per weight shape on the model's weights at
    # start-up, kernels.gemv with a few tile configurations, each shape on the faster (engine.decode_products); under
    # `auto` one-row products run kernels.gemv.gemv_row unless it times clearly slower on the shape.
    decode_gemm: str = "auto"
    # SGLang's hybrid SWA memory (engine.cache.swa_pool): in a model that mixes sliding-window and full-attention
    # layers, the sliding layers' KV has a pool of its own of swa_full_tokens_ratio times the full pool's tokens, whose
    # pages go back behind each request's window; disable_hybrid_swa_memory keeps every layer's KV in one pool
    swa_full_tokens_ratio: float = 0.8
    disable_hybrid_swa_memory: bool = False
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    # How host pages reach the device (SGLang's flag): `kernel`, a copy kernel per layer reading the pinned host pool,
    # or `direct`, the GPU's copy engines (engine.cache.dma), which take no SM from the forward the loads overlap.
    # Unset: `direct` where the driver batches copies (CUDA 12.8+), else `kernel` (host_pool.default_io_backend).
    hicache_io_backend: str | None = None
    hicache_storage_backend: str | None = None
    hicache_storage_url: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_backend_extra_config: str | None = None
    kv_events_config: str | None = None
    random_seed: int | None = None
    # SGLang's: a request's tokens and logprobs independent of its batch, its cached prefix and its prefill's chunking
    # (engine.batch_invariant: products and attention a row at a time; CPU only so far, plain-torch attention)
    enable_deterministic_inference: bool = False
    stream_output: bool = False
    # A stream sends a request's first token at once, then every stream_interval tokens (and its last): fewer, larger
    # messages for the same tokens (SGLang's --stream-interval)
    stream_interval: int = 1
    sampling_defaults: str = "model"
    grammar_backend: str = "xgrammar"
    # An embedding engine (SGLang's --is-embedding): requests run the prefill forward only and return one pooled,
    # L2-normalised vector of the final hidden states (engine.pooling); generation requests are refused.
    is_embedding: bool = False
    # Tensor parallelism (engine.distributed): the model spread over tp_size ranks, nnodes machines, node_rank this
    # one; dist_init_addr is rank 0's host:port for the rendezvous (default: a free local port, one node only).
    tp_size: int = field(default=1, metadata={"aliases": ("--tp",)})
    # expert parallelism (SGLang's --ep-size): 1, or tp_size to place whole experts on the ranks
    ep_size: int = field(default=1, metadata={"aliases": ("--expert-parallel-size", "--ep")})
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int | None = None  # seconds a collective may wait for a rank (default 600)
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    enable_p2p_check: bool = False
    log_level: str = "info"

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model_path=model_path, **kwargs)


def resolve_dtype(name: str, model: ModelConfig, device: str) -> torch.dtype:
    """SGLang's rule for "auto": float32 checkpoints run in float16 on GPUs; CPUs keep the checkpoint's dtype."""
    import torch

    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
        return torch_dtype(name)
    ckpt_name = model.torch_dtype.replace("torch.", "")
    ckpt = torch_dtype(ckpt_name) if ckpt_name in _DTYPES else torch.float32
    if device == "cpu":
        return ckpt
    return torch.float16 if ckpt == torch.float32 else ckpt


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def resolve_args(args: EngineArgs, model: ModelConfig) -> EngineArgs:
    """Fill every auto value; validate ranges; refuse a model we would serve wrong (engine.models.support).
    Memory-derived sizes (max_total_tokens) are resolved by the runner."""
    import torch

    from radixmesh.engine.models.attention_spec import has_sinks
    from radixmesh.engine.models.support import check_servable
    from radixmesh.engine.speculative.config import resolve_speculative
    from radixmesh.engine.lora.config import resolve_lora

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check(device in ("cpu", "cuda") or device.startswith("cuda:"), f"unsupported device {device!r}")
    page = args.page_size or 1
    _check(page > 0 and page & (page - 1) == 0, f"page_size must be a power of two, got {page}")
    _check(args.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}, got {args.load_format!r}")
    quantization = _resolve_quantization(args.quantization, model)
    _check(args.schedule_policy in SCHEDULE_POLICIES,
           f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    _check(args.schedule_conservativeness > 0, "schedule_conservativeness must be > 0")
    _check(isinstance(args.stream_interval, int) and args.stream_interval >= 1,
           f"stream_interval must be an integer >= 1, got {args.stream_interval!r}")
    _check(args.decode_gemm in ("auto", "gemv", "cublas"),
           f"decode_gemm must be 'auto', 'gemv' or 'cublas', got {args.decode_gemm!r}")
    _check(args.grammar_backend in ("xgrammar", "none"),
           f"grammar_backend must be 'xgrammar' or 'none', got {args.grammar_backend!r}")
    _check(args.sampling_defaults in ("model", "openai"),
           f"sampling_defaults must be 'model' or 'openai', got {args.sampling_defaults!r}")
    _check(args.kv_cache_dtype == "auto" or args.kv_cache_dtype in _DTYPES or args.kv_cache_dtype in _FP8_KV,
           f"kv_cache_dtype must be auto or one of {', '.join([*_DTYPES, *_FP8_KV])}, got {args.kv_cache_dtype!r}")
    _check(0 < args.swa_full_tokens_ratio <= 1, "swa_full_tokens_ratio (SWA pool tokens per full pool token) must "
           f"be in (0, 1], got {args.swa_full_tokens_ratio!r}")
    _check_hicache(args)
    _check_tp(args, model)
    _check(args.moe_runner_backend in ("auto", "torch", "triton"),
           f"moe_runner_backend must be auto, torch or triton, got {args.moe_runner_backend!r}")
    _check(args.moe_runner_backend != "triton" or device != "cpu" or _triton_interpreting(),
           "moe_runner_backend triton runs kernels.moe's Triton kernels on a CUDA device (on CPU only in Triton's "
           "interpreter, TRITON_INTERPRET=1); on CPU use torch or auto")
    _check(args.fp8_gemm_backend in ("auto", "triton"), f"fp8_gemm_backend {args.fp8_gemm_backend!r} is not "
           "implemented by radixmesh: auto and triton are")
    _check(args.fp8_gemm_backend != "triton" or device != "cpu" or _triton_interpreting(),
           "fp8_gemm_backend triton runs fp8 products on Triton kernels on a CUDA device (on CPU only in Triton's "
           "interpreter, TRITON_INTERPRET=1); on CPU use auto")
    _check(not args.enable_expert_distribution_metrics or model.moe is not None,
           f"enable_expert_distribution_metrics counts the tokens routed to each expert: {model.architecture} has "
           "no mixture-of-experts layers")
    disable_radix_cache = args.disable_radix_cache or _pooling_needs_every_token(args, model)
    context = args.context_length or model.max_position_embeddings
    check_servable(model, context)  # before any weight is read: what we would serve wrong is refused here
    chunk = args.chunked_prefill_size
    if chunk is None:
        chunk = 8192 if device != "cpu" else 2048
    if chunk > 0:
        _check(chunk >= page, f"chunked_prefill_size ({chunk}) must be >= page_size ({page})")
        chunk = chunk // page * page
    dtype = resolve_dtype(args.dtype, model, device)
    attention = _resolve_attention(args, device, str(dtype).removeprefix("torch."), model.head_dim,
                                   model.mla is not None or has_sinks(model))
    if args.enable_deterministic_inference:
        _check_deterministic(args, model, device, attention)
    _check(args.cuda_graph_max_bs is None or args.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1")
    _check(not args.cuda_graph_bs or min(args.cuda_graph_bs) >= 1, "cuda_graph_bs sizes must be >= 1")
    return dataclasses.replace(
        args,
        device=device,
        quantization=quantization,
        disable_radix_cache=disable_radix_cache,
        page_size=page,
        context_length=context,
        chunked_prefill_size=chunk,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(dtype).removeprefix("torch.") if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        **attention,
        disable_cuda_graph=args.disable_cuda_graph or device == "cpu",
        # auto: the grouped-GEMM kernel on a GPU (checked there, at the weight-read bound from 64 tokens on; graphs
        # capture it), the plain-PyTorch twin elsewhere
        moe_runner_backend=args.moe_runner_backend if args.moe_runner_backend != "auto"
        else "triton" if device != "cpu" and model.moe is not None else "torch",
        cuda_graph_bs=tuple(sorted(set(args.cuda_graph_bs))) if args.cuda_graph_bs else None,
        mem_fraction_static=args.mem_fraction_static if args.mem_fraction_static is not None else 0.88,
        random_seed=args.random_seed if args.random_seed is not None else 42,
        tokenizer_path=args.tokenizer_path or args.model_path,
        **resolve_speculative(args),
        **resolve_lora(args, model),
    )


# timeout_s: bound on one store call; prefetch_timeout_s: the `timeout` prefetch policy's wait; capacity_bytes, ttl_s:
# the store's bounds (memory/file, redis); skip_slow_fetches (default true): skip most prefetches once fetching has
# been measured slower than prefilling; transport (kvstore only): "grpc" or "mooncake" (page bytes by the Mooncake
# transfer engine, straight from and into the host pool) and transfer_host, the address the kvstore reaches this
# worker's transfer engine at.
HICACHE_EXTRA_KEYS = ("timeout_s", "prefetch_timeout_s", "capacity_bytes", "ttl_s", "skip_slow_fetches", "transport",
                      "transfer_host")
STORAGE_TRANSPORTS = ("grpc", "mooncake")


# --quantization values (SGLang's) -> what the engine does: round an unquantized checkpoint's weights to fp8
# ("fp8"; SGLang's w8a8_fp8 does the same: fp8 weights per output row, activations quantized per token), or read
# the checkpoint's own (None: fp8 and mxfp4 checkpoints are read without the flag; modelopt and mxfp4 say which kind
# it must be)
QUANTIZATIONS = {"fp8": "fp8", "w8a8_fp8": "fp8", "modelopt": None, "modelopt_fp8": None, "mxfp4": None}


def _resolve_quantization(quantization: str | None, model: ModelConfig) -> str | None:
    _check(quantization is None or quantization in QUANTIZATIONS, f"quantization {quantization!r} is not implemented "
           f"by radixmesh yet: {', '.join(QUANTIZATIONS)} are (and fp8 checkpoints are read without the flag)")
    if quantization in ("modelopt", "modelopt_fp8"):
        quant = model.raw.get("quantization_config")
        _check(isinstance(quant, dict) and quant.get("quant_method") == "modelopt",  # (its quant_algo: check_servable)
               f"quantization {quantization!r} reads an NVIDIA ModelOpt FP8 checkpoint (hf_quant_config.json, or "
               f"quantization_config.quant_method 'modelopt' in config.json); {model.path} is not one: serve it "
               "without the flag, or with --quantization fp8 to round its weights to fp8")
    if quantization == "mxfp4":
        from radixmesh.engine.quantization.mxfp4 import is_mxfp4

        _check(is_mxfp4(model.raw), f"quantization 'mxfp4' reads an MXFP4 checkpoint (quantization_config.quant_method "
               f"'mxfp4' in config.json: GPT-OSS as published); {model.path} is not one: serve it without the flag")
    return QUANTIZATIONS[quantization] if quantization else None


def hicache_extra(args: EngineArgs) -> dict:
    """--hicache-storage-backend-extra-config as a dict (JSON object; keys: HICACHE_EXTRA_KEYS)."""
    if not args.hicache_storage_backend_extra_config:
        return {}
    try:
        extra = json.loads(args.hicache_storage_backend_extra_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {e}") from None
    _check(isinstance(extra, dict), "hicache_storage_backend_extra_config must be a JSON object")
    unknown = sorted(set(extra) - set(HICACHE_EXTRA_KEYS))
    _check(not unknown, f"unknown hicache_storage_backend_extra_config key(s) {unknown}; known: {HICACHE_EXTRA_KEYS}")
    transport = extra.get("transport", "grpc")
    _check(transport in STORAGE_TRANSPORTS,
           f"hicache_storage_backend_extra_config transport must be one of {STORAGE_TRANSPORTS}, got {transport!r}")
    _check(transport == "grpc" or args.hicache_storage_backend == "kvstore",
           "hicache_storage_backend_extra_config transport applies to the kvstore backend only")
    return extra


def _check_hicache(args: EngineArgs) -> None:
    from radixmesh.engine.cache.hierarchy import PREFETCH_POLICIES, WRITE_POLICIES

    _check(args.hicache_write_policy in WRITE_POLICIES,
           f"hicache_write_policy must be one of {WRITE_POLICIES}, got {args.hicache_write_policy!r}")
    _check(args.hicache_storage_prefetch_policy in PREFETCH_POLICIES, "hicache_storage_prefetch_policy must be one"
           f" of {PREFETCH_POLICIES}, got {args.hicache_storage_prefetch_policy!r}")
    from radixmesh.engine.cache.host_pool import IO_BACKENDS

    _check(args.hicache_io_backend is None or args.hicache_io_backend in IO_BACKENDS,
           f"hicache_io_backend must be one of {IO_BACKENDS}, got {args.hicache_io_backend!r}")
    _check(args.hicache_ratio > 0 and args.hicache_size >= 0, "hicache_ratio must be > 0 and hicache_size >= 0")
    _check(not args.enable_hierarchical_cache or not args.disable_radix_cache,
           "enable_hierarchical_cache needs the radix cache (drop disable_radix_cache)")
    _check(args.hicache_storage_backend is None or args.enable_hierarchical_cache,
           "hicache_storage_backend needs enable_hierarchical_cache (L3 pages pass through the host pool)")
    _check(args.kv_events_config is None or not args.disable_radix_cache,
           "kv_events_config needs the radix cache (events describe its pages)")
    hicache_extra(args)


def _check_deterministic(args: EngineArgs, model: ModelConfig, device: str, attention: dict) -> None:
    """What --enable-deterministic-inference covers (engine.batch_invariant): anything else is refused, not served
    with results that still depend on the batch."""
    _check(device == "cpu", "enable_deterministic_inference runs on CPU only so far: the GPU's Triton, FlashInfer and "
           "cuBLAS kernels choose tiles and split counts by batch size, and batch-invariant GPU kernels are not built")
    _check(args.speculative_algorithm is None, "enable_deterministic_inference does not cover speculative decoding "
           "yet (draft trees' verify rows)")
    _check(set(attention.values()) == {"torch_native"}, "enable_deterministic_inference runs attention on the "
           f"torch_native backend (each row alone); got {attention}")


def _check_tp(args: EngineArgs, model: ModelConfig) -> None:
    """Tensor parallelism's sizes, and what does not run under it yet (refused, not half-done)."""
    tp = args.tp_size
    _check(tp >= 1 and args.nnodes >= 1, "tp_size and nnodes must be >= 1")
    _check(tp % args.nnodes == 0, f"tp_size ({tp}) must be divisible by nnodes ({args.nnodes})")
    _check(0 <= args.node_rank < args.nnodes, f"node_rank ({args.node_rank}) must be in [0, nnodes={args.nnodes})")
    _check(args.nnodes == 1 or args.dist_init_addr, "nnodes > 1 needs dist_init_addr (rank 0's host:port)")
    _check(args.dist_timeout is None or args.dist_timeout > 0, "dist_timeout must be > 0 seconds")
    _check(args.base_gpu_id >= 0 and args.gpu_id_step >= 1, "base_gpu_id must be >= 0 and gpu_id_step >= 1")
    _check(args.ep_size in (1, tp), f"ep_size must be 1 or tp_size ({tp}): experts are placed whole on the tensor "
           f"parallel ranks; got {args.ep_size}")
    _check(args.ep_size == 1 or model.moe is not None,
           f"ep_size {args.ep_size} places experts on ranks: {model.architecture} has no mixture-of-experts layers")
    if args.ep_size > 1:
        _check(model.moe.num_experts % args.ep_size == 0,
               f"the model's {model.moe.num_experts} experts must be divisible by ep_size ({args.ep_size})")
    if tp == 1:
        return
    _check(model.num_heads % tp == 0,
           f"the model's {model.num_heads} attention heads must be divisible by tp_size ({tp})")
    kv = model.num_kv_heads
    _check(kv % tp == 0 or tp % kv == 0,
           f"the model's {kv} KV heads and tp_size ({tp}) must divide one another (KV heads are split, or "
           "replicated when there are fewer than ranks)")
    _check(model.intermediate_size % tp == 0,
           f"the model's intermediate_size ({model.intermediate_size}) must be divisible by tp_size ({tp})")


def _triton_interpreting() -> bool:
    from radixmesh.kernels.runtime import interpreting  # imported only when the triton MoE runner is asked for

    return interpreting()


def _pooling_needs_every_token(args: EngineArgs, model: ModelConfig) -> bool:
    """Mean pooling needs the hidden state of every prompt token, which a prefix-cache hit would skip: an embedding
    engine that mean-pools runs without the radix cache. Last-token pooling keeps it (see engine.pooling)."""
    if not args.is_embedding:
        return False
    from radixmesh.engine.pooling import Pooling, pooling_of

    if pooling_of(model.path) is not Pooling.MEAN:
        return False
    _check(not args.enable_hierarchical_cache, "a mean-pooling embedding model runs without the prefix cache: "
           "drop enable_hierarchical_cache")
    _check(args.kv_events_config is None, "a mean-pooling embedding model runs without the prefix cache: "
           "drop kv_events_config")
    return True


def _resolve_attention(args: EngineArgs, device: str, dtype: str, head_dim: int, latent: bool = False) -> dict:
    """attention_backend defaults by device and model; the prefill and decode backends default to it, except that
    with no backend flag at all a FlashInfer default decodes on Triton on Hopper and later
    (registry.default_decode_backend); a `latent` KV cache (multi-head latent attention), or heads with attention
    sinks (GPT-OSS), attend on Triton's kernels on CUDA (registry.default_latent_backend: FlashInfer's paged kernels
    take neither)."""
    from radixmesh.engine.attention.registry import (check_backend_name, default_backend, default_decode_backend,
                                                     default_latent_backend)

    names = {"attention_backend": args.attention_backend or
             (default_latent_backend(device) if latent else default_backend(device, dtype, head_dim))}
    names["prefill_attention_backend"] = args.prefill_attention_backend or names["attention_backend"]
    decode = names["attention_backend"]
    if args.attention_backend is None:
        decode = decode if latent else default_decode_backend(device, decode)
    names["decode_attention_backend"] = args.decode_attention_backend or decode
    for flag, name in names.items():
        check_backend_name(name, flag)
    return names


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES.get(name) or _FP8_KV[name])
