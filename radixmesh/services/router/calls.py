"""The router's open worker calls, so it can cancel those of a worker that went away (or all, at shutdown) and
tell the request that owned a call why: a call it cancelled carries (reason, may retry elsewhere)."""

from __future__ import annotations

from typing import Callable

import grpc


class OpenCalls:
    def __init__(self) -> None:
        self._open: dict[grpc.aio.Call, str] = {}  # open worker call -> its worker's url
        self._cancelled: dict[grpc.aio.Call, tuple[str, bool]] = {}  # calls cancelled here -> (why, may retry)

    def track(self, call: grpc.aio.Call, worker_url: str) -> None:
        self._open[call] = worker_url

    def forget(self, call: grpc.aio.Call) -> None:
        self._open.pop(call, None)
        self._cancelled.pop(call, None)

    def cancel(self, which: Callable[[str], bool], reason: str, retry: bool = False) -> int:
        """Cancel the open calls whose worker url `which` accepts; returns how many."""
        calls = [c for c, url in self._open.items() if which(url)]
        for call in calls:
            self._cancelled[call] = (reason, retry)
            call.cancel()
        return len(calls)

    def why_cancelled(self, call: grpc.aio.Call) -> tuple[str, bool] | None:
        """(reason, may retry) when this object cancelled `call`; None when someone else did (or nobody)."""
        return self._cancelled.get(call)
