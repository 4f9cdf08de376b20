"""Service settings: defaults < --config file < RADIXMESH_* environment < flags; bad values are clear errors."""

from __future__ import annotations

import pytest

from radixmesh.engine.config import EngineArgs
from radixmesh.settings import build_parser, resolve
from radixmesh.services.worker.settings import WorkerSettings
from radixmesh.services.router.settings import RouterSettings


def settings_of(cls, argv, env=None, *extra):
    ns = build_parser("test", cls, *extra).parse_args(argv)
    kwargs = resolve(ns, cls, *extra, environ=env or {})
    return cls(**kwargs[0]), kwargs[1:]


def test_precedence_file_env_flags(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("tokenizer-url: file:1\npolicy: random\nport: 1111\nworker_urls: [a:1, b:2]\n")
    s, _ = settings_of(RouterSettings, ["--config", str(cfg)])
    assert (s.tokenizer_url, s.policy, s.port, s.worker_urls) == ("file:1", "random", 1111, ("a:1", "b:2"))
    env = {"RADIXMESH_POLICY": "round_robin", "RADIXMESH_PORT": "2222", "RADIXMESH_WORKER_URLS": "c:3,d:4",
           "RADIXMESH_DISABLE_RETRIES": "true"}
    s, _ = settings_of(RouterSettings, ["--config", str(cfg)], env)
    assert (s.policy, s.port, s.worker_urls, s.disable_retries) == ("round_robin", 2222, ("c:3", "d:4"), True)
    s, _ = settings_of(RouterSettings, ["--config", str(cfg), "--port", "3333", "--worker-urls", "e:5"], env)
    assert (s.port, s.worker_urls, s.policy) == (3333, ("e:5",), "round_robin")


def test_worker_settings_split_engine_args(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("page_size: 16\nport: 4000\n")
    s, (engine,) = settings_of(WorkerSettings, ["--config", str(cfg), "--model-path", "m", "--enable-mixed-chunk"],
                               {"RADIXMESH_CHUNKED_PREFILL_SIZE": "64"}, EngineArgs)
    assert s.port == 4000 and s.disaggregation_mode == "null"
    assert engine == {"model_path": "m", "page_size": 16, "enable_mixed_chunk": True, "chunked_prefill_size": 64}


@pytest.mark.parametrize("argv, env, message", [
    (["--tokenizer-url", "t:1", "--policy", "fastest"], {}, "--policy must be one of"),
    (["--tokenizer-url", "t:1"], {"RADIXMESH_PORT": "lots"}, "RADIXMESH_PORT"),
    (["--tokenizer-url", "t:1"], {"RADIXMESH_DISABLE_RETRIES": "maybe"}, "expected true or false"),
    ([], {}, "--tokenizer-url is required"),
])
def test_bad_settings_are_clear_errors(argv, env, message):
    with pytest.raises(ValueError, match=message):
        settings_of(RouterSettings, argv, env)


def test_unknown_key_in_config_file(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tokenizer_url: t:1\nnot_a_setting: 3\n")
    with pytest.raises(ValueError, match="not_a_setting"):
        settings_of(RouterSettings, ["--config", str(cfg)])


def test_the_launcher_names_the_served_model_for_every_service():
    from radixmesh.services.launch import LaunchSettings, plan

    children = plan(LaunchSettings(), {"model_path": "/m"}, router={"served_model_name": "tiny"})
    for child in children:
        argv = child.argv
        assert argv[argv.index("--served-model-name") + 1] == "tiny", child.name


def test_sglang_router_flag_names_are_accepted_as_aliases():
    s, _ = settings_of(RouterSettings, ["--tokenizer-url", "t:1", "--request-timeout-secs", "90", "--max-tree-size",
                                        "4096", "--health-check-interval-secs", "7", "--shutdown-grace-period-secs",
                                        "12", "--policy", "power_of_two", "--prefill-policy", "cache_aware",
                                        "--decode-policy", "round_robin", "--retry-max-retries", "3",
                                        "--cb-failure-threshold", "4", "--max-concurrent-requests", "8"])
    assert (s.request_timeout_s, s.max_tree_tokens, s.health_check_interval_s, s.shutdown_grace_s) == (90, 4096, 7, 12)
    assert (s.policy, s.prefill_policy, s.decode_policy) == ("power_of_two", "cache_aware", "round_robin")
    assert (s.retry_max_retries, s.cb_failure_threshold, s.max_concurrent_requests) == (3, 4, 8)


def test_every_port_the_launcher_hands_out_is_its_own():
    """Services, their stream lanes, metrics and bootstrap ports: no two the same (a CI run once gave the kvstore
    and a tokenizer one port, and both gRPC servers bound it). Planned many times, as many meshes are in a test
    run; and a second gRPC server on a taken port fails instead of sharing it."""
    import asyncio
    import re

    from radixmesh.services.common.server import GrpcService, GrpcSettings
    from radixmesh.services.launch import LaunchSettings, plan

    seen: list[int] = []
    for _ in range(50):
        for disaggregation in ("null", "pd"):
            children = plan(LaunchSettings(disaggregation=disaggregation, kvstore=True, num_tokenizers=2,
                                           enable_metrics=True), {"model_path": "/m"})
            ports = [int(a) for c in children if not c.name.startswith("router")  # its --port is the user's
                     for flag, a in zip(c.argv, c.argv[1:]) if re.fullmatch(r"--(port|stream-lane-port|metrics-port|disaggregation-bootstrap-port)", flag)]
            assert len(ports) == len(set(ports)), ports
            seen += ports
    assert len(seen) == len(set(seen))  # across meshes too, as long as the recent ones are remembered

    async def two_on_one_port():
        first = GrpcService(GrpcSettings("127.0.0.1", 0, 0.1), lambda server: [])
        with pytest.raises(OSError, match="cannot listen"):
            GrpcService(GrpcSettings("127.0.0.1", first.port, 0.1), lambda server: [])
        await first.server.stop(None)
    asyncio.run(two_on_one_port())


def test_serve_composes_the_routers_flags_and_hands_them_on():
    """`radixmesh serve` declares no router flag of its own: RouterSettings' flags (but the addresses the launcher
    wires) are its flags, with the same precedence, and reach every router as given."""
    from radixmesh.services.launch import ROUTER_WIRED, SERVE_PARTS, LaunchSettings, plan
    from radixmesh.settings import build_parser, resolve

    parser = build_parser("serve", *SERVE_PARTS, skip=ROUTER_WIRED)
    ns = parser.parse_args(["--model-path", "m", "--cache-threshold", "0.25", "--port", "31000", "--num-routers",
                            "2", "--no-kvstore-l3", "--api-key", "k"])
    launch, router, trace, pd, engine, auth = resolve(ns, *SERVE_PARTS, skip=ROUTER_WIRED,
                                                      environ={"RADIXMESH_MAX_MIGRATIONS": "0"})
    assert router == {"cache_threshold": 0.25, "port": 31000, "api_key": "k", "max_migrations": 0}
    assert launch == {"num_routers": 2, "kvstore_l3": False} and engine == {"model_path": "m"}
    routers = [c for c in plan(LaunchSettings(**launch), engine, pd, router, trace) if c.name.startswith("router")]
    for port, child in zip((31000, 31001), routers):
        s, _ = settings_of(RouterSettings, child.argv[1:])
        assert (s.port, s.cache_threshold, s.api_key, s.max_migrations) == (port, 0.25, "k", 0)
    for wired in ("--tokenizer-url", "--worker-urls", "--kvstore-url"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model-path", "m", wired, "a:1"])


def test_as_flags_gives_back_what_it_was_given():
    from radixmesh.services.common.tracing import TraceSettings
    from radixmesh.settings import as_flags

    given = {"tokenizer_url": "t:1", "worker_urls": ("a:1", "b:2"), "cache_threshold": 0.75, "disable_retries": True,
             "policy": "cache_aware", "grpc_port": None}
    s, _ = settings_of(RouterSettings, as_flags(RouterSettings, given))
    assert (s.tokenizer_url, s.worker_urls, s.cache_threshold, s.disable_retries) == ("t:1", ("a:1", "b:2"), 0.75, True)
    assert as_flags(RouterSettings, {"policy": "cache_aware", "grpc_port": None}) == []  # defaults: nothing to say
    assert as_flags(TraceSettings, {"trace_sample_ratio": 0.5}) == ["--trace-sample-ratio", "0.5"]


def test_engine_tools_read_the_environment_as_services_do():
    import argparse

    from radixmesh.settings import add_settings, resolve

    parser = argparse.ArgumentParser()
    add_settings(parser, EngineArgs)
    kwargs = resolve(parser.parse_args(["--model-path", "m"]), EngineArgs, environ={"RADIXMESH_PAGE_SIZE": "16"})[0]
    assert kwargs == {"model_path": "m", "page_size": 16}
    with pytest.raises(ValueError, match="--model-path is required"):
        resolve(parser.parse_args([]), EngineArgs, environ={})
