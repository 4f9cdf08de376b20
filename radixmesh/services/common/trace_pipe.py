"""The bounded span buffer of a traced process and the pipe to its exporter process (services.common.trace_export).

`add` (the recorder's sink, any thread) appends a finished span, a Record tuple, to a deque: no lock. With the native
recorder (`native`, services/common/_spanrec.c), spans are written in C into its buffer as they end instead, already
encoded as OTLP, and the writer takes whole records from it, up to a batch a frame: `O`, the number of spans (4
bytes, little-endian) and the spans (ScopeSpans.spans fields), which the exporter only wraps in a request. A daemon thread
wakes every OTEL_BSP_SCHEDULE_DELAY ms, or as soon as OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans wait, and writes them to
the exporter's stdin as one frame: a 4-byte little-endian length, then the list of records, marshalled in one go
(trace_recorder.encode_batch: what the records share is written once). The exporter encodes OTLP and talks to the
collector in its own process, so neither costs this process's GIL.

Nothing blocks the serving code: when the exporter falls behind (a slow or absent collector), the pipe fills, the
writer thread waits on it, the deque reaches OTEL_BSP_MAX_QUEUE_SIZE and further spans are dropped and counted
(`dropped`; logged at most once a minute). If the exporter process dies, spans are dropped from then on.

The exporter runs in a session of its own (a Ctrl-C or a signal to the service's process group does not cut its
last export short); it exits when its stdin closes (this process ended or called `close`) and, should the pipe have
leaked into another process, when this process is gone (it polls its parent pid)."""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from radixmesh.services.common.trace_recorder import encode_batch

log = logging.getLogger(__name__)

_F_SETPIPE_SZ = 1031  # fcntl command (Linux): a larger pipe rides out short exporter stalls without blocking
PIPE_BYTES = 1 << 20
DROP_LOG_EVERY_S = 60.0
_FRAME = struct.Struct("<I")
_COUNT = struct.Struct("<i")  # the spans in an OTLP frame
OTLP_FRAME = b"O"  # a frame of OTLP spans (the native recorder's); a marshalled list begins otherwise


def env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%s is not an integer; using %d", name, os.environ.get(name), default)
        return default
    return value if value > 0 else default


def exporter_command(role: str, endpoint: str | None, batch: int = 512) -> list[str]:
    """The exporter process's argv (`python -m radixmesh.services.common.trace_export ...`)."""
    argv = [sys.executable, "-m", "radixmesh.services.common.trace_export", "--role", role,
            "--parent-pid", str(os.getpid()), "--batch", str(batch)]
    return argv + (["--endpoint", endpoint] if endpoint else [])


def encode_frame(batch: list[tuple]) -> bytes:
    """One frame: the byte length, then the list of Record tuples, marshalled (trace_recorder.encode_batch)."""
    data = encode_batch(batch)
    return _FRAME.pack(len(data)) + data


