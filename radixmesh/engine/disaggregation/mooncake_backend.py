"""The Mooncake transfer engine (`mooncake-transfer-engine`; `-non-cuda` on CPU machines) over TCP with the
peer-to-peer handshake: no metadata server, each engine listens on its own RPC port and peers address it as
"host:port". Only registered memory can be read or written."""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from radixmesh.engine.disaggregation.transfer import TransferError, Write

log = logging.getLogger(__name__)

MAX_BATCH = 128  # ranges per batch_transfer_sync_write call


class MooncakeBackend:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError("the mooncake transfer backend needs `pip install mooncake-transfer-engine-non-cuda` "
                               "(CPU) or the CUDA build, and Debian's libibverbs1, librdmacm1, libnuma1") from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) -> {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()  # one batch at a time per engine keeps error attribution simple
        log.info("mooncake transfer engine on %s (%s)", self.session_id, protocol)

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {nbytes}) -> {rc}")
        self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if self._registered.pop(ptr, None) is not None:
            self._engine.unregister_memory(ptr)

    def write(self, peer: str, writes: Sequence[Write]) -> None:
        """Each Write copies local `src` to the peer's `dst`."""
        self._transfer(peer, writes, self._engine.batch_transfer_sync_write, "write", "to")

    def read(self, peer: str, reads: Sequence[Write]) -> None:
        """Each Write copies the peer's `src` to local `dst`."""
        self._transfer(peer, [Write(r.dst, r.src, r.length) for r in reads], self._engine.batch_transfer_sync_read,
                       "read", "from")

    def _transfer(self, peer: str, ranges: Sequence[Write], submit, verb: str, direction: str) -> None:
        """`ranges` as (local, remote, length)."""
        if not ranges:
            return
        with self._lock:
            # Submitted in groups: one batch of thousands of ranges (a fragmented prompt on a 64-buffer model)
            # overflows the TCP transport's lane queue and fails as a whole.
            for at in range(0, len(ranges), MAX_BATCH):
                group = ranges[at:at + MAX_BATCH]
                rc = submit(peer, [r.src for r in group], [r.dst for r in group], [r.length for r in group])
                if rc != 0:
                    raise TransferError(f"mooncake {verb} of {len(group)} ranges ({sum(r.length for r in group)} "
                                        f"bytes; {at} of {len(ranges)} done) {direction} {peer} failed: {rc}")

    def close(self) -> None:
        for ptr in list(self._registered):
            self.unregister(ptr)
