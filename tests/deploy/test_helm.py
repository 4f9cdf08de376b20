"""The Helm chart (helm/radixmesh) with the real helm binary: `helm lint --strict` and `helm template` for the
default values and every values file in ci/ (colocated, PD, hierarchical cache, router replicas with monitoring and
tracing, GPU); every rendered manifest valid under kubernetes-validate's strict schemas for the oldest and the newest
Kubernetes the chart supports (the Prometheus operator's objects under that operator's CRD schemas, made strict the
same way); every radixmesh container's command accepted by the service's own argument parser, with its environment
as Kubernetes would give it; and the wiring: Services select pods and name ports the containers have, the routers
discover and are registered with by the right names, secrets and probes line up, drains fit the grace period."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.commands import parse_command

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "radixmesh"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
SCHEMAS = Path(__file__).parent / "schemas"
KUBE_VERSIONS = ("1.27.0", "1.37.0")  # Chart.yaml's kubeVersion floor, and the newest schemas we have
POD_IP = "10.1.2.3"
INTERNAL_SECRET = "rm-radixmesh-internal-token"


def _helm() -> str:
    found = shutil.which("helm") or (str(ROOT / ".tools/helm/helm") if (ROOT / ".tools/helm/helm").exists() else "")
    if not found:
        pytest.fail("helm is missing: `make test` installs it into .tools/helm (make helm)")
    return found


def helm(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def render(values: Path | None = None, *sets: str) -> list[dict]:
    args = ["template", "rm", str(CHART), "--namespace", "llm"]
    args += ["-f", str(values)] if values else []
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


# ids are "values-<file>": a bare "gpu" id would read as the gpu marker (tests/conftest.py skips those without CUDA)
@pytest.fixture(scope="module", params=[None, *VALUES],
                ids=["values-defaults", *(f"values-{v.name.removesuffix('-values.yaml')}" for v in VALUES)])
def rendered(request) -> tuple[str, list[dict]]:
    variant = request.param.name.removesuffix("-values.yaml") if request.param else "defaults"
    return variant, render(request.param)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]):
    for name, dep in by_kind(docs, "Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield name, dep, c


def test_lint_passes_strictly_for_every_values_file():
    assert VALUES, "helm/radixmesh/ci has no values files"
    for values in (None, *VALUES):
        proc = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
        assert "0 chart(s) failed" in proc.stdout


def _strict(schema):
    """The CRD schema as the API server applies it to unknown fields: objects with properties and without
    x-kubernetes-preserve-unknown-fields accept no others."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


CRD_SCHEMAS = {kind: _strict(json.loads((SCHEMAS / f"{kind.lower()}-v1.json").read_text()))
               for kind in ("ServiceMonitor", "PrometheusRule")}


def test_every_manifest_is_valid_under_strict_schemas(rendered):
    _, docs = rendered
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            errors = list(jsonschema.Draft7Validator(CRD_SCHEMAS[doc["kind"]]).iter_errors(doc))
            assert not errors, f"{where}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(copy.deepcopy(doc), version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{where} against Kubernetes {version}: at {list(e.absolute_path)}: {e.message[:300]}")


