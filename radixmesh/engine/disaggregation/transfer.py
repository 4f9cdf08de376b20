"""The transfer-backend interface and what every backend shares: write byte ranges of registered local memory
into a peer's registered memory, identified by the peer's session id ("host:port").

KV pages move as runs: consecutive source pages that land on consecutive destination pages become one write, so a
prompt whose pages were allocated contiguously on both sides moves in one write per layer buffer."""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence


class TransferError(RuntimeError):
    """A write did not complete (peer gone, connection refused, injected fault). Nothing may be assumed about the
    destination bytes; the caller frees the room and reports the request."""


class Write(NamedTuple):
    """One contiguous write: `length` bytes from local address `src` to the peer's address `dst`."""

    src: int
    dst: int
    length: int


class TransferBackend(Protocol):
    session_id: str  # "host:port" peers address this backend by

    def register(self, ptr: int, nbytes: int) -> None:
        """Make [ptr, ptr + nbytes) readable and writable by peers (KV buffers, staging buffers)."""

    def unregister(self, ptr: int) -> None: ...

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        """Write every range into the peer's memory, blocking until all are done. Raises TransferError."""

    def close(self) -> None: ...


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, number of pages) for each maximal run in which both sides
    advance by one page together. The i-th source page goes to the i-th destination page."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


def page_writes(src_base: int, dst_base: int, page_bytes: int, src_pages: Sequence[int],
                dst_pages: Sequence[int]) -> list[Write]:
    """The writes that copy pages of one buffer (e.g. one layer's K cache) laid out as [num_pages, page_bytes]."""
    return [Write(src_base + s * page_bytes, dst_base + d * page_bytes, n * page_bytes)
            for s, d, n in page_runs(src_pages, dst_pages)]
