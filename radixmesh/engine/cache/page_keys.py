"""Chained page keys: the names of KV pages outside one worker (L3 store keys, KV events, the global index).

key(page i) = blake2b-128(key(page i-1) || the page's token ids as little-endian int32), and the chain starts from a
root bound to the KV layout and the tenant namespace. So a key identifies every token before it too, two layouts or
two tenants never share a key, and any process (a worker, the kvstore's index) derives the same keys from the same
tokens. Only full pages have keys.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from radixmesh.engine.cache.storage import KvLayout

KEY_BYTES = 16
_DOMAIN = b"radixmesh/kv-page/v1\0"


def namespace_root(layout: KvLayout, tenant: str = "") -> bytes:
    """The parent key of a namespace's first page."""
    return hashlib.blake2b(_DOMAIN + layout.tag() + b"\0" + tenant.encode(), digest_size=KEY_BYTES).digest()


def chain_keys(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens`, chained under `parent` (a root or the key of the page before)."""
    n = len(tokens) // page_size
    if n == 0:
        return []
    raw = np.asarray(tokens[: n * page_size], dtype="<i4").tobytes()
    step = page_size * 4
    keys, prev = [], parent
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def prompt_keys(layout: KvLayout, tenant: str, tokens: Sequence[int]) -> list[bytes]:
    return chain_keys(namespace_root(layout, tenant), tokens, layout.page_size)
