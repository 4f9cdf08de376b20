"""House rules a script can check: all our Python lives under `radixmesh` and imports the same from any directory,
the engine is a pure library, and nothing of ours shadows another distribution's package (Hugging Face's `kernels`,
which transformers imports for its MoE models, say)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "google.protobuf", "aiohttp", "radixmesh.services", "radixmesh.v1", "prometheus_client")
SERVICE_ROOTS = ("grpc", "aiohttp", "prometheus_client")  # top-level packages the engine must not load


def _python(code: str, cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_our_python_is_one_namespace():
    """Every package of ours is below radixmesh/; at the top only tests (pytest's) and the build scripts."""
    tops = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert tops <= {"radixmesh", "tests"}, f"top-level packages outside radixmesh: {sorted(tops - {'radixmesh'})}"


def test_engine_sources_import_no_service_libraries():
    pattern = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(re.escape(m) for m in FORBIDDEN) + r")\b", re.M)
    offenders = [str(p) for p in (ROOT / "radixmesh" / "engine").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_importing_engine_loads_no_service_libraries():
    code = ("import sys, radixmesh.engine, radixmesh.engine.engine, radixmesh.engine.bench_one_batch, "
            "radixmesh.engine.bench_offline_throughput; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in {SERVICE_ROOTS!r} "
            "or m.startswith(('google.protobuf', 'radixmesh.services', 'radixmesh.v1'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("cwd", [ROOT, "/"], ids=["repo-root", "filesystem-root"])
def test_transformers_moe_models_import_beside_ours(cwd):
    """transformers' MoE models import Hugging Face's `kernels` hub when it is installed: no folder of ours may stand
    in for it, from the repo root or anywhere else, and our services and stubs import from any directory."""
    code = ("from transformers import Qwen3MoeForCausalLM, MixtralForCausalLM\n"
            "from radixmesh.engine import Engine\n"
            "import radixmesh.engine.engine, radixmesh.kernels.norm, radixmesh.services.launch, "
            "radixmesh.v1.worker_pb2\n"
            "import importlib.util\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "assert spec is None or 'radixmesh' not in str(spec.origin or spec.submodule_search_locations), spec\n"
            "print(radixmesh.engine.engine.__file__)\n")
    proc = _python(code, cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == str(ROOT / "radixmesh" / "engine" / "engine.py")


def test_router_launcher_and_kvstore_load_no_model_stack():
    """The router, the launcher and the kvstore stay light: no torch, no transformers (none loads a model; each
    starts once per mesh, and torch's import is ~2 s of CPU)."""
    code = ("import sys, radixmesh.services.router.__main__, radixmesh.services.launch, "
            "radixmesh.services.kvstore.__main__; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = _python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """Our modules `path` imports, at module level or inside functions, TYPE_CHECKING blocks included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
            if isinstance(node, ast.ImportFrom) and node.module else []
        found |= {n for n in names if n in modules}
    return found


def test_no_import_cycles():
    """Every import among our modules points one way: a cycle (even through a function-level import) means two
    concepts that should be one, or a piece in the wrong module."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "radixmesh").rglob("*.py")}
    edges = {m: _imports_of(p, set(paths)) - {m} for m, p in paths.items()}
    edges = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in edges.items()}  # its packages
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []
