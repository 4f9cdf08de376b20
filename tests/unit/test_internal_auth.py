"""Internal authentication pieces in one process: the flags and token files, the server's token check (every token
of a rotation accepted, health open, refusals logged once per peer without any token), mutual TLS with certificates
from radixmesh.services.certs (a certificate of another CA refused, the health probe with TLS), what the launcher gives
its children (a random token per launch unless one is given, the TLS flags every service's parser takes) and the
router's --worker-allowlist."""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixmesh.services.certs import write_certs
from radixmesh.services.common import auth, healthcheck
from radixmesh.services.common.auth import TOKEN_ENV, InternalAuth, InternalAuthSettings, parse_tokens
from radixmesh.services.common.auth_channel import aio_channel
from radixmesh.services.common.server import GrpcService, GrpcSettings
from radixmesh.services.launch import LaunchSettings, plan, secure
from radixmesh.services.router.allowlist import WorkerAllowlist
from radixmesh.services.router.settings import RouterSettings
from tests.deploy.commands import PARSERS

LIST = reflection_pb2.ServerReflectionRequest(list_services="")


@pytest.fixture(autouse=True)
def no_process_auth():
    yield
    auth.configure(InternalAuth())  # what a test configured must not reach the others


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs, each with a leaf certificate: ours and a stranger's."""
    root = tmp_path_factory.mktemp("pki")
    return {who: write_certs(root / who, ["worker.example", "10.0.0.7"]) for who in ("ours", "theirs")}


def tls_settings(paths: dict, **more) -> InternalAuthSettings:
    return InternalAuthSettings(tls_cert=str(paths["cert"]), tls_key=str(paths["key"]), tls_ca=str(paths["ca"]),
                                **more)


def test_settings_and_token_files(tmp_path):
    assert parse_tokens("new, old\nolder\n") == ("new", "old", "older")
    for bad in ("", " , \n", "has space"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    with pytest.raises(ValueError, match="go together"):
        InternalAuthSettings(tls_cert="c", tls_key="k")
    with pytest.raises(ValueError, match="not both"):
        InternalAuthSettings(internal_token="t", internal_token_file="f")
    path = tmp_path / "token"
    path.write_text("first\nsecond\n")
    from_file = InternalAuthSettings(internal_token_file=str(path))
    assert InternalAuth.from_settings(from_file).tokens == ("first", "second")
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        InternalAuth.from_settings(InternalAuthSettings(internal_token_file=str(path)))
    with pytest.raises(SystemExit, match="cannot read --tls-cert"):
        auth.setup({"tls_cert": str(tmp_path / "missing"), "tls_key": "k", "tls_ca": "c"})
    assert "secret" not in repr(InternalAuthSettings(internal_token="secret"))


async def _reflect(url: str, credentials: InternalAuth) -> grpc.StatusCode:
    async with aio_channel(url, auth=credentials) as ch:
        try:
            async for _ in reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([LIST])):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def _serving(settings: InternalAuthSettings):
    auth.setup(settings)
    service = GrpcService(GrpcSettings(port=0), lambda server: [])
    await service.start()
    return service, f"127.0.0.1:{service.port}"


