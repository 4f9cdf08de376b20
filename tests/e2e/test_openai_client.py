"""The official `openai` client, sync and async, against the launched mesh (tokenizer, 2 workers, router)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.conftest import model_path

NAME = model_path(MODEL)  # the served model name defaults to the model path
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
async def aclient(mesh):
    async with openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat_ids(offline, messages) -> list[int]:
    """What the tokenizer service must produce: the rendered template, tokenized without adding BOS twice."""
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return offline.tokenizer(text, add_special_tokens=False).input_ids


def _chat_ref(offline, messages, max_tokens, **kwargs):
    return offline.generate(input_ids=chat_ids(offline, messages),
                            sampling_params={"max_new_tokens": max_tokens, **GREEDY}, **kwargs)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]


def test_chat_and_completion_match_the_offline_engine(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about the sea."}]
    ref = _chat_ref(offline, messages, 24)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, **GREEDY)
    assert chat.choices[0].message.content == ref["text"]
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert chat.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    prompt = "The quick brown fox jumps over"
    ref = offline.generate(prompt, {"max_new_tokens": 20, **GREEDY})
    comp = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, **GREEDY)
    assert comp.choices[0].text == ref["text"]
    assert comp.choices[0].finish_reason == "length"


def test_streaming_chat_and_completion(client, offline):
    messages = [{"role": "user", "content": "Count with me: one two three"}]
    ref = _chat_ref(offline, messages, 30)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].choices == []
    prompt = "Once upon a time"
    ref = offline.generate(prompt, {"max_new_tokens": 25, **GREEDY})
    pieces = [c.choices[0].text for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=25,
                                                                   stream=True, **GREEDY) if c.choices]
    assert "".join(pieces) == ref["text"]
    assert len(pieces) > 5  # it really streamed


def test_n_stop_and_seed(client):
    two = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12, n=2, temperature=1.0,
                                    seed=7)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 24
    again = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12, n=2, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    other = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12, n=2, temperature=1.0, seed=8)
    assert [c.text for c in other.choices] != [c.text for c in two.choices]
    full = client.completions.create(model=NAME, prompt="Hello there", max_tokens=16, **GREEDY).choices[0].text
    stop = full[4:7]
    assert stop.strip(), full
    cut = client.completions.create(model=NAME, prompt="Hello there", max_tokens=16, stop=[stop], **GREEDY)
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_and_top_logprobs(client, offline):
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    ref = _chat_ref(offline, messages, 6, return_logprob=True, top_logprobs_num=3)
    for entry, (lp, _, _) in zip(content, ref["meta_info"]["output_token_logprobs"]):
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy picks the best
    comp = client.completions.create(model=NAME, prompt="Some text", max_tokens=5, logprobs=2, **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and "".join(lp.tokens) == comp.choices[0].text


# No maxLength: xgrammar 0.2.8's bounded-string rule lets control characters (e.g. 0x1c) into strings.
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ada", "alan", "grace"]}, "likes_tea": {"type": "boolean"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "likes_tea", "age"], "additionalProperties": False}


def test_response_format_json_schema(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=80, seed=seed,
            temperature=0.8, response_format={"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": SCHEMA}})
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_repeated_long_prompt_reports_cached_tokens(client):
    prompt = " ".join(f"word{i}" for i in range(150))
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, **GREEDY)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, **GREEDY)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 100
    # cache_aware routing sends the repeat to the worker that holds the prefix
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.choices[0].text == first.choices[0].text


async def test_async_client(aclient, offline):
    messages = [{"role": "user", "content": "async hello"}]
    ref = _chat_ref(offline, messages, 12)
    chat, comp = await asyncio.gather(
        aclient.chat.completions.create(model=NAME, messages=messages, max_tokens=12, **GREEDY),
        aclient.completions.create(model=NAME, prompt="async prompt", max_tokens=12, **GREEDY))
    assert chat.choices[0].message.content == ref["text"]
    assert comp.choices[0].text == offline.generate("async prompt", {"max_new_tokens": 12, **GREEDY})["text"]
    stream = await aclient.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stream=True,
                                                   **GREEDY)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == ref["text"]
    stream = await aclient.completions.create(model=NAME, prompt="async prompt", max_tokens=12, stream=True, **GREEDY)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == comp.choices[0].text
    models = await aclient.models.list()
    assert models.data[0].id == NAME


async def test_200_concurrent_streams(mesh, aclient, offline):
    prompts = [f"Story number {i}: once there was" for i in range(10)]
    refs = {p: offline.generate(p, {"max_new_tokens": 16, **GREEDY})["text"] for p in prompts}

    async def one(i):
        p = prompts[i % len(prompts)]
        stream = await aclient.completions.create(model=NAME, prompt=p, max_tokens=16, stream=True, **GREEDY)
        return p, "".join([c.choices[0].text async for c in stream if c.choices])

    results = await asyncio.gather(*(one(i) for i in range(200)))
    wrong = [(p, t) for p, t in results if t != refs[p]]
    assert not wrong, wrong[:3]


def test_a_list_of_prompts_answers_like_one_request_per_prompt(client, offline):
    """Strings and token lists in one request, n=2: choice i*n+j belongs to prompt i, greedy texts equal the ones a
    request per prompt gets, usage counts each prompt once; streamed, the same texts arrive by index."""
    ids = offline.tokenizer("A river runs", add_special_tokens=False).input_ids
    prompts = ["The quick brown fox", ids, "Once upon a time in a small village"]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=10, **GREEDY) for p in prompts]
    batch = client.completions.create(model=NAME, prompt=prompts, max_tokens=10, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=10, n=2, stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == set(range(6))
    assert [texts[i] for i in range(6)] == [c.text for c in batch.choices]


def test_a_list_of_prompts_with_echo_and_logprobs(client):
    prompts = ["Hello there", "Some text here"]
    batch = client.completions.create(model=NAME, prompt=prompts, max_tokens=4, echo=True, logprobs=1, **GREEDY)
    for prompt, choice in zip(prompts, batch.choices):
        alone = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=1, **GREEDY)
        assert choice.text.startswith(prompt) and choice.text == alone.choices[0].text
        assert choice.logprobs.tokens == alone.choices[0].logprobs.tokens
        assert choice.logprobs.text_offset == alone.choices[0].logprobs.text_offset


def test_a_bad_prompt_in_a_list_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=["fine", [1, -5]], max_tokens=4)
    assert "prompt[1]" in str(e.value)


def _post(mesh, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(mesh.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_endpoints(mesh, offline):
    tok = offline.tokenizer
    status, one = _post(mesh, "/tokenize", {"prompt": "Hello there"})
    assert status == 200 and one["tokens"] == tok("Hello there").input_ids
    assert one["count"] == len(one["tokens"]) and one["max_model_len"] > 0
    status, two = _post(mesh, "/v1/tokenize", {"model": NAME, "prompt": ["a b", "c"], "add_special_tokens": False})
    assert status == 200 and two["tokens"] == [tok("a b", add_special_tokens=False).input_ids,
                                               tok("c", add_special_tokens=False).input_ids]
    assert two["count"] == [len(t) for t in two["tokens"]]
    status, text = _post(mesh, "/detokenize", {"tokens": one["tokens"]})
    assert status == 200 and text["text"] == tok.decode(one["tokens"])
    status, texts = _post(mesh, "/v1/detokenize", {"tokens": one["tokens"], "skip_special_tokens": True})
    assert texts["text"] == "Hello there"
    status, texts = _post(mesh, "/detokenize", {"tokens": two["tokens"]})
    assert status == 200 and texts["text"] == ["a b", "c"]
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": []}, "prompt"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens")]:
        status, err = _post(mesh, path, body)
        assert (status, err["error"]["param"]) == (400, param), (path, body, err)
    status, err = _post(mesh, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"


def test_models_retrieve_and_openai_extra_fields(client):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    # OpenAI's user and metadata fields, and a strict json_schema, are accepted.
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, user="u-1",
        metadata={"job": "nightly"}, response_format={"type": "json_schema", "json_schema": {
            "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                    "required": ["a"], "additionalProperties": False}}})
    assert out.choices[0].message.content is not None
    comp = client.completions.create(model=NAME, prompt="hi", max_tokens=2, user="u-2")
    assert comp.choices[0].text is not None


def test_an_empty_completions_prompt_is_its_special_tokens(client, offline):
    """An empty prompt is served as what the tokenizer makes of it (BOS), as before prompts went to the workers as
    text (the fuzz's first find, 2026-12-05: a worker refuses an empty text)."""
    ref = offline.generate(input_ids=offline.tokenizer("").input_ids, sampling_params={"max_new_tokens": 4, **GREEDY})
    comp = client.completions.create(model=NAME, prompt="", max_tokens=4, **GREEDY)
    assert comp.choices[0].text == ref["text"] and comp.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"] >= 1
