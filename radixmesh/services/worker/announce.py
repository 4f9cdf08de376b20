"""A worker that finds the router on its own (`--router-url http://router:30000`): once it serves, it registers
with every address the router's name resolves to (POST /add_worker?url=<this worker>&lease_s=N, so several router
replicas behind a headless Service all learn of it), renews that every third of the lease (a restarted router learns
of it again; a worker that dies without leaving is forgotten when its lease lapses), and leaves (POST /remove_worker)
after it has drained on shutdown. A router that is down is retried with backoff and logged once per outage; the
worker serves meanwhile."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Awaitable, Callable

import aiohttp

from radixmesh.services.common.dns import join_host_port, resolve_all, split_host_port

log = logging.getLogger(__name__)
FIRST_RETRY_S = 0.5


def parse_router_url(url: str) -> tuple[str, str, int]:
    """`http://host:port` (or `host:port`, or https) -> (scheme, host, port); ValueError when it is not one."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "http", url.strip()
    if scheme not in ("http", "https"):
        raise ValueError(f"--router-url takes http://host:port, got {url!r}")
    host, port = split_host_port(rest.rstrip("/"), "--router-url (http://host:port of the router)")
    return scheme, host, port


class RouterAnnouncer:
    def __init__(self, router_urls: tuple[str, ...], worker_url: str, api_key: str | None, lease_s: float,
                 resolve: Callable[[str, int], Awaitable[list[str]]] = resolve_all):
        self.routers = [parse_router_url(u) for u in router_urls]
        self.worker_url = worker_url
        self.lease_s = lease_s
        self.resolve = resolve
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.registered: set[str] = set()  # router base urls that accepted the last registration
        self.rounds = 0  # rounds in which every resolved router accepted it
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._failing: set[str] = set()
        self._unresolved = False

    def start(self) -> None:
        if self._task is None:
            timeout = aiohttp.ClientTimeout(total=max(2.0, self.lease_s / 3))
            self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers)
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="router-registration")
            log.info("registering with router(s) %s as %s (lease %.0f s)",
                     ", ".join(f"{s}://{join_host_port(h, p)}" for s, h, p in self.routers), self.worker_url,
                     self.lease_s)

    async def _loop(self) -> None:
        retry_s = FIRST_RETRY_S
        while True:
            ok = await self.announce_once()
            if ok:
                retry_s = FIRST_RETRY_S
            await asyncio.sleep(self.lease_s / 3 if ok else retry_s)
            retry_s = min(retry_s * 2, self.lease_s / 3)

    async def _bases(self) -> list[str]:
        answers = await asyncio.gather(*(self.resolve(host, port) for _, host, port in self.routers))
        return [f"{scheme}://{join_host_port(a, port)}"
                for (scheme, _, port), addresses in zip(self.routers, answers) for a in addresses]

    async def announce_once(self) -> bool:
        """Register with every router address once; True when there was one and all of them accepted."""
        bases = await self._bases()
        if not bases:
            if not self._unresolved:
                log.warning("router name(s) do not resolve yet; retrying")
            self._unresolved = True
            return False
        self._unresolved = False
        query = urllib.parse.urlencode({"url": self.worker_url, "lease_s": f"{self.lease_s:g}"})
        errors = dict(zip(bases, await asyncio.gather(*(self._post(f"{b}/add_worker?{query}") for b in bases))))
        for base, error in errors.items():
            if error is not None and base not in self._failing:
                log.warning("cannot register with router %s (%s); retrying", base, error)
            elif error is None and base not in self.registered:
                log.info("registered with router %s as %s", base, self.worker_url)
        self._failing = {b for b, error in errors.items() if error is not None}
        self.registered = set(errors) - self._failing
        self.rounds += not self._failing
        return not self._failing

    async def _post(self, url: str) -> str | None:
        """None when the router answered 200, else why not."""
        try:
            async with self._session.post(url) as reply:
                if reply.status == 200:
                    return None
                return f"HTTP {reply.status}: {(await reply.text()).strip()[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    async def stop(self) -> None:
        """Stop renewing and leave every router that held the registration (bounded: a dead router is skipped)."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        query = urllib.parse.urlencode({"url": self.worker_url})
        results = await asyncio.gather(*(self._post(f"{b}/remove_worker?{query}") for b in sorted(self.registered)))
        for base, error in zip(sorted(self.registered), results):
            if error is None:
                log.info("left router %s", base)
            else:
                log.warning("could not leave router %s (%s); its lease lapses instead", base, error)
        await self._session.close()
