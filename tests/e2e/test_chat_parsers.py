"""Tool calls, reasoning and fill-in-the-middle completions through the launched mesh (tiny-qwen3, whose template
lists tools, renders calls as <tool_call> blocks and closes the thinking block when enable_thinking is false), with
the official openai client: outputs parse into the SDK's types, arguments validate against the tools' schemas,
reasoning is split off, constraints bind the answer only. The worker renders the chats (it reports where its
rendering leaves the thinking), with the outputs of the tokenizer service's rendering."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re

import aiohttp
import jsonschema
import openai
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from radixmesh.services.common import auth
from radixmesh.services.common.auth import InternalAuth
from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.e2e.mesh import INTERNAL_TOKEN, cmdline, metric_sum, openai_client, running_mesh

MODEL = model_path("tiny-qwen3")
END_THINK = 1001  # "</think>" in tiny-qwen3's tokenizer (an added, non-special token, as in Qwen3's)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}, "utc": {"type": "boolean"}},
         "required": ["tz", "utc"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = [{"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "<think>\nLet me see"}]
# The template closes the thinking block: a constraint binds the whole output. (With thinking on, the tiny model
# may open a <think> block first, and a constraint binds only what follows its end: see the tests below.)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(MODEL, tmp_path_factory.mktemp("parsers"), "--reasoning-parser", "qwen3",
                      "--tool-call-parser", "qwen25", "--completion-template", "qwen_coder", "--enable-metrics") as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):
    with openai_client(mesh) as c:
        yield c


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_always_gives_valid_calls(client):
    """96 sampled outputs (temperature 1): each is one call whose arguments validate against its tool's schema. The
    12 requests (n=8 each) are sent at once: the worker decodes them as one batch, each under its own grammar."""
    def sample(seed: int):
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, n=8, temperature=1.0, seed=seed,
                                              max_tokens=200, extra_body=NO_THINKING)
    seen = set()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(sample, range(12)))
    assert sum(len(out.choices) for out in outs) == 96
    for out in outs:
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1 and not choice.message.content
            _valid(choice.message.tool_calls[0])
            seen.add(choice.message.tool_calls[0].function.name)
    assert seen == {"get_weather", "get_time"}  # the grammar lets the model choose either (about half each)


def test_streamed_tool_calls_have_incremental_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=3,
        max_tokens=400, stream=True))
    calls: dict[tuple[int, int], dict] = {}
    pieces = 0
    finish = {}
    for chunk in chunks:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault((c.index, d.index), {"name": None, "args": "", "id": None})
                if d.id:
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["args"] += d.function.arguments or ""
                pieces += 1
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert calls and pieces > 2 * len(calls)  # arguments arrived in several pieces
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        jsonschema.validate(json.loads(entry["args"]), SCHEMAS[entry["name"]])


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                             temperature=1.0, seed=5, max_tokens=200, stream=stream)
        if stream:
            deltas = [d for ch in out for c in ch.choices for d in (c.delta.tool_calls or [])]
            assert deltas[0].function.name == "get_time"
            jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), CLOCK)
        else:
            (call,) = out.choices[0].message.tool_calls
            assert call.function.name == "get_time"
            _valid(call)


def test_auto_tool_calls_are_parsed_from_the_output(client):
    """tool_choice auto: --tool-call-parser qwen25 finds the <tool_call> block (a regex makes the tiny model
    write one) and leaves the text around it as content."""
    regex = r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}", "unit": "celsius", "days": 2\}\}\n</tool_call>'
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=1,
                                           max_tokens=300, extra_body={"regex": regex, **NO_THINKING})
    msg = whole.choices[0].message
    assert msg.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    _valid(call)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=1,
                                              max_tokens=300, extra_body={"regex": regex, **NO_THINKING},
                                              stream=True)
    content, args, name = "", "", None
    for chunk in streamed:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                name = d.function.name or name
                args += d.function.arguments or ""
    assert (content, name, json.loads(args)) == ("Sure.", "get_weather", json.loads(call.function.arguments))


def test_tool_messages_round_trip_through_the_template(client):
    """An assistant turn with tool_calls and the tool's answer reach the template as transformers renders them."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in text and "<tool_call>" in text
    assert out.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_reasoning_is_split_from_the_answer(client):
    """The assistant turn opens a <think> block (continue_final_message); a bias makes the tiny model close it
    mid-output. reasoning_content is the text before </think>, content the rest, streamed or whole."""
    common = dict(model=MODEL, messages=THINKING, max_tokens=24, temperature=0, logit_bias={str(END_THINK): 8})
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    raw = client.chat.completions.create(**common, extra_body={**extra, "separate_reasoning": False})
    text = raw.choices[0].message.content
    before, sep, after = text.partition("</think>")
    assert sep and before and after.strip("\n"), text  # the bias puts </think> mid-output
    split = client.chat.completions.create(**common, extra_body=extra).choices[0].message
    assert split.reasoning_content == before and split.content == after.lstrip("\n")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**common, extra_body=extra, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (split.reasoning_content, split.content)


