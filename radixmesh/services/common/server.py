"""gRPC server bootstrap shared by every service: grpc.aio server, the standard health service
(grpc.health.v1, SERVING once started), server reflection, the error interceptor, the internal credentials
(services.common.auth: the token check, mutual TLS), and graceful shutdown:
on SIGTERM/SIGINT the health turns NOT_SERVING, new calls are refused, in-flight calls get `grace_s` to finish,
then the process exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixmesh.v1 import lane_pb2, lane_pb2_grpc
from radixmesh.services.common import auth, event_loop, heap, stream_lane
from radixmesh.services.common.auth_channel import aio_channel
from radixmesh.services.common.errors import ErrorInterceptor
from radixmesh.services.common.trace_grpc import client_interceptors, server_interceptors

log = logging.getLogger(__name__)

# Messages up to this size (prompt token lists, KV pages) pass; gRPC's default of 4 MiB is too small for KV pages.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_SIZES = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Clients ping every 10 s and give up after 5 s without an answer, so a peer that hangs (SIGSTOP, a dead host) fails
# its open calls within ~15 s instead of at the request deadline; servers accept pings that often.
KEEPALIVE_TIME_MS = 10_000
CHANNEL_OPTIONS = [*_SIZES, ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
# A restarted peer is found again within a second (gRPC's default reconnect backoff grows to 120 s). Not
# grpc.min_reconnect_backoff_ms: gRPC core takes it as the least time a connection attempt may take (20 s by
# default), and at 200 ms a slow handshake (a loaded host, TLS) would never connect.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
# Not SO_REUSEPORT (gRPC's default on Linux): a second service given the same port must fail to start, not share
# the port's connections with the first; router processes that do share their port ask for it (reuse_port).
SERVER_OPTIONS = [*_SIZES, ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
                  ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0),
                  ("grpc.so_reuseport", 0)]


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    """Flags every gRPC service takes."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "gRPC port (0: pick a free one and log it)"})
    shutdown_grace_s: float = field(default=30.0, metadata={"help": "seconds in-flight calls get on SIGTERM"})
    log_level: str = "info"
    event_loop: str = field(default="auto", metadata={"help": event_loop.HELP})  # (after log_level: positional use)

    def __post_init__(self) -> None:
        event_loop.check(self.event_loop)


@dataclass(frozen=True, slots=True)
class LaneGrpcSettings(GrpcSettings):
    """Flags of a gRPC service whose long-lived streams the router uses (workers, the tokenizer service)."""

    stream_lane_port: int = field(default=0, metadata={
        "help": "TCP port of this service's stream lanes (services/common/stream_lane.py: the router's "
                "GenerateStream or TokenizeStream over a plain connection; 0: pick a free one)"})
    stream_lane_host: str | None = field(default=None, metadata={
        "help": "the address routers dial for the stream lanes (default: the host they dialled for gRPC); give it "
                "where gRPC is reached through a load-balanced address, e.g. a Kubernetes pod's IP behind a Service"})
    disable_stream_lane: bool = field(default=False, metadata={
        "help": "offer no stream lane: routers carry the long-lived streams over gRPC"})


