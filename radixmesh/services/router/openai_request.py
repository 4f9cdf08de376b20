"""OpenAI request JSON -> the pieces of a worker request: tokenizer input, SamplingParams and LogprobOptions.

Semantics follow SGLang's OpenAI server. Unset OpenAI fields stay unset in SamplingParams, so the worker applies the
model's recommended value or SGLang's default (this includes `max_tokens`: no OpenAI-style default of 16 here).
Unknown fields are ignored, and so are SGLang's `rid` and OpenAI's `user` and `metadata`; `null` means absent.
Decisions worth knowing:
  - completions take a string, a list of token ids, or a list of either (a batch: prompt i's n choices have indices
    i*n .. i*n+n-1, as OpenAI numbers them).
  - `tools` reach the chat template (unless `tool_choice` is "none"). `tool_choice` "required" or a named function
    constrains the output with a JSON schema built from the tools' (tool_parsers), so the calls' arguments validate;
    "auto" leaves the output free and the router's --tool-call-parser finds the calls (chat_output).
  - chat content parts must be text (joined with "\\n"): these models take text only.
  - role "developer" is passed to the chat template as "system".
  - completions `echo` with `logprobs` also asks for prompt logprobs (logprob_start_len = 0), as OpenAI returns them.
Every rejection is an OpenAIError(400) whose message and `param` name the field; an unknown model is a 404."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from radixmesh.engine.sampling.params import MAX_N
from radixmesh.v1 import common_pb2, tokenizer_pb2
from radixmesh.services.router.completion_templates import CompletionTemplate
from radixmesh.services.router.openai_errors import bad_request
from radixmesh.services.router.request_fields import (INT32_MAX, Fields, adapter_of_model, are_token_ids,
                                                      body_fields, is_token_id, served_model, show, token_key)
from radixmesh.services.router.sampling_fields import OPENAI_ROWS, openai_value
from radixmesh.services.router.tool_parsers import named_call_schema, required_calls_schema

INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20
_ROLES = ("system", "user", "assistant", "tool", "developer")
_NON_TEXT_PARTS = ("image_url", "image", "input_image", "input_audio", "audio", "video_url", "file")


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt: exactly one of `tokenize` (text or chat for the tokenizer) and `ids` (token ids) is set."""

    tokenize: tokenizer_pb2.TokenizeRequest | None = None
    ids: tuple[int, ...] | None = None
    shown: str | None = None  # what `echo` shows when it is not the text tokenized (the prompt of a FIM render)


@dataclass(frozen=True, slots=True)
class OpenAIJob:
    """One validated OpenAI request: one prompt (chat) or one or more (completions)."""

    model: str
    kind: Literal["chat", "completion"]
    sampling: common_pb2.SamplingParams
    logprobs: common_pb2.LogprobOptions
    prompts: tuple[PromptInput, ...]
    stream: bool = False
    # stream_options.include_usage, and only when streaming (a non-streamed reply always has usage).
    include_usage: bool = False
    n: int = 1
    # Completions only: prepend the prompt text (and prompt logprobs when want_logprobs) to each choice.
    echo: bool = False
    # Whether the reply carries a `logprobs` object, and how many alternatives per token it lists.
    want_logprobs: bool = False
    top_logprobs: int = 0
    # Chat only: as given ("none", "auto", "required" or {"type": "function", ...}), the tools (OpenAI dicts; empty
    # when tool_choice is "none"), whether several calls may come back, and whether reasoning is split off.
    tool_choice: Any = None
    tools: tuple[dict[str, Any], ...] = ()
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True
    # The LoRA adapter `model` names (SGLang's `<served model>:<adapter>`, or the adapter's name); "": the base model.
    lora: str = ""

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# Common fields


def _stop(f: Fields) -> list[str]:
    value = f.body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise f.fail("stop", "must be a non-empty string or a list of non-empty strings")
    return items


def _logit_bias(f: Fields) -> dict[int, float]:
    value = f.object("logit_bias") or {}
    out = {}
    for key, bias in value.items():
        token = token_key(key)
        if not is_token_id(token):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias' value for token {key} must be a number in [-100, 100], got "
                              f"{show(bias)}", param="logit_bias")
        out[token] = float(bias)
    return out


