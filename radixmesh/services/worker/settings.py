"""Worker settings (the decode service, and the prefill service that shares its code). Engine arguments
(`--model-path`, `--page-size`, ...) come from engine.config.EngineArgs, with SGLang's flag names."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.services.common.server import LaneGrpcSettings

DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerSettings(LaneGrpcSettings):
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null: a colocated worker (prefill + decode); prefill / decode: one side of a PD pair"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name clients use (default: path)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "chat template file or built-in name for chat prompts the worker renders (as the tokenizer "
                "service's --chat-template; the router sends chat prompts to workers whose template is the service's)"})
    health_check_timeout_s: float = field(default=20.0, metadata={
        "help": "seconds the HealthCheck test generation may take"})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={
        "help": "prefill workers: the port decode workers register their KV destinations with"})
    kvstore_url: str | None = field(default=None, metadata={
        "help": "host:port of the kvstore: this worker publishes its KV events there (the global prefix index) and, "
                "with --hicache-storage-backend kvstore, uses it as its L3 tier"})
    advertise_url: str | None = field(default=None, metadata={
        "help": "the address the kvstore and routers reach this worker at (default: --host:--port)"})
    router_url: tuple[str, ...] = field(default=(), metadata={
        "help": "http://HOST:PORT of the router(s) this worker registers itself with once it serves (POST "
                "/add_worker, renewed) and leaves on shutdown; a name resolving to several addresses (a headless "
                "Service of router replicas) registers with each"})
    router_api_key: str | None = field(default=None, repr=False, metadata={
        "help": "the router's API key, for registering (better from the environment: RADIXMESH_ROUTER_API_KEY)"})
    router_lease_s: float = field(default=30.0, metadata={
        "help": "a router forgets this worker when it has not renewed its registration for this long (renewed "
                "every third of it)"})

    def __post_init__(self) -> None:
        LaneGrpcSettings.__post_init__(self)  # (slots: no zero-argument super())
        if self.router_url:
            from radixmesh.services.worker.announce import parse_router_url

            for url in self.router_url:
                parse_router_url(url)
        if not self.router_lease_s >= 3:
            raise ValueError(f"--router-lease-s must be at least 3 seconds, got {self.router_lease_s}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation_mode!r}")


@dataclass(frozen=True, slots=True)
class PdSettings:
    """How prefill and decode workers move KV (`radixmesh serve --disaggregation pd` forwards these)."""

    disaggregation_transfer_backend: str = field(default="mooncake", metadata={
        "help": "how KV pages move between prefill and decode workers: mooncake (Mooncake transfer engine, TCP), "
                "shm (workers on one host: through /dev/shm) or fake (in-process, for tests)"})
    disaggregation_transfer_host: str | None = field(default=None, metadata={
        "help": "address peers reach this worker's transfer engine at (default: --host, or this host's address "
                "when --host is a wildcard)"})
    disaggregation_bootstrap_timeout: float = field(default=10.0, metadata={
        "help": "seconds a prefill/decode pair may take to find each other for a request"})
    disaggregation_transfer_timeout: float = field(default=30.0, metadata={
        "help": "seconds the KV transfer may take (prefill: also the wait for the decode worker's pages)"})
    disaggregation_verify_kv: bool = field(default=False, metadata={
        "help": "decode workers: compare a checksum of the received KV pages with the sender's"})
    disaggregation_prealloc_queue_size: int = field(default=1024, metadata={
        "help": "decode workers: requests that may wait for KV pre-allocation before new ones are refused"})

    disaggregation_inject_fault: str | None = field(default=None, metadata={
        "help": "testing only: make this worker's KV writes fail on purpose: drop, corrupt or delay:SECONDS "
                "(comma-separated)"})

    def __post_init__(self) -> None:
        from radixmesh.engine.disaggregation.fake_backend import Faults
        from radixmesh.engine.disaggregation.registry import BACKENDS

        Faults.parse(self.disaggregation_inject_fault)
        if self.disaggregation_transfer_backend not in BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.disaggregation_transfer_backend!r}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_transfer_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
