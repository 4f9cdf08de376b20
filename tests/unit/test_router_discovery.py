"""How the router learns of workers besides --worker-urls: DNS discovery (addresses that appear are added, vanished
ones removed, other workers left alone, a worker that does not answer yet retried), leased registrations that lapse,
and the flags' checks. Workers here are real gRPC servers (benchmarks.fake_worker) on loopback; only the resolver's
answers are scripted, so a name can lose an address."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.benchmarks.fake_worker import FakeWorker
from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common.dns import join_host_port, resolve_all, split_host_port
from radixmesh.services.common.server import GrpcService, GrpcSettings
from radixmesh.services.worker.announce import parse_router_url
from radixmesh.services.worker.settings import WorkerSettings
from radixmesh.services.launch import free_port
from radixmesh.services.router.discovery import DnsDiscovery
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.workers import WorkerRegistry


async def fake_worker(port: int | None = None) -> GrpcService:
    servicer = FakeWorker(4, "fake")

    def register(server) -> list[str]:
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name]

    service = GrpcService(GrpcSettings("127.0.0.1", port or 0, shutdown_grace_s=0.1), register)
    await service.start()
    return service


class Answers:
    """A resolver whose answers the test sets: name -> addresses."""

    def __init__(self):
        self.names: dict[str, list[str]] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        return list(self.names.get(host, []))


async def test_dns_discovery_adds_new_addresses_and_removes_vanished_ones():
    services = [await fake_worker(), await fake_worker()]
    ports = [s.port for s in services]
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60)
    static = await fake_worker()
    await registry.add(f"127.0.0.1:{static.port}")  # given by --worker-urls: discovery never removes it
    answers = Answers()
    answers.names["workers"] = ["127.0.0.1"]
    answers.names["workers2"] = ["127.0.0.1"]
    discovery = DnsDiscovery(registry, [f"workers:{ports[0]}", f"workers2:{ports[1]}"], answers)
    try:
        await discovery.refresh()
        assert set(registry.workers) == {f"127.0.0.1:{p}" for p in (*ports, static.port)}
        assert all(w.healthy for w in registry.workers.values())
        answers.names["workers2"] = []  # the second worker's pod is gone from the Service
        await discovery.refresh()
        assert set(registry.workers) == {f"127.0.0.1:{ports[0]}", f"127.0.0.1:{static.port}"}
        answers.names["workers"] = []
        await discovery.refresh()
        assert set(registry.workers) == {f"127.0.0.1:{static.port}"}
    finally:
        await registry.close()
        for s in (*services, static):
            await s.stop()


async def test_a_discovered_address_that_does_not_answer_yet_is_added_once_it_does(caplog):
    port = free_port()
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60)
    answers = Answers()
    answers.names["w"] = ["127.0.0.1"]
    discovery = DnsDiscovery(registry, [f"w:{port}"], answers)
    service = None
    try:
        await discovery.refresh()
        await discovery.refresh()
        assert registry.workers == {}
        assert sum("not added yet" in r.message for r in caplog.records) == 1  # logged once per outage
        service = await fake_worker(port)
        # the next round that reaches it adds it: the first may still fall in gRPC's reconnect backoff for the
        # refused address (up to 1 s plus jitter, against the 1 s connect timeout; a dry run hit that)
        for _ in range(4):
            await discovery.refresh()
            if registry.workers:
                break
        assert list(registry.workers) == [f"127.0.0.1:{port}"]
        assert sum("not added yet" in r.message for r in caplog.records) == 1  # no new warning: the same outage
    finally:
        await registry.close()
        if service is not None:
            await service.stop()


async def test_the_scheduled_discovery_runs_with_the_registry_and_stops_with_it():
    service = await fake_worker()
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60)
    answers = Answers()
    discovery = DnsDiscovery(registry, [f"w:{service.port}"], answers)
    registry.schedule(0.05, discovery.refresh)
    registry.start()
    try:
        answers.names["w"] = ["127.0.0.1"]
        for _ in range(100):
            if registry.workers:
                break
            await asyncio.sleep(0.05)
        assert list(registry.workers) == [f"127.0.0.1:{service.port}"]
    finally:
        await registry.close()
        await service.stop()
    assert all(t.done() for t in registry._tasks)


async def test_a_lease_lapses_unless_renewed_and_a_plain_registration_stays():
    services = [await fake_worker(), await fake_worker()]
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60)
    leased, plain = (f"127.0.0.1:{s.port}" for s in services)
    try:
        await registry.add(leased)
        await registry.add(plain)
        registry.lease(leased, 0.3)
        await asyncio.sleep(0.2)
        registry.lease(leased, 0.3)  # renewed in time
        await asyncio.sleep(0.2)
        await registry._expire_leases()
        assert set(registry.workers) == {leased, plain}
        await asyncio.sleep(0.35)
        await registry._expire_leases()
        assert set(registry.workers) == {plain}
        await registry.add(leased)
        registry.lease(leased, 0.1)
        registry.lease(leased, None)  # registered again for good
        await asyncio.sleep(0.2)
        await registry._expire_leases()
        assert set(registry.workers) == {leased, plain}
    finally:
        await registry.close()
        for s in services:
            await s.stop()


async def test_resolve_all_reads_the_system_resolver():
    assert "127.0.0.1" in await resolve_all("localhost", 80)
    assert await resolve_all("no-such-name.invalid", 80) == []


def test_host_port_parsing_and_ipv6_brackets():
    assert split_host_port("workers.ns.svc:50051", "x") == ("workers.ns.svc", 50051)
    assert split_host_port("[fd00::1]:50051", "x") == ("fd00::1", 50051)
    assert join_host_port("fd00::1", 50051) == "[fd00::1]:50051"
    assert join_host_port("10.0.0.1", 50051) == "10.0.0.1:50051"
    for bad in ("workers", "workers:", ":50051", "workers:http", "workers:70000"):
        with pytest.raises(ValueError, match="host:port"):
            split_host_port(bad, "x")


def test_flags_refuse_bad_names_and_urls():
    with pytest.raises(ValueError, match="--discovery-dns"):
        RouterSettings(tokenizer_url="t:1", discovery_dns=("workers",))
    with pytest.raises(ValueError, match="--discovery-interval-s"):
        RouterSettings(tokenizer_url="t:1", discovery_interval_s=0)
    assert parse_router_url("http://router:30000") == ("http", "router", 30000)
    assert parse_router_url("router.ns:30000/") == ("http", "router.ns", 30000)
    assert parse_router_url("https://[fd00::2]:443") == ("https", "fd00::2", 443)
    for bad in ("ftp://router:1", "http://router", "router"):
        with pytest.raises(ValueError, match="--router-url"):
            parse_router_url(bad)
    with pytest.raises(ValueError, match="--router-url"):
        WorkerSettings(router_url=("http://router",))
    with pytest.raises(ValueError, match="--router-lease-s"):
        WorkerSettings(router_lease_s=1)
    assert "sk-secret" not in repr(WorkerSettings(router_api_key="sk-secret"))
