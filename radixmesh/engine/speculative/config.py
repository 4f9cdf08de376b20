"""Speculative decoding's flags (SGLang's names), checked and resolved with the rest of the engine's arguments."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from radixmesh.engine.speculative.tree import MAX_TREE_KEYS, TreeShape

log = logging.getLogger(__name__)

ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")  # what runs here
DRAFTED = ("STANDALONE", "EAGLE", "EAGLE3")  # a draft model runs a chain of steps
EAGLES = ("EAGLE", "EAGLE3")  # a head reading the target's hidden states: may draft trees (topk > 1)
# SGLang's NEXTN: EAGLE with the model's own multi-token-prediction layer (DeepSeek-V3's; engine.speculative.nextn)
# as the head, read from the model's checkpoint unless a draft path is given
NEXTN = "NEXTN"
PLANNED: tuple[str, ...] = ()  # SGLang's others: refused by name until they land
NGRAM_MATCH_TYPES = ("BFS", "PROB")
NGRAM_DEFAULT_DRAFT_TOKENS = 8  # the newest token and up to 7 drafted ones per verify
DEFAULT_STEPS = 3  # draft forwards per verify (SGLang's draft-model default chain: 3 steps, 4 tokens)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def resolve_speculative(args: Any) -> dict:
    """`args`: engine.config.EngineArgs (not imported: engine.config imports this). The speculative fields resolved (algorithm upper-cased, defaults filled), as EngineArgs replacements; {}
    when speculation is off. Raises ValueError on what we cannot run."""
    algo = args.speculative_algorithm
    if algo is None:
        return {}
    algo = str(algo).upper()
    nextn = {}
    if algo == NEXTN:
        algo = "EAGLE"
        nextn = {"speculative_draft_model_path": args.speculative_draft_model_path or args.model_path}
        args = dataclasses.replace(args, **nextn)
    _check(algo not in PLANNED, f"speculative_algorithm {algo} is not implemented by radixmesh yet: "
           f"{', '.join(ALGORITHMS)} is")
    named = ALGORITHMS + (NEXTN,) + PLANNED
    _check(algo in ALGORITHMS, f"speculative_algorithm must be one of {', '.join(named)}, "
           f"got {args.speculative_algorithm!r}")
    _check(not args.is_embedding, "speculative decoding speeds up generation: an embedding engine (is_embedding) "
           "generates nothing")
    _check(args.speculative_accept_threshold_single == 1.0 and args.speculative_accept_threshold_acc == 1.0,
           "speculative_accept_threshold_single and _acc below 1.0 accept drafts the target would not have chosen "
           "(outputs no longer follow the model's distribution); radixmesh verifies exactly: leave them at 1.0")
    _check(args.speculative_token_map is None, "speculative_token_map (FR-Spec's reduced draft vocabulary) is not "
           "implemented yet")
    _check(args.speculative_attention_mode == "decode", "speculative_attention_mode: verify forwards run as decode "
           "batches of a row per token, in the decode backend's kernels and CUDA graphs ('decode'); 'prefill' (an "
           f"extend over the request's KV) is not implemented; got {args.speculative_attention_mode!r}")
    topk = args.speculative_eagle_topk if args.speculative_eagle_topk is not None else 1
    _check(isinstance(topk, int) and topk >= 1, f"speculative_eagle_topk must be an integer >= 1, got {topk!r}")
    _check(topk == 1 or algo in EAGLES, f"speculative_eagle_topk {topk}: draft trees are drafted by an EAGLE head "
           f"(speculative_algorithm EAGLE or EAGLE3); {algo} drafts one chain (topk 1)")
    if topk > 1:
        n, steps = _tree(args, algo, topk)
    elif algo in DRAFTED:
        n = _chain(args, algo)
    else:
        _check(args.speculative_draft_model_path is None,
               f"speculative_algorithm {algo} drafts from the request's own tokens: it takes no "
               "speculative_draft_model_path")
        n = args.speculative_num_draft_tokens if args.speculative_num_draft_tokens is not None \
            else NGRAM_DEFAULT_DRAFT_TOKENS
    _check(isinstance(n, int) and n >= 2, "speculative_num_draft_tokens counts the newest token and the drafted "
           f"ones a verify checks: it must be an integer >= 2, got {n!r}")
    lo, hi = args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size
    _check(1 <= lo <= hi, "speculative_ngram_min_match_window_size and ..._max_match_window_size must satisfy "
           f"1 <= min <= max, got {lo} and {hi}")
    b_lo, b_hi = args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth
    _check(1 <= b_lo <= b_hi, "speculative_ngram_min_bfs_breadth and ..._max_bfs_breadth must satisfy "
           f"1 <= min <= max, got {b_lo} and {b_hi}")
    _check(args.speculative_ngram_match_type in NGRAM_MATCH_TYPES, "speculative_ngram_match_type must be one of "
           f"{NGRAM_MATCH_TYPES}, got {args.speculative_ngram_match_type!r}")
    _check(args.speculative_ngram_branch_length >= 1, "speculative_ngram_branch_length must be >= 1")
    _check(args.speculative_ngram_capacity >= 1, "speculative_ngram_capacity must be >= 1")
    if not args.disable_overlap_schedule:
        log.info("speculative decoding: the overlap scheduler is off (a draft needs the previous step's tokens)")
    return {"speculative_algorithm": algo, "speculative_num_draft_tokens": n, "speculative_eagle_topk": topk,
            "speculative_num_steps": steps if topk > 1 else n - 1, "disable_overlap_schedule": True, **nextn}


def _chain(args: Any, algo: str) -> int:
    """A draft model's num_draft_tokens: a chain of num_steps draft forwards verifies num_steps + 1 tokens (either
    flag gives the other; both must agree)."""
    what = "a smaller model" if algo == "STANDALONE" else "an EAGLE head"
    _check(args.speculative_draft_model_path is not None,
           f"speculative_algorithm {algo} drafts with {what}: give speculative_draft_model_path")
    steps, n = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is None:
        steps = n - 1 if isinstance(n, int) else DEFAULT_STEPS
    _check(isinstance(steps, int) and steps >= 1, f"speculative_num_steps must be an integer >= 1, got {steps!r}")
    _check(n is None or n == steps + 1, f"speculative_num_draft_tokens ({n}) must be speculative_num_steps + 1 "
           f"({steps + 1}): a chain of draft steps (topk 1) verifies the newest token and one drafted per step")
    return steps + 1


def _tree(args: Any, algo: str, topk: int) -> tuple[int, int]:
    """A draft tree's num_draft_tokens and num_steps (engine.speculative.tree): steps default to 3, draft tokens to
    1 + steps * topk (at most 64); the tree's nodes must be candidates the steps propose, and a verify row's or a
    draft step's masked span at most 64 keys."""
    _check(args.speculative_draft_model_path is not None,
           f"speculative_algorithm {algo} drafts with an EAGLE head: give speculative_draft_model_path")
    steps = args.speculative_num_steps if args.speculative_num_steps is not None else DEFAULT_STEPS
    _check(isinstance(steps, int) and steps >= 1, f"speculative_num_steps must be an integer >= 1, got {steps!r}")
    n = args.speculative_num_draft_tokens
    if n is None:
        n = min(MAX_TREE_KEYS, 1 + steps * topk)
    shape = TreeShape(topk, steps, n) if isinstance(n, int) else None
    _check(shape is not None and n >= 2, "speculative_num_draft_tokens counts the newest token and the drafted "
           f"ones a verify checks: it must be an integer >= 2, got {n!r}")
    _check(shape.nodes <= shape.candidates, f"speculative_num_draft_tokens {n}: a tree of {steps} steps with topk "
           f"{topk} proposes {shape.candidates} nodes, so at most {shape.candidates + 1} draft tokens")
    _check(n <= MAX_TREE_KEYS and (steps - 1) * topk <= MAX_TREE_KEYS, f"a draft tree's verify rows attend to "
           f"at most {MAX_TREE_KEYS} tree slots: speculative_num_draft_tokens ({n}) and (speculative_num_steps - 1) "
           f"* speculative_eagle_topk ({(steps - 1) * topk}) must be <= {MAX_TREE_KEYS}")
    return n, steps


def max_draft(args: Any) -> int:
    """Drafted tokens a verify checks per request at most (0: speculation off)."""
    if args.speculative_algorithm is None:
        return 0
    if args.speculative_algorithm in DRAFTED:
        return args.speculative_num_draft_tokens - 1
    return min(args.speculative_num_draft_tokens - 1, args.speculative_ngram_branch_length)
