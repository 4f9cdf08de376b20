"""`radixmesh serve --model-path PATH [--num-workers N] [--port 30000] [engine flags]` (also
`python -m radixmesh.services.launch serve ...`): starts the tokenizer, N colocated workers (or, with
`--disaggregation pd --num-prefill N --num-decode M`, prefill and decode workers) and the router as separate OS
processes on loopback (with `--kvstore`, the kvstore too, wired to the workers and the router), waits until each is
healthy, prints the URL, and on SIGINT/SIGTERM stops them all: the
router first (it lets open requests finish), then the workers and the tokenizer. Children get SIGKILL if the
launcher itself dies (PR_SET_PDEATHSIG), so nothing is left over. Calls between the services carry an internal
token (--internal-token, else a random one made per launch, passed by the environment) and, with --tls-cert,
--tls-key and --tls-ca, run over mutual TLS (services.common.auth). `radixmesh certs --out DIR` makes a CA and a
certificate for that (services.certs).

Each service's start is logged with its pid and command line (secret flag values left out). With
RADIXMESH_FORK_SERVER naming a running fork server's socket (services.forkserver), services are forked from it instead
of started afresh, skipping their heavy imports; where it refuses or does not answer they start afresh."""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.engine.config import STORAGE_TRANSPORTS, EngineArgs
from radixmesh.engine.lifetime import die_with_parent
from radixmesh.services import forkserver
from radixmesh.services.common import auth
from radixmesh.services.common.auth import TOKEN_ENV, InternalAuth, InternalAuthSettings
from radixmesh.services.common.auth_channel import sync_channel
from radixmesh.services.common.ports import free_port, reserve
from radixmesh.services.common.tracing import TraceSettings
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.worker.settings import PdSettings
from radixmesh.services.supervise import Supervisor
from radixmesh.settings import as_flags, build_parser, resolve

log = logging.getLogger("radixmesh.launch")


