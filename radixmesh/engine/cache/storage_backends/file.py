"""`file`: pages as files in a directory (options.url), so they outlive the process.

One file per page: `<dir>/<first key byte, hex>/<key hex>.page`, a 16-byte header (magic, CRC-32, data length) then
the data. Writes go to a temporary file in the same folder and are renamed into place (os.replace), so a reader never
sees half a page; files are not fsynced (a page lost in a power cut is recomputed, like any miss). With
capacity_bytes > 0 the data bytes are bounded by evicting the least recently used pages: recency is the file's
mtime, refreshed on every hit, and the in-memory index is rebuilt from the directory at open, so a new instance over
the same directory sees the pages and their order. One process owns a directory at a time.
"""

from __future__ import annotations

import os
import struct
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from radixmesh.engine.cache.storage import StorageError, StorageOptions, StoredPage, checksum
from radixmesh.engine.cache.storage_backends.base import Counters, check_keys, split_intact

MAGIC = b"RMKV"
HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the data, data length in bytes
SUFFIX = ".page"
TMP_SUFFIX = ".tmp"


class FileStorage:
    """Thread-safe: one lock guards the index (key -> data bytes, least recently used first); file reads and the
    writes of temporary files happen outside it."""

    def __init__(self, root: str | os.PathLike, capacity_bytes: int = 0):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._counters = Counters()
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as e:
            raise StorageError(f"file storage at {self.root}: {e}") from e

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _rebuild(self) -> None:
        """Index every page file by mtime (oldest first); drop temporary files a crash left behind."""
        found = []
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, key, max(st.st_size - HEADER.size, 0)))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._bytes += size
        with self._lock:
            self._evict()

    def exists(self, keys: list[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
            return n

    def get(self, keys: list[bytes]) -> list[StoredPage]:
        """Refreshes the recency of returned pages; deletes a damaged page and stops there."""
        check_keys(keys)
        out = []
        for key in keys:
            with self._lock:
                if key not in self._index:
                    break
            page = self._read(key)
            if page is None:
                break
            out.append(page)
        with self._lock:
            self._counters.count_get(len(keys), len(out))
        return out

    def _read(self, key: bytes) -> StoredPage | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # evicted or cleared since the index said so
            self._forget(key)
            return None
        except OSError as e:
            raise StorageError(f"file storage: cannot read {path}: {e}") from e
        if len(raw) >= HEADER.size:
            magic, crc, size = HEADER.unpack_from(raw)
            data = raw[HEADER.size:]
            if magic == MAGIC and size == len(data) and checksum(data) == crc:
                _touch(path)
                with self._lock:
                    if key in self._index:
                        self._index.move_to_end(key)
                return StoredPage(key, data, crc)
        _unlink(path)
        self._forget(key)
        with self._lock:
            self._counters.corrupt_pages += 1
        return None

    def set(self, pages: list[StoredPage]) -> int:
        """Writes intact pages no larger than the capacity (atomically), evicting least recently used ones."""
        check_keys(p.key for p in pages)
        good, rejected = split_intact(pages)
        stored = 0
        for page in good:
            size = len(page.data)
            if self.capacity_bytes and size > self.capacity_bytes:
                rejected += 1
                continue
            self._write(page)
            with self._lock:
                self._bytes += size - self._index.pop(page.key, 0)
                self._index[page.key] = size
                self._evict()
            stored += 1
        with self._lock:
            self._counters.sets += stored
            self._counters.rejected += rejected
        return stored

    def _write(self, page: StoredPage) -> None:
        path = self._path(page.key)
        tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(HEADER.pack(MAGIC, page.checksum, len(page.data)))
                fh.write(page.data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(f"file storage: cannot write {path}: {e}") from e

    def _evict(self) -> None:
        """Caller holds the lock."""
        while self.capacity_bytes and self._bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            _unlink(self._path(key))
            self._counters.evictions += 1

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)

    def clear(self) -> int:
        with self._lock:
            n = len(self._index)
            for key in self._index:
                _unlink(self._path(key))
            self._index.clear()
            self._bytes = 0
            return n

    def stats(self) -> dict:
        with self._lock:
            return {"backend": "file", "pages": len(self._index), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, "path": str(self.root), **self._counters.as_dict()}

    def close(self) -> None:
        pass


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def open_file(options: StorageOptions) -> FileStorage:
    if not options.url:
        raise StorageError("the file storage backend needs a directory (--storage-url /path/to/dir)")
    return FileStorage(options.url.removeprefix("file://"), options.capacity_bytes)
