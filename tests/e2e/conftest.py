"""The launched mesh (2 colocated workers on tiny-llama) shared by the end-to-end tests of a session, and the
offline Engine the outputs are compared with."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.e2e.mesh import launch, stop_and_check
from tests.engine_utils import running_engine

MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def mesh(tmp_path_factory):
    m = launch(model_path(MODEL), tmp_path_factory.mktemp("mesh"), num_workers=2)
    try:
        yield m
    finally:
        stop_and_check(m)


@pytest.fixture(scope="session")
def offline():
    with running_engine(model_path(MODEL)) as llm:
        yield llm
