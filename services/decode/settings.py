"""Worker settings (the decode service, and the prefill service that shares its code). Engine arguments
(`--model-path`, `--page-size`, ...) come from engine.config.EngineArgs, with SGLang's flag names."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.server import GrpcSettings

DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerSettings(GrpcSettings):
    disaggregation_mode: str = field(default="null", metadata={
        "help": "null: a colocated worker (prefill + decode); prefill / decode: one side of a PD pair"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name clients use (default: path)"})
    health_check_timeout_s: float = field(default=20.0, metadata={
        "help": "seconds the HealthCheck test generation may take"})
    disaggregation_bootstrap_port: int = field(default=8998, metadata={
        "help": "prefill workers: the port decode workers register their KV destinations with"})

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation_mode!r}")
