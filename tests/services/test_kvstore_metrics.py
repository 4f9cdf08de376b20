"""The kvstore's Prometheus metrics, scraped from a real process: calls by method and status code, page gets
(hits and misses), sets, evictions, pages and bytes held, the index, and page bytes moved by the transfer engine;
and the launcher's --enable-metrics, whose every child takes the flags it is given."""

from __future__ import annotations

import json

import grpc
import pytest

from radixmesh.engine.cache.storage import StorageOptions
from radixmesh.v1 import kvstore_pb2 as pb
from radixmesh.services.kvstore.client import open_kvstore
from radixmesh.services.launch import LaunchSettings, free_port, plan, write_metrics_targets
from tests.services.metrics_utils import scrape
from tests.services.test_kvstore_service import LAYOUT, PAGE_BYTES, pages_for, start_kvstore

pytestmark = pytest.mark.timeout(90)


def test_kvstore_counts_calls_pages_and_transfers(tmp_path):
    port = free_port()
    kv = start_kvstore(tmp_path, "--backend", "memory", "--capacity-bytes", str(4 * PAGE_BYTES),
                       "--enable-mooncake-transfer", "--metrics-port", str(port))
    storage = open_kvstore(StorageOptions(url=kv.url, timeout_s=5, layout=LAYOUT, transport="mooncake"))
    try:
        pages = pages_for(5)
        assert storage.set(pages) == 5  # capacity 4: one eviction
        assert len(storage.get([p.key for p in pages[1:]] + [b"missing"])) == 4  # 4 hits, 1 miss
        with grpc.insecure_channel(kv.url) as ch, pytest.raises(grpc.RpcError):
            kv.stub(ch).BatchGet(pb.BatchGetRequest(keys=[b""]), timeout=5)  # INVALID_ARGUMENT
        m = scrape(port)
        assert m.value("radixmesh:kvstore_requests_total", method="BatchSet", code="OK") == 1
        assert m.value("radixmesh:kvstore_requests_total", method="BatchGet", code="OK") == 1
        assert m.value("radixmesh:kvstore_requests_total", method="BatchGet", code="INVALID_ARGUMENT") == 1
        assert m.value("radixmesh:kvstore_requests_total", method="ReleaseStaged", code="OK") == 1
        assert m.value("radixmesh:kvstore_request_duration_seconds_count", method="BatchGet") == 2
        assert m.value("radixmesh:kvstore_page_gets_total", result="hit") == 4
        assert m.value("radixmesh:kvstore_page_gets_total", result="miss") == 1
        assert m.value("radixmesh:kvstore_page_sets_total") == 5
        assert m.value("radixmesh:kvstore_evictions_total") == 1
        assert m.value("radixmesh:kvstore_pages") == 4 and m.value("radixmesh:kvstore_bytes") == 4 * PAGE_BYTES
        assert m.value("radixmesh:kvstore_capacity_bytes") == 4 * PAGE_BYTES
        assert m.value("radixmesh:kvstore_indexed_workers") == 0
        assert m.value("radixmesh:kvstore_transfer_bytes_total", direction="in") == 5 * PAGE_BYTES
        assert m.value("radixmesh:kvstore_transfer_bytes_total", direction="out") == 4 * PAGE_BYTES
        assert m.labels("radixmesh:kvstore_pages", "role") == {"kvstore"}
        # counters only go up: GetStats (itself counted) and a second scrape change nothing else
        storage.stats()
        again = scrape(port)
        assert again.value("radixmesh:kvstore_page_gets_total", result="hit") == 4
        assert again.value("radixmesh:kvstore_requests_total", method="GetStats", code="OK") == 1
    finally:
        storage.close()
        kv.kill()


def test_the_launcher_gives_every_service_a_metrics_port(tmp_path):
    from radixmesh.engine.config import EngineArgs
    from radixmesh.services.common.metrics import MetricsSettings
    from radixmesh.settings import build_parser
    from radixmesh.services.worker.settings import PdSettings, WorkerSettings
    from radixmesh.services.kvstore.settings import KvStoreSettings
    from radixmesh.services.router.settings import RouterSettings
    from radixmesh.services.tokenizer.settings import TokenizerSettings

    settings = LaunchSettings(num_workers=2, kvstore=True, enable_metrics=True,
                              metrics_sd_file=str(tmp_path / "targets.json"))
    children = plan(settings, {"model_path": "m"})
    parsers = {"radixmesh.services.kvstore": (KvStoreSettings, MetricsSettings),
               "radixmesh.services.router": (RouterSettings, MetricsSettings),
               "radixmesh.services.tokenizer": (TokenizerSettings, MetricsSettings),
               "radixmesh.services.worker": (WorkerSettings, PdSettings, MetricsSettings, EngineArgs)}
    for c in children:
        assert "--enable-metrics" in c.argv and c.metrics, c.name
        build_parser("", *parsers[c.argv[0]]).parse_args(c.argv[1:])  # the service's own parser takes them
    write_metrics_targets(children, settings.metrics_sd_file)
    groups = json.loads((tmp_path / "targets.json").read_text())
    assert sorted(g["labels"]["service"] for g in groups) == sorted(c.name for c in children)
    assert len({g["targets"][0] for g in groups}) == len(children), "every service on its own port"
    with pytest.raises(ValueError, match="add --enable-metrics"):
        LaunchSettings(metrics_sd_file="x.json")
