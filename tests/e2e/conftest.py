"""The launched meshes shared by the end-to-end tests of a session (2 colocated workers on tiny-llama, and an
--is-embedding one on tiny-qwen3-embed), and the offline Engine the outputs are compared with."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.e2e.mesh import Mesh, await_ready, running_mesh, start, stop_and_check
from tests.engine_utils import running_engine

MODEL = "tiny-llama"
EMBED = "tiny-qwen3-embed"


_EARLY: list[Mesh] = []  # the session mesh, spawned when the tests were collected


def pytest_collection_finish(session):
    """When a test of the session will use `mesh`, it is spawned now: its start-up (mostly one core's CPU, each
    process importing torch and transformers) overlaps the tests that run before its first user, which mostly keep
    one core busy, instead of holding up that test."""
    if not session.config.option.collectonly and any(_uses_mesh(item) for item in session.items):
        _EARLY.append(start(model_path(MODEL), session.config._tmp_path_factory.mktemp("mesh"), num_workers=2))


def _uses_mesh(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("mesh") if info is not None else None
    return bool(defs) and getattr(defs[-1].func, "__module__", None) == __name__  # this one, not a module's own


def pytest_sessionfinish(session):
    while _EARLY:  # spawned, never used (the session stopped early)
        _EARLY.pop().stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory):
    m = _EARLY.pop() if _EARLY else start(model_path(MODEL), tmp_path_factory.mktemp("mesh"), num_workers=2)
    await_ready(m)
    try:
        yield m
    finally:
        stop_and_check(m)


@pytest.fixture(scope="session")
def embed_mesh(tmp_path_factory):
    """An embedding model's colocated mesh (1 worker, page size 4): test_embeddings_mesh's, and the colocated side
    of test_pd's PD embeddings."""
    with running_mesh(model_path(EMBED), tmp_path_factory.mktemp("embed-mesh"), "--is-embedding", "--page-size",
                      "4") as m:
        yield m


@pytest.fixture(scope="session")
def offline():
    with running_engine(model_path(MODEL)) as llm:
        yield llm
