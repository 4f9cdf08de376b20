"""House rules a script can check: all our Python lives under `radixmesh` and imports the same from any directory,
the engine is a pure library, and nothing of ours shadows another distribution's package (Hugging Face's `kernels`,
which transformers imports for its MoE models, say)."""

from __future__ import annotations

import ast
import json
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


# One interpreter, started at the filesystem root, answers three tests: torch + transformers' MoE models are most of
# an import check's CPU (~12 s each), so it is paid once. In order: the engine alone (nothing else imported yet),
# then transformers' MoE models beside all of ours, then, after moving to the repo root, where every top-level module
# it loaded would be found from there (the repo root is first on sys.path there: a folder of ours named like another
# distribution's package shadows it only from there). The same files found from both places means the same code runs
# from both, so the imports above stand for the repo root too.
_IMPORTS = f"""
import importlib, importlib.util, json, os, sys

def say(**kw):
    print(json.dumps(kw), flush=True)

import radixmesh.engine, radixmesh.engine.engine, radixmesh.engine.bench_one_batch
import radixmesh.engine.bench_offline_throughput
say(engine_loads=[m for m in sys.modules if m.split('.')[0] in {SERVICE_ROOTS!r}
                  or m.startswith(('google.protobuf', 'radixmesh.services', 'radixmesh.v1'))])

from transformers import Qwen3MoeForCausalLM, MixtralForCausalLM
from radixmesh.engine import Engine
import radixmesh.kernels.norm, radixmesh.services.launch, radixmesh.v1.worker_pb2
spec = importlib.util.find_spec('kernels')
assert spec is None or 'radixmesh' not in str(spec.origin or spec.submodule_search_locations), spec
say(engine_file=radixmesh.engine.engine.__file__)

def found(name):  # what `import name` would load now, whatever sys.modules holds
    for finder in sys.meta_path:
        spec = finder.find_spec(name, None) if hasattr(finder, 'find_spec') else None
        if spec is not None:
            return [spec.origin, list(spec.submodule_search_locations or [])]
    return None

names = sorted({{m.partition('.')[0] for m in sys.modules}} | {{'kernels', 'radixmesh'}})
here = {{n: found(n) for n in names}}
os.chdir({str(ROOT)!r})
importlib.invalidate_caches()
say(checked=len(names), differ={{n: [here[n], found(n)] for n in names if found(n) != here[n]}})
"""


@pytest.fixture(scope="module")
def imports_from_root() -> tuple[dict, str]:
    """What the one interpreter said (its JSON lines merged) and its whole output, for the failure message."""
    proc = _python(_IMPORTS, "/")
    said = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            said.update(json.loads(line))
    return said, f"exit {proc.returncode}: {proc.stdout}{proc.stderr}"


def test_importing_engine_loads_no_service_libraries(imports_from_root):
    said, output = imports_from_root
    assert said.get("engine_loads") == [], output


def test_transformers_moe_models_import_beside_ours(imports_from_root):
    """transformers' MoE models import Hugging Face's `kernels` hub when it is installed: no folder of ours may stand
    in for it, from the repo root or anywhere else, and our services and stubs import from any directory."""
    said, output = imports_from_root
    assert "exit 0:" in output, output
    assert said["engine_file"] == str(ROOT / "radixmesh" / "engine" / "engine.py"), output
    # from the repo root, every module found is the one found from / (`kernels` and `radixmesh` among them)
    assert said["checked"] > 100 and said["differ"] == {}, output


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