# What the launcher decides for its router children (the addresses it hands out): not flags of `radixmesh serve`.
ROUTER_WIRED = frozenset({"tokenizer_url", "worker_urls", "discovery_dns", "discovery_interval_s", "kvstore_url"})


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """The launcher's own flags. The router's (RouterSettings, but for ROUTER_WIRED), the tracing flags
    (TraceSettings), the engine's (EngineArgs), PD's (PdSettings) and the internal credentials (InternalAuthSettings)
    are composed beside them, declared once in their own classes and passed to the children as given."""

    num_workers: int = field(default=1, metadata={
        "aliases": ("--dp-size", "--dp"),
        "help": "colocated workers (separate processes; SGLang's --dp-size): data parallelism, each worker one "
                "tensor-parallel group of --tp-size ranks"})
    disaggregation: str = field(default="null", metadata={
        "help": "null: colocated workers (--num-workers); pd: prefill and decode workers (--num-prefill, "
                "--num-decode) with KV moved between them"})
    worker_gpu_ids: tuple[str, ...] = field(default=(), metadata={
        "help": "GPU ids for the workers, in turn (worker i sees only the i-th, wrapping around); default: every "
                "worker sees every GPU and uses the first"})
    num_routers: int = field(default=1, metadata={
        "help": "router replicas over the same workers, on --port, --port + 1, ... (a load balancer goes in front)"})
    num_prefill: int = field(default=1, metadata={"help": "with --disaggregation pd: prefill workers"})
    num_decode: int = field(default=1, metadata={"help": "with --disaggregation pd: decode workers"})
    max_restarts: int = field(default=10, metadata={
        "help": "a service that exits once the mesh is up is started again (backoff 0.5 s doubling to 30 s); after "
                "this many failures in a row (each under a minute of uptime) the mesh stops"})
    num_tokenizers: int = field(default=1, metadata={
        "help": "tokenizer service replicas; the routers balance over them and fail over between them"})
    kvstore: bool = field(default=False, metadata={
        "help": "start the kvstore: workers publish KV events to it and (with --enable-hierarchical-cache) use it "
                "as their L3 tier; the router can route on its index (--policy kv_index)"})
    kvstore_l3: bool = field(default=True, metadata={
        "help": "with --kvstore and --enable-hierarchical-cache: the workers use the kvstore as their L3 tier "
                "(--no-kvstore-l3: the index only)"})
    kvstore_backend: str = field(default="memory", metadata={"help": "with --kvstore: memory, file, redis or mooncake"})
    kvstore_storage_url: str | None = field(default=None, metadata={
        "help": "with --kvstore: the backend's directory (file) or address (redis://host:port/db)"})
    kvstore_capacity_bytes: int | None = field(default=None, metadata={"help": "with --kvstore: bound on stored pages"})
    kvstore_transport: str = field(default="grpc", metadata={
        "help": "with --kvstore as L3: how page bytes travel between the workers and the kvstore, grpc (in the "
                "messages) or mooncake (the Mooncake transfer engine, straight from and into the host pools)"})
    enable_metrics: bool = field(default=False, metadata={
        "help": "every service exports Prometheus metrics: the routers at /metrics on their API ports, the others "
                "on a free --metrics-port each (listed at start-up and in --metrics-sd-file)"})
    metrics_sd_file: str | None = field(default=None, metadata={
        "help": "with --enable-metrics: write the metrics targets here as a Prometheus file_sd JSON list (each "
                "target labelled service=<name>)"})
    chat_template: str | None = field(default=None, metadata={"help": "chat template file or built-in name"})
    startup_timeout_s: float = field(default=600.0, metadata={"help": "give up if a service is not healthy by then"})

    def __post_init__(self) -> None:
        if self.num_tokenizers < 1 or self.max_restarts < 0:
            raise ValueError("--num-tokenizers must be at least 1 and --max-restarts at least 0")
        if self.num_workers < 1 or self.num_routers < 1:
            raise ValueError("--num-workers and --num-routers must be at least 1")
        if self.disaggregation not in ("null", "pd"):
            raise ValueError(f"--disaggregation must be null or pd, got {self.disaggregation!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("--num-prefill and --num-decode must be at least 1")
        if self.metrics_sd_file and not self.enable_metrics:
            raise ValueError("--metrics-sd-file lists the metrics targets: add --enable-metrics")
        if self.kvstore_transport not in STORAGE_TRANSPORTS:
            raise ValueError(f"--kvstore-transport must be one of {', '.join(STORAGE_TRANSPORTS)}, "
                             f"got {self.kvstore_transport!r}")


def router_view(settings: LaunchSettings, router: dict) -> RouterSettings:
    """The routers' settings as given to the launcher, checked as each router will check them (with the addresses
    the launcher hands out standing in for ROUTER_WIRED). ValueError on a bad one."""
    if router.get("policy") == "kv_index" and not settings.kvstore:
        raise ValueError("--policy kv_index routes on the kvstore's index: add --kvstore")
    wired = {"tokenizer_url": "127.0.0.1:1", "kvstore_url": "127.0.0.1:1" if settings.kvstore else None}
    return RouterSettings(**{**router, **wired})


SECRET_FLAG_ENDS = ("-key", "-token", "-secret", "-password")


def shown_argv(argv: list[str]) -> str:
    """A command line for the log, the values of flags that may hold secrets (--api-key ...) left out."""
    out = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        flag, _, value = arg.partition("=")
        if arg.startswith("--") and value and flag.endswith(SECRET_FLAG_ENDS):  # --api-key=...
            arg = flag + "=***"
        elif previous.startswith("--") and previous.endswith(SECRET_FLAG_ENDS) and not arg.startswith("--"):
            arg = "***"
        out.append(arg)
    return " ".join(out)


def engine_flags(engine_kwargs: dict) -> list[str]:
    """Engine keyword arguments back into SGLang-named flags for the workers."""
    flags = []
    for name, value in engine_kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, (list, tuple)):  # a flag of several values (--lora-paths a=x b=y, --cuda-graph-bs)
            flags += [flag, *map(str, value)] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    health: str  # "grpc://host:port" or "http://host:port/health"
    proc: subprocess.Popen | forkserver.Forked | None = None
    env: dict = field(default_factory=dict)  # set on top of the launcher's environment
    metrics: str | None = None  # host:port of its /metrics (with --enable-metrics)

    def start(self) -> None:
        env = {**os.environ, **self.env}  # the same interpreter and environment: it imports what this process does
        server = os.environ.get(forkserver.ENV)
        forked = forkserver.spawn(server, self.argv, env) if server else None
        if isinstance(forked, forkserver.Forked):
            self.proc = forked
        else:
            if forked:
                log.info("%s: not forked (%s); started afresh", self.name, forked)
            # Its own session: a terminal's Ctrl-C reaches only the launcher, which then stops the services in order.
            self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], env=env, preexec_fn=die_with_parent,
                                         start_new_session=True)
        log.info("%s started (pid %d%s): %s", self.name, self.proc.pid, ", forked" if forked is self.proc else "",
                 shown_argv(self.argv))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        if self.health.startswith("grpc://"):
            with sync_channel(self.health.removeprefix("grpc://")) as ch:  # TLS when the mesh has it
                try:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError:
                    return False
                return r.status == health_pb2.HealthCheckResponse.SERVING
        try:
            with urllib.request.urlopen(self.health, timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):  # not up yet, or a torn answer
            return False


