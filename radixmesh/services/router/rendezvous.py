"""Rendezvous (highest-random-weight) hashing of a prompt over worker URLs: every router replica that sees the same
candidates sends the same prompt to the same worker, with no shared state; removing a worker moves only the prompts
that went to it. The key is the prompt's first HASH_TOKENS tokens, so prompts that share that much of a prefix land
together (where their cache will be). Hashes are blake2b, never Python's per-process salted hash()."""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Sequence, TypeVar

HASH_TOKENS = 128

T = TypeVar("T")


def prompt_key(input_ids: Sequence[int]) -> bytes:
    """A stable 16-byte digest of the prompt's first HASH_TOKENS token ids (int32, little-endian)."""
    head = array.array("i", input_ids[:HASH_TOKENS])
    if sys.byteorder == "big":
        head.byteswap()
    return hashlib.blake2b(head.tobytes(), digest_size=16).digest()


def score(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "little")


def rendezvous(candidates: Sequence[T], key: bytes, url_of=lambda c: c.url) -> T:
    """The candidate whose URL scores highest for `key` (equal scores, practically impossible: the greater URL)."""
    return max(candidates, key=lambda c: (score(key, url_of(c)), url_of(c)))
