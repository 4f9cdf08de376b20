"""Fast checks on the images' sources (no container is built): the entrypoint's roles are the services that exist,
the two Dockerfiles parse, lint clean and build the same way, and the build context holds what they copy."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import dockerfile

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"
HADOLINT = ROOT / ".tools" / "hadolint" / "bin" / "hadolint"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


entrypoint = _load("radixmesh_entrypoint", ROOT / "docker" / "entrypoint.py")
requirements = _load("radixmesh_requirements", ROOT / "docker" / "requirements.py")


def test_roles_are_the_services_that_exist():
    mains = {f"radixmesh.services.{p.parent.name}" for p in (ROOT / "radixmesh" / "services").glob("*/__main__.py")}
    modules = {role.module for role in entrypoint.ROLES.values()}
    assert mains <= modules, f"services without a role in docker/entrypoint.py: {sorted(mains - modules)}"
    for name, role in entrypoint.ROLES.items():
        assert importlib.util.find_spec(role.module) is not None, f"role {name}: no module {role.module}"
    assert set(entrypoint.ROLES) == {"router", "tokenizer", "worker", "prefill", "decode", "kvstore", "serve"}
    assert entrypoint.ROLES["serve"].fixed == ("serve",)  # services.launch wants its subcommand


def test_entrypoint_adds_container_defaults_that_flags_override():
    py = sys.executable
    assert entrypoint.command(["tokenizer", "--model-path", "/m"], {}) == [
        py, "-m", "radixmesh.services.tokenizer", "--host", "0.0.0.0", "--port", "50051", "--model-path", "/m"]
    assert entrypoint.command(["decode", "--port=7000", "--host", "10.0.0.2"], {}) == [
        py, "-m", "radixmesh.services.worker", "--disaggregation-mode", "decode", "--port=7000", "--host", "10.0.0.2"]
    assert entrypoint.command(["router", "--tokenizer-url", "t:1"], {"RADIXMESH_PORT": "8080"})[3:] == [
        "--host", "0.0.0.0", "--tokenizer-url", "t:1"]
    # a config file may set host and port; the entrypoint must not override it from the command line
    assert entrypoint.command(["kvstore", "--config", "kv.yaml"], {})[3:] == ["--config", "kv.yaml"]
    assert entrypoint.command(["serve", "--model-path", "/m"], {})[2:6] == [
        "radixmesh.services.launch", "serve", "--host", "0.0.0.0"]
    assert entrypoint.command(["bash", "-c", "true"], {}) == ["bash", "-c", "true"]
    assert entrypoint.command(["--help"], {}) == []


def test_entrypoint_usage_and_role_help():
    script = str(ROOT / "docker" / "entrypoint.py")
    usage = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0
    for name in entrypoint.ROLES:
        assert f"  {name} " in usage.stdout
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    helped = subprocess.run([sys.executable, script, "router", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=env)
    assert helped.returncode == 0 and "--tokenizer-url" in helped.stdout


def test_requirements_come_from_pyproject_without_torch():
    reqs = requirements.requirements(str(ROOT / "pyproject.toml"), ["pd"])
    names = [r.split(";")[0].split("=")[0].split(">")[0].strip() for r in reqs]
    assert "torch" not in names and "grpcio-tools" in names
    assert any(n.startswith("mooncake-transfer-engine") for n in names)
    with pytest.raises(SystemExit):
        requirements.requirements(str(ROOT / "pyproject.toml"), ["no-such-extra"])


@pytest.mark.parametrize("path", [CPU, CUDA], ids=["cpu", "cuda"])
def test_dockerfile_structure(path):
    instructions = dockerfile.parse(path)
    assert dockerfile.stages(instructions) == ["base", "deps", "models", "app", "runtime"]
    final = [i for i in instructions if i.stage == "runtime"]
    user = [i.args for i in final if i.keyword == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root"), "the image must run as an unprivileged user"
    health = [i.args for i in final if i.keyword == "HEALTHCHECK"]
    assert health and "radixmesh.services.common.healthcheck" in health[0]
    entry = [i.args for i in final if i.keyword == "ENTRYPOINT"]
    assert entry == ['["python", "/opt/radixmesh/entrypoint.py"]']
    ignore = dockerfile.dockerignore(ROOT / ".dockerignore")
    sources = dockerfile.copy_sources(instructions)
    assert "radixmesh/" in sources, f"{path.name}: the radixmesh package is not copied into the image"
    for source in sources:
        assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such path"
        assert not dockerfile.ignored(source, ignore), f"{path.name}: COPY {source} is kept out by .dockerignore"


def test_cpu_and_cuda_build_alike():
    """Apart from the base, torch's wheel index and the GPU extras, both images are built by the same steps."""
    cpu, cuda = dockerfile.parse(CPU), dockerfile.parse(CUDA)

    def steps(instructions, stage, keywords=("RUN", "COPY", "WORKDIR", "USER", "ENTRYPOINT", "EXPOSE")):
        return [(i.keyword, i.args) for i in instructions if i.stage == stage and i.keyword in keywords]

    for stage in ("models", "app", "runtime"):
        assert steps(cpu, stage) == steps(cuda, stage), f"stage {stage} differs"
    cpu_deps, cuda_deps = steps(cpu, "deps"), steps(cuda, "deps")
    assert [k for k, _ in cpu_deps] == [k for k, _ in cuda_deps]
    assert cpu_deps[:3] == cuda_deps[:3]  # the venv, torch from TORCH_INDEX_URL, the requirements' sources
    for _, run in (cpu_deps[3], cuda_deps[3]):
        assert run.startswith("python /tmp/build/requirements.py /tmp/build/pyproject.toml ")
    assert "mooncake-transfer-engine-cuda13" in cuda_deps[3][1] and " gpu " in cuda_deps[3][1]


def test_dockerignore_keeps_the_context_small():
    ignore = dockerfile.dockerignore(ROOT / ".dockerignore")
    for heavy in (".git", ".venv", "models/tiny-qwen2/model.safetensors", "build", ".tools", "benchmarks",
                  "radixmesh/benchmarks/serving.py", "radixmesh/v1/worker_pb2.py",
                  "radixmesh/services/__pycache__/launch.cpython-311.pyc"):
        assert dockerfile.ignored(heavy, ignore), f"{heavy} would enter the build context"
    for needed in ("radixmesh/__init__.py", "radixmesh/engine/engine.py", "radixmesh/services/launch.py",
                   "protos/radixmesh/v1/worker.proto", "pyproject.toml"):
        assert not dockerfile.ignored(needed, ignore), f"{needed} would be missing from the build context"


def test_dockerfiles_lint_clean():
    hadolint = shutil.which("hadolint") or (str(HADOLINT) if HADOLINT.exists() else None)
    if hadolint is None:
        pytest.skip("hadolint is missing: `make container-deps` installs it into .tools/hadolint")
    r = subprocess.run([hadolint, "--no-color", "--config", str(ROOT / "docker" / ".hadolint.yaml"), str(CPU),
                        str(CUDA)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_healthcheck_cmd_is_exec_form():
    """Exec form (no shell needed in the image) and the probe module's own flags."""
    health = next(i.args for i in dockerfile.parse(CPU) if i.keyword == "HEALTHCHECK")
    cmd = health.split(" CMD ", 1)[1]
    assert cmd.startswith("[") and shlex.split(cmd.strip("[]").replace(",", " ")) == [
        "python", "-m", "radixmesh.services.common.healthcheck", "--auto"]
