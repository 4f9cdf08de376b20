"""A fork server for the services: one process that has imported torch, transformers and the RPC stack once, from
which services are forked instead of started afresh. A service's start then skips the imports that are most of it on
a CPU (a tiny-model worker: about 4 of its 5 CPU-s; the tokenizer service about 2 of 3), which matters where many
meshes start one after another: a test suite, a benchmark sweeping configurations, a development loop.

    python -m radixmesh.services.forkserver --socket /tmp/rm-fork.sock &
    RADIXMESH_FORK_SERVER=/tmp/rm-fork.sock radixmesh serve --model-path ...

With RADIXMESH_FORK_SERVER set, `radixmesh serve` (and its restarts) asks the server at that socket to fork each
service; without it, or where the server refuses, each service is a fresh `python -m` process as before. A forked
service is that same `python -m` run (runpy, with its argv, environment, working folder, stdin/stdout/stderr and a
session of its own), with three differences a caller may see: its /proc cmdline is the server's (the launcher logs
each service's pid and command line instead), its parent is the server, and modules the server imported read their
import-time settings from the server's environment. So the server refuses a request whose environment differs from
its own in anything but RADIXMESH_*, TORCHINDUCTOR_* and OTEL_* variables (their packages are not preloaded),
PYTHONUNBUFFERED (applied per service), a shell's own variables and those given with --free-env: the caller then
starts the process itself.

Lifetimes are tied as PR_SET_PDEATHSIG ties a launcher's children: when the requester's connection closes (it exited
or was killed) the server kills the service with SIGKILL, and every service gets SIGKILL when the server dies. The
server reports each service's exit status to its requester (`Forked`, which answers as subprocess.Popen does:
poll(), wait(timeout), returncode, send_signal, terminate, kill). The server must never initialize CUDA (a forked
child could not use it): it imports modules only, and runs on CPU-only machines unless the caller knows better.

Protocol (AF_UNIX stream, one connection per service): the request is a 4-byte big-endian length and a JSON object
{argv: [module, args...], env, cwd, new_session}, sent with the requester's stdin, stdout and stderr (SCM_RIGHTS);
the server answers lines of JSON: {"pid": N} or {"refused": reason}, then {"exit": code} (negative: killed by that
signal, as Popen says)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass

from radixmesh.engine.forked import CONNECT_TIMEOUT_S, ENV, HEADER, Forked, spawn  # noqa: F401 (the client)
from radixmesh.engine.lifetime import die_with_parent

log = logging.getLogger("radixmesh.forkserver")

# what the services import that costs most; each is imported where installed
PRELOAD = ("numpy", "torch", "transformers", "tokenizers", "safetensors", "grpc", "google.protobuf", "aiohttp",
           "uvloop", "orjson", "yaml", "jinja2", "prometheus_client")
# transformers builds these lazily on first use: resolved once here
PRELOAD_ATTRS = (("transformers", ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "PretrainedConfig")),)
# may differ between the server's environment and a request's (read at run time only, or applied per service)
# ours, and those read where torch._inductor and OpenTelemetry are imported, which the server does not do
FREE_ENV_PREFIXES = ("RADIXMESH_", "TORCHINDUCTOR_", "OTEL_")
# PYTHONUNBUFFERED: applied per service (_run_job); the rest: a shell's own
FREE_ENV = frozenset({"PYTHONUNBUFFERED", "SHLVL", "_", "PWD", "OLDPWD", "COLUMNS", "LINES"})


def env_difference(server_env: dict, env: dict, free: frozenset = frozenset()) -> list[str]:
    """Variables whose values differ (set in one and not the other included) outside the free ones."""
    keys = set(server_env) | set(env)
    return sorted(k for k in keys if server_env.get(k) != env.get(k)
                  and k not in FREE_ENV and k not in free and not k.startswith(FREE_ENV_PREFIXES))


# ---- the server ----

@dataclass(slots=True)
class _Job:
    """What a forked child runs once it has left the server's loop."""
    argv: list[str]
    cwd: str


def _preload(modules=PRELOAD) -> list[str]:
    loaded = []
    for name in modules:
        try:
            __import__(name)
            loaded.append(name)
        except ImportError:
            pass
    for name, attrs in PRELOAD_ATTRS:
        if name in loaded:
            module = sys.modules[name]
            for attr in attrs:
                getattr(module, attr, None)
    return loaded


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request and its three file descriptors; ValueError or OSError (none left open) when it is malformed."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        if len(fds) != 3:
            raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} file descriptors")
        if len(data) < HEADER.size:
            raise ValueError("short request")
        (size,) = HEADER.unpack_from(data)
        data = data[HEADER.size:]
        while len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                raise ValueError("request cut short")
            data += more
        request = json.loads(data)
        if not isinstance(request, dict) or not isinstance(request.get("argv"), list) or not request["argv"]:
            raise ValueError("a request needs argv: [module, args...]")
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the requester is gone
        pass