class SpanPipe:
    """Finished spans on their way to the exporter process. `close` flushes and waits for the exporter to end."""

    def __init__(self, argv: list[str], max_queue: int = 2048, batch: int = 512, delay_s: float = 5.0,
                 native=None):
        self.max_queue, self.batch, self.delay_s = max_queue, batch, delay_s
        self._dropped = self.sent = 0
        self._native = native  # the _spanrec module whose buffer holds the records, or None: the deque
        self._queue: collections.deque = collections.deque()
        self._closing = self._broken = False
        self._limit = max_queue  # 0 once nothing more can be sent
        self._wake = threading.Event()
        self._last_drop_log, self._dropped_logged = time.monotonic(), 0
        root = str(Path(__file__).resolve().parents[3])  # the folder holding radixmesh/
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, start_new_session=True)
        try:
            fcntl.fcntl(self.proc.stdin.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size: keep the default size
        if native is not None:
            native.set_buffer(max_queue, batch, self._wake.set)
            self._dropped -= native.dropped()  # its count lives as long as the process; this pipe's from here
        self._thread = threading.Thread(target=self._run, name="span-pipe", daemon=True)
        self._thread.start()
        os.register_at_fork(after_in_child=self._forked)

    @property
    def dropped(self) -> int:
        """Spans dropped so far (a full queue, a gone exporter)."""
        return self._dropped + (self._native.dropped() if self._native is not None else 0)

    def add(self, record: tuple) -> None:
        """Queue one finished span (the recorder's sink); dropped and counted when the queue is full."""
        queue = self._queue
        if len(queue) < self._limit:
            queue.append(record)
            if len(queue) == self.batch:  # a full batch waits (else the writer wakes on its schedule)
                self._wake.set()
        else:
            self._dropped += 1

    def _run(self) -> None:
        while not self._closing:
            full = self._wake.wait(self.delay_s)
            self._wake.clear()
            self._send_waiting(full_only=full)
            self._report_drops()
        self._send_waiting()
        self._close_pipe()

    def _send_waiting(self, full_only: bool = False) -> None:
        """Frames of at most `batch` spans (an export request each), of every span waiting; with `full_only` (woken
        by a full batch) only full ones: the rest waits for the next batch or the schedule, as the SDK's does."""
        native, queue, least = self._native, self._queue, self.batch if full_only else 1
        while native is not None and not self._broken and native.waiting() >= least:
            n, data = native.take(self.batch)
            if not n:  # a record is being written (its str() calls run Python): it goes with the next frame
                break
            self._write(n, _FRAME.pack(len(data) + 5) + OTLP_FRAME + _COUNT.pack(n), data)
        while len(queue) >= least and not self._broken:
            n = min(len(queue), self.batch)
            batch = [queue.popleft() for _ in range(n)]
            self._write(n, encode_frame(batch))

    def _write(self, n: int, *parts: bytes) -> None:
        """Write a frame of `n` records to the exporter; on a broken pipe, drop it and everything from now on."""
        try:
            for part in parts:
                self.proc.stdin.write(part)
            self.proc.stdin.flush()
            self.sent += n
        except (OSError, ValueError) as e:  # the exporter is gone (BrokenPipeError) or the pipe was closed
            self._stop_recording()
            self._dropped += n + len(self._queue)
            self._queue.clear()
            log.error("trace exporter process gone (%s, exit code %s): spans are dropped from now on", e,
                      self.proc.poll())

    def _stop_recording(self) -> None:
        """Nothing more is queued: spans that end from now on are dropped (and counted)."""
        self._broken, self._limit = True, 0
        if self._native is not None:
            self._native.set_buffer(0, self.batch, None)
            n, _ = self._native.take()
            self._dropped += n

    def _report_drops(self) -> None:
        now = time.monotonic()
        if self.dropped > self._dropped_logged and now - self._last_drop_log >= DROP_LOG_EVERY_S:
            log.warning("tracing: %d spans dropped so far (the exporter or the collector is not keeping up)",
                        self.dropped)
            self._last_drop_log, self._dropped_logged = now, self.dropped

    def _close_pipe(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, close the pipe (the exporter exports the rest and exits) and wait for the exporter
        up to `timeout_s` (then kill it). New spans are dropped from here on."""
        deadline = time.monotonic() + timeout_s
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck on a full pipe: the exporter stopped reading
            self.proc.kill()
            self._thread.join(1.0)
        self._stop_recording()
        self._dropped += len(self._queue)  # ended after the writer's last look
        self._queue.clear()
        try:
            self.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("trace exporter did not finish within %.0f s; killed", timeout_s)
            self.proc.kill()
            self.proc.wait()
        if self.dropped:
            log.warning("tracing: %d spans dropped in all", self.dropped)

    def _forked(self) -> None:
        """In a forked child the writer thread is gone and the pipe is the parent's: this copy records nothing."""
        self._closing = True
        self._stop_recording()
