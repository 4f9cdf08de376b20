"""Per-request sampling parameters (SGLang's `sampling_params` dict), validated at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is decoded greedily (as SGLang does).
GREEDY_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}; supported: "
                             f"{', '.join(sorted(names))}")
        if d.get("stop_token_ids") is not None:
            d["stop_token_ids"] = tuple(int(t) for t in d["stop_token_ids"])
        else:
            d.pop("stop_token_ids", None)
        params = cls(**d)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
