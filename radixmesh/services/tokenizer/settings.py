"""Flags of the tokenizer service (SGLang's names where SGLang has them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.services.common.server import LaneGrpcSettings


@dataclass(frozen=True, slots=True)
class TokenizerSettings(LaneGrpcSettings):
    model_path: str = field(default="", metadata={
        "help": "model folder (its tokenizer and config.json) or Hugging Face model id (local cache); required"})
    tokenizer_path: str | None = field(default=None, metadata={
        "help": "tokenizer folder or model id (default: --model-path)"})
    revision: str | None = field(default=None, metadata={
        "help": "the cached snapshot of a model id: a branch, tag or commit hash (default main)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name in this service's metrics labels (default: --model-path)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "chat template override: a .jinja, .txt or .json file, or a built-in name (chatml, llama-3)"})
    context_length: int | None = field(default=None, metadata={
        "help": "context length reported to clients (default: max_position_embeddings of config.json)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow custom tokenizer code from the model"})
    tokenizer_worker_num: int = field(default=4, metadata={
        "help": "threads that tokenize and detokenize, each with its own copy of the tokenizer"})

    def __post_init__(self) -> None:
        LaneGrpcSettings.__post_init__(self)  # (slots: no zero-argument super())
        if not self.model_path:
            raise ValueError("--model-path is required")
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError(f"--context-length must be > 0, got {self.context_length}")
        if self.tokenizer_worker_num <= 0:
            raise ValueError(f"--tokenizer-worker-num must be > 0, got {self.tokenizer_worker_num}")

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path
