"""--event-loop: the loop a service's asyncio code runs on (services/common/event_loop.py)."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.services.common import event_loop
from radixmesh.services.router.settings import RouterSettings


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_where_installed():
    pytest.importorskip("uvloop")
    assert event_loop.chosen("auto") == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")
    assert event_loop.run(_loop_module(), "uvloop").startswith("uvloop")


def test_asyncio_runs_on_the_standard_loop():
    assert event_loop.chosen("asyncio") == "asyncio"
    assert event_loop.run(_loop_module(), "asyncio").startswith("asyncio")


def test_result_and_exception_come_back_on_both_loops():
    async def fails():
        raise KeyError("x")

    for choice in ("auto", "asyncio"):
        assert event_loop.run(asyncio.sleep(0, result=7), choice) == 7
        with pytest.raises(KeyError):
            event_loop.run(fails(), choice)


def test_bad_choice_is_a_clear_error():
    with pytest.raises(ValueError, match="--event-loop must be one of auto, uvloop, asyncio, got 'libuv'"):
        RouterSettings(tokenizer_url="127.0.0.1:1", event_loop="libuv")


def test_uvloop_asked_for_but_missing(monkeypatch):
    monkeypatch.setattr(event_loop, "_uvloop", lambda: None)
    assert event_loop.chosen("auto") == "asyncio"
    with pytest.raises(ValueError, match="uvloop package is not installed"):
        event_loop.check("uvloop")
    coro = _loop_module()
    try:
        with pytest.raises(ValueError):
            event_loop.run(coro, "uvloop")
    finally:
        coro.close()
