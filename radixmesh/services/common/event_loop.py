"""The event loop a service runs its asyncio code on (`--event-loop`, taken by the router and every gRPC service:
the tokenizer service, the workers, the kvstore): uvloop (libuv, written in C) where it is installed, else
asyncio's own.

In the router, whose work per request is mostly turns of the loop, socket reads and writes and callbacks,
uvloop takes 10-18% of the instructions a request costs (`benchmarks.router_instructions`, this repository's
NOTES.md, 2026-11-28 (night)). Everything the services use works on both: grpc.aio, aiohttp, the stream lanes'
protocols, signal handlers and threads handing work to the loop (`call_soon_threadsafe`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

log = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
HELP = ("the asyncio event loop: uvloop (libuv; cheaper per request), asyncio (the standard library's), or auto "
        "(uvloop where it is installed)")


def check(choice: str) -> None:
    """A clear error for a value that is not one of EVENT_LOOPS, or for uvloop asked for but not installed."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "uvloop" and _uvloop() is None:
        raise ValueError("--event-loop uvloop: the uvloop package is not installed (pip install uvloop)")


def _uvloop():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def chosen(choice: str = "auto") -> str:
    """The loop `run` would use for `choice`: "uvloop" or "asyncio"."""
    return "uvloop" if choice != "asyncio" and _uvloop() is not None else "asyncio"


def running() -> str:
    """The kind of loop running this coroutine's thread ("uvloop" or "asyncio"), for start-up logs."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def run(main: Coroutine[Any, Any, Any], choice: str = "auto") -> Any:
    """Run `main` to completion on a new loop of the kind `choice` names (asyncio.run's semantics); returns its
    result."""
    check(choice)
    if chosen(choice) == "uvloop":
        return _uvloop().run(main)
    return asyncio.run(main)
