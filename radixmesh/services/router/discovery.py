"""Workers found by DNS: `--discovery-dns NAME:PORT` names a DNS name that resolves to every worker's address (a
Kubernetes headless Service, a compose service with several replicas). Every `--discovery-interval-s` the router
resolves it again: an address that appeared is added to the registry (retried next round while it does not answer
yet), one that vanished is removed. Only workers this discovery added are ever removed by it; workers given with
--worker-urls or POST /add_worker are left alone."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

from radixmesh.services.common.dns import join_host_port, resolve_all, split_host_port
from radixmesh.services.router.workers import WorkerRegistry

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> its addresses


def parse_name(name: str) -> tuple[str, int]:
    """`host:port` -> (host, port); ValueError naming the flag when it is not one."""
    return split_host_port(name, "--discovery-dns (a DNS name and the workers' gRPC port)")


class DnsDiscovery:
    def __init__(self, registry: WorkerRegistry, names: Iterable[str], resolve: Resolver = resolve_all):
        self.registry = registry
        self.names = [parse_name(n) for n in names]
        self.resolve = resolve
        self.found: set[str] = set()  # urls this discovery added and still holds
        self._failing: set[str] = set()  # urls whose last add failed (logged once until they answer)

    async def refresh(self) -> None:
        """Resolve every name once and bring the registry in line with the answers."""
        answers = await asyncio.gather(*(self.resolve(host, port) for host, port in self.names))
        current = {join_host_port(a, port) for (_, port), addresses in zip(self.names, answers) for a in addresses}
        for url in sorted(self.found - current):
            log.info("worker %s no longer in DNS; removing it", url)
            self.found.discard(url)
            await self.registry.remove(url)
        new = [u for u in sorted(current - self.found) if u not in self.registry.workers]
        await asyncio.gather(*(self._add(url) for url in new))

    async def _add(self, url: str) -> None:
        try:
            worker = await self.registry.add(url)
        except ValueError as e:
            if url not in self._failing:
                log.warning("discovered worker not added yet (tried again each round): %s", e)
            self._failing.add(url)
            return
        self._failing.discard(url)
        self.found.add(url)
        await self.registry.probe(worker)
