"""House rules a script can check: engine/ is a pure library, and our `kernels` package stays invisible to
transformers (which probes for a package of that name)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("grpc", "google.protobuf", "aiohttp", "services", "prometheus_client")
SERVICE_ROOTS = ("grpc", "aiohttp", "services", "prometheus_client")  # top-level packages engine must not load


def test_engine_sources_import_no_service_libraries():
    pattern = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(re.escape(m) for m in FORBIDDEN) + r")\b", re.M)
    offenders = [str(p) for p in (ROOT / "engine").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_importing_engine_loads_no_service_libraries():
    code = ("import sys, engine, engine.engine, engine.bench_one_batch, engine.bench_offline_throughput; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in {SERVICE_ROOTS!r} "
            "or m.startswith('google.protobuf')]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_transformers_does_not_see_our_kernels_package():
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available() is False


def test_router_and_launcher_load_no_model_stack():
    """The router must stay light: no torch, no transformers (it never loads a model)."""
    code = ("import sys, services.router.__main__, services.launch; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