def _worker_roles(settings: LaunchSettings) -> list[tuple[str, list[str]]]:
    """(name, role flags) per worker process."""
    if settings.disaggregation == "null":
        return [(f"worker-{i}", []) for i in range(settings.num_workers)]
    roles = [(f"worker-prefill-{i}", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                      str(free_port())]) for i in range(settings.num_prefill)]
    return roles + [(f"worker-decode-{i}", ["--disaggregation-mode", "decode"]) for i in range(settings.num_decode)]


def plan(settings: LaunchSettings, engine_kwargs: dict, pd_kwargs: dict | None = None, router: dict | None = None,
         trace: dict | None = None) -> list[Child]:
    """The processes to start, in start order (tokenizer, workers, router). `router`, `trace`: the RouterSettings
    and TraceSettings keyword arguments given (what is not given keeps the services' defaults)."""
    router = router or {}
    view = router_view(settings, router)
    model = engine_kwargs["model_path"]
    # the router's ports came with the flags (a test or benchmark may have picked them): none is handed out again
    reserve(view.grpc_port, *(view.port + i for i in range(settings.num_routers)))
    tok_ports = [free_port() for _ in range(settings.num_tokenizers)]
    tok = ["radixmesh.services.tokenizer", "--model-path", engine_kwargs.get("tokenizer_path") or model]
    if engine_kwargs.get("revision"):  # the tokenizer of the model id's snapshot the workers read
        tok += ["--revision", engine_kwargs["revision"]]
    if settings.chat_template:
        tok += ["--chat-template", settings.chat_template]
    if engine_kwargs.get("context_length"):
        tok += ["--context-length", str(engine_kwargs["context_length"])]
    if view.served_model_name:  # its metrics carry the model_name the router's and workers' do
        tok += ["--served-model-name", view.served_model_name]
    # every port of the mesh from this process's free_port, the stream lanes' too (a lane on a port the kernel
    # picked could take one handed to a service that has not started yet)
    children = [Child("tokenizer" if i == 0 else f"tokenizer-{i}",
                      [*tok, "--port", str(port), "--stream-lane-port", str(free_port())],
                      f"grpc://127.0.0.1:{port}") for i, port in enumerate(tok_ports)]
    kv_flags, router_kv = [], []
    if settings.kvstore:
        kv_port = free_port()
        kv_flags = ["--kvstore-url", f"127.0.0.1:{kv_port}"]
        router_kv = list(kv_flags)
        if (settings.kvstore_l3 and engine_kwargs.get("enable_hierarchical_cache")
                and not engine_kwargs.get("hicache_storage_backend")):
            kv_flags += ["--hicache-storage-backend", "kvstore"]
        # the transfer engine only where pages move (its staging memory is registered at start)
        transfer = settings.kvstore_transport != "grpc" and "--hicache-storage-backend" in kv_flags
        if transfer:
            engine_kwargs = _with_transport(engine_kwargs, settings.kvstore_transport)
        children.append(Child("kvstore", _kvstore_argv(settings, kv_port, transfer), f"grpc://127.0.0.1:{kv_port}"))
    worker_urls = []
    pd_flags = engine_flags(pd_kwargs or {}) if settings.disaggregation == "pd" else []
    for name, role in _worker_roles(settings):
        port = free_port()
        worker_urls.append(f"127.0.0.1:{port}")
        argv = ["radixmesh.services.worker", "--port", str(port), "--stream-lane-port", str(free_port()), *role,
                *pd_flags, *kv_flags, *engine_flags(engine_kwargs)]
        if view.served_model_name:
            argv += ["--served-model-name", view.served_model_name]
        if settings.chat_template:  # the template the tokenizer service renders with: workers render chat alike
            argv += ["--chat-template", settings.chat_template]
        gpus = settings.worker_gpu_ids
        env = {"CUDA_VISIBLE_DEVICES": gpus[(len(worker_urls) - 1) % len(gpus)]} if gpus else {}
        tp = engine_kwargs.get("tp_size") or 1
        if tp > 1 and not gpus:  # each worker's ranks on GPUs of their own: worker i from base + i * tp GPUs on
            step = engine_kwargs.get("gpu_id_step") or 1
            argv += ["--base-gpu-id", str((engine_kwargs.get("base_gpu_id") or 0) + (len(worker_urls) - 1) * tp * step)]
        children.append(Child(name, argv, f"grpc://127.0.0.1:{port}", env=env))
    router_argv = ["radixmesh.services.router", "--port", str(view.port),
                   "--tokenizer-url", ",".join(f"127.0.0.1:{port}" for port in tok_ports),
                   "--worker-urls", *worker_urls, *router_kv,
                   *as_flags(RouterSettings, {k: v for k, v in router.items() if k != "port"})]
    host = "127.0.0.1" if view.host in ("0.0.0.0", "::") else view.host
    children.append(Child("router", router_argv, f"http://{host}:{view.port}/health"))
    for i in range(1, settings.num_routers):  # replicas: the same flags on the next ports, no public gRPC API
        port = view.port + i
        replica = list(router_argv)
        replica[replica.index("--port") + 1] = str(port)
        if view.grpc_port is not None:
            at = replica.index("--grpc-port")
            del replica[at:at + 2]
        children.append(Child(f"router-{i}", replica, f"http://{host}:{port}/health"))
    if settings.enable_metrics:
        _add_metrics(children, host)
    for c in children:
        c.argv += trace_flags(trace or {})
    return children


