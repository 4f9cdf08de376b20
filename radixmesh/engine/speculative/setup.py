"""Speculative decoding's parts of an engine's start: the draft model or EAGLE head (its arguments, config and
runner), the hidden states the target keeps for a head, and the scheduler's speculative steps."""

from __future__ import annotations

import dataclasses

from radixmesh.engine.config import EngineArgs, resolve_args
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.scheduler.spec_steps import SpecSteps
from radixmesh.engine.speculative.config import EAGLES, max_draft
from radixmesh.engine.speculative.draft_model import DraftModel
from radixmesh.engine.speculative.eagle_head import EAGLE, EAGLE3, as_draft_config, eagle3_layers
from radixmesh.engine.speculative.nextn import NEXTN_HEAD, nextn_config
from radixmesh.engine.models.attention_spec import layer_windows
from radixmesh.engine.speculative.ngram import NgramCorpus, NgramIndex
from radixmesh.engine.speculative.tree import TreeShape
from radixmesh.engine.speculative.tree_draft import TreeDrafter

# decode attention backends that verify a draft tree (batch.tree_mask): Triton and torch_native mask it, FlashInfer
# lists each tree row's keys instead (engine.attention.flashinfer_backend; no windows there; its tree rows run eagerly).
# Every registered backend today; one added to the registry is refused for trees until it joins.
TREE_BACKENDS = ("triton", "torch_native", "flashinfer")
# the target's arguments a draft runs with (its one-token steps replay CUDA graphs of their own)
_DRAFT_KEEPS = ("dtype", "kv_cache_dtype", "device", "context_length", "page_size", "prefill_attention_backend",
                "decode_attention_backend", "random_seed", "load_format", "moe_runner_backend", "disable_cuda_graph",
                "cuda_graph_max_bs", "cuda_graph_bs")


def refuse_head_as_model(config: ModelConfig) -> None:
    if config.architecture in (EAGLE, EAGLE3, NEXTN_HEAD):
        raise ValueError(f"{config.path} is an EAGLE draft head ({config.architecture}): serve its target model "
                         "with --speculative-algorithm EAGLE/EAGLE3 --speculative-draft-model-path pointing here")


def draft_config(args: EngineArgs, target: ModelConfig) -> tuple[EngineArgs, ModelConfig] | None:
    """STANDALONE's draft model or an EAGLE head: its resolved arguments (the target's device, dtypes, pages,
    attention backends and CUDA graphs) and config; None without one. Refused unless it shares the target's
    vocabulary (and, for a head, its hidden size)."""
    algo = args.speculative_algorithm
    if algo not in ("STANDALONE", *EAGLES):
        return None
    if args.speculative_eagle_topk > 1:
        _check_tree(args, target)
    path = args.speculative_draft_model_path
    config = ModelConfig.from_path(path)
    nextn = nextn_config(config) if algo == "EAGLE" else None
    if nextn is not None:  # the model's own multi-token-prediction layer (SGLang's NEXTN)
        config = nextn
    elif algo in EAGLES and path == args.model_path:
        raise ValueError(f"speculative_algorithm NEXTN (EAGLE with the model as its own draft) drafts with the "
                         f"model's multi-token-prediction layers, and {path} ({config.architecture}) has none "
                         "(num_nextn_predict_layers)")
    elif algo in EAGLES:
        config = as_draft_config(config, algo)
        if config.hidden_size != target.hidden_size:
            raise ValueError(f"the {algo} head's hidden size ({config.hidden_size}, {path}) differs from the "
                             f"target's ({target.hidden_size}): it was trained for another model")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({config.vocab_size} tokens, {path}) differs from the "
                         f"target's ({target.vocab_size}): a draft must share the target's tokenizer")
    draft = EngineArgs.from_kwargs(path, **{k: getattr(args, k) for k in _DRAFT_KEEPS}, skip_tokenizer_init=True,
                                   log_level=args.log_level)
    return resolve_args(draft, config), config


