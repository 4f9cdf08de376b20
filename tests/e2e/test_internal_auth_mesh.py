"""Internal authentication of a launched mesh, end to end: `radixmesh certs` makes a CA and a certificate in a tmp
dir, `radixmesh serve` runs tokenizer, kvstore, a prefill and a decode worker (KV over Mooncake) and the router with
mutual TLS and the internal token, and serves a chat completion through all of them. Every internal service
(tokenizer, kvstore, both workers, the prefill bootstrap port) refuses a call with a valid client certificate but
without the token (UNAUTHENTICATED) and serves it with the token; a client without a client certificate, or without
TLS, gets nowhere; workers and the kvstore reach each other. The router's --worker-allowlist refuses an unlisted
host and accepts a listed one."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from radixmesh.v1 import (bootstrap_pb2, bootstrap_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, tokenizer_pb2,
                          tokenizer_pb2_grpc, worker_pb2, worker_pb2_grpc)
from radixmesh.services.common.auth import InternalAuth, InternalAuthSettings
from radixmesh.services.common.auth_channel import sync_channel
from radixmesh.services.launch import main as radixmesh
from tests.e2e.mesh import INTERNAL_TOKEN, cmdline, openai_client, running_mesh
from tests.e2e.test_mesh_faults import post
from tests.e2e.test_pd import NAME

PD = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "mooncake", "--kvstore")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    assert radixmesh(["certs", "--out", str(out)]) == 0
    return InternalAuthSettings(tls_cert=str(out / "tls.crt"), tls_key=str(out / "tls.key"), tls_ca=str(out / "ca.crt"))


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, certs):
    tls = ["--tls-cert", certs.tls_cert, "--tls-key", certs.tls_key, "--tls-ca", certs.tls_ca]
    with running_mesh(NAME, tmp_path_factory.mktemp("tls"), *PD, *tls,
                      env={"RADIXMESH_WORKER_ALLOWLIST": "127.0.0.1,10.20.0.0/16"}) as m:
        yield m


def addresses(mesh) -> dict[str, str]:
    """Service -> its gRPC address (prefill, decode, tokenizer, kvstore, bootstrap), from the command lines."""
    out = {}
    for pid in mesh.services().values():
        argv = cmdline(pid).split()
        module = next((a for a in argv if a.startswith("radixmesh.services.")), "")
        if "--port" not in argv or module == "radixmesh.services.router":
            continue
        name = module.removeprefix("radixmesh.services.")
        if "--disaggregation-mode" in argv:
            name = argv[argv.index("--disaggregation-mode") + 1]
        out[name] = f"127.0.0.1:{argv[argv.index('--port') + 1]}"
        if name == "prefill":
            out["bootstrap"] = f"127.0.0.1:{argv[argv.index('--disaggregation-bootstrap-port') + 1]}"
    assert set(out) == {"prefill", "decode", "tokenizer", "kvstore", "bootstrap"}, out
    return out


def _call(name: str, channel):
    """One call to service `name`; the bootstrap call reaches the servicer, which refuses a handoff without a hello
    (INVALID_ARGUMENT): past the token check, that is its answer."""
    if name in ("prefill", "decode"):
        return worker_pb2_grpc.WorkerServiceStub(channel).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
    if name == "tokenizer":
        return tokenizer_pb2_grpc.TokenizerServiceStub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"),
                                                                         timeout=10)
    if name == "kvstore":
        return kvstore_pb2_grpc.KvStoreServiceStub(channel).GetStats(kvstore_pb2.GetStatsRequest(), timeout=10)
    return list(bootstrap_pb2_grpc.KvBootstrapServiceStub(channel).Handoff(iter([bootstrap_pb2.HandoffRequest()]),
                                                                           timeout=10))


def _code(name: str, channel) -> grpc.StatusCode:
    try:
        _call(name, channel)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_the_tls_mesh_serves_a_chat_completion(tls_mesh):
    reply = openai_client(tls_mesh).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_every_internal_service_wants_the_token_and_a_client_certificate(tls_mesh, certs):
    given = InternalAuth.from_settings(certs)
    no_token = InternalAuth((), given.cert, given.key, given.ca)
    with_token = InternalAuth((INTERNAL_TOKEN,), given.cert, given.key, given.ca)
    wrong = InternalAuth(("wrong-token",), given.cert, given.key, given.ca)
    for name, url in addresses(tls_mesh).items():
        with sync_channel(url, auth=no_token) as a, sync_channel(url, auth=wrong) as b, \
                sync_channel(url, auth=with_token) as c:
            assert _code(name, a) == grpc.StatusCode.UNAUTHENTICATED, name
            assert _code(name, b) == grpc.StatusCode.UNAUTHENTICATED, name
            assert _code(name, c) == (grpc.StatusCode.INVALID_ARGUMENT if name == "bootstrap" else
                                      grpc.StatusCode.OK), name
        no_cert = InternalAuth((INTERNAL_TOKEN,))  # the token, but neither TLS nor a client certificate
        with grpc.secure_channel(url, grpc.ssl_channel_credentials(given.ca)) as d, \
                sync_channel(url, auth=no_cert) as e:
            assert _code(name, d) == grpc.StatusCode.UNAVAILABLE, name
            assert _code(name, e) == grpc.StatusCode.UNAVAILABLE, name


def test_workers_and_the_kvstore_reach_each_other(tls_mesh, certs):
    """Workers register with the kvstore and the kvstore follows their KV events: a worker is in the prefix index
    only when both calls pass the token and TLS."""
    given = InternalAuth.from_settings(certs)
    with sync_channel(addresses(tls_mesh)["kvstore"], auth=InternalAuth((INTERNAL_TOKEN,), given.cert, given.key,
                                                                        given.ca)) as ch:
        stub, deadline = kvstore_pb2_grpc.KvStoreServiceStub(ch), time.monotonic() + 30
        while stub.GetStats(kvstore_pb2.GetStatsRequest(), timeout=10).indexed_workers != 2:
            assert time.monotonic() < deadline, tls_mesh.log_tail()
            time.sleep(0.2)


def test_the_worker_allowlist(tls_mesh):
    status, raw = post(f"{tls_mesh.url}/add_worker?url=10.9.8.7:50051", b"", headers=None)
    error = json.loads(raw)["error"]
    assert status == 403 and "--worker-allowlist" in error["message"] and error["param"] == "url", raw
    status, raw = post(f"{tls_mesh.url}/add_worker?url=no-port.example", b"", headers=None)
    assert status == 400 and json.loads(raw)["error"]["param"] == "url", raw
    decode = addresses(tls_mesh)["decode"]  # listed (127.0.0.1): registering it again is accepted
    status, raw = post(f"{tls_mesh.url}/add_worker?url={decode}", b"", headers=None)
    assert status == 200 and decode in raw.decode(), raw