def _environment(container: dict) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", item
            env[item["name"]] = POD_IP
        elif "secretKeyRef" in source:
            env[item["name"]] = "secret-from-" + source["secretKeyRef"]["name"]
        else:
            env[item["name"]] = item["value"]
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args (an unknown variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def parsed_commands(docs: list[dict]):
    """(deployment, module, parsed settings) of every radixmesh container, parsed by the service's own parser."""
    for name, _, c in containers(docs):
        if c["name"] != "redis":
            env = _environment(c)
            yield name, *parse_command([_expand(a, env) for a in c["args"]], env, name)


def test_every_container_command_is_accepted_by_its_service(rendered, capsys):
    _, docs = rendered
    seen = {module for _, module, _ in parsed_commands(docs)}
    assert {"radixmesh.services.router", "radixmesh.services.tokenizer", "radixmesh.services.worker"} <= seen, seen
    assert "error:" not in capsys.readouterr().err


def test_services_select_pods_and_name_ports_they_have(rendered):
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    for name, svc in by_kind(docs, "Service").items():
        selector = svc["spec"]["selector"]
        matches = [d for d in deployments.values()
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        ports = {p["name"] for c in matches[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name} targets {port['targetPort']}, pods have {ports}"
    for name, dep in deployments.items():
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in deployments.values()), f"PodDisruptionBudget {name} selects nothing"


def test_probes_target_declared_ports_and_drains_fit_the_grace_period(rendered):
    _, docs = rendered
    for name, dep, c in containers(docs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                assert c["name"] == "redis" and kind == "startupProbe", f"{name} has no {kind}"
                continue
            if "grpc" in probe:
                assert probe["grpc"]["port"] in ports.values(), (name, kind)
            elif "httpGet" in probe:
                assert probe["httpGet"]["port"] in ports, (name, kind)
        if "--shutdown-grace-s" in c["args"]:
            grace = float(c["args"][c["args"].index("--shutdown-grace-s") + 1])
            pre_stop = 5 if "lifecycle" in c else 0
            assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace + pre_stop, name


def _args_after(args: list[str], flag: str) -> list[str]:
    """The values of a flag that takes several (up to the next flag)."""
    i = args.index(flag) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def test_routers_discover_workers_and_workers_register_with_every_router(rendered):
    _, docs = rendered
    services = by_kind(docs, "Service")
    deployments = by_kind(docs, "Deployment")
    router = deployments["rm-radixmesh-router"]["spec"]["template"]["spec"]["containers"][0]
    names = _args_after(router["args"], "--discovery-dns")
    worker_deps = {n: d for n, d in deployments.items() if d["metadata"]["labels"]["app.kubernetes.io/component"]
                   in ("worker", "prefill", "decode")}
    assert sorted(n.split(":")[0] for n in names) == sorted(worker_deps)
    for name in names:
        host, port = name.split(":")
        assert services[host]["spec"]["clusterIP"] == "None"  # headless: one address per worker pod
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    replicas = services["rm-radixmesh-router-replicas"]["spec"]
    assert replicas["clusterIP"] == "None" and replicas["publishNotReadyAddresses"] is True
    for name, dep in worker_deps.items():
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert _args_after(args, "--router-url") == ["http://rm-radixmesh-router-replicas:30000"], name
        assert _args_after(args, "--advertise-url") == ["$(POD_IP):50051"], name


def test_the_api_key_reaches_the_router_and_the_registering_workers(rendered):
    variant, docs = rendered
    secrets = {n: s for n, s in by_kind(docs, "Secret").items() if n != INTERNAL_SECRET}
    keyed = {name: [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
                    and e["name"] != "RADIXMESH_INTERNAL_TOKEN"] for name, _, c in containers(docs)}
    if variant in ("defaults", "hicache", "router-replicas"):
        assert not secrets and not any(keyed.values())  # no key: no Secret, nothing references one
        return
    names = {e["name"] for refs in keyed.values() for e in refs}
    assert names == {"RADIXMESH_API_KEY", "RADIXMESH_ROUTER_API_KEY"}
    for refs in keyed.values():
        for e in refs:
            ref = e["valueFrom"]["secretKeyRef"]
            if variant == "pd":  # apiKey.existingSecret: made outside the chart
                assert ref == {"name": "radixmesh-keys", "key": "router"} and not secrets
            else:
                assert ref["key"] in secrets[ref["name"]]["data"]


def test_monitoring_objects_carry_the_dashboards_and_alert_rules():
    docs = render(CHART / "ci" / "router-replicas-values.yaml")
    rule = next(iter(by_kind(docs, "PrometheusRule").values()))
    alerts = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    monitor = next(iter(by_kind(docs, "ServiceMonitor").values()))
    scraped = {s["metadata"]["labels"]["radixmesh.io/service"] for s in by_kind(docs, "Service").values()
               if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()}
    assert scraped == {"router", "tokenizer", "kvstore", "worker"}
    assert monitor["spec"]["endpoints"][0]["relabelings"][0]["targetLabel"] == "service"
    dashboards = next(iter(by_kind(docs, "ConfigMap").values()))["data"]
    for path in (ROOT / "dashboards").glob("*.json"):
        assert json.loads(dashboards[path.name]) == json.loads(path.read_text())
    pd = render(CHART / "ci" / "pd-values.yaml", "metrics.serviceMonitor.enabled=true")
    assert {s["metadata"]["labels"].get("radixmesh.io/service") for s in by_kind(pd, "Service").values()} >= {
        "worker-prefill", "worker-decode"}


def test_gpu_workers_run_the_cuda_image_with_a_gpu_each():
    docs = render(CHART / "ci" / "gpu-values.yaml")
    worker = by_kind(docs, "Deployment")["rm-radixmesh-worker"]["spec"]["template"]["spec"]
    c = worker["containers"][0]
    assert c["image"] == "radixmesh:cuda"
    assert c["resources"]["limits"] == {"memory": "128Gi", "nvidia.com/gpu": 1}
    model = {"name": "model", "persistentVolumeClaim": {"claimName": "llm-models", "readOnly": True}}
    assert model in worker["volumes"]
    assert worker["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert by_kind(docs, "Deployment")["rm-radixmesh-tokenizer"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == "radixmesh:cpu"


def test_tensor_parallel_workers_get_their_ranks_and_gpus():
    """workers.tpSize: --tp-size in every worker's arguments (accepted by the worker's flag parser) and that many
    GPUs per pod; replicas stay the data-parallel count."""
    docs = render(CHART / "ci" / "gpu-values.yaml", "workers.tpSize=2")
    worker = by_kind(docs, "Deployment")["rm-radixmesh-worker"]
    c = worker["spec"]["template"]["spec"]["containers"][0]
    assert _args_after(c["args"], "--tp-size") == ["2"] and worker["spec"]["replicas"] == 2
    assert "--enable-hierarchical-cache" in c["args"] and _args_after(c["args"], "--hicache-storage-backend") == [
        "kvstore"]  # the store keeps every rank's shard of a page together
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    (module, parsed), = [(m, p) for name, m, p in parsed_commands(docs) if name == "rm-radixmesh-worker"]
    assert module == "radixmesh.services.worker" and parsed[4]["tp_size"] == 2
    assert "--tp-size" not in by_kind(render(CHART / "ci" / "gpu-values.yaml"), "Deployment")[
        "rm-radixmesh-worker"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_tensor_parallel_pd_workers():
    """workers.mode pd with workers.tpSize: both roles run --tp-size (each prefill rank's KV shard goes to the
    matching decode rank, so the sizes must agree: one setting for both)."""
    docs = render(CHART / "ci" / "gpu-values.yaml", "workers.tpSize=2", "workers.mode=pd")
    deployments = by_kind(docs, "Deployment")
    for role in ("prefill", "decode"):
        c = deployments[f"rm-radixmesh-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert _args_after(c["args"], "--tp-size") == ["2"] and c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert c["args"][0] == role


def test_bad_values_fail_with_a_clear_message():
    proc = helm("template", "rm", str(CHART), "--set", "workers.mode=mixed", ok=False)
    assert proc.returncode != 0 and "workers.mode must be colocated or pd" in proc.stderr
    proc = helm("template", "rm", str(CHART), "--set", "redis.enabled=false", ok=False)
    assert proc.returncode != 0 and "kvstore.storageUrl" in proc.stderr


def test_router_processes_per_pod():
    """router.processes becomes --router-workers (left out at its default, 1)."""
    def router_args(docs):
        return by_kind(docs, "Deployment")["rm-radixmesh-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _args_after(router_args(render(CHART / "ci" / "router-replicas-values.yaml")), "--router-workers") == ["2"]
    assert "--router-workers" not in router_args(render(CHART / "ci" / "colocated-values.yaml"))
    assert _args_after(router_args(render(CHART / "ci" / "colocated-values.yaml", "router.processes=0")),
                       "--router-workers") == ["0"]


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels, matchExpressions with In / NotIn)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        inside = labels.get(e["key"]) in e["values"]
        if (e["operator"] == "In") != inside:
            return False
    return True


def test_the_network_policy_closes_every_internal_service_to_other_pods(rendered):
    """Every pod but the router's is selected (only this release's pods may reach it, and anyone its metrics port);
    the router's stays open; each selected pod names the metrics port the policy opens."""
    variant, docs = rendered
    (policy,) = by_kind(docs, "NetworkPolicy").values()
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    peers = spec["ingress"][0]["from"]
    assert peers == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "rm"}}}]
    assert spec["ingress"][1]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    for name, dep in by_kind(docs, "Deployment").items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        router = labels.get("app.kubernetes.io/component") == "router"
        assert _selects(spec["podSelector"], labels) != router, (variant, name)
        assert _selects(peers[0]["podSelector"], labels), (variant, name)  # every pod of the mesh may call in
        if not router:
            ports = {p.get("name") for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            assert "metrics" in ports or name.endswith("redis"), (variant, name, ports)
    off = render(None, "networkPolicy.enabled=false")
    assert not by_kind(off, "NetworkPolicy")
