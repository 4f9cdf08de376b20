"""A container's radixmesh command as the image runs it: docker/entrypoint.py maps `<role> [flags]` to `python -m
<service> ...`, and the service's own parser (each `services.<name>.__main__.parse_args`) must accept the flags, with
the container's environment in place (RADIXMESH_* variables are settings too). Used by the compose and Helm tests."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {"radixmesh.services.router": "radixmesh.services.router.__main__",
           "radixmesh.services.tokenizer": "radixmesh.services.tokenizer.__main__",
           "radixmesh.services.worker": "radixmesh.services.worker.__main__",
           "radixmesh.services.prefill": "radixmesh.services.worker.__main__",
           "radixmesh.services.kvstore": "radixmesh.services.kvstore.__main__"}


def load_entrypoint():
    spec = importlib.util.spec_from_file_location("radixmesh_entrypoint", ROOT / "docker" / "entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_command(args: list[str], env: dict[str, str], where: str) -> tuple[str, object]:
    """(service module, its parsed settings) for the container arguments `args`; fails the test, naming `where`,
    when the service's parser refuses them."""
    argv = load_entrypoint().command(args, {**os.environ, **env})
    assert argv[1] == "-m", (where, argv)
    module, flags = argv[2], argv[3:]
    parser = importlib.import_module(PARSERS[module])
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        try:
            return module, parser.parse_args(flags)
        except SystemExit as e:
            pytest.fail(f"{where}: `{module} {' '.join(flags)}` refused by its parser: {e}")