def launcher_metrics(settings: LaunchSettings, children: list[Child], served_model_name: str | None = None):
    """With --enable-metrics: the launcher's own /metrics (radixmesh:launcher_restarts_total{service}) on a free
    port, logged, and --metrics-sd-file written with it and every child's; returns the restart counter's
    `count(service)` (else None). Called before any child starts, so the file is complete from its first version
    (a reader of it after "ready" once saw the launcher missing)."""
    if not settings.enable_metrics:
        return None
    log.info("metrics: %s", ", ".join(f"{c.name} http://{c.metrics}/metrics" for c in children))
    from prometheus_client import start_http_server

    from radixmesh.services.common.metrics import ServiceMetrics

    metrics = ServiceMetrics("launcher", served_model_name or "")
    restarts = metrics.counter("radixmesh:launcher_restarts_total", "Services started again after they exited",
                               ("service",))
    for c in children:
        restarts.labels(c.name)
    port = free_port()
    start_http_server(port, "127.0.0.1", registry=metrics.registry)
    log.info("launcher metrics: http://127.0.0.1:%d/metrics", port)
    if settings.metrics_sd_file:
        write_metrics_targets([*children, Child("launcher", [], "", metrics=f"127.0.0.1:{port}")],
                              settings.metrics_sd_file)
    return lambda name: restarts.labels(name).inc()