def _refuse(conn: socket.socket, fds: list[int], reason: str) -> None:
    """Answers a request with why it is not forked and lets go of it."""
    for fd in fds:
        os.close(fd)
    _send(conn, {"refused": reason})
    conn.close()


class Server:
    def __init__(self, path: str, free_env: frozenset = frozenset(), exit_with_parent: bool = False):
        self.path = path
        self.pid = os.getpid()
        self.parent = os.getppid() if exit_with_parent else None
        self.env = dict(os.environ)
        self.free_env = free_env
        self.children: dict[int, socket.socket] = {}  # pid -> its requester's connection
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wake_r, self.wake_w = os.pipe()
        self.stopping = False
        self._in_child = False  # set in a forked child, which must not tear down the server's socket

    def run(self) -> _Job | None:
        """Serves until SIGTERM/SIGINT (returns None) or, in a forked child, returns the child's job."""
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        # bound and listening under a temporary name, then renamed into place: a client that finds the path can
        # connect (bound at the path itself, the socket refused connections until listen(), and a client that took
        # the path's existence for readiness was refused: a suite run's failure)
        staging = f"{self.path}.{os.getpid()}.tmp"
        if os.path.exists(staging):
            os.unlink(staging)
        self.listener.bind(staging)
        os.chmod(staging, 0o600)
        self.listener.listen(64)
        os.replace(staging, self.path)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        print(f"fork server ready on {self.path}", flush=True)
        try:
            while not self.stopping:
                if self.parent is not None and os.getppid() != self.parent:
                    log.warning("the process that started this server exited: stopping")
                    break
                for key, _ in self.sel.select(timeout=1.0):
                    if key.data == "accept":
                        job = self._accept()
                        if job is not None:
                            return job
                    elif key.data == "wake":
                        self._drain_wakeups()
                    else:
                        self._requester_readable(key.fileobj, key.data)
                self._reap()
        finally:
            if not self._in_child:
                self._shutdown()
        return None

    def _stop(self, *_) -> None:
        self.stopping = True

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> _Job | None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            request, fds = _recv_request(conn)
        except (OSError, ValueError) as e:
            log.warning("a bad request: %s", e)
            conn.close()
            return None
        differ = env_difference(self.env, request.get("env", {}), self.free_env)
        if differ:
            return _refuse(conn, fds, f"environment differs from the fork server's in {', '.join(differ[:5])}")
        try:
            pid = os.fork()
        except OSError as e:  # out of processes or memory: the requester starts it itself
            return _refuse(conn, fds, f"fork failed: {e}")
        if pid == 0:
            self._in_child = True
            return self._become_child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        _send(conn, {"pid": pid})
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def _become_child(self, conn: socket.socket, request: dict, fds: list[int]) -> _Job:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        for s in (self.listener, conn, *self.children.values()):
            s.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        die_with_parent(self.pid)
        if request.get("new_session", True):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        return _Job(list(request["argv"]), request.get("cwd") or os.getcwd())

    def _requester_readable(self, conn: socket.socket, pid: int) -> None:
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the requester is gone: its service goes too (as PR_SET_PDEATHSIG would have it)
            self.sel.unregister(conn)
            conn.close()
            if self.children.pop(pid, None) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        while True:  # every exited child, its requester's gone or not
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                self.sel.unregister(conn)
                conn.close()

    def _shutdown(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _run_job(job: _Job) -> int:
    """In the forked child: what `python -m module args...` would do from job.cwd."""
    os.chdir(job.cwd)
    sys.path[0] = job.cwd  # `python -m` puts the working folder first
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        # whole lines out promptly; write-through where the service asked for unbuffered output
        stream.reconfigure(line_buffering=True, write_through=unbuffered)
    module, *args = job.argv
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a fork server for radixmesh's services (module docstring)")
    parser.add_argument("--socket", required=True, help="the AF_UNIX socket path to listen on")
    parser.add_argument("--free-env", nargs="*", default=[], metavar="NAME",
                        help="more environment variables a request may set otherwise than this server's (ones no "
                             "preloaded module reads, such as a test runner's PYTEST_CURRENT_TEST)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop (and so stop every service forked from here) once the process that started this "
                             "server has exited, even if it was killed")
    parser.add_argument("--preload", nargs="*", default=list(PRELOAD), metavar="MODULE",
                        help="modules imported before any fork (default: the services' heavy imports)")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s forkserver: %(message)s")
    loaded = _preload(args.preload)
    log.info("imported %s", ", ".join(loaded))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        log.error("CUDA was initialized while importing %s: not serving", ", ".join(loaded))
        return 1
    logging.getLogger().handlers.clear()  # a forked service configures logging itself, as a fresh process would
    job = Server(args.socket, frozenset(args.free_env), args.exit_with_parent).run()
    if job is None:
        return 0
    return _run_job(job)


if __name__ == "__main__":
    sys.exit(main())
