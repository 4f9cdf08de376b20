"""What the engine knows of prefill/decode disaggregation: a request's role, and what passes from the prefill side
to the decode side besides the KV pages. The services move the pages and the messages (see services/prefill and
services/worker); the engine only allocates, holds and frees.

Prefill role: the request is prefilled and samples its first token as usual, then, instead of decoding, its KV stays
pinned (`held`) and `on_ready(pages, first)` is called on the scheduler thread; the caller transfers the pages and
calls `Engine.release_kv(rid)`.

Decode role: the request waits in the pre-allocation queue until its prompt's KV fits (plus a reserve of
`num_reserved_decode_tokens` per active request); then slots are allocated (a cached prefix in the local radix
tree is reused and not transferred) and `on_allocated(pages, cached_len)` is called on the scheduler thread. The
caller fills the pages and calls `Engine.deliver_kv(rid, first)`; the request then decodes like any other.

Speculative decoding with an EAGLE head (engine.disaggregation.draft_state): the decode side sets
`DecodeRole.draft_wanted` before `on_allocated`, the prefill side's `FirstToken.draft` holds its head's state of the
prompt, and the caller passes on what `draft_wanted` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from radixmesh.engine.disaggregation.draft_state import DraftState, DraftWanted
from radixmesh.engine.request import LogprobList


@dataclass(slots=True)
class FirstToken:
    """The token the prefill side sampled, with what the request's logprob options asked for, in the scheduler's
    own per-token shapes (see Req.output_logprobs and Req.input_logprobs)."""

    token_id: int
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
    logprob: float | None = None
    top_logprobs: LogprobList = field(default_factory=list)
    token_ids_logprobs: LogprobList = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[LogprobList] = field(default_factory=list)
    input_token_ids_logprobs: list[LogprobList] = field(default_factory=list)
    # an EAGLE head's state of the prompt (prefill side: all of it; decode side: what was asked for and received)
    draft: DraftState | None = None


@dataclass(slots=True)
class PrefillRole:
    # (KV pages of the prompt in page order, the first token) -> None; called on the scheduler thread
    on_ready: Callable[[list[int], FirstToken], None]


@dataclass(slots=True)
class DecodeRole:
    # (destination pages for prompt tokens [cached_len, prompt_len), cached_len) -> None; on the scheduler thread
    on_allocated: Callable[[list[int], int], None]
    # Set by the caller while a peer may be writing into the pages: an abort then keeps them pinned until
    # Engine.release_kv, so a late write cannot land in pages another request reuses.
    in_transfer: bool = False
    # Set on the scheduler thread before on_allocated when the engine drafts with an EAGLE head: what its head lacks
    # of the prompt (engine.disaggregation.draft_state), for the caller to ask the prefill side for.
    draft_wanted: DraftWanted | None = None


Role = PrefillRole | DecodeRole