def test_constraints_bind_the_answer_not_the_reasoning(client):
    """With --reasoning-parser, response_format and tool_choice=required constrain the answer only: the reasoning is
    what the unconstrained model thinks (token-exact, greedy), the answer validates, whole and streamed."""
    common = dict(model=MODEL, messages=THINKING, max_tokens=80, temperature=0, logit_bias={str(END_THINK): 8})
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    free = client.chat.completions.create(**common, extra_body=extra).choices[0].message
    assert free.reasoning_content  # the bias closes the thinking after a few tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "clock", "schema": CLOCK}}
    out = client.chat.completions.create(**common, response_format=fmt, extra_body=extra).choices[0]
    assert out.message.reasoning_content == free.reasoning_content and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), CLOCK)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**common, response_format=fmt, extra_body=extra, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (out.message.reasoning_content, out.message.content)
    called = client.chat.completions.create(**{**common, "max_tokens": 300}, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, extra_body=extra).choices[0]
    assert called.message.reasoning_content == free.reasoning_content and called.finish_reason == "tool_calls"
    assert called.message.tool_calls
    for call in called.message.tool_calls:
        _valid(call)


def test_with_thinking_on_the_output_may_think_before_its_constrained_answer(client):
    """Thinking on (the prompt leaves the block unopened): the first token may open it, and the constraint then
    waits for its end. With seed 1 the tiny model opens it, and never closes it in 12 tokens."""
    regex = r"Sure\. [a-z]{2,6}"
    common = dict(model=MODEL, messages=ASK, temperature=1.0, seed=1, max_tokens=12)
    thinking = client.chat.completions.create(**common, extra_body={"regex": regex}).choices[0]
    assert thinking.message.reasoning_content and not thinking.message.content
    assert thinking.finish_reason == "length"
    answer = client.chat.completions.create(**common, extra_body={"regex": regex, **NO_THINKING}).choices[0]
    assert answer.message.reasoning_content is None and answer.message.content.startswith("Sure. ")


def test_enable_thinking_false_leaves_no_reasoning(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = out.choices[0].message
    assert msg.reasoning_content is None and msg.content


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_suffix_fills_in_the_middle_with_the_completion_template(client):
    """--completion-template qwen_coder: prompt and suffix go to the model as Qwen2.5-Coder's FIM prompt, token-exact
    with sending that prompt yourself; echo shows the prompt, not the render; a token-id prompt is a 400."""
    prompt, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    common = dict(model=MODEL, max_tokens=10, temperature=0)
    fim = client.completions.create(**common, prompt=[prompt, "x = "], suffix=suffix)
    for choice, p in zip(fim.choices, [prompt, "x = "]):
        own = client.completions.create(**common, prompt=f"<|fim_prefix|>{p}<|fim_suffix|>{suffix}<|fim_middle|>")
        assert choice.text == own.choices[0].text
    assert fim.usage.prompt_tokens == sum(
        client.completions.create(**common, prompt=f"<|fim_prefix|>{p}<|fim_suffix|>{suffix}<|fim_middle|>")
        .usage.prompt_tokens for p in [prompt, "x = "])
    echoed = client.completions.create(**common, prompt=prompt, suffix=suffix, echo=True)
    assert echoed.choices[0].text == prompt + fim.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**common, prompt=[1, 2, 3], suffix=suffix)
    assert e.value.body["param"] == "suffix"


