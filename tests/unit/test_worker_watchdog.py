"""The worker's engine watchdog: a scheduler that dies on its own stops the worker with exit 1; a scheduler shut
down by a stop the worker was asked for (SIGTERM) is no failure. CI once saw exit 1 after a plain SIGTERM, because
the watchdog saw the engine go down during the signal's own shutdown."""

from __future__ import annotations

import asyncio

from radixmesh.services.worker.__main__ import _watch_engine


class _Engine:
    alive = True


class _Service:
    """The two members of GrpcService the watchdog uses."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.grace: list[float | None] = []

    def request_stop(self, grace_s: float | None = None) -> None:
        self.stop_requested = True
        self.grace.append(grace_s)


def test_a_scheduler_that_dies_stops_the_worker_as_a_failure():
    engine, service = _Engine(), _Service()
    engine.alive = False
    assert asyncio.run(_watch_engine(engine, service)) is True
    assert service.grace == [0]


def test_the_engine_shut_down_by_a_requested_stop_is_no_failure():
    async def main():
        engine, service = _Engine(), _Service()
        watch = asyncio.create_task(_watch_engine(engine, service))
        await asyncio.sleep(0.05)
        service.stop_requested = True  # SIGTERM: the service stops, then shuts the engine down
        engine.alive = False
        return await asyncio.wait_for(watch, 5), service.grace

    died, grace = asyncio.run(main())
    assert died is False and grace == []
