"""What the fuzz strategies produce: `Req`, one HTTP request to the router, and the mesh it targets (`Target`).
Bodies are JSON with NaN and Infinity written as their JavaScript literals; `Deep` and `BigInt` stand for JSON
text that Python's own encoder cannot write (nesting past its recursion limit, integers past 4300 digits)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Target:
    """The mesh under test: the served model's name, the API key and the workers' addresses."""

    model: str
    key: str
    worker_urls: tuple[str, ...]
    embedding: bool = False  # an --is-embedding model: embeddings are served, generation refused

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}


@dataclass(frozen=True)
class Req:
    """One HTTP request. `body` is JSON-encoded unless it is bytes (sent as is) or None (no body). `ok`: the request
    is valid, only a 200 will do; `expect`: the one status a malformed request must get (None: any 4xx)."""

    method: str
    path: str
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    ok: bool = False
    expect: int | None = None
    ascii: bool = True  # False: non-ASCII characters go as raw UTF-8 (a lone surrogate as invalid UTF-8 bytes)
    # The client goes away (a TCP reset) "at once" after sending the request, or "after the first bytes" of the answer
    hang_up: str | None = None

    @functools.cached_property
    def _encoded(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        text = json.dumps(self.body, allow_nan=True, ensure_ascii=self.ascii, default=_placeholder)
        text = _PLACEHOLDER.sub(lambda m: _RAW[m.group(1)](int(m.group(2))), text)
        return text.encode("utf-8", "surrogatepass")

    def encoded(self) -> bytes | None:
        """The body as sent (encoded once)."""
        return self._encoded

    def show(self, limit: int = 600) -> str:
        """The request as a reproduction: method, path, headers and (the start of) the body."""
        body = self.encoded()
        text = "" if body is None else body[:limit].decode("utf-8", "backslashreplace")
        more = f" ... ({len(body)} bytes)" if body is not None and len(body) > limit else ""
        gone = f" (the client hangs up {self.hang_up})" if self.hang_up else ""
        return f"{self.method} {self.path} headers={self.headers} body={text}{more}{gone}"


class Deep:
    """`depth` nested arrays (kind "a") or objects (kind "o")."""

    def __init__(self, depth: int, kind: str = "a"):
        self.depth, self.kind = depth, kind

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.kind!r})"


class BigInt:
    """An integer literal of `digits` digits."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"BigInt({self.digits})"


_PLACEHOLDER = re.compile(r'"@@raw:(\w+):(\d+)@@"')
_RAW = {"a": lambda n: "[" * n + "]" * n, "o": lambda n: '{"k":' * n + "1" + "}" * n, "int": lambda n: "9" * n}


def _placeholder(value: Any) -> str:
    if isinstance(value, Deep):
        return f"@@raw:{value.kind}:{value.depth}@@"
    if isinstance(value, BigInt):
        return f"@@raw:int:{value.digits}@@"
    raise TypeError(f"cannot encode {value!r}")