class GrpcService:
    """One running gRPC server. `register(server)` adds the servicers and returns their full service names."""

    def __init__(self, settings: GrpcSettings, register: Callable[[grpc.aio.Server], list[str]],
                 on_stop: Callable[[], Awaitable[None]] | None = None,
                 on_start: Callable[[], None] | None = None, internal: bool = True,
                 lanes: dict[str, tuple[stream_lane.Handler, type]] | None = None, reuse_port: bool = False):
        """`on_start()` runs once the server answers SERVING; `on_stop()` after in-flight calls drained. An
        `internal` server requires this process's internal credentials (services.common.auth), health excepted.
        `lanes`: the streams this service also offers over stream lanes (method -> (handler, request type));
        `reuse_port`: other processes serve the same port (SO_REUSEPORT: --router-workers)."""
        self.settings = settings
        guard = auth.server_interceptors() if internal else []
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport"] if reuse_port else SERVER_OPTIONS
        self.server = grpc.aio.server(interceptors=[*guard, *server_interceptors(), ErrorInterceptor()],
                                      options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.names = list(register(self.server))
        self.lanes = None
        if lanes:
            assert isinstance(settings, LaneGrpcSettings)
            why_not = ("--disable-stream-lane" if settings.disable_stream_lane else
                       "internal TLS is on (a lane is not encrypted)" if internal and auth.current().tls else "")
            if not why_not:
                self.lanes = stream_lane.LaneServer(settings.host, settings.stream_lane_port, lanes,
                                                    settings.stream_lane_host or "")
            lane_pb2_grpc.add_StreamLaneServiceServicer_to_server(stream_lane.LaneServicer(self.lanes, why_not),
                                                                  self.server)
            self.names.append(lane_pb2.DESCRIPTOR.services_by_name["StreamLaneService"].full_name)
        reflection.enable_server_reflection([*self.names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{settings.host}:{settings.port}"
        try:
            self.port = auth.add_port(self.server, address) if internal else self.server.add_insecure_port(address)
        except RuntimeError as e:  # grpc's "Failed to bind": the port is taken
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self._on_stop = on_stop
        self._on_start = on_start
        self._stopping = asyncio.Event()
        self._grace_s = settings.shutdown_grace_s
        # set when draining starts: servicers end their long-lived streams (GenerateStream, TokenizeStream) once
        # nothing runs on them, so the drain does not wait the whole grace period for streams that never end
        self.draining = asyncio.Event()

    async def _set_all(self, status) -> None:
        for name in ("", *self.names):
            await self.health.set(name, status)

    async def start(self) -> None:
        if self.lanes is not None:
            try:
                port = await self.lanes.start()
                log.info("stream lanes (%s) on %s:%d", ", ".join(self.lanes.handlers), self.settings.host, port)
            except OSError as e:  # a lane is a faster path, not a reason not to serve: routers stay on gRPC
                self.lanes.unusable = f"cannot listen on {self.settings.host}:{self.lanes.port} ({e.strerror or e})"
                log.warning("no stream lanes: %s", self.lanes.unusable)
        await self.server.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d (%s event loop)", ", ".join(self.names), self.settings.host, self.port,
                 event_loop.running())
        if self._on_start is not None:
            self._on_start()
        heap.serving()

    def request_stop(self, grace_s: float | None = None) -> None:
        """Stop serving; `grace_s` replaces --shutdown-grace-s (0: in-flight calls cannot finish anyway)."""
        if grace_s is not None:
            self._grace_s = grace_s
        self._stopping.set()

    @property
    def stop_requested(self) -> bool:
        """A stop was asked for (a signal, or request_stop): the engine's shutdown that follows is expected."""
        return self._stopping.is_set()

    async def stop(self) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period, then release."""
        self.draining.set()
        if self.lanes is not None:
            self.lanes.stop_accepting()
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("shutting down: draining in-flight calls for up to %.0f s", self._grace_s)
        await self._drain_lanes(self.server.stop(self._grace_s))
        if self._on_stop is not None:
            await self._on_stop()
        log.info("stopped")

    async def _drain_lanes(self, grpc_stopped: Awaitable[None]) -> None:
        """The lanes drain beside the gRPC calls, within the same grace period (their handlers end once idle, as
        the gRPC streams' do); what still runs after it is cancelled."""
        if self.lanes is None:
            await grpc_stopped
            return
        lanes = self.lanes

        async def lanes_done() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(lanes.idle(), self._grace_s)
            await lanes.close()

        await asyncio.gather(grpc_stopped, lanes_done())

    async def run_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self._stopping.wait()
        await self.stop()


def untraced_channel(url: str, extra_options=()) -> grpc.aio.Channel:
    """A channel as `channel` makes, but never with interceptors: for a client whose calls pass their trace context
    as metadata themselves (tracing.current_metadata)."""
    return aio_channel(url, [*CHANNEL_OPTIONS, *extra_options])


def channel(url: str) -> grpc.aio.Channel:
    """A channel to the internal service at `host:port` with the large-message options, this process's internal
    credentials (TLS, token) and, with tracing on, the interceptor that passes the trace context on. A peer the
    supervisor restarted is reached again within a second (RECONNECT_OPTIONS)."""
    return aio_channel(url, CHANNEL_OPTIONS + RECONNECT_OPTIONS, client_interceptors() or None)
