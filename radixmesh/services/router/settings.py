"""Router settings. Names follow SGLang's router where it has them (--worker-urls, --policy, --cache-threshold,
--balance-abs-threshold, --balance-rel-threshold, --api-key). Tenants (--api-key-tenants, --tenant-header): see
tenants.py; the kv_index policy (--kvstore-url, --kvstore-timeout-s): see kv_index.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.services.common.event_loop import HELP as EVENT_LOOP_HELP
from radixmesh.services.common.event_loop import check as check_event_loop
from radixmesh.services.router.tenants import parse_key_tenants, validate_header_name

POLICIES = ("round_robin", "random", "power_of_two", "manual", "cache_aware", "kv_index")
ASSIGNMENT_MODES = ("random", "min_load")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP address to listen on"})
    port: int = field(default=30000, metadata={"help": "HTTP port (OpenAI and SGLang APIs)"})
    grpc_port: int | None = field(default=None, metadata={"help": "port of the public gRPC API (unset: off)"})
    tokenizer_url: str = field(default="", metadata={
        "help": "host:port of the tokenizer service; several replicas comma-separated (balanced, failed over)"})
    worker_urls: tuple[str, ...] = field(default=(), metadata={"help": "host:port of each worker"})
    discovery_dns: tuple[str, ...] = field(default=(), metadata={
        "help": "NAME:PORT of DNS names that resolve to the workers' addresses (a Kubernetes headless Service, a "
                "compose service): re-resolved every --discovery-interval-s, new addresses added, vanished ones "
                "removed (workers may also register themselves with POST /add_worker)"})
    discovery_interval_s: float = field(default=5.0, metadata={"help": "seconds between DNS discovery rounds"})
    policy: str = field(default="cache_aware", metadata={
        "help": "round_robin, random, cache_aware (the router's own prefix trees) or kv_index (the kvstore's global "
                "prefix index and the workers' measured speeds: lowest expected time to first token)"})
    cache_threshold: float = field(default=0.5, metadata={
        "help": "cache_aware: route by prefix match when the best match covers at least this share of the prompt"})
    balance_abs_threshold: int = field(default=32, metadata={
        "help": "cache_aware: load is imbalanced when max - min in-flight requests exceeds this ..."})
    balance_rel_threshold: float = field(default=1.0001, metadata={
        "help": "... and max > min * this; then the least loaded worker is chosen"})
    max_tree_tokens: int = field(default=1 << 22, metadata={"aliases": ("--max-tree-size",),
        "help": "cache_aware: tokens remembered per worker before the oldest prefixes are forgotten"})
    prefill_policy: str | None = field(default=None, metadata={
        "help": "PD mode: the policy that picks prefill workers (default: --policy)"})
    decode_policy: str | None = field(default=None, metadata={
        "help": "PD mode: the policy that picks decode workers (default: power_of_two's less loaded choice)"})
    assignment_mode: str = field(default="random", metadata={
        "help": "manual: where a request without a routing key goes: random or min_load"})
    kvstore_url: str | None = field(default=None, metadata={
        "help": "kv_index: host:port of the kvstore whose prefix index (MatchPrefix) the policy asks"})
    kvstore_timeout_s: float = field(default=0.05, metadata={
        "help": "kv_index: bound on one MatchPrefix call; past it the request is routed by load alone"})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "require Authorization: Bearer <key>"})
    api_key_tenants: tuple[str, ...] = field(default=(), repr=False, metadata={
        "help": "KEY=TENANT pairs: each KEY is also an accepted API key and runs its requests in the KV cache "
                "namespace TENANT (--api-key itself: the shared namespace)"})
    tenant_header: str | None = field(default=None, metadata={
        "help": "a trusted header (e.g. X-Tenant; gRPC metadata: lower-cased) naming the tenant, for gateways that "
                "authenticate clients; a key from --api-key-tenants wins over it (default: off)"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name (default: the workers')"})
    request_timeout_s: float = field(default=600.0, metadata={"aliases": ("--request-timeout-secs",),
                                                               "help": "upper bound on one request's total time"})
    connect_timeout_s: float = field(default=5.0, metadata={
        "help": "bound on reaching a worker or the tokenizer before the first response"})
    health_check_interval_s: float = field(default=2.0, metadata={"aliases": ("--health-check-interval-secs",),
                                                                  "help": "seconds between worker health probes"})
    health_check_timeout_secs: float = field(default=2.0, metadata={"help": "bound on one health probe"})
    lora_timeout_s: float = field(default=60.0, metadata={
        "help": "bound on each worker's part of /load_lora_adapter and /unload_lora_adapter (and of undoing one)"})
    health_failure_threshold: int = field(default=3, metadata={
        "help": "failed probes in a row that mark a worker unhealthy (a refused call marks it at once)"})
    health_success_threshold: int = field(default=2, metadata={
        "help": "passed probes in a row that make an unhealthy worker healthy again"})
    disable_health_check: bool = field(default=False, metadata={"help": "no background health probes"})
    shutdown_grace_s: float = field(default=30.0, metadata={"aliases": ("--shutdown-grace-period-secs",),
                                                            "help": "seconds open requests get on SIGTERM"})
    # resilience (services.router.resilience): retries before the first byte, a circuit breaker per worker
    retry_max_retries: int = field(default=5, metadata={
        "help": "attempts per request, the first included, while nothing was streamed (1: no retry)"})
    retry_initial_backoff_ms: float = field(default=50.0, metadata={"help": "wait before the first retry"})
    retry_max_backoff_ms: float = field(default=30_000.0, metadata={"help": "longest wait between retries"})
    retry_backoff_multiplier: float = field(default=1.5, metadata={"help": "each retry waits this much longer"})
    retry_jitter_factor: float = field(default=0.2, metadata={"help": "waits vary by +- this fraction"})
    disable_retries: bool = field(default=False, metadata={"help": "one attempt per request"})
    max_migrations: int = field(default=3, metadata={
        "help": "times a streaming request whose worker dies or hangs mid-stream moves to another worker, which "
                "continues after the tokens already streamed (0: the stream ends with an error instead)"})
    cb_failure_threshold: int = field(default=10, metadata={
        "help": "failures within --cb-window-duration-secs that open a worker's circuit breaker"})
    cb_success_threshold: int = field(default=3, metadata={
        "help": "successful trial requests in a row that close a half-open breaker"})
    cb_timeout_duration_secs: float = field(default=60.0, metadata={
        "help": "seconds an open breaker keeps requests off its worker before a trial"})
    cb_window_duration_secs: float = field(default=120.0, metadata={"help": "window the failures are counted in"})
    disable_circuit_breaker: bool = field(default=False, metadata={"help": "no circuit breakers"})
    # admission (services.router.admission)
    max_concurrent_requests: int = field(default=-1, metadata={
        "help": "requests the router runs at once; more wait in a queue (-1: no limit)"})
    queue_size: int = field(default=100, metadata={"help": "requests that may wait for a slot (beyond: 429)"})
    queue_timeout_secs: float = field(default=60.0, metadata={"help": "longest wait for a slot (then 408)"})
    rate_limit_tokens_per_second: float | None = field(default=None, metadata={
        "help": "requests per second each API key (or client address) may send; beyond it 429 (default: off)"})
    rate_limit_burst: float | None = field(default=None, metadata={
        "help": "requests an idle API key may send at once (default: one second's worth, at least 1)"})
    tokenizer_cache_enable_l0: bool = field(default=False, metadata={
        "help": "answer repeated tokenize requests (same text, or same chat messages and options) from a cache"})
    tokenizer_cache_l0_max_entries: int = field(default=10000, metadata={"help": "the cache's size in requests"})
    worker_allowlist: tuple[str, ...] = field(default=(), metadata={
        "help": "hosts POST /add_worker may register (others get a 403): DNS names as written, IP addresses or "
                "CIDR networks, e.g. 10.0.0.0/8 for pod addresses (default: any host)"})
    admin_api_key: str | None = field(default=None, repr=False, metadata={
        "help": "the key /add_worker, /remove_worker, /flush_cache, /start_profile and /stop_profile require "
                "(default: any accepted API key)"})
    disable_generate_stream: bool = field(default=False, metadata={
        "help": "a worker call per request instead of one GenerateStream per worker carrying all of them (a "
                "worker without GenerateStream gets calls anyway)"})
    disable_stream_lane: bool = field(default=False, metadata={
        "help": "carry GenerateStream and TokenizeStream over gRPC even where a worker or tokenizer service offers "
                "a stream lane (a plain TCP connection for the same messages, several times cheaper per message)"})
    router_workers: int = field(default=1, metadata={
        "help": "router processes serving the same ports (SO_REUSEPORT) under one supervisor that replaces any "
                "that dies; they share the worker registry, health and the cache-aware routes; admission limits "
                "are divided among them (0: one per available core)"})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "split chat outputs into reasoning_content and content: qwen3, qwen3-thinking, deepseek-r1, "
                "deepseek-v3, glm45, kimi or gpt-oss (GPT-OSS's analysis channel; default: off)"})
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "find tool calls in chat outputs when tool_choice is auto: qwen25 (also qwen, hermes), llama3, "
                "mistral, pythonic, deepseekv3, deepseekv31, kimi_k2, glm45 (also glm), qwen3_coder or gpt-oss "
                "(default: off; tool_choice required or a named function needs none)"})
    completion_template: str | None = field(default=None, metadata={
        "help": "fill-in-the-middle template for /v1/completions' suffix: deepseek_coder, star_coder, qwen_coder "
                "or a JSON file (default: off; a suffix is then a 400)"})
    event_loop: str = field(default="auto", metadata={"help": EVENT_LOOP_HELP})
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_event_loop(self.event_loop)
        if self.completion_template is not None:
            from radixmesh.services.router.completion_templates import load_completion_template

            load_completion_template(self.completion_template)
        if self.reasoning_parser is not None:
            from radixmesh.services.router.reasoning import reasoning_format

            reasoning_format(self.reasoning_parser)
        if self.tool_call_parser is not None:
            from radixmesh.services.router.tool_call_parsers import TOOL_CALL_PARSERS

            if self.tool_call_parser not in TOOL_CALL_PARSERS:
                raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                                 f"got {self.tool_call_parser!r}")
        for flag, value in (("--policy", self.policy), ("--prefill-policy", self.prefill_policy),
                            ("--decode-policy", self.decode_policy)):
            if value is not None and value not in POLICIES:
                raise ValueError(f"{flag} must be one of {', '.join(POLICIES)}, got {value!r}")
        if self.assignment_mode not in ASSIGNMENT_MODES:
            raise ValueError(f"--assignment-mode must be one of {', '.join(ASSIGNMENT_MODES)}, "
                             f"got {self.assignment_mode!r}")
        if self.router_workers < 0:
            raise ValueError(f"--router-workers must be 0 (one per core) or more, got {self.router_workers}")
        if self.tokenizer_cache_l0_max_entries < 1:
            raise ValueError("--tokenizer-cache-l0-max-entries must be at least 1")
        from radixmesh.services.router.resilience import check_settings

        check_settings(self)
        if not self.tokenizer_url:
            raise ValueError("--tokenizer-url is required")
        bad = [u for u in self.tokenizer_url.split(",") if u.strip() and not _is_host_port(u.strip())]
        if bad:
            raise ValueError(f"--tokenizer-url takes host:port (several comma-separated), got {bad[0]!r}")
        if self.policy == "kv_index" and not self.kvstore_url:
            raise ValueError("--policy kv_index needs --kvstore-url host:port (the kvstore that keeps the prefix "
                             "index)")
        if self.kvstore_url and not _is_host_port(self.kvstore_url):
            raise ValueError(f"--kvstore-url must be host:port, got {self.kvstore_url!r}")
        if self.discovery_dns:
            from radixmesh.services.router.discovery import parse_name

            for name in self.discovery_dns:
                parse_name(name)
        if not self.discovery_interval_s > 0:
            raise ValueError(f"--discovery-interval-s must be > 0, got {self.discovery_interval_s}")
        if not self.kvstore_timeout_s > 0:
            raise ValueError(f"--kvstore-timeout-s must be > 0, got {self.kvstore_timeout_s}")
        if self.worker_allowlist:
            from radixmesh.services.router.allowlist import allowlist

            allowlist(self.worker_allowlist)
        parse_key_tenants(self.api_key_tenants, self.api_key)
        if self.tenant_header:
            validate_header_name(self.tenant_header)


def _is_host_port(url: str) -> bool:
    host, sep, port = url.removeprefix("grpc://").rpartition(":")
    return bool(sep and host and port.isdigit())
