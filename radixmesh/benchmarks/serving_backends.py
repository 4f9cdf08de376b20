"""The backends `python -m radixmesh.benchmarks.serving` drives, and the per-request record each request leaves.

Every backend sends one prompt (token ids) greedy with ignore_eos, streaming, and times it the same way:
TTFT is the time to the first event that carries a token; when a later event carries k > 1 new tokens, the gap
since the previous token-carrying event is split into k equal ITL samples (tokens that arrive together in the
first event get no ITL sample), as SGLang's client does for its native backend. The openai backend cannot see how
many tokens a chunk holds (completions chunks carry text only), so there each non-empty chunk after the first is one
ITL sample, as in SGLang's openai client. E2E runs from sending the request to the end of its stream. A request
succeeds only when the server reports exactly the tokens asked for (ignore_eos makes that the contract)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from radixmesh.engine.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/results, models/
_COMPLETION_KEY = b'"completion_tokens"'
_COLON_INT = re.compile(rb"\s*:\s*(\d+)")


class BenchError(Exception):
    """A problem with the benchmark's set-up (bad flags, no server); main() prints it as one line."""


@dataclass(frozen=True, slots=True)
class WorkItem:
    input_ids: list[int]
    output_len: int


@dataclass(slots=True)
class RequestOutput:
    """One request's timings, in seconds; `itl_s` are its ITL samples (see the module docstring)."""

    prompt_len: int
    success: bool = False
    error: str = ""
    output_len: int = 0  # completion tokens the server reported
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StreamTimer:
    """Turns the arrival times of a stream's events into a RequestOutput (see the module docstring)."""

    item: WorkItem
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    tokens: int = 0  # cumulative completion tokens seen in events so far
    events: int = 0  # token-carrying chunks seen (openai)
    reported: int | None = None  # completion tokens the server reported last
    out: RequestOutput = field(init=False)

    def __post_init__(self) -> None:
        self.out = RequestOutput(prompt_len=len(self.item.input_ids))

    def on_tokens(self, total: int, now: float) -> None:
        """An event at `now` whose server-reported cumulative completion tokens are `total`."""
        new = total - self.tokens
        if new <= 0:
            return
        if self.tokens == 0:
            self.out.ttft_s = now - self.start
        else:
            self.out.itl_s.extend([(now - self.last) / new] * new)
        self.tokens, self.last = total, now

    def on_chunk(self, now: float) -> None:
        """A chunk with output whose token count is unknown (openai): one ITL sample per chunk after the first."""
        if self.events == 0:
            self.out.ttft_s = now - self.start
        else:
            self.out.itl_s.append(now - self.last)
        self.events, self.last = self.events + 1, now

    def fail(self, error: str) -> RequestOutput:
        self.out.error = error
        return self.out

    def finish(self, end: float) -> RequestOutput:
        self.out.e2e_s = end - self.start
        self.out.output_len = self.reported or 0
        if self.reported != self.item.output_len:
            return self.fail(f"the server reported {self.reported} completion tokens, {self.item.output_len} were "
                             "asked for with ignore_eos")
        if self.tokens == 0 and self.events == 0:
            return self.fail("the stream ended without a token")
        self.out.success = True
        return self.out


def sampling_params(item: WorkItem) -> dict:
    return {"max_new_tokens": item.output_len, "temperature": 0.0, "ignore_eos": True}


def reported_tokens(payload: bytes) -> int | None:
    """meta_info.completion_tokens of a cumulative /generate event, found from the end: meta_info follows text and
    output_ids, so this reads a few bytes instead of parsing the whole (ever longer) event."""
    at = payload.rfind(_COMPLETION_KEY)
    match = _COLON_INT.match(payload, at + len(_COMPLETION_KEY)) if at >= 0 else None
    return int(match.group(1)) if match else None


def error_text(payload: bytes | str) -> str:
    """The message of an OpenAI-style error object, else the payload itself (cut short)."""
    raw = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        err = None
    return str((err.get("message", err) if isinstance(err, dict) else err) or raw)[:300]