# Chats whose rendering leaves the thinking open (the assistant turn opened it), outside (thinking on: the output
# may open it) and closed (enable_thinking false), split or not, free or constrained (the gate is the worker's).
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
BIAS = {"logit_bias": {str(END_THINK): 8}}  # closes the thinking after a few tokens
CASES = [
    {"messages": THINKING, **CONTINUE, **BIAS},
    {"messages": THINKING, **CONTINUE, **BIAS, "separate_reasoning": False},
    {"messages": ASK, **NO_THINKING},
    {"messages": THINKING, **CONTINUE, **BIAS, "max_tokens": 40,
     "response_format": {"type": "json_schema", "json_schema": {"name": "clock", "schema": CLOCK}}},
    {"messages": ASK, "regex": r"Sure\. [a-z]{2,6}", "temperature": 1.0, "seed": 1},
]


def _addresses(mesh) -> dict[str, str]:
    """The mesh's tokenizer and worker gRPC addresses, from their command lines."""
    out = {}
    for name, pid in mesh.services().items():
        argv = cmdline(pid).split()
        for service in ("tokenizer", "worker"):
            if name == f"radixmesh.services.{service}":
                out[service] = f"127.0.0.1:{argv[argv.index('--port') + 1]}"
    return out


def _tokenizer_calls(mesh) -> float:
    """Calls the tokenizer service has served (its metrics' URL is in the launcher's log)."""
    match = re.search(r"tokenizer (http://\S+/metrics)", mesh.log_path.read_text())
    assert match, mesh.log_tail()
    return metric_sum(match.group(1).rstrip(","), "radixmesh:tokenizer_requests_total")


@contextlib.asynccontextmanager
async def _tokenizer_path_router(mesh):
    """A second router, in this process, over the mesh's tokenizer service and worker, which it takes for a worker of
    an older release (its GetModelInfo without reports_prompt_thinking): the tokenizer service renders its chats
    under --reasoning-parser, as every router's before workers said where a rendering leaves the thinking. Yields
    its base URL."""
    async with _second_router(mesh, "qwen3", "qwen25", older_worker=True) as base:
        yield base


@contextlib.asynccontextmanager
async def _second_router(mesh, reasoning_parser: str, tool_call_parser: str, older_worker: bool = False):
    """A second router, in this process, over the mesh's tokenizer service and worker, with parsers of its own
    (`older_worker`: see _tokenizer_path_router). Yields its base URL."""
    from radixmesh.services.router.__main__ import build_app, build_router
    from radixmesh.services.router.settings import RouterSettings

    where = _addresses(mesh)
    before = auth.current()
    auth.configure(InternalAuth((INTERNAL_TOKEN,)))
    router = await build_router(RouterSettings(
        tokenizer_url=where["tokenizer"], worker_urls=(where["worker"],), reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser, disable_health_check=True))
    runner = web.AppRunner(build_app(router))
    try:
        if older_worker:
            for worker in router.registry.workers.values():
                worker.info.reports_prompt_thinking = False
            router.registry.workers = dict(router.registry.workers)  # what it knew of the workers is asked anew
            assert router.routes_chat() and not router.routes_chat(thinking=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await router.registry.close()
        await router.tokenizer.close()
        auth.configure(before)


async def _chat(session: aiohttp.ClientSession, base: str, body: dict) -> dict:
    """What a client gets, without the response's id, times, tool calls' ids and cached tokens: the choices and
    usage of a whole answer; each choice's reasoning, content and finish reason of a streamed one."""
    async with session.post(base + "/v1/chat/completions", json={"model": MODEL, **body}) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            out = await r.json()
            for c in out["choices"]:
                for call in c["message"].get("tool_calls") or ():
                    call.pop("id")
            out["usage"].pop("prompt_tokens_details", None)  # the first router's requests cached the prompts
            return {"choices": out["choices"], "usage": out["usage"]}
        choices: dict[int, dict] = {}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"reasoning": "", "content": "", "finish": None})
                got["reasoning"] += c["delta"].get("reasoning_content") or ""
                got["content"] += c["delta"].get("content") or ""
                got["finish"] = c["finish_reason"] or got["finish"]
        return choices


