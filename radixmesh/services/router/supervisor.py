"""`--router-workers N` (N > 1): N router processes on the same HTTP and gRPC ports (SO_REUSEPORT: the kernel
spreads connections over them), under this supervisor, which

- runs the hub they share state through (services/router/peers.py): it forwards each process's announcements to the
  others and keeps the registry (workers added at run time, their leases, their health) and the run-time LoRA
  changes for a process it restarts, and grants the turn to change LoRA adapters to one process at a time
  (services/router/lora_peers.py);
- starts a process again when one dies (a process that dies before it ever served stops the whole router: a bad
  flag or an unreachable tokenizer would only die again);
- serves --metrics-port with every process's metrics, each sample labelled router_process;
- on SIGTERM/SIGINT passes the signal on and waits for the processes to drain (--shutdown-grace-s)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from radixmesh.services.router.lora_peers import LoraLedger
from radixmesh.services.router.peers import COUNT_ENV, HUB_ENV, INDEX_ENV, LINE_LIMIT, SCRAPE_TIMEOUT_S

log = logging.getLogger("radixmesh.services.router.supervisor")
RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 10.0  # a replacement that dies before it serves waits longer each time
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def merge_expositions(texts: dict[int, str]) -> bytes:
    """Prometheus text expositions of several processes as one: samples labelled router_process="i", each family's
    HELP/TYPE once and its samples together (the format requires a family's lines to be contiguous)."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for index in sorted(texts):
        family = None
        for line in texts[index].splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                families.setdefault(family, [])
                heads = headers.setdefault(family, [])
                if not any(h.startswith(line[:7]) for h in heads):
                    heads.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, rest = m.groups()
            label = f'router_process="{index}"'
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            families.setdefault(family or name, []).append(name + labels + rest)
    out = []
    for family, samples in families.items():
        out += headers.get(family, [])
        out += samples
    return ("\n".join(out) + "\n").encode()


class Hub:
    def __init__(self, path: str):
        self.path = path
        self.conns: dict[int, asyncio.StreamWriter] = {}
        self.ready: set[int] = set()  # processes serving now
        self.served: set[int] = set()  # indexes that have served at least once
        self.workers: dict[str, dict[str, Any]] = {}  # url -> {"lease_s"?: s, "leased_at"?: t, "healthy"?: bool}
        self.removed: set[str] = set()  # removed at run time (a restarted process may have them in its flags)
        self._ids = itertools.count()
        self._scrapes: dict[int, dict[int, str]] = {}
        self._waiters: dict[int, asyncio.Future] = {}
        self._server: asyncio.base_events.Server | None = None
        self.lora = LoraLedger(self._write)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=LINE_LIMIT)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self.conns.values():
            w.close()

    def _send(self, index: int, msg: dict[str, Any] | bytes) -> None:
        self._write(self.conns.get(index), msg)

    @staticmethod
    def _write(w: asyncio.StreamWriter | None, msg: dict[str, Any] | bytes) -> None:
        if w is not None and not w.is_closing():
            w.write(msg if isinstance(msg, bytes) else orjson.dumps(msg) + b"\n")

    def _snapshot(self) -> dict[str, Any]:
        now, workers = time.monotonic(), {}
        for url, entry in self.workers.items():
            out = {k: v for k, v in entry.items() if k in ("healthy",)}
            if "lease_s" in entry:
                out["lease_s"] = None if entry["lease_s"] is None else \
                    max(entry["lease_s"] - (now - entry["leased_at"]), 0.1)
            workers[url] = out
        return {"op": "snapshot", "workers": workers, "removed": sorted(self.removed), "lora": self.lora.snapshot()}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = None
        try:
            while line := await reader.readline():
                try:
                    index = self._handle(orjson.loads(line), index, writer)
                except Exception:  # noqa: BLE001 - one bad message must not cut a process off
                    log.exception("bad message from router process %s: %.200r", index, line)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            log.warning("router process %s's link broke: %s", index, e)
        finally:
            if index is not None and self.conns.get(index) is writer:
                del self.conns[index]
            self.lora.left(writer)
            writer.close()

    def _handle(self, msg: dict[str, Any], index: int | None, writer: asyncio.StreamWriter) -> int | None:
        """Acts on one message from the process `index` (None before its hello); its index from then on."""
        op = msg["op"]
        if op == "hello":  # from now on it hears the others; the snapshot brings it up to date
            self.conns[msg["index"]] = writer
            self._send(msg["index"], self._snapshot())
            return msg["index"]
        if op == "ready":
            self.ready.add(index)
            self.served.add(index)
            log.info("router process %d (pid %d) serves", index, msg["pid"])
            return index
        if op.startswith("lora"):
            self.lora.handle(msg, writer, [w for w in self.conns.values() if w is not writer])
            return index
        if op == "scrape_all":
            asyncio.create_task(self._scrape_for(index, msg["id"]))
            return index
        if op == "scraped":
            answers = self._scrapes.get(msg["id"])
            waiter = self._waiters.get(msg["id"])
            if answers is not None and waiter is not None and not waiter.done():
                answers[msg["index"]] = msg["text"]
                if set(answers) >= set(self.conns):
                    waiter.set_result(None)
            return index
        self._remember(msg)
        msg["from"] = index
        data = orjson.dumps(msg) + b"\n"
        for other in list(self.conns):
            if other != index:
                self._send(other, data)
        return index

    def _remember(self, msg: dict[str, Any]) -> None:
        op, url = msg["op"], msg.get("url")
        if op == "add":
            self.workers.setdefault(url, {})
            self.removed.discard(url)
        elif op == "remove":
            self.workers.pop(url, None)
            self.removed.add(url)
        elif op == "lease":
            self.workers.setdefault(url, {}).update(lease_s=msg["lease_s"], leased_at=time.monotonic())
        elif op == "health" and url in self.workers:
            self.workers[url]["healthy"] = msg["healthy"]

    async def scrape(self) -> bytes:
        """Every serving process's metrics, merged."""
        scrape_id = next(self._ids)
        self._scrapes[scrape_id] = {}
        self._waiters[scrape_id] = asyncio.get_running_loop().create_future()
        for index in list(self.conns):
            self._send(index, {"op": "scrape", "id": scrape_id})
        try:
            await asyncio.wait_for(self._waiters[scrape_id], SCRAPE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("metrics scrape: router processes %s did not answer in %.0f s",
                        sorted(set(self.conns) - set(self._scrapes[scrape_id])), SCRAPE_TIMEOUT_S)
        finally:
            self._waiters.pop(scrape_id, None)
        return merge_expositions(self._scrapes.pop(scrape_id))

    async def _scrape_for(self, index: int | None, scrape_id: int) -> None:
        text = await self.scrape()
        if index is not None:
            self._send(index, {"op": "scraped_all", "id": scrape_id, "text": text.decode()})


async def _metrics_site(hub: Hub, host: str, port: int) -> web.AppRunner:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=await hub.scrape(), content_type="text/plain", charset="utf-8",
                            headers={"X-Router-Processes": str(len(hub.ready & set(hub.conns)))})
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("metrics of all router processes on http://%s:%d/metrics", host, port)
    return runner


