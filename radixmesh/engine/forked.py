"""The client half of the fork server (radixmesh.services.forkserver, which says how it works): `spawn` asks the server
at a socket to fork `python -m module args`, and `Forked` answers for the service as subprocess.Popen does. Here, below
the services, so that the engine's tensor-parallel ranks (engine.tp_worker) can be forked too."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import threading

ENV = "RADIXMESH_FORK_SERVER"  # the socket of the server `radixmesh serve` forks its services from
HEADER = struct.Struct(">I")
CONNECT_TIMEOUT_S = 10.0


class Forked:
    """A service forked by the server, answering as subprocess.Popen does for what the launcher uses."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], buffered: bytes = b""):
        self._conn = conn
        self._buf = buffered  # what came after the pid's line
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        # one reader at a time: a tensor-parallel leader's watch thread and its main thread both wait for a rank
        # (engine.tp_worker), and a read that closed the connection under another's recv failed it (EBADF: a CI run)
        self._reading = threading.Lock()

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            self._read_locked(timeout)
        finally:
            self._reading.release()

    def _read_locked(self, timeout: float | None) -> None:
        if self.returncode is not None:  # (another thread read it meanwhile)
            return
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                data = self._conn.recv(256)
                if not data:  # the server died: the service died with it (its PR_SET_PDEATHSIG)
                    self.returncode = -signal.SIGKILL
                    self._conn.close()
                    return
                self._buf += data
        except (TimeoutError, BlockingIOError):
            return
        line, _, self._buf = self._buf.partition(b"\n")
        self.returncode = int(json.loads(line)["exit"])
        self._conn.close()

    def fileno(self) -> int:
        """Readable once the service has exited (its status came, or the server is gone): a sentinel for
        multiprocessing.connection.wait and selectors (-1 once the status was read)."""
        return self._conn.fileno()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(path: str, argv: list[str], env: dict, cwd: str | None = None, new_session: bool = True,
          fds: tuple[int, int, int] = (0, 1, 2)) -> Forked | str:
    """Asks the server at `path` to fork `python -m argv[0] argv[1:]` with `fds` as its stdin, stdout and stderr
    (this process's own by default). Returns the service, or why not (the server's refusal, or no server there): the
    caller starts it itself."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(path)
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "new_session": new_session}).encode()
        socket.send_fds(conn, [HEADER.pack(len(body)) + body], list(fds))
        buf = b""
        while b"\n" not in buf:
            data = conn.recv(256)
            if not data:
                raise ConnectionError("the fork server closed the connection")
            buf += data
    except OSError as e:
        conn.close()
        return f"no fork server at {path}: {e}"
    line, _, rest = buf.partition(b"\n")
    answer = json.loads(line)
    if "pid" not in answer:
        conn.close()
        return answer.get("refused", "refused")
    return Forked(conn, int(answer["pid"]), argv, rest)
