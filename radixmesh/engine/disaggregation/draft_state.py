"""What an EAGLE draft head needs of a prompt besides the target's KV, passed from the prefill side to the decode side
of a prefill/decode pair (engine.speculative.draft_model runs the head).

A colocated engine's head catches up over the prompt at its first draft step: at each position it reads the target's
hidden state there (kept from the prefill) and writes its own KV. A decode worker has neither: the target's KV came
from the prefill worker, whose forward computed the hidden states. So the prefill side runs that catch-up itself once
the first token is sampled (its head's KV pool mirrors its target's slot for slot, and keeps the head's KV of cached
prefixes as the target's KV is kept), and hands over:

- the head's KV of the positions the decode side lacks, from `DraftWanted.start` (where the head KV of the decode
  side's own cached prefix ends) to the one before the last prompt position, with a flag per position saying
  whether the head read the target's hidden state there (it did not where the prefill side's prefix-cache hit held no
  head KV of these tokens: it read zeros, as a colocated engine's head does);
- the target's hidden state at the last prompt position, which the decode side's first catch-up reads to recompute
  that position (its head output is the first draft's input).

The hidden states of the other positions never travel: cached prefixes keep the head's KV, not hidden states, so the
head KV is what either side can always give. On the wire (format 1, DRAFT_FORMAT): the KV as, for each of the head's
KV buffers in order, its rows back to back, `kv_row_bytes[i]` bytes a row (a row is one position's
[num_kv_heads, head_dim] values in the pool's dtype); one byte (0 or 1) per row for the flags; the hidden state as
`width` values of `dtype`; all little-endian. A row of hidden state is the target's final hidden state (EAGLE,
`layers` empty) or the inputs of `layers` concatenated (EAGLE-3, engine.hidden_capture).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

DRAFT_FORMAT = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


def describe(layers: tuple[int, ...]) -> str:
    return f"the inputs of layers {list(layers)}" if layers else "the final hidden states"


@dataclass(frozen=True, slots=True)
class DraftWanted:
    """A decode side's request: the head KV of positions from `start` on (`kv_row_bytes`: its rows' size in each KV
    buffer), and the target's `layers` hidden states (`width` values) its head reads."""

    start: int
    layers: tuple[int, ...]
    width: int
    kv_row_bytes: tuple[int, ...]
    format: int = DRAFT_FORMAT