def _response_format(f: Fields) -> str | None:
    """The JSON-schema constraint text that `response_format` asks for, or None."""
    fmt = f.object("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {show(kind)}",
                          param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"'response_format.json_schema' must be a JSON object, got {show(spec)}",
                          param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'response_format.json_schema.schema' must be a JSON schema object, got {show(schema)}",
                          param="response_format.json_schema.schema")
    return json.dumps(schema, ensure_ascii=False)


def _constraint(f: Fields, sp: common_pb2.SamplingParams) -> None:
    given = []
    schema = _response_format(f)
    if schema is not None:
        sp.json_schema = schema
        given.append("response_format")
    for name in ("regex", "ebnf"):
        text = f.str(name)
        if text is None:
            continue
        if not text:
            raise f.fail(name, "must be a non-empty string")
        setattr(sp, name, text)
        given.append(name)
    if len(given) > 1:
        raise bad_request(f"give at most one structured-output constraint, got {' and '.join(given)}",
                          param=given[1])


def sample_seed_error(sp: common_pb2.SamplingParams) -> str | None:
    """Why `sp`'s seed cannot seed its n samples, or None: sample j draws with seed + j, a signed 64-bit integer
    (past it the worker's sampling step fails)."""
    n = sp.n if sp.HasField("n") else 1
    if sp.HasField("sampling_seed") and sp.sampling_seed > INT64_MAX - (n - 1):
        return (f"the seed ({sp.sampling_seed}) must be at most {INT64_MAX - (n - 1)} with n = {n}: sample j draws "
                f"with seed + j, a signed 64-bit integer")
    return None


_OPENAI_NAMES = tuple((row, row.openai_names) for row in OPENAI_ROWS)  # (the names: a property, made once)


def _sampling(f: Fields) -> common_pb2.SamplingParams:
    """The scalar fields (the field table's OpenAI rows: max_completion_tokens or max_tokens, min_tokens, seed and
    the rest under their own names), then stops, logit_bias and the output constraint."""
    sp = common_pb2.SamplingParams()
    given = f.body.keys()
    for row, names in _OPENAI_NAMES:
        if given.isdisjoint(names):  # none of its names in the body (most rows, most requests)
            continue
        value = openai_value(f, row)
        if value is not None:
            setattr(sp, row.name, value)
    seed_error = sample_seed_error(sp)
    if seed_error:
        raise bad_request(seed_error, param="seed")
    if sp.HasField("min_new_tokens") and sp.HasField("max_new_tokens") and sp.min_new_tokens > sp.max_new_tokens:
        raise bad_request(f"'min_tokens' ({sp.min_new_tokens}) must be <= the maximum number of new tokens "
                          f"({sp.max_new_tokens})", param="min_tokens")
    sp.stop.extend(_stop(f))
    stop_ids = f.list("stop_token_ids") or []
    if not are_token_ids(stop_ids):
        raise f.fail("stop_token_ids", "must be a list of token ids")
    sp.stop_token_ids.extend(stop_ids)
    for token, bias in _logit_bias(f).items():
        sp.logit_bias[token] = bias
    _constraint(f, sp)
    return sp


def _logprob_options(top: int, echo: bool) -> common_pb2.LogprobOptions:
    opts = common_pb2.LogprobOptions(return_logprob=True, top_logprobs_num=top, return_text_in_logprobs=True)
    if echo:
        opts.logprob_start_len = 0
    return opts


