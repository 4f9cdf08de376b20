"""Keeping a launched mesh up (`radixmesh serve`): a service that exits after the mesh is ready is started again
(same command, same ports) instead of the mesh stopping. Restarts back off exponentially (0.5 s, doubling, at most
30 s) while a service keeps failing; a service that stayed up for STABLE_S counts as recovered and its next failure
starts from the shortest wait again. After --max-restarts failures in a row the launcher gives up and stops the mesh
(a service that cannot start is a configuration error, not a crash). Each restart is logged with its count, and
counted in the launcher's metrics (radixmesh:launcher_restarts_total{service}) when metrics are on.

While a service is down the others carry on: the router answers 503 at once for what needs it (no tokenizer, no
healthy worker), moves streams of a dead worker to another (request migration), and reconnects when it is back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("radixmesh.launch")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0


@dataclass(slots=True)
class _State:
    failures: int = 0  # in a row: exits without STABLE_S of uptime between them
    restarts: int = 0  # in total
    started: float = 0.0
    restart_at: float | None = None  # when the dead service starts again


class Supervisor:
    def __init__(self, children: list, max_restarts: int, on_restart=None):
        """`children`: the launcher's Child objects (start(), alive(), proc, name); `on_restart(name)` counts one."""
        now = time.monotonic()
        self.children = children
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.state = {c.name: _State(started=now) for c in children}

    def restarts(self, name: str) -> int:
        return self.state[name].restarts

    def tick(self, now: float | None = None) -> str | None:
        """Look after every service once; returns why the mesh must stop (a service that keeps failing), or None."""
        now = time.monotonic() if now is None else now
        for c in self.children:
            s = self.state[c.name]
            if c.alive():
                if s.failures and now - s.started >= STABLE_S:
                    s.failures = 0
                continue
            if s.restart_at is None:  # just found dead
                if now - s.started >= STABLE_S:
                    s.failures = 0
                if s.failures >= self.max_restarts:
                    return (f"{c.name} exited (status {c.proc.returncode}) {s.failures + 1} times in a row; "
                            f"giving up after --max-restarts {self.max_restarts}")
                wait = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** s.failures)
                s.restart_at = now + wait
                log.warning("%s exited (status %s); restarting it in %.1f s", c.name, c.proc.returncode, wait)
            elif now >= s.restart_at:
                c.start()
                s.failures += 1
                s.restarts += 1
                s.started, s.restart_at = now, None
                log.warning("%s restarted (restart %d, pid %d)", c.name, s.restarts, c.proc.pid)
                if self.on_restart is not None:
                    self.on_restart(c.name)
        return None
