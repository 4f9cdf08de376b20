"""kvstore protos <-> engine types, with the checks on input at the service's edge (ValueError: INVALID_ARGUMENT)."""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from radixmesh.engine.cache.storage import DTYPE_BYTES, KvLayout, StoredPage
from radixmesh.engine.cache.storage_backends.base import MAX_KEY_BYTES
from radixmesh.v1 import kvstore_pb2, worker_pb2
from radixmesh.services.kvstore.index import Tier, WorkerMatch

DTYPES = tuple(DTYPE_BYTES)
_TIERS = {worker_pb2.KV_TIER_DEVICE: Tier.DEVICE, worker_pb2.KV_TIER_HOST: Tier.HOST}


def layout_from_proto(message: kvstore_pb2.KvLayout) -> KvLayout:
    if message.dtype not in DTYPES:
        raise ValueError(f"layout.dtype must be one of {', '.join(DTYPES)}, got {message.dtype!r}")
    for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(message, name) <= 0:
            raise ValueError(f"layout.{name} must be > 0, got {getattr(message, name)}")
    if message.kv_buffers not in (0, 1, 2):
        raise ValueError(f"layout.kv_buffers must be 1 or 2 (0: 2), got {message.kv_buffers}")
    return KvLayout(message.model, message.page_size, message.dtype, message.num_layers, message.num_kv_heads,
                    message.head_dim, message.kv_buffers or 2)


def request_layout(request) -> KvLayout | None:
    """The request's layout; None when it names none (no layout, or page_size 0)."""
    if not request.HasField("layout") or request.layout.page_size == 0:
        return None
    return layout_from_proto(request.layout)


def layout_to_proto(layout: KvLayout) -> kvstore_pb2.KvLayout:
    return kvstore_pb2.KvLayout(model=layout.model, page_size=layout.page_size, dtype=layout.dtype,
                                num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                head_dim=layout.head_dim, kv_buffers=layout.kv_buffers)


def check_keys(keys: Sequence[bytes], what: str = "keys") -> list[bytes]:
    for i, key in enumerate(keys):
        if not key:
            raise ValueError(f"{what}[{i}] is empty")
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"{what}[{i}] is {len(key)} bytes; a key has at most {MAX_KEY_BYTES}")
    return list(keys)


def pages_from_proto(pages: Sequence[kvstore_pb2.KvPage], layout: KvLayout | None) -> list[StoredPage]:
    """The pages, checked: non-empty keys and, under a layout, data of exactly the layout's page size."""
    check_keys([p.key for p in pages], "pages[].key")
    if layout is not None:
        expect = layout.page_bytes
        for i, p in enumerate(pages):
            if len(p.data) != expect:
                raise ValueError(f"pages[{i}].data is {len(p.data)} bytes; a page of layout {layout.tag().decode()} "
                                 f"is {expect} bytes")
    return [StoredPage(p.key, p.data, p.checksum) for p in pages]


class TransferredPages(NamedTuple):
    """Pages of a BatchSet whose bytes lie in the caller's registered memory."""

    session_id: str
    keys: list[bytes]
    checksums: list[int]
    lengths: list[int]
    addresses: list[int]


def transferred_pages_from_proto(request: kvstore_pb2.BatchSetRequest, layout: KvLayout | None,
                                 max_bytes: int) -> TransferredPages:
    pages, transfer = request.pages, request.transfer
    if not transfer.session_id:
        raise ValueError("transfer.session_id is required (the caller's transfer engine, host:port)")
    if len(transfer.addresses) != len(pages):
        raise ValueError(f"transfer.addresses has {len(transfer.addresses)} entries for {len(pages)} pages")
    keys = check_keys([p.key for p in pages], "pages[].key")
    for i, p in enumerate(pages):
        if p.data:
            raise ValueError(f"pages[{i}] carries data in a transfer-engine BatchSet (its bytes are read from "
                             "transfer.addresses)")
        if p.length <= 0 or (layout is not None and p.length != layout.page_bytes):
            expect = f"the layout's {layout.page_bytes}" if layout is not None else "> 0"
            raise ValueError(f"pages[{i}].length is {p.length}; expected {expect}")
    total = sum(p.length for p in pages)
    if total > max_bytes:
        raise ValueError(f"{total} bytes of pages in one transfer-engine BatchSet; at most {max_bytes}")
    return TransferredPages(transfer.session_id, keys, [p.checksum for p in pages], [p.length for p in pages],
                            list(transfer.addresses))


def page_heads_to_proto(pages: Iterable[StoredPage]) -> list[kvstore_pb2.KvPage]:
    """The pages without their bytes: key, checksum and length (the bytes travel by the transfer engine)."""
    return [kvstore_pb2.KvPage(key=bytes(p.key), checksum=p.checksum, length=len(p.data)) for p in pages]


def pages_to_proto(pages: Iterable[StoredPage]) -> list[kvstore_pb2.KvPage]:
    return [kvstore_pb2.KvPage(key=bytes(p.key), data=bytes(p.data), checksum=p.checksum) for p in pages]


def tier_from_proto(tier: int) -> Tier | None:
    """None for KV_TIER_UNSPECIFIED or an unknown value."""
    return _TIERS.get(tier)


def match_to_proto(m: WorkerMatch) -> kvstore_pb2.WorkerMatch:
    return kvstore_pb2.WorkerMatch(worker_url=m.worker_url, matched_tokens=m.matched_tokens,
                                   device_tokens=m.device_tokens, host_tokens=m.host_tokens,
                                   storage_tokens=m.storage_tokens)


def match_from_proto(m: kvstore_pb2.WorkerMatch) -> WorkerMatch:
    return WorkerMatch(m.worker_url, m.device_tokens, m.host_tokens, m.storage_tokens)


STATS_FIELDS = ("pages", "bytes", "capacity_bytes", "get_hits", "get_misses", "sets", "evictions", "corrupt_pages")


TRANSFER_FIELDS = ("transfer_bytes_in", "transfer_bytes_out")


def stats_to_proto(backend: str, stats: dict, indexed_workers: int, indexed_pages: int, transfer_session: str = "",
                   transfer: dict | None = None) -> kvstore_pb2.GetStatsResponse:
    transfer = transfer or {}
    return kvstore_pb2.GetStatsResponse(backend=backend, indexed_workers=indexed_workers, indexed_pages=indexed_pages,
                                        transfer_session=transfer_session,
                                        **{name: int(transfer.get(name, 0)) for name in TRANSFER_FIELDS},
                                        **{name: int(stats.get(name, 0)) for name in STATS_FIELDS})


def stats_from_proto(response: kvstore_pb2.GetStatsResponse) -> dict:
    out = {name: getattr(response, name) for name in STATS_FIELDS + TRANSFER_FIELDS}
    out.update(backend=response.backend, indexed_workers=response.indexed_workers,
               indexed_pages=response.indexed_pages, transfer_session=response.transfer_session)
    return out