def _check_tree(args: EngineArgs, target: ModelConfig) -> None:
    """Draft trees need a decode attention backend with the tree mask, and windows longer than the tree is deep: a
    tree row's window counts back from its position, and an ancestor's table index is not its position, so only a
    window that shows every ancestor whatever their indices is exact (kernels.decode_attention)."""
    topk, backend = args.speculative_eagle_topk, args.decode_attention_backend
    if backend not in TREE_BACKENDS:  # (a tree's rows are decode rows; prefills need no mask)
        raise ValueError(f"speculative_eagle_topk {topk} (a draft tree) verifies with a tree mask, which the {backend} "
                         f"attention backend does not have (decode_attention_backend): use --decode-attention-backend "
                         f"{' or '.join(TREE_BACKENDS)}, or speculative_eagle_topk 1")
    windows = [w for w in layer_windows(target, args.context_length) if w is not None]
    if windows and backend == "flashinfer":
        raise ValueError(f"speculative_eagle_topk {topk} (a draft tree) under sliding windows verifies with Triton or "
                         f"torch_native: FlashInfer's tree rows list their keys with no window: use "
                         f"--decode-attention-backend triton, or speculative_eagle_topk 1")
    if windows and min(windows) <= args.speculative_num_steps:
        raise ValueError(f"speculative_eagle_topk {topk} (a draft tree) needs sliding windows longer than the tree is "
                         f"deep: this model's shortest window is {min(windows)} tokens, speculative_num_steps "
                         f"{args.speculative_num_steps}; use fewer steps or speculative_eagle_topk 1")


def capture_layers(args: EngineArgs, draft: tuple[EngineArgs, ModelConfig] | None,
                   target: ModelConfig) -> tuple[int, ...] | None:
    """The target's hidden states an EAGLE head reads (engine.hidden_capture): its final ones (EAGLE), three
    layers' inputs (EAGLE3); None: no draft reads any."""
    algo = args.speculative_algorithm
    if draft is None or algo not in EAGLES:
        return None
    return eagle3_layers(draft[1], target.num_layers) if algo == "EAGLE3" else ()


def draft_runner(algorithm: str, draft: tuple[EngineArgs, ModelConfig], target: ModelRunner) -> ModelRunner:
    """The draft's runner: its KV pool mirrors the target's slot for slot (the target's table, as many tokens),
    budgeted with the target's pool; a head uses the target's embedding (and output layer), and a head drafting
    trees captures its CUDA graphs for K rows per request under a tree mask."""
    args, config = draft
    args = dataclasses.replace(args, max_total_tokens=target.kv_pool.capacity_tokens,
                               max_running_requests=target.max_running_requests)
    shared = target.model if algorithm in EAGLES else None
    topk = (target.args.speculative_eagle_topk or 1) if algorithm in EAGLES else 1
    return ModelRunner(args, config, table=target.req_to_token, shared_with=shared, draft_topk=topk)


def spec_steps(args: EngineArgs, cache, runner: ModelRunner, drafts: ModelRunner | None) -> SpecSteps | None:
    """Speculative decoding's scheduler steps, when --speculative-algorithm is given."""
    if args.speculative_algorithm is None:
        return None
    # a verify runs a row per token: within the largest CUDA graph where there are graphs
    max_rows = runner.graphs.max_bs if runner.graphs is not None else None
    if drafts is not None:
        layers = runner.capture.layers if runner.capture is not None else ()
        drafter = DraftModel(drafts, eagle=args.speculative_algorithm in EAGLES, layers=layers)
        if drafter.head is not None:
            # the head's pool mirrors the target's slot for slot: a tail's copy of part of a cached page
            # (engine.cache.tails) copies the head's KV too, else its catch-up would read zeros there; a freed
            # page's records go, else a later owner's prefix hit could keep the head's KV of another context
            cache.page_followers.append(drafter)
        tree = None
        if args.speculative_eagle_topk > 1:
            tree = TreeDrafter(drafter, TreeShape(args.speculative_eagle_topk, args.speculative_num_steps,
                                                  args.speculative_num_draft_tokens))
        return SpecSteps(cache, max_draft(args), None, args.context_length, drafter, max_rows=max_rows, tree=tree)
    windows = (args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)
    corpus = NgramCorpus(args.speculative_ngram_capacity)
    return SpecSteps(cache, max_draft(args), lambda req: NgramIndex(*windows, corpus), args.context_length,
                     corpus=corpus, max_rows=max_rows)
