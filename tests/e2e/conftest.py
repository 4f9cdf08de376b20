"""The launched meshes shared by the end-to-end tests of a session (2 colocated workers on tiny-llama, and an
--is-embedding one on tiny-qwen3-embed), and the offline Engine the outputs are compared with."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.e2e.mesh import launch, running_mesh, stop_and_check
from tests.engine_utils import running_engine

MODEL = "tiny-llama"
EMBED = "tiny-qwen3-embed"


@pytest.fixture(scope="session")
def mesh(tmp_path_factory):
    m = launch(model_path(MODEL), tmp_path_factory.mktemp("mesh"), num_workers=2)
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