def trace_flags(trace: dict) -> list[str]:
    """The tracing flags every child gets (TraceSettings keyword arguments as given; none when tracing is off)."""
    checked = TraceSettings(**trace)  # raises on a bad ratio or endpoint
    if not (checked.enable_trace or checked.otlp_traces_endpoint is not None):
        return []
    return as_flags(TraceSettings, {**trace, "enable_trace": True})


def _add_metrics(children: list[Child], router_host: str) -> None:
    """--enable-metrics for every child; a free --metrics-port for each gRPC service (a router serves /metrics on
    its API port). Sets each child's `metrics` target (host:port)."""
    for c in children:
        c.argv.append("--enable-metrics")
        if c.name.startswith("router"):
            c.metrics = f"{router_host}:{c.argv[c.argv.index('--port') + 1]}"
        else:
            port = free_port()
            c.argv += ["--metrics-port", str(port)]
            c.metrics = f"127.0.0.1:{port}"


def write_metrics_targets(children: list[Child], path: str) -> None:
    """Prometheus file_sd: one target group per service, labelled service=<its name>."""
    groups = [{"targets": [c.metrics], "labels": {"service": c.name}} for c in children if c.metrics]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(groups, f, indent=1)
    os.replace(tmp, path)  # Prometheus re-reads the file when it changes: never let it see half of it


def _with_transport(engine_kwargs: dict, transport: str) -> dict:
    """The engine flags with `transport` added to --hicache-storage-backend-extra-config."""
    extra = json.loads(engine_kwargs.get("hicache_storage_backend_extra_config") or "{}")
    extra["transport"] = transport
    return {**engine_kwargs, "hicache_storage_backend_extra_config": json.dumps(extra)}


def _kvstore_argv(settings: LaunchSettings, port: int, transfer: bool) -> list[str]:
    argv = ["radixmesh.services.kvstore", "--port", str(port), "--backend", settings.kvstore_backend]
    if transfer:
        argv.append("--enable-mooncake-transfer")
    if settings.kvstore_storage_url:
        argv += ["--storage-url", settings.kvstore_storage_url]
    if settings.kvstore_capacity_bytes is not None:
        argv += ["--capacity-bytes", str(settings.kvstore_capacity_bytes)]
    return argv


class Interrupted(Exception):
    pass


def wait_healthy(children: list[Child], deadline: float, stopping: list) -> None:
    pending = list(children)
    while pending:
        if stopping:
            raise Interrupted()
        for c in list(pending):
            if not c.alive():
                raise RuntimeError(f"{c.name} exited with status {c.proc.returncode} during startup")
            if c.healthy():
                log.info("%s is healthy", c.name)
                pending.remove(c)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not healthy within the startup timeout: {', '.join(c.name for c in pending)}")
        time.sleep(0.2)


def stop_all(children: list[Child], grace_s: float) -> None:
    """Router first (so open streams end while the workers still serve them), then everything else."""
    router = [c for c in children if c.name.startswith("router")]
    for group in (router, [c for c in children if c.name != "router"]):
        for c in group:
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5
        for c in group:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit in time; killing it", c.name)
                c.proc.kill()
                c.proc.wait()


