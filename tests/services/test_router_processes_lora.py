"""Run-time LoRA changes with `--router-workers 2`: one router however many processes serve its port. A change made
through one process (POST /load_lora_adapter, /unload_lora_adapter) is applied by the other before the answer (its
routing and listing, its record of the run-time changes), a process the supervisor starts again gets that record,
and changes made through both at once are made one after the other, leaving every worker and every process agreeing.

The tokenizer service, the supervisor with its two router processes and two fake workers that keep LoRA adapters in
memory (benchmarks.fake_worker --enable-lora; one takes LOAD_DELAY_S per load, as reading weights does) are real
processes, launched once for the module. The kernel picks the process a connection lands on (SO_REUSEPORT), so each
test opens keep-alive connections until it holds one on each process (which process owns a connection's server-side
socket: /proc) and says through which one every request goes."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import ROOT
from tests.services.metrics_utils import stop
from tests.services.test_router_processes import _exited, children, serving, wait_until
from tests.services.test_router_resilience import KEY, Mesh, tokenizer  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux only")
LOAD_DELAY_S = 0.4  # the slow worker's LoadLoraAdapter
TIMEOUT_S = 10  # --lora-timeout-s: a change waits at most twice that for another process's


class LoraMesh:
    def __init__(self, mesh: Mesh, base: str, dirs: dict[str, str], args: dict[str, list[str]]):
        self.mesh, self.base, self.dirs, self.args = mesh, base, dirs, args
        self.port = int(base.rsplit(":", 1)[1])
        self.supervisor = mesh.procs[-1]
        self.slow, self.fast = mesh.workers

    def routers(self) -> set[int]:
        return children(self.supervisor.pid)

    def pinned(self, per_process: int = 1) -> list[list[http.client.HTTPConnection]]:
        """Keep-alive connections, `per_process` on each router process (one list per process)."""
        wait_until(lambda: len(self.routers()) == 2 and serving(self.mesh) == 2, what="two router processes")
        pids = self.routers()
        conns: dict[int, list] = {pid: [] for pid in pids}
        for _ in range(200):
            if all(len(c) >= per_process for c in conns.values()):
                return list(conns.values())
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            status, _ = call(conn, "GET", "/health")
            assert status == 200
            mine = conns[owner(conn, pids)]
            if len(mine) < per_process:
                mine.append(conn)
            else:
                conn.close()
        raise AssertionError(f"200 connections did not reach both router processes: {conns}")

    def restart_worker(self, url: str) -> None:
        """Stops the fake worker at `url` and starts it again on its port with its flags (its --lora-paths only)."""
        i = self.mesh.workers.index(url)
        old = self.mesh.procs[i]
        assert stop(old) == 0
        self.mesh.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "radixmesh.benchmarks.fake_worker", "--port", url.rsplit(":", 1)[1],
             "--served-model-name", "fake", "--tokens", "4", *self.args[url]], cwd=ROOT)
        with grpc.insecure_channel(url) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)


def owner(conn: http.client.HTTPConnection, pids: set[int]) -> int:
    """The process among `pids` holding the server side of `conn`."""
    mine, server = conn.sock.getsockname()[1], conn.sock.getpeername()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == server and int(f[2].rsplit(":", 1)[1], 16) == mine:
                    inodes.add(f"socket:[{f[9]}]")
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                pass
    raise AssertionError(f"no router process holds the server side of port {mine}")


def call(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None):
    """(status, parsed body) of one request on a keep-alive connection."""
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    raw = r.read()
    return r.status, json.loads(raw) if raw.startswith(b"{") else raw.decode()


def load(conn, name: str, path: str):
    return call(conn, "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload(conn, name: str):
    return call(conn, "POST", "/unload_lora_adapter", {"lora_name": name})


def generate(conn, lora: str):
    return call(conn, "POST", "/generate", {"text": "hello there", "lora_path": lora,
                                            "sampling_params": {"max_new_tokens": 2}})


def listed(conn) -> set[str]:
    """The adapters GET /v1/models lists through `conn`'s process."""
    status, body = call(conn, "GET", "/v1/models")
    assert status == 200, body
    return {card["id"] for card in body["data"]} - {"fake"}


