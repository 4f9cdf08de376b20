"""The chart's internal authentication (helm template with the real helm binary): a Secret holding the internal
token (generated, or the value given; none when an existing Secret is named) reaches every radixmesh container as
RADIXMESH_INTERNAL_TOKEN; with internalAuth.tls.existingSecret every container mounts it and gets the TLS flags, its
gRPC probes run the image's health probe with the certificate, and everything still validates and parses."""

from __future__ import annotations

import base64
import copy

import kubernetes_validate

from tests.deploy.test_helm import (CHART, INTERNAL_SECRET, KUBE_VERSIONS, by_kind, containers, parsed_commands,
                                    render)

TLS = "internalAuth.tls.existingSecret=mesh-tls"


def _token_refs(docs) -> dict[str, dict]:
    """Deployment -> the secretKeyRef of its container's RADIXMESH_INTERNAL_TOKEN (radixmesh containers only)."""
    out = {}
    for name, _, c in containers(docs):
        if c["name"] != "redis":
            (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", [])
                      if e["name"] == "RADIXMESH_INTERNAL_TOKEN"]
            out[name] = ref
    return out


def test_the_internal_token_reaches_every_container():
    docs = render(CHART / "ci" / "pd-values.yaml")
    refs = _token_refs(docs)
    assert {"rm-radixmesh-router", "rm-radixmesh-tokenizer", "rm-radixmesh-kvstore", "rm-radixmesh-prefill",
            "rm-radixmesh-decode"} <= set(refs)
    assert all(ref == {"name": INTERNAL_SECRET, "key": "internal-token"} for ref in refs.values()), refs
    generated = base64.b64decode(by_kind(docs, "Secret")[INTERNAL_SECRET]["data"]["internal-token"]).decode()
    assert len(generated) == 48 and generated.isalnum()
    for _, _, c in containers(docs):
        assert not any("internal-token" in a for a in c.get("args", [])), "never on a command line"

    given = render(None, "internalAuth.token=s3cret-token")
    data = by_kind(given, "Secret")[INTERNAL_SECRET]["data"]["internal-token"]
    assert base64.b64decode(data).decode() == "s3cret-token"

    theirs = render(None, "internalAuth.existingSecret=my-mesh", "internalAuth.secretKey=token")
    assert INTERNAL_SECRET not in by_kind(theirs, "Secret")
    assert all(ref == {"name": "my-mesh", "key": "token"} for ref in _token_refs(theirs).values())


def test_mutual_tls_from_an_existing_secret():
    for values in (None, CHART / "ci" / "pd-values.yaml"):
        docs = render(values, TLS, "kvstore.backend=file")
        for name, dep, c in containers(docs):
            if c["name"] == "redis":
                continue
            args, pod = c["args"], dep["spec"]["template"]["spec"]
            for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
                assert args[args.index(flag) + 1] == f"/etc/radixmesh/tls/{file}", (name, flag)
            assert args[args.index("--tls-server-name") + 1] == "radixmesh.internal", name
            assert {"name": "internal-tls", "mountPath": "/etc/radixmesh/tls", "readOnly": True} in c["volumeMounts"]
            volume = next(v for v in pod["volumes"] if v["name"] == "internal-tls")
            assert volume["secret"]["secretName"] == "mesh-tls", name
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                if "httpGet" in probe:  # the router's HTTP API keeps its probes
                    continue
                command = probe["exec"]["command"]
                assert command[:3] == ["python", "-m", "radixmesh.services.common.healthcheck"], (name, kind)
                assert command[command.index("--tls-ca") + 1] == "/etc/radixmesh/tls/ca.crt", (name, kind)
        for name, _, parsed in parsed_commands(docs):  # every service's parser takes the flags
            last = parsed[-1]  # InternalAuthSettings (workers) or its keyword arguments
            cert = last["tls_cert"] if isinstance(last, dict) else last.tls_cert
            assert cert == "/etc/radixmesh/tls/tls.crt", name
        for doc in docs:
            if doc["kind"] in ("Deployment", "Secret"):
                kubernetes_validate.validate(copy.deepcopy(doc), KUBE_VERSIONS[-1], strict=True)
