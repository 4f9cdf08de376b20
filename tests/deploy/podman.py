"""Podman as the container tests drive it: building docker/Dockerfile with this machine's options, and running,
probing and removing containers. `python -m tests.deploy.podman` builds the CPU image (`make image`).

The Dockerfiles stay standard; the options for machines without a registry or a Docker engine are added here:
the locally bootstrapped base image (`make container-deps`), the host network for pip and apt, the host's
certificate bundle for pip, the local wheel folder (the CPU torch wheel), and the Docker image format (the OCI
format has no HEALTHCHECK)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/debian-py:bookworm"  # the Makefile's container-deps target makes it
CPU_IMAGE = "localhost/radixmesh:cpu-test"
LABEL = "radixmesh.test=deploy"  # on everything the tests start, so cleanup can find it


def podman(*args: str, check: bool = True, timeout: float = 120, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], check=check, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def missing() -> str | None:
    """Why containers cannot be built here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (run `make container-deps` as root)"
    if podman("image", "exists", BASE_IMAGE, check=False).returncode != 0:
        return f"the base image {BASE_IMAGE} is missing (run `make container-deps` as root)"
    return None


def build_options(environ: dict | None = None) -> list[str]:
    """This machine's `podman build` options for docker/Dockerfile."""
    environ = os.environ if environ is None else environ
    opts = ["--network=host", "--format=docker", "--layers", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    cert = environ.get("SSL_CERT_FILE") or environ.get("PIP_CERT")
    if cert and Path(cert).is_file():
        opts += ["-v", f"{cert}:/host-ca.pem:ro", "--build-arg", "PIP_CERT=/host-ca.pem"]
    wheels = environ.get("PIP_FIND_LINKS")
    if wheels and Path(wheels).is_dir() and any(Path(wheels).glob("torch-*.whl")):
        # The CPU torch wheel is here: no CPU wheel index needed (none may be reachable).
        opts += ["-v", f"{wheels}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels", "--build-arg",
                 "TORCH_INDEX_URL="]
    return opts


def image_id(tag: str) -> str | None:
    r = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def build(tag: str = CPU_IMAGE, dockerfile: str = "docker/Dockerfile", timeout: float = 1800) -> float:
    """Build (from the layer cache where nothing changed); returns the seconds it took. The image this tag named
    before is removed when the build replaces it (its layers that the new one shares stay). One build at a time on
    this machine: the suite's two processes (test_image.py, test_compose.py) would otherwise build the same layers
    twice at once; the second waits and finds them cached."""
    lock_path = ROOT / "build" / "podman-build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = image_id(tag)
        proc = subprocess.run(["podman", "build", *build_options(), "-f", dockerfile, "-t", tag, "."], cwd=ROOT,
                              timeout=timeout, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"podman build failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    after = image_id(tag)
    if before and before != after:
        podman("rmi", before, check=False)
    return took


def image_size(tag: str = CPU_IMAGE) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def inspect(name: str) -> dict:
    return json.loads(podman("container", "inspect", name).stdout)[0]


def ours(kind: str = "container") -> list[str]:
    """Names (containers) or ids (networks) of what the tests started and is still there."""
    if kind == "container":
        r = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}")
    else:
        r = podman("network", "ls", "--filter", f"label={LABEL}", "--format", "{{.Name}}")
    return r.stdout.split()


def remove_all() -> None:
    """Stop (SIGTERM, then SIGKILL after 20 s) and remove every container and network the tests made."""
    names = ours("container")
    if names:
        podman("rm", "--force", "--time", "20", *names, check=False, timeout=90)
    networks = ours("network")
    if networks:
        podman("network", "rm", "--force", *networks, check=False)


def main() -> int:
    why = missing()
    if why:
        print(why, file=sys.stderr)
        return 1
    took = build()
    print(f"built {CPU_IMAGE} in {took:.0f} s, {image_size() / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