def _stream(f: Fields) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is accepted and ignored."""
    stream = bool(f.bool("stream"))
    options = f.object("stream_options") or {}
    include_usage = Fields(options, "stream_options.").bool("include_usage")
    return stream, stream and bool(include_usage)


# ---------------------------------------------------------------------------------------------------------------
# Chat completions


def _content(value: Any, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a string, null or a list of content parts, got {show(value)}",
                          param=param)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _NON_TEXT_PARTS:
            raise bad_request(f"this model takes text only: '{param}[{j}]' is a {kind} part", param=f"{param}[{j}]")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{param}[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}, got "
                              f"{show(part)}", param=f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_message(i: int, m: Any) -> tokenizer_pb2.ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{param}' must be a JSON object with 'role' and 'content', got {show(m)}", param=param)
    f = Fields(m, param + ".")
    role = m.get("role")
    if role not in _ROLES:
        raise f.fail("role", f"must be one of {', '.join(_ROLES)}")
    if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
        raise f.fail("content", "is required (only an assistant message with tool_calls may omit it)")
    msg = tokenizer_pb2.ChatMessage(role="system" if role == "developer" else role,
                                    content=_content(m.get("content"), param + ".content"))
    msg.name = f.str("name") or ""
    msg.tool_call_id = f.str("tool_call_id") or ""
    tool_calls = f.list("tool_calls")
    if tool_calls:
        if not all(isinstance(c, dict) for c in tool_calls):
            raise f.fail("tool_calls", "must be a list of JSON objects")
        msg.tool_calls_json = json.dumps(tool_calls, ensure_ascii=False)
    return msg


_TOOL_SHAPE = '{"type": "function", "function": {"name": ...}}'


def _tools(f: Fields) -> tuple[str, Any]:
    """(the tools, for the chat template and the parsers; tool_choice as given); "none" keeps the tools out."""
    tools = f.list("tools") or []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or tool.get("type") != "function":
            raise bad_request(f"'tools[{i}]' must be {_TOOL_SHAPE}, got {show(tool)}", param=f"tools[{i}]")
        if not fn["name"]:
            raise bad_request(f"'tools[{i}].function.name' must be a non-empty string",
                              param=f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object, got "
                              f"{show(fn['parameters'])}", param=f"tools[{i}].function.parameters")
    choice = f.body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise f.fail("tool_choice", f"must be 'none', 'auto', 'required' or {_TOOL_SHAPE}")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                              param="tool_choice")
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise f.fail("tool_choice", f"must be 'none', 'auto', 'required' or {_TOOL_SHAPE}")
    if choice == "required" and not tools:
        raise bad_request("'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
    return (tools if choice != "none" else []), choice


def _tool_constraint(sp: common_pb2.SamplingParams, tools: list[dict], choice: Any, parallel: bool) -> None:
    """tool_choice "required" or a named function: the output is constrained to calls whose arguments validate."""
    if choice != "required" and not isinstance(choice, dict):
        return
    given = sp.WhichOneof("constraint")
    if given is not None:
        name = "response_format" if given == "json_schema" else given
        raise bad_request(f"'tool_choice' {show(choice)} constrains the output; it cannot be combined with "
                          f"'{name}'", param=name)
    if choice == "required":
        schema = required_calls_schema(tools, parallel)
    else:
        schema = named_call_schema(next(t for t in tools if t["function"]["name"] == choice["function"]["name"]))
    sp.json_schema = json.dumps(schema, ensure_ascii=False)


REASONING_EFFORTS = ("low", "medium", "high")


def _chat_input(f: Fields, tools: list[dict]) -> tokenizer_pb2.ChatInput:
    messages = f.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"'messages' must be a non-empty list of messages, got {show(messages)}", param="messages")
    chat = tokenizer_pb2.ChatInput(messages=[_chat_message(i, m) for i, m in enumerate(messages)])
    chat.tools_json = json.dumps(tools, ensure_ascii=False) if tools else ""
    cont = bool(f.bool("continue_final_message"))
    add_prompt = f.bool("add_generation_prompt")
    if cont:
        if add_prompt:
            raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                              param="add_generation_prompt")
        if chat.messages[-1].role != "assistant":
            raise bad_request("'continue_final_message' needs the last message to be from the assistant",
                              param="continue_final_message")
        add_prompt = False
    chat.continue_final_message = cont
    if add_prompt is not None:
        chat.add_generation_prompt = add_prompt
    kwargs = dict(f.object("chat_template_kwargs") or {})
    effort = f.str("reasoning_effort")
    if effort is not None:  # OpenAI's field; GPT-OSS's template writes it into the system message
        if effort not in REASONING_EFFORTS:
            raise f.fail("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}")
        kwargs.setdefault("reasoning_effort", effort)  # (chat_template_kwargs' own, where it gives one, stands)
    if kwargs:
        chat.chat_template_kwargs_json = json.dumps(kwargs, ensure_ascii=False)
    return chat


def parse_chat_completion(body: Any, served_models: Collection[str], adapters: Collection[str] = ()) -> OpenAIJob:
    """Validates a /v1/chat/completions body; raises OpenAIError (400, 404 unknown model, 503 no model).
    `adapters`: the LoRA adapters loaded, whose names `model` may give."""
    f = body_fields(body)
    model = served_model(f, served_models, adapters)
    tools, tool_choice = _tools(f)
    chat = _chat_input(f, tools)
    sampling = _sampling(f)
    parallel = f.bool("parallel_tool_calls")
    _tool_constraint(sampling, tools, tool_choice, parallel is not False)
    separate = f.bool("separate_reasoning")
    want = bool(f.bool("logprobs"))
    top = f.int("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not want:
        raise bad_request("'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
    stream, include_usage = _stream(f)
    lora = adapter_of_model(model, served_models, adapters) or ""
    return OpenAIJob(model=model, lora=lora, kind="chat", sampling=sampling,
                     logprobs=_logprob_options(top or 0, False) if want else common_pb2.LogprobOptions(),
                     prompts=(PromptInput(tokenize=tokenizer_pb2.TokenizeRequest(chat=chat)),), stream=stream,
                     include_usage=include_usage,
                     n=sampling.n if sampling.HasField("n") else 1, want_logprobs=want, top_logprobs=top or 0,
                     tool_choice=tool_choice, tools=tuple(tools), parallel_tool_calls=parallel is not False,
                     separate_reasoning=separate is not False)


# ---------------------------------------------------------------------------------------------------------------
# Completions


MAX_PROMPTS = 1024


def _one_prompt(value: Any) -> PromptInput | None:
    if isinstance(value, str):
        return PromptInput(tokenize=tokenizer_pb2.TokenizeRequest(text=value))
    if isinstance(value, list) and value and are_token_ids(value):
        return PromptInput(ids=tuple(value))
    return None


def _prompts(f: Fields) -> tuple[PromptInput, ...]:
    """The body's prompts: a string or token ids is one; a list of strings and token-id lists is a batch."""
    prompt = f.body.get("prompt")
    one = _one_prompt(prompt)
    if one is not None:
        return (one,)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(f"'prompt' must be a string, a non-empty list of token ids or a non-empty list of those, "
                          f"got {show(prompt)}", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        bad = next(t for t in prompt if not is_token_id(t))
        raise bad_request(f"'prompt' token ids must be integers in [0, {INT32_MAX}], got {show(bad)}", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} fit in one request",
                          param="prompt")
    batch = []
    for i, p in enumerate(prompt):
        one = _one_prompt(p)
        if one is None:
            raise bad_request(f"'prompt[{i}]' must be a string or a non-empty list of token ids (each in "
                              f"[0, {INT32_MAX}]), got {show(p)}", param=f"prompt[{i}]")
        batch.append(one)
    return tuple(batch)