def secure(children: list[Child], auth_settings: InternalAuthSettings) -> InternalAuth:
    """Every child gets the internal token(s) by its environment (the ones given, else a random one made for this
    launch: a launched mesh is always authenticated) and the TLS flags when given; this process's health probes use
    the same TLS. Returns the credentials. ValueError when a file given cannot be read."""
    given = InternalAuth.from_settings(auth_settings)
    tokens = given.tokens or (secrets.token_urlsafe(32),)
    flags = []
    for name in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(auth_settings, name):
            flags += ["--" + name.replace("_", "-"), str(Path(getattr(auth_settings, name)).resolve())]
    if auth_settings.tls_server_name:
        flags += ["--tls-server-name", auth_settings.tls_server_name]
    for c in children:
        c.argv += flags
        # an inherited RADIXMESH_INTERNAL_TOKEN_FILE would clash with the token given here: blank it
        c.env.update({TOKEN_ENV: ",".join(tokens), TOKEN_ENV + "_FILE": ""})
    resolved = InternalAuth(tokens, given.cert, given.key, given.ca, given.server_name)
    auth.configure(resolved)
    return resolved


def serve(settings: LaunchSettings, engine_kwargs: dict, pd_kwargs: dict | None = None,
          auth_settings: InternalAuthSettings | None = None, router: dict | None = None,
          trace: dict | None = None) -> int:
    router = router or {}
    view = router_view(settings, router)
    children = plan(settings, engine_kwargs, pd_kwargs, router, trace)
    try:
        log.info("internal calls: %s", secure(children, auth_settings or InternalAuthSettings()).describe())
    except ValueError as e:
        log.error("%s", e)
        return 2
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    routers = [c for c in children if c.name.startswith("router")]
    backends = [c for c in children if c not in routers]
    try:
        count_restart = launcher_metrics(settings, children, view.served_model_name)
        for c in backends:
            c.start()
        wait_healthy(backends, time.monotonic() + settings.startup_timeout_s, stopping)
        for c in routers:
            c.start()
        wait_healthy(routers, time.monotonic() + settings.startup_timeout_s, stopping)
        more = f" (and {settings.num_routers - 1} more routers on the next ports)" if settings.num_routers > 1 else ""
        print(f"radixmesh is ready: http://{view.host}:{view.port} (OpenAI base URL "
              f"http://{view.host}:{view.port}/v1){more}", flush=True)
        code = 0
        supervisor = Supervisor(children, settings.max_restarts, count_restart)
        while not stopping:
            given_up = supervisor.tick()
            if given_up:
                log.error("%s; stopping everything", given_up)
                code = 1
                break
            time.sleep(0.2)
    except RuntimeError as e:
        log.error("%s", e)
        code = 1
    except Interrupted:
        log.info("interrupted during startup")
        code = 0
    log.info("stopping all services")
    stop_all(children, view.shutdown_grace_s)
    return code


# What `radixmesh serve` is made of, each part's flags declared once in its own class.
SERVE_PARTS = (LaunchSettings, RouterSettings, TraceSettings, PdSettings, EngineArgs, InternalAuthSettings)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "certs":
        from radixmesh.services.certs import main as certs_main

        return certs_main(argv[1:])
    if not argv or argv[0] != "serve":
        print("usage: radixmesh serve --model-path PATH [--num-workers N] [--port 30000] [flags]  (serve --help)\n"
              "       radixmesh certs --out DIR [--hosts h1,h2]  (a CA and a certificate for mutual TLS)",
              file=sys.stderr)
        return 2
    parser = build_parser("radixmesh serve: tokenizer, workers and router on this machine", *SERVE_PARTS,
                          skip=ROUTER_WIRED)
    try:
        launch, router, trace, pd_kwargs, engine_kwargs, auth_kwargs = resolve(parser.parse_args(argv[1:]),
                                                                               *SERVE_PARTS, skip=ROUTER_WIRED)
        settings = LaunchSettings(**launch)
        router_view(settings, router)
        trace_flags(trace)
        auth_settings = InternalAuthSettings(**auth_kwargs)
    except (TypeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s launch: %(message)s")
    return serve(settings, engine_kwargs, pd_kwargs, auth_settings, router, trace)


if __name__ == "__main__":
    sys.exit(main())