@dataclass(slots=True)
class DraftState:
    """One request's hand-over: head KV rows of positions [kv_start, kv_start + n) (`kv`: per buffer [n, row bytes]
    uint8; `read_features` [n] bool), and the target's hidden state `hidden` [width] at `hidden_position`."""

    layers: tuple[int, ...]
    kv_start: int
    kv: list[torch.Tensor]
    read_features: torch.Tensor
    hidden_position: int
    hidden: torch.Tensor

    @property
    def kv_rows(self) -> int:
        return self.read_features.shape[0]

    @property
    def width(self) -> int:
        return self.hidden.shape[0]

    @property
    def kv_row_bytes(self) -> tuple[int, ...]:
        return tuple(t.shape[1] for t in self.kv)

    def problem(self, wanted: DraftWanted) -> str | None:
        """Why this state cannot answer `wanted` (None: it can)."""
        if wanted.format != DRAFT_FORMAT:
            return f"draft state format {wanted.format} asked for, this worker writes format {DRAFT_FORMAT}"
        if tuple(wanted.layers) != self.layers or wanted.width != self.width:
            return (f"a head reading {describe(tuple(wanted.layers))} ({wanted.width} values a position) asks, this "
                    f"worker's head reads {describe(self.layers)} ({self.width} values)")
        if tuple(wanted.kv_row_bytes) != self.kv_row_bytes:
            return (f"the asking head's KV rows are {list(wanted.kv_row_bytes)} bytes in its buffers, this worker's "
                    f"{list(self.kv_row_bytes)} (another head, or --kv-cache-dtype?)")
        return None

    def since(self, start: int, max_bytes: int | None = None) -> "DraftState":
        """The KV rows of positions from `start` on (none where they would begin after it: the decode side's
        catch-up then recomputes them all; also none past `max_bytes`)."""
        end = self.kv_start + self.kv_rows
        first = min(max(start, self.kv_start), end)
        n = end - first
        if first > start or (max_bytes is not None and n * sum(self.kv_row_bytes) > max_bytes):
            first, n = end, 0
        at = first - self.kv_start
        return DraftState(self.layers, first, [t[at:at + n] for t in self.kv], self.read_features[at:at + n],
                          self.hidden_position, self.hidden)

    def to_wire(self) -> dict:
        """The format-1 fields: kv, kv_read_features, dtype, hidden (bytes, and the hidden state's dtype name)."""
        _little_endian()
        hidden = self.hidden.detach().to("cpu").contiguous()
        if hidden.dtype not in _NAMES:
            raise ValueError(f"a hidden state of dtype {hidden.dtype} cannot be sent (format {DRAFT_FORMAT} carries "
                             f"{', '.join(DTYPES)})")
        kv = b"".join(t.to("cpu").contiguous().numpy().tobytes() for t in self.kv)
        return {"kv": kv, "kv_read_features": self.read_features.to(torch.uint8).numpy().tobytes(),
                "dtype": _NAMES[hidden.dtype], "hidden": hidden.view(torch.uint8).numpy().tobytes()}

    @classmethod
    def from_wire(cls, fmt: int, layers: tuple[int, ...], width: int, kv_row_bytes: tuple[int, ...], kv_start: int,
                  kv_rows: int, kv: bytes, read_features: bytes, hidden_position: int, dtype: str,
                  hidden: bytes) -> "DraftState":
        """The state a peer sent; ValueError when it is not well-formed format 1."""
        if fmt != DRAFT_FORMAT:
            raise ValueError(f"draft state in format {fmt}; this worker reads format {DRAFT_FORMAT}")
        if dtype not in DTYPES:
            raise ValueError(f"a hidden state of dtype {dtype!r}; format {DRAFT_FORMAT} carries {', '.join(DTYPES)}")
        _little_endian()
        size = torch.empty((), dtype=DTYPES[dtype]).element_size()
        sizes = [("kv", kv, kv_rows * sum(kv_row_bytes)), ("kv_read_features", read_features, kv_rows),
                 ("hidden", hidden, width * size)]
        for name, data, need in sizes:
            if len(data) != need:
                raise ValueError(f"draft state: {name} needs {need} bytes ({kv_rows} KV rows of {list(kv_row_bytes)} "
                                 f"bytes, {width} {dtype} values), got {len(data)}")
        flat = _bytes(kv)
        parts, at = [], 0
        for row in kv_row_bytes:
            parts.append(flat[at:at + kv_rows * row].view(kv_rows, row))
            at += kv_rows * row
        return cls(tuple(layers), kv_start, parts, _bytes(read_features).bool(), hidden_position,
                   _bytes(hidden).view(DTYPES[dtype]))


def kv_rows_of(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `slots` in each of `pool`'s KV buffers (engine.cache.kv_pool.KVPool), as [n, row bytes] uint8
    copies on the pool's device."""
    index = slots.to(pool.buffers()[0].device)
    return [_by_row(t).index_select(0, index) for t in pool.buffers()]


def write_kv_rows(pool, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """Rows [n, row bytes] (as `kv_rows_of` gives them) into `slots` of each of `pool`'s KV buffers."""
    buffers = pool.buffers()
    index = slots.to(buffers[0].device)
    for t, r in zip(buffers, rows, strict=True):
        _by_row(t).index_copy_(0, index, r.to(t.device))


def row_bytes(pool) -> tuple[int, ...]:
    """Bytes of one slot in each of `pool`'s KV buffers."""
    return tuple(t[0].numel() * t.element_size() for t in pool.buffers())


def _by_row(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1).view(torch.uint8)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _little_endian() -> None:
    if sys.byteorder != "little":  # (tensors' bytes are in the host's order; the wire's is little-endian)
        raise ValueError("draft states travel little-endian: this host is big-endian")
