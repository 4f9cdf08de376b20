"""The garbage collector of a service process, set for serving once the process is up.

CPython's cyclic collector runs a young-generation pass every 700 net allocations of container objects and, now
and then, a full pass over every object the process holds. A serving process allocates a few hundred containers
per request (dicts, lists, protobuf wrappers, coroutine frames) that almost all die young with no cycle, and holds
a large, unchanging heap from start-up (grpc, protobuf descriptors, aiohttp, torch's modules): the router spent ~6%
of its CPU in the collector (perf, streamed chat, benchmarks.router), most of it re-walking that start-up heap.

`opt_in()` (from a service's `main`, before its event loop starts) and then `serving()` (called where the service
starts serving: GrpcService.start, the router's HTTP site) collect once, move every object alive then into the
permanent generation (`gc.freeze`: never walked again) and raise the young generation's threshold, so that
collections run rarely and only over what was made since. Cycles are still collected; garbage in them waits a
little longer. Processes that did not opt in (tests that run a service inside pytest) are left as they are: a
frozen heap would keep what such a process drops later."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# Net container allocations between young-generation passes (CPython's default: 700). A router request at 32
# concurrent streams keeps well under this many containers alive, so most die before a pass sees them.
GEN0_THRESHOLD = 20_000
_wanted = False
_done = False


def opt_in() -> None:
    """This process is a service's own: `serving()` will settle its heap."""
    global _wanted
    _wanted = True


def serving() -> None:
    """The service is up: collect, freeze what is alive, and raise the young generation's threshold (once, and
    only in a process that opted in)."""
    global _done
    if not _wanted or _done:
        return
    _done = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    log.debug("heap settled: %d objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold())