class GenerateApi:
    """SGLang's native `POST /generate` with input_ids; cumulative SSE events ending with `data: [DONE]`."""

    path, info_path = "/generate", "/get_model_info"

    def model_hint(self, info: dict) -> str | None:
        return info.get("tokenizer_path") or info.get("model_path")

    def payload(self, item: WorkItem) -> dict:
        return {"input_ids": item.input_ids, "sampling_params": sampling_params(item), "stream": True}

    def on_event(self, data: bytes, now: float, timer: StreamTimer) -> str | None:
        """Records one event's tokens; returns an error message to fail the request."""
        if data == b"[DONE]":
            return None
        timer.reported = reported_tokens(data)
        if timer.reported is None:
            return error_text(data)
        timer.on_tokens(timer.reported, now)
        return None


class CompletionsApi:
    """OpenAI `POST /v1/completions` with a token-id prompt, streamed, usage in the last chunk."""

    path, info_path = "/v1/completions", "/v1/models"

    def __init__(self, model: str | None):
        self.model = model

    def model_hint(self, info: dict) -> str | None:
        """The server's first model: the request's `model` unless --model named one, and the tokenizer hint."""
        first = (info.get("data") or [{}])[0].get("id")
        self.model = self.model or first
        return first

    def payload(self, item: WorkItem) -> dict:
        body = {"prompt": item.input_ids, "max_tokens": item.output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        return {**body, "model": self.model} if self.model else body

    def on_event(self, data: bytes, now: float, timer: StreamTimer) -> str | None:
        if data == b"[DONE]":
            return None
        chunk = json.loads(data)
        if "error" in chunk:
            return error_text(data)
        if any(c.get("text") for c in chunk.get("choices") or ()):
            timer.on_chunk(now)
        if chunk.get("usage"):
            timer.reported = chunk["usage"]["completion_tokens"]
        return None


class HttpBackend:
    """A server over HTTP through `api` (GenerateApi or CompletionsApi): one session with no connection cap (the
    benchmark's semaphore is the cap); OPENAI_API_KEY, when set, is sent as the bearer token."""

    def __init__(self, base_url: str, api: GenerateApi | CompletionsApi):
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> str | None:
        """Opens the session and checks the server answers; returns its model path when it names one."""
        key = os.environ.get("OPENAI_API_KEY")
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                             headers={"Authorization": f"Bearer {key}"} if key else None)
        url = self.base_url + self.api.info_path
        try:
            async with self.session.get(url) as resp:
                body = await resp.read()
            info = json.loads(body) if resp.status == 200 else None
        except (aiohttp.ClientError, OSError) as e:
            raise BenchError(f"cannot reach the server at {self.base_url}: {e}") from None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise BenchError(f"GET {url} answered HTTP {resp.status}: {error_text(body)}")
        return self.api.model_hint(info)

    async def send(self, item: WorkItem) -> RequestOutput:
        timer = StreamTimer(item)
        try:
            async with self.session.post(self.base_url + self.api.path, json=self.api.payload(item)) as resp:
                if resp.status != 200:
                    return timer.fail(f"HTTP {resp.status}: {error_text(await resp.read())}")
                return await self._read_stream(resp, timer)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return timer.fail(f"{type(e).__name__}: {e}")

    async def _read_stream(self, resp: aiohttp.ClientResponse, timer: StreamTimer) -> RequestOutput:
        """Splits SSE `data:` lines per network read (bytes.split, no per-byte loop); every event of one read gets
        that read's arrival time."""
        pending = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    error = self.api.on_event(line[5:].strip(), now, timer)
                    if error:
                        return timer.fail(error)
        return timer.finish(time.perf_counter())

    async def flush_cache(self) -> None:
        async with self.session.post(self.base_url + "/flush_cache") as resp:
            await resp.read()

    async def profile(self, start: bool, output_dir: str | None = None) -> str:
        """SGLang's /start_profile (`output_dir` on the server's machine, else its $SGLANG_TORCH_PROFILER_DIR) or
        /stop_profile; the server's answer, or BenchError with it."""
        path, body = ("/start_profile", {"output_dir": output_dir} if output_dir else {}) if start else \
            ("/stop_profile", {})
        async with self.session.post(self.base_url + path, json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise BenchError(f"{path} answered {resp.status}: {text[:300]}")
        return text

    async def device(self) -> str | None:
        """The workers' device kind, from /get_server_info (None when the server does not say)."""
        try:
            async with self.session.get(self.base_url + "/get_server_info") as resp:
                info = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, ValueError):
            return None
        return info.get("device") if isinstance(info, dict) else None

    async def counters(self) -> dict:
        """The first worker's scheduler counters (forward_extend, forward_decode, prefill_tokens, ...) from
        /get_server_info; {} when the server does not report them."""
        try:
            async with self.session.get(self.base_url + "/get_server_info") as resp:
                info = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, ValueError):
            return {}
        states = info.get("internal_states") if isinstance(info, dict) else None
        return _counters(states[0]) if states else {}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class EngineBackend:
    """The offline `engine.Engine` in this process: the same workload without router, tokenizer service or gRPC."""

    def __init__(self, engine_kwargs: dict):
        self.kwargs = engine_kwargs
        self.llm = None

    async def start(self) -> str | None:
        from radixmesh.engine import Engine

        try:
            self.llm = Engine(**self.kwargs)
        except (ValueError, TypeError, OSError) as e:
            raise BenchError(f"cannot start the engine: {e}") from None
        return self.kwargs.get("tokenizer_path") or self.kwargs["model_path"]

    async def send(self, item: WorkItem) -> RequestOutput:
        timer = StreamTimer(item)
        try:
            stream = await self.llm.async_generate(input_ids=item.input_ids, sampling_params=sampling_params(item),
                                                   stream=True)
            async for chunk in stream:
                timer.reported = chunk["meta_info"]["completion_tokens"]
                timer.on_tokens(timer.reported, time.perf_counter())
        except (RuntimeError, ValueError) as e:
            return timer.fail(f"{type(e).__name__}: {e}")
        return timer.finish(time.perf_counter())

    async def flush_cache(self) -> None:
        self.llm.flush_cache()

    async def profile(self, start: bool, output_dir: str | None = None) -> str:
        try:
            files = [self.llm.start_profile(output_dir=output_dir)] if start else self.llm.stop_profile()
        except ValueError as e:
            raise BenchError(f"{'start' if start else 'stop'}_profile: {e}") from None
        return "\n".join(files)

    async def device(self) -> str | None:
        return self.llm.runner.device.type if self.llm else None

    async def counters(self) -> dict:
        return _counters(await asyncio.get_running_loop().run_in_executor(None, self.llm.get_load))

    async def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


COUNTERS = ("forward_extend", "forward_decode", "prefill_tokens", "retractions")


def _counters(state: dict) -> dict:
    return {k: state[k] for k in COUNTERS if isinstance(state.get(k), int)}


def describe_device(kind: str | None) -> str | None:
    """A readable name for a device kind ("cuda", "cuda:1", "cpu") of this machine."""
    if not kind:
        return None
    if kind.startswith("cuda"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            return kind
        index = int(kind.partition(":")[2] or 0)
        return names[index].strip() if index < len(names) else kind
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    return f"cpu ({cpu})"


class LaunchedMesh:
    """`python -m radixmesh.services.launch serve ...` as a child process, its output in `log_path`; stop() ends it (the
    launcher stops its own services, router first)."""

    def __init__(self, argv: list[str], base_url: str, log_path: Path):
        self.argv, self.base_url, self.log_path = argv, base_url, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        with open(self.log_path, "wb") as log:  # (die_with_parent: no orphan mesh if we are killed)
            self.proc = subprocess.Popen([sys.executable, "-m", "radixmesh.services.launch", "serve", *self.argv],
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise BenchError(f"the mesh exited with status {self.proc.returncode} while starting:\n"
                                 f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"the mesh was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 10) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