async def supervise(argv: list[str], count: int, grace_s: float, metrics_host: str | None,
                    metrics_port: int | None) -> int:
    """Runs `count` router processes with `argv` until SIGTERM/SIGINT; the exit status."""
    tmp = tempfile.TemporaryDirectory(prefix="radixmesh-router-")
    hub = Hub(str(Path(tmp.name) / "hub.sock"))
    await hub.start()
    procs: dict[int, asyncio.subprocess.Process] = {}
    stop = asyncio.Event()
    failed: list[str] = []

    async def spawn(index: int) -> None:
        env = {**os.environ, HUB_ENV: hub.path, INDEX_ENV: str(index), COUNT_ENV: str(count)}
        procs[index] = await asyncio.create_subprocess_exec(sys.executable, "-m", "radixmesh.services.router", *argv,
                                                            env=env)

    async def watch(index: int) -> None:
        delay = RESTART_DELAY_S
        while not stop.is_set():
            rc = await procs[index].wait()
            if stop.is_set():
                return
            if index not in hub.served:  # a bad flag or an unreachable tokenizer: it would only die again
                failed.append(f"router process {index} exited with status {rc} before it served")
                stop.set()
                return
            delay = RESTART_DELAY_S if index in hub.ready else min(delay * 2, MAX_RESTART_DELAY_S)
            hub.ready.discard(index)
            log.warning("router process %d (pid %d) exited with status %s; starting another in %.1f s", index,
                        procs[index].pid, rc, delay)
            await asyncio.sleep(delay)
            if not stop.is_set():
                await spawn(index)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for index in range(count):
        await spawn(index)
    watchers = [asyncio.create_task(watch(i)) for i in range(count)]
    metrics = await _metrics_site(hub, metrics_host or "0.0.0.0", metrics_port) if metrics_port is not None \
        else None
    log.info("supervising %d router processes", count)
    await stop.wait()
    for w in watchers:
        w.cancel()
    for p in procs.values():
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs.values())), grace_s + 10)
    except asyncio.TimeoutError:
        for p in procs.values():
            if p.returncode is None:
                log.warning("router process pid %d still running after the grace period; killing it", p.pid)
                p.kill()
        await asyncio.gather(*(p.wait() for p in procs.values()))
    if metrics is not None:
        await metrics.cleanup()
    await hub.close()
    tmp.cleanup()
    for reason in failed:
        log.error("%s; stopping the router", reason)
    return 1 if failed else 0


def cores() -> int:
    return len(os.sched_getaffinity(0))