def _fill_in_the_middle(prompts: tuple[PromptInput, ...], suffix: str,
                        template: CompletionTemplate | None) -> tuple[PromptInput, ...]:
    if template is None:
        raise bad_request("'suffix' needs a fill-in-the-middle template: start the router with "
                          "--completion-template (deepseek_coder, star_coder, qwen_coder or a JSON file)",
                          param="suffix")
    if any(p.tokenize is None for p in prompts):
        raise bad_request("'suffix' needs text prompts: a fill-in-the-middle prompt is rendered from text, not "
                          "token ids", param="suffix")
    return tuple(PromptInput(tokenize=tokenizer_pb2.TokenizeRequest(text=template.render(p.tokenize.text, suffix)),
                             shown=p.tokenize.text) for p in prompts)


def parse_completion(body: Any, served_models: Collection[str],
                     completion_template: CompletionTemplate | None = None, adapters: Collection[str] = ()
                     ) -> OpenAIJob:
    """Validates a /v1/completions body; raises OpenAIError (400, 404 unknown model, 503 no model). A `suffix`
    needs the router's --completion-template, which renders each text prompt with it for fill-in-the-middle.
    `adapters`: the LoRA adapters loaded, whose names `model` may give."""
    f = body_fields(body)
    model = served_model(f, served_models, adapters)
    prompts = _prompts(f)
    suffix = f.str("suffix")
    if suffix:
        prompts = _fill_in_the_middle(prompts, suffix, completion_template)
    sampling = _sampling(f)
    n = sampling.n if sampling.HasField("n") else 1
    best_of = f.int("best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad_request(f"'best_of' different from 'n' is not supported (best_of={best_of}, n={n})", param="best_of")
    top = f.int("logprobs", 0, MAX_TOP_LOGPROBS)
    echo = bool(f.bool("echo"))
    stream, include_usage = _stream(f)
    lora = adapter_of_model(model, served_models, adapters) or ""
    return OpenAIJob(model=model, lora=lora, kind="completion", sampling=sampling,
                     logprobs=_logprob_options(top, echo) if top is not None else common_pb2.LogprobOptions(),
                     prompts=prompts, stream=stream, include_usage=include_usage, n=n, echo=echo,
                     want_logprobs=top is not None, top_logprobs=top or 0)
