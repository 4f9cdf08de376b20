"""The CPU image for real, under podman: build it (the layer cache makes a rebuild quick), run the mesh in it, talk
OpenAI to the router, check the image's HEALTHCHECK and its unprivileged user, and leave nothing running.

Two shapes: `serve` (the whole mesh in one container, colocated or prefill/decode, its port published on loopback)
and one container per role (tokenizer, kvstore, worker, router) on a podman network, where the gRPC services'
health checks run too."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.deploy import podman as pm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
MODEL = "/models/tiny-qwen2"
READY_S = 300  # two CPU cores shared with other test runs: a cold start of the mesh takes tens of seconds


@pytest.fixture(scope="module")
def image():
    why = pm.missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)  # CI runs `make test`, which prepares podman: a missing piece there is a bug
        pytest.skip(why)
    took = pm.build()
    print(f"\n{pm.CPU_IMAGE}: built in {took:.0f} s, {pm.image_size() / 1e6:.0f} MB")
    yield pm.CPU_IMAGE


@pytest.fixture
def cleanup():
    """Removes whatever the test started, and checks that nothing of it is left, running or not."""
    yield
    pm.remove_all()
    assert pm.ours("container") == [], "containers left behind"
    assert pm.ours("network") == [], "networks left behind"


def _unique(name: str) -> str:
    return f"radixmesh-test-{name}-{uuid.uuid4().hex[:8]}"


def _run(image: str, name: str, *args: str, options: tuple[str, ...] = ()) -> None:
    pm.podman("run", "--detach", "--name", name, "--label", pm.LABEL, *options, image, *args)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _logs(name: str, lines: int) -> str:
    r = pm.podman("logs", "--tail", str(lines), name, check=False)
    return r.stdout + r.stderr


def _wait_healthy(names: list[str], deadline_s: float = READY_S) -> None:
    """Until the image's own HEALTHCHECK passes in every container (`podman healthcheck run`: exit 0)."""
    deadline = time.monotonic() + deadline_s
    pending = list(names)
    while pending:
        for name in list(pending):
            state = pm.inspect(name)["State"]
            if not state["Running"]:
                logs = _logs(name, 40)
                pytest.fail(f"{name} exited ({state['ExitCode']}):\n{logs}")
            if pm.podman("healthcheck", "run", name, check=False).returncode == 0:
                pending.remove(name)
        if pending and time.monotonic() > deadline:
            logs = {n: _logs(n, 20) for n in pending}
            pytest.fail(f"not healthy within {deadline_s} s: {pending}\n{logs}")
        time.sleep(2)


def _published(name: str, port: int = 30000) -> str:
    out = pm.podman("port", name, f"{port}/tcp").stdout.split()[0]  # e.g. 127.0.0.1:41234
    return f"http://{out}"


def _chat(base_url: str) -> None:
    """One chat completion through the router with the official client; the answer must be well formed."""
    import openai

    deadline = time.monotonic() + READY_S
    while not _http_ok(base_url + "/health"):  # the router's view: at least one worker is healthy
        assert time.monotonic() < deadline, f"{base_url}/health never answered 200"
        time.sleep(1)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    while not (models := client.models.list().data):  # none listed until a worker has said what it serves
        assert time.monotonic() < deadline, f"{base_url}/v1/models never listed a model"
        time.sleep(1)
    model = models[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there!"}],
                                           max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 1


def _assert_unprivileged(name: str) -> None:
    config_user = pm.inspect(name)["Config"]["User"]
    assert config_user and config_user.split(":")[0] not in ("0", "root")
    status = pm.podman("exec", name, "cat", "/proc/1/status").stdout  # the service itself, PID 1
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids and all(u != "0" for u in uids), f"{name}'s main process runs as uid {uids}"


def _stop(name: str) -> int:
    """SIGTERM, as `docker stop` sends it; the exit status (0 when the service shut down cleanly)."""
    pm.podman("stop", "--time", "60", name, timeout=120)
    return pm.inspect(name)["State"]["ExitCode"]


@pytest.mark.parametrize("mode", [(), ("--disaggregation", "pd")], ids=["colocated", "pd"])
def test_serve_container(image, cleanup, mode):
    """The whole mesh in one container; with pd, KV moves between the workers over the Mooncake transfer engine."""
    name = _unique("serve")
    _run(image, name, "serve", "--model-path", MODEL, *mode, options=("--publish", "127.0.0.1::30000"))
    _wait_healthy([name])
    assert pm.inspect(name)["State"]["Health"]["Status"] == "healthy"
    _chat(_published(name))
    _assert_unprivileged(name)
    assert _stop(name) == 0, _logs(name, 30)  # the launcher as PID 1 took SIGTERM and stopped its services


def test_tracing_sets_up_in_the_image(image):
    """The image has what --enable-trace needs (the OpenTelemetry SDK and its OTLP/gRPC exporter): tracing starts."""
    out = pm.podman("run", "--rm", "--entrypoint", "python", image, "-c",
                    "from radixmesh.services.common import tracing as t; print(t.setup_tracing("
                    "t.TraceSettings(enable_trace=True), 'router'), type(t.tracer()).__module__)")
    assert "True opentelemetry.sdk.trace" in out.stdout, out.stdout + out.stderr