def test_chats_the_worker_renders_answer_as_the_tokenizer_services_renderings_do(mesh):
    """The mesh's router sends every chat to the worker (which says where its rendering leaves the thinking, and
    gates constraints): the tokenizer service is not called, and each answer, whole or streamed, is the one a
    router gives that has the tokenizer service render the chat (reasoning_content, content, finish, usage; its
    streamed answers are its whole ones, as test_reasoning_is_split_from_the_answer checks)."""
    bodies = [{"max_tokens": 24, "temperature": 0, **case} for case in CASES]

    async def run() -> tuple[list, list, list, float]:
        async with aiohttp.ClientSession() as session:
            await _chat(session, mesh.url, bodies[-1])  # the router learns the think tags' token ids (once)
            calls = _tokenizer_calls(mesh)
            by_worker = [await _chat(session, mesh.url, b) for b in bodies]
            streamed = [await _chat(session, mesh.url, {**b, "stream": True}) for b in bodies]
            assert _tokenizer_calls(mesh) == calls, "the router had the tokenizer service render a chat"
            async with _tokenizer_path_router(mesh) as base:
                by_tokenizer = [await _chat(session, base, b) for b in bodies]
            return by_worker, streamed, by_tokenizer, _tokenizer_calls(mesh) - calls

    by_worker, streamed, by_tokenizer, rendered = asyncio.run(run())
    assert rendered >= len(bodies)  # the second router's chats were the tokenizer service's
    for body, worker, pieces, tokenizer in zip(bodies, by_worker, streamed, by_tokenizer):
        assert worker == tokenizer, body
        (choice,) = tokenizer["choices"]
        message = choice["message"]
        assert pieces == {0: {"reasoning": message.get("reasoning_content") or "", "content": message["content"],
                              "finish": choice["finish_reason"]}}, body
    whole = [w["choices"][0]["message"] for w in by_worker]
    assert whole[0]["reasoning_content"] and whole[0]["content"]  # open: thought, then answered
    assert "reasoning_content" not in whole[1] and "</think>" in whole[1]["content"]  # not split
    assert whole[2]["reasoning_content"] is None and whole[2]["content"]  # closed: all answer
    assert whole[3]["reasoning_content"] == whole[0]["reasoning_content"]  # the gate let the thinking be
    jsonschema.validate(json.loads(whole[3]["content"]), CLOCK)
    assert whole[4]["reasoning_content"] and not whole[4]["content"]  # outside: the output opened the thinking


def test_chats_read_by_gpt_oss_parsers_keep_special_tokens_in_their_text(mesh):
    """Under --reasoning-parser and --tool-call-parser gpt-oss (GPT-OSS's channel markers are special tokens) the
    router has the worker keep special tokens in a chat's text, unless the request set skip_special_tokens or its
    output is not read so. tiny-qwen3 has no harmony markers: its <|endoftext|>, forced by logit_bias past
    ignore_eos, is text outside any header, so content."""
    forced = {"messages": ASK, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"0": 100}}
    kept = {"reasoning": "", "content": "<|endoftext|>" * 3, "finish": "length"}
    skipped = {**kept, "content": ""}

    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as session, _second_router(mesh, "gpt-oss", "gpt-oss") as base:
            bodies = [forced, {**forced, "stream": True}, {**forced, "separate_reasoning": False, "tools": TOOLS},
                      {**forced, "separate_reasoning": False}, {**forced, "skip_special_tokens": True}]
            return [await _chat(session, base, b) for b in bodies]

    whole, streamed, tools, plain, asked = asyncio.run(run())
    (choice,) = whole["choices"]
    assert choice["message"]["content"] == kept["content"] and choice["message"]["reasoning_content"] is None
    assert streamed == {0: kept}
    assert tools["choices"][0]["message"]["content"] == kept["content"]  # the tool-call parser's markers too
    for out in (plain, asked):
        assert out["choices"][0]["message"]["content"] == skipped["content"]
