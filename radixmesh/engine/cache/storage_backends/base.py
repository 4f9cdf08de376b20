"""What every storage backend shares: its counters, the stored form of a page (a checksum header, then the data)
and the checks on keys and pages at its edge."""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Iterable, NamedTuple

from radixmesh.engine.cache.storage import StoredPage, intact

# The stored value of a page in redis and Mooncake: CRC-32 of the data (little-endian uint32), then the data.
VALUE_HEADER = struct.Struct("<I")
# Store keys of remote backends: this prefix, then the page key (bytes in redis, hex in Mooncake).
KEY_PREFIX = b"rmkv:"
# Page keys are chained hashes (16 bytes); the bound keeps file names under the 255-byte limit.
MAX_KEY_BYTES = 100


@dataclass(slots=True)
class Counters:
    """Per-backend counts since open. Hits and misses count pages: a get of n keys that returns h pages adds h hits
    and n - h misses."""

    get_hits: int = 0
    get_misses: int = 0
    sets: int = 0
    rejected: int = 0  # pages `set` refused (data not matching the checksum, larger than the capacity)
    evictions: int = 0
    corrupt_pages: int = 0  # pages `get` found damaged and deleted

    def as_dict(self) -> dict:
        return asdict(self)

    def count_get(self, requested: int, returned: int) -> None:
        self.get_hits += returned
        self.get_misses += requested - returned


def check_keys(keys: Iterable[bytes]) -> None:
    """Raises ValueError for a key that is not non-empty bytes of at most MAX_KEY_BYTES."""
    for key in keys:
        if not isinstance(key, (bytes, bytearray)) or not key or len(key) > MAX_KEY_BYTES:
            shown = key[:MAX_KEY_BYTES + 1].hex() if isinstance(key, (bytes, bytearray)) else repr(key)
            raise ValueError(f"a page key must be 1 to {MAX_KEY_BYTES} bytes, got {shown!r}")


def leading_hits(found: Iterable) -> int:
    """How many of the per-key existence answers, from the first, are true."""
    n = 0
    for hit in found:
        if not hit:
            break
        n += 1
    return n


class Split(NamedTuple):
    good: list[StoredPage]
    rejected: int


def split_intact(pages: Iterable[StoredPage]) -> Split:
    """The pages whose data matches their checksum (in order), and how many did not."""
    good, bad = [], 0
    for page in pages:
        if intact(page):
            good.append(page)
        else:
            bad += 1
    return Split(good, bad)


def pack(page: StoredPage) -> bytes:
    return VALUE_HEADER.pack(page.checksum) + bytes(page.data)


def unpack(key: bytes, value: bytes | None) -> StoredPage | None:
    """The page a stored value holds; None for a missing value or one too short to hold the header."""
    if value is None or len(value) < VALUE_HEADER.size:
        return None
    (crc,) = VALUE_HEADER.unpack_from(value)
    return StoredPage(key, bytes(memoryview(value)[VALUE_HEADER.size:]), crc)
