"""Router settings. Names follow SGLang's router where it has them (--worker-urls, --policy, --cache-threshold,
--balance-abs-threshold, --balance-rel-threshold, --api-key)."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("round_robin", "random", "cache_aware")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP address to listen on"})
    port: int = field(default=30000, metadata={"help": "HTTP port (OpenAI and SGLang APIs)"})
    grpc_port: int | None = field(default=None, metadata={"help": "port of the public gRPC API (unset: off)"})
    tokenizer_url: str = field(default="", metadata={"help": "host:port of the tokenizer service"})
    worker_urls: tuple[str, ...] = field(default=(), metadata={"help": "host:port of each worker"})
    policy: str = field(default="cache_aware", metadata={"help": "round_robin, random or cache_aware"})
    cache_threshold: float = field(default=0.5, metadata={
        "help": "cache_aware: route by prefix match when the best match covers at least this share of the prompt"})
    balance_abs_threshold: int = field(default=32, metadata={
        "help": "cache_aware: load is imbalanced when max - min in-flight requests exceeds this ..."})
    balance_rel_threshold: float = field(default=1.0001, metadata={
        "help": "... and max > min * this; then the least loaded worker is chosen"})
    max_tree_tokens: int = field(default=1 << 22, metadata={
        "help": "cache_aware: tokens remembered per worker before the oldest prefixes are forgotten"})
    api_key: str | None = field(default=None, metadata={"help": "require Authorization: Bearer <key>"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name (default: the workers')"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "upper bound on one request's total time"})
    connect_timeout_s: float = field(default=5.0, metadata={
        "help": "bound on reaching a worker or the tokenizer before the first response"})
    health_check_interval_s: float = field(default=2.0, metadata={"help": "seconds between worker health probes"})
    shutdown_grace_s: float = field(default=30.0, metadata={"help": "seconds open requests get on SIGTERM"})
    retry_on_unavailable: bool = field(default=True, metadata={
        "help": "retry once on another worker when a worker fails before anything was streamed"})
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.tokenizer_url:
            raise ValueError("--tokenizer-url is required")