def on_worker(url: str) -> dict[str, str]:
    with grpc.insecure_channel(url) as ch:
        resp = worker_pb2_grpc.WorkerServiceStub(ch).ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=10)
    return {a.lora_name: a.lora_path for a in resp.adapters}


def under_way(m: LoraMesh, name: str) -> None:
    """Returns once a load of `name` is under way: done on the fast worker, LOAD_DELAY_S from done on the slow one."""
    deadline = time.monotonic() + 10
    while name not in on_worker(m.fast):
        assert time.monotonic() < deadline, f"the load of {name} did not begin"
        time.sleep(0.01)
    assert name not in on_worker(m.slow)  # (the test's premise: not done yet)


def lora_calls(m: LoraMesh, name: str) -> int:
    total = 0
    for url in m.mesh.workers:
        with grpc.insecure_channel(url) as ch:
            info = worker_pb2_grpc.WorkerServiceStub(ch).GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=5)
        total += json.loads(info.server_info_json)["lora_calls"].get(name, 0)
    return total


@pytest.fixture(scope="module")
def lora_mesh(tokenizer, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("lora-processes")
    dirs = {}
    for name in ("x", "y", "z", "w", "flag", "c", "k"):
        (tmp / name).mkdir()
        dirs[name] = str(tmp / name)
    mesh = Mesh(tokenizer, tmp)
    flags = ["--enable-lora", "--lora-paths", f"flag={dirs['flag']}"]
    slow = mesh.worker(*flags, "--lora-load-delay-s", str(LOAD_DELAY_S))
    fast = mesh.worker(*flags)
    args = {slow: [*flags, "--lora-load-delay-s", str(LOAD_DELAY_S)], fast: flags}
    # polls every 60 s: what a process knows of a change made through the other is what the change told it
    base = mesh.router("--router-workers", "2", "--health-check-interval-secs", "60", "--lora-timeout-s",
                       str(TIMEOUT_S))
    try:
        yield LoraMesh(mesh, base, dirs, args)
    finally:
        mesh.close()


def test_a_change_through_one_process_is_usable_through_the_other_at_once(lora_mesh):
    (a,), (b,) = lora_mesh.pinned()
    status, body = generate(b, "x")  # refused: b asks the workers again, and not again within a second
    assert status == 400 and "unknown LoRA adapter 'x'" in body["error"]["message"], body
    status, body = load(a, "x", lora_mesh.dirs["x"])
    assert status == 200 and body["loaded_adapters"]["x"] == lora_mesh.dirs["x"], body
    status, body = generate(b, "x")
    assert status == 200, body
    assert "x" in listed(b) and lora_calls(lora_mesh, "x") == 1
    status, body = unload(b, "x")
    assert status == 200 and "x" not in body["loaded_adapters"], body
    assert "x" not in listed(a)
    status, body = generate(a, "x")
    assert status == 400 and "unknown LoRA adapter 'x'" in body["error"]["message"], body
    assert lora_calls(lora_mesh, "x") == 1  # refused by the router: no worker was asked
    assert all("x" not in on_worker(url) for url in lora_mesh.mesh.workers)


def test_concurrent_changes_of_one_name_through_both_processes_are_serialized(lora_mesh):
    (a, a2), (b, b2) = lora_mesh.pinned(2)
    dirs, workers = lora_mesh.dirs, lora_mesh.mesh.workers
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # the load takes LOAD_DELAY_S on the slow worker; the unload, sent meanwhile through the other process, waits
        loading = pool.submit(load, a, "c", dirs["c"])
        under_way(lora_mesh, "c")
        unloading = pool.submit(unload, b, "c")
        assert loading.result()[0] == 200 and unloading.result()[0] == 200, (loading.result(), unloading.result())
        assert [("c" in on_worker(url)) for url in workers] == [False, False]
        assert "c" not in listed(a) | listed(b)
        # loads and unloads of one name through both processes at once, each answered 200 or refused as a whole
        calls = [(load, (conn, "c", dirs["c"])) if i % 2 == 0 else (unload, (conn, "c"))
                 for i, conn in enumerate([a, b, a2, b2] * 2)]
        answers = list(pool.map(lambda fa: (fa[0].__name__, fa[0](*fa[1])), calls[:4])) + \
            list(pool.map(lambda fa: (fa[0].__name__, fa[0](*fa[1])), calls[4:]))
    assert all(status in (200, 400) for _, (status, _) in answers), answers
    have = [("c" in on_worker(url)) for url in workers]
    assert have in ([True, True], [False, False]), (have, answers)
    for conn in (a, b):
        assert ("c" in listed(conn)) == have[0]
        assert (generate(conn, "c")[0] == 200) == have[0]
    if have[0]:
        assert unload(a, "c")[0] == 200


def test_a_resync_waits_for_a_change_under_way_through_the_other_process(lora_mesh):
    """b finds a worker with an adapter its intent says was unloaded while a's load of it is under way: b's resync
    of that worker waits for the load (and then has nothing to do) instead of unloading it there."""
    (a,), (b,) = lora_mesh.pinned()
    dirs, workers = lora_mesh.dirs, lora_mesh.mesh.workers
    assert load(a, "r", dirs["x"])[0] == 200 and unload(b, "r")[0] == 200
    time.sleep(1.1)  # b asks the workers again for a request naming an unknown adapter (at most once a second)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load, a, "r", dirs["x"])
        under_way(lora_mesh, "r")
        status, body = generate(b, "nosuch")  # b polls: the fast worker has r
        assert status == 400 and "unknown LoRA adapter 'nosuch'" in body["error"]["message"], body
        assert loading.result()[0] == 200
    assert [("r" in on_worker(url)) for url in workers] == [True, True]
    for conn in (a, b):
        assert "r" in listed(conn) and generate(conn, "r")[0] == 200
    assert unload(b, "r")[0] == 200


def test_intent_follows_changes_through_either_process_and_restarted_processes(lora_mesh):
    (a,), (b,) = lora_mesh.pinned()
    m, dirs = lora_mesh, lora_mesh.dirs
    assert load(a, "z", dirs["z"])[0] == 200
    assert unload(b, "z")[0] == 200  # loaded through a, unloaded through b
    assert load(b, "w", dirs["w"])[0] == 200
    assert unload(a, "flag")[0] == 200  # came with the workers' flags
    m.restart_worker(m.fast)  # comes back with its flags: flag, not w
    wait_until(lambda: "w" in on_worker(m.fast), timeout_s=15, what="the run-time changes on the worker")
    time.sleep(0.5)  # every process has resynced it by now
    assert on_worker(m.fast).keys() == {"w"}, on_worker(m.fast)  # none brought z or flag back
    # a holder that dies frees the turn: kill a's process in the middle of a (slow) load through it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        dying = pool.submit(lambda: _swallow(load, a, "k", dirs["k"]))
        under_way(m, "k")
        victim = owner(a, m.routers())
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: _exited(victim), timeout_s=10, what="the killed process to exit")
        started = time.monotonic()
        assert load(b, "y", dirs["y"])[0] == 200
        assert time.monotonic() - started < TIMEOUT_S, "the dead process's turn was not freed"
        dying.result()
    # the other process dies too: both are new, with only what the supervisor's hub kept
    wait_until(lambda: len(m.routers()) == 2 and victim not in m.routers() and serving(m.mesh) == 2, timeout_s=30,
               what="a replacement process")
    survivor = owner(b, m.routers())
    os.kill(survivor, signal.SIGKILL)
    wait_until(lambda: len(m.routers()) == 2 and survivor not in m.routers() and serving(m.mesh) == 2, timeout_s=30,
               what="a replacement process")
    m.restart_worker(m.fast)
    wait_until(lambda: on_worker(m.fast).keys() >= {"w", "y"} and "flag" not in on_worker(m.fast), timeout_s=15,
               what="the restarted processes to resync the worker")
    (a,), (b,) = m.pinned()
    for conn in (a, b):
        assert listed(conn) >= {"w", "y"} and not listed(conn) & {"flag", "z"}
        assert generate(conn, "w")[0] == 200 and generate(conn, "flag")[0] == 400


def _swallow(fn, *args):
    try:
        return fn(*args)
    except (OSError, http.client.HTTPException):
        return None