async def test_the_token_check_accepts_each_token_of_a_rotation_and_logs_once_per_peer(caplog):
    service, url = await _serving(InternalAuthSettings(internal_token="new-token,old-token"))
    try:
        with caplog.at_level(logging.WARNING, logger="radixmesh.services.common.auth"):
            results = [await _reflect(url, InternalAuth(tokens)) for tokens in
                       [("new-token",), ("old-token",), ("wrong-token",), (), ("wrong-token",)]]
        assert results == [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.UNAUTHENTICATED] * 3
        # a refused streaming call says why, every time (a status racing the client's first message made grpc's
        # client report INTERNAL, about 1 call in 1000: services.common.auth._first_message)
        refused = collections.Counter([await _reflect(url, InternalAuth(())) for _ in range(400)])
        assert refused == {grpc.StatusCode.UNAUTHENTICATED: 400}, refused
        async with aio_channel(url, auth=InternalAuth()) as ch:  # health needs no token
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # (an earlier test may have set the root logger to INFO: the service's start-up line is captured too)
        (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "ServerReflectionInfo" in record.getMessage() and "ipv4:127.0.0.1" in record.getMessage()
        assert not any(t in caplog.text for t in ("new-token", "old-token", "wrong-token"))
    finally:
        service.request_stop(0)
        await service.stop()


async def test_mutual_tls_refuses_a_certificate_of_another_ca(pki):
    service, url = await _serving(tls_settings(pki["ours"], internal_token="t0ken"))
    ours = auth.current()
    theirs = InternalAuth.from_settings(tls_settings(pki["theirs"]))
    stranger = InternalAuth(("t0ken",), theirs.cert, theirs.key, ours.ca)  # trusts us, signed by another CA
    try:
        assert await _reflect(url, ours) == grpc.StatusCode.OK
        assert await _reflect(url, stranger) == grpc.StatusCode.UNAVAILABLE
        assert await _reflect(url, InternalAuth(("t0ken",))) == grpc.StatusCode.UNAVAILABLE  # plaintext
        named = InternalAuth(ours.tokens, ours.cert, ours.key, ours.ca, "worker.example")  # --tls-server-name
        assert await _reflect(url, named) == grpc.StatusCode.OK
        flags = {"tls_cert": str(pki["ours"]["cert"]), "tls_key": str(pki["ours"]["key"]),
                 "tls_ca": str(pki["ours"]["ca"])}
        loop = asyncio.get_running_loop()
        ok, message = await loop.run_in_executor(None, healthcheck.check_grpc, "127.0.0.1", service.port, "", 5.0,
                                                 flags)
        assert ok, message
        ok, _ = await loop.run_in_executor(None, healthcheck.check_grpc, "127.0.0.1", service.port, "", 2.0)
        assert not ok  # a probe without the certificate cannot reach a TLS service
    finally:
        service.request_stop(0)
        await service.stop()
    argv = ["-m", "radixmesh.services.kvstore", "--tls-cert", "c.pem", "--port", "1"]
    assert healthcheck.tls_of(argv, {"RADIXMESH_TLS_KEY": "k.pem", "RADIXMESH_TLS_CA": "ca.pem"}) == {
        "tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"}


def _children():
    return plan(LaunchSettings(num_workers=2, kvstore=True), {"model_path": "m"})


def test_the_launcher_gives_every_child_the_token_and_the_tls_flags(pki):
    children = _children()
    made = secure(children, InternalAuthSettings())  # no token given: a random one for this launch
    assert len(made.token) >= 32 and not made.tls
    assert {c.env[TOKEN_ENV] for c in children} == {made.token} and secure(_children(), InternalAuthSettings()) \
        .token != made.token
    assert not any("--internal-token" in " ".join(c.argv) for c in children)  # never on a command line
    children = _children()
    given = secure(children, tls_settings(pki["ours"], internal_token="mine,old", tls_server_name="mesh"))
    assert given.tokens == ("mine", "old") and given.tls and auth.current() is given
    for c in children:
        assert c.env[TOKEN_ENV] == "mine,old" and c.argv[c.argv.index("--tls-ca") + 1] == str(pki["ours"]["ca"])
        parsed = __import__(PARSERS[c.argv[0]], fromlist=["parse_args"]).parse_args(c.argv[1:])
        tls = parsed[-1] if isinstance(parsed[-1], InternalAuthSettings) else InternalAuthSettings(**parsed[-1])
        assert tls.tls_server_name == "mesh" and tls.tls_cert == str(pki["ours"]["cert"]), c.name


def test_the_worker_allowlist():
    allowed = WorkerAllowlist.parse(("Worker-0.example", "10.20.0.0/16", "192.168.1.5", "fd00::/8", "[::2]"))
    for host in ("worker-0.example", "10.20.3.4", "192.168.1.5", "[fd00::1]", "[::2]"):
        assert allowed.allows(host), host
    for host in ("worker-1.example", "10.21.0.1", "192.168.1.6", "[::1]", "example"):
        assert not allowed.allows(host), host
    with pytest.raises(ValueError, match="worker-allowlist"):
        RouterSettings(tokenizer_url="t:1", worker_allowlist=("not a host",))
