"""Text prompts routed untokenized (Router.routes_text): when the router sends text to the workers, cache_aware
matches it by its text, in every router process alike, and the router only does so where every worker tokenizes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from radixmesh.v1 import common_pb2, tokenizer_pb2, worker_pb2
from radixmesh.services.common.chat_render import template_sha256
from radixmesh.services.router.core import Router
from radixmesh.services.router.kv_index import KvIndexPolicy
from radixmesh.services.router.policies import (TEXT_BLOCK, CacheAware, PowerOfTwo, RoundRobin, block_keys,
                                                chat_routing_text)
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.workers import Worker, WorkerRegistry

PREFIX = "You are a careful assistant. Answer in one sentence, and cite the source you used. " * 3


def _worker(url: str, mode: str = "null", tokenizes: bool = True, template: str = "TEMPLATE",
            thinking: bool = True) -> Worker:
    """`thinking`: it reports where its chat renderings leave the thinking (a worker of an older release does not)."""
    info = worker_pb2.GetModelInfoResponse(served_model_name="m", disaggregation_mode=mode, tokenizes_text=tokenizes,
                                           chat_template_sha256=template_sha256(template) if tokenizes else "",
                                           reports_prompt_thinking=tokenizes and thinking)
    return Worker(url, channel=None, stub=None, info=info)


def _policy() -> CacheAware:
    return CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.5,
                      max_tree_tokens=1 << 16)


def test_cache_aware_sends_a_shared_text_prefix_where_it_went_before():
    policy = _policy()
    workers = [SimpleNamespace(url=f"w{i}", in_flight=0) for i in range(4)]
    first = {policy.pick(workers, PREFIX + f"Question {q}: why is the sky blue?").url for q in range(3)}
    assert len(first) == 1, "one prefix went to several workers"
    assert policy.last_reason == "cache_hit" and policy.last_matched_tokens >= len(PREFIX.encode()) - TEXT_BLOCK
    other = policy.pick(workers, "An unrelated prompt about gardening, long enough to fill two blocks of text. " * 2)
    assert policy.last_reason == "cache_miss" and other.url not in first  # the least-seen worker
    # the same text in another namespace (tenant or adapter) is not cached there
    policy.pick(workers, PREFIX + "Question 9", namespace="tenant-b")
    assert policy.last_reason == "cache_miss"


def test_text_thresholds_count_bytes_not_characters():
    """A prompt of multibyte characters: the matched share is measured in UTF-8 bytes on both sides."""
    policy = _policy()
    workers = [SimpleNamespace(url=f"w{i}", in_flight=0) for i in range(2)]
    shared = "日本語の長い共有された前置きです。" * 8  # 3 bytes a character
    policy.pick(workers, shared + "一")
    policy.pick(workers, shared + "二")
    assert policy.last_reason == "cache_hit"
    assert policy.last_matched_tokens == len(shared.encode()) // TEXT_BLOCK * TEXT_BLOCK


def test_text_and_token_prompts_have_keys_of_their_own():
    ids = list(range(64))
    assert set(block_keys(ids)).isdisjoint(block_keys("x" * 256))
    assert block_keys("a" * (TEXT_BLOCK - 1)) == []  # a partial block is not remembered
    assert len(block_keys("é" * TEXT_BLOCK)) == 2  # bytes, not characters
    assert block_keys(PREFIX, "t") != block_keys(PREFIX)


def test_text_keys_are_the_same_in_every_process():
    """Sibling router processes share keys: a text's keys may not depend on the process's hash seed."""
    code = ("from radixmesh.services.router.policies import block_keys;"
            f"print(block_keys({PREFIX!r}, 'tenant'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{block_keys(PREFIX, 'tenant')}\n"}


def _router(policy, *workers: Worker, template: str | None = "TEMPLATE") -> Router:
    """`template`: the tokenizer service's chat template (None: the service has not answered yet)."""
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60)
    registry.workers = {w.url: w for w in workers}
    info = None if template is None else tokenizer_pb2.GetTokenizerInfoResponse(chat_template=template)
    return Router(RouterSettings(tokenizer_url="127.0.0.1:1"), registry, policy,
                  tokenizer=SimpleNamespace(info=info))


@pytest.mark.parametrize("policy", [_policy(), RoundRobin(), PowerOfTwo()], ids=lambda p: type(p).__name__)
def test_text_goes_untokenized_only_where_every_worker_tokenizes(policy):
    assert _router(policy, _worker("a:1"), _worker("b:1")).routes_text()
    assert not _router(policy, _worker("a:1"), _worker("b:1", tokenizes=False)).routes_text()
    assert not _router(policy).routes_text()  # no worker yet: nobody to say it tokenizes
    # a PD mesh gets ids: the prefill and decode sides must hold the same ones
    assert not _router(policy, _worker("p:1", "prefill"), _worker("d:1", "decode")).routes_text()


def test_kv_index_routing_needs_token_ids():
    policy = KvIndexPolicy.__new__(KvIndexPolicy)  # (its kvstore connection plays no part here)
    assert not _router(policy, _worker("a:1")).routes_text()


def test_chat_goes_to_the_workers_only_where_every_one_renders_the_tokenizer_services_template():
    policy = _policy()
    assert _router(policy, _worker("a:1"), _worker("b:1")).routes_chat()
    # a worker started with another --chat-template than the tokenizer service's: the service renders
    assert not _router(policy, _worker("a:1"), _worker("b:1", template="OTHER")).routes_chat()
    assert not _router(policy, _worker("a:1"), _worker("b:1"), template="OTHER").routes_chat()
    assert not _router(policy, _worker("a:1"), _worker("b:1", tokenizes=False)).routes_chat()
    assert not _router(policy, _worker("a:1"), template=None).routes_chat()  # the service's template not known yet
    assert not _router(policy, _worker("a:1", template=""), template="").routes_chat()  # no template anywhere
    assert _router(RoundRobin(), _worker("a:1")).routes_chat()
    kv = KvIndexPolicy.__new__(KvIndexPolicy)
    assert not _router(kv, _worker("a:1")).routes_chat()  # kv_index needs the ids


def test_chat_under_a_reasoning_parser_goes_to_the_workers_only_where_every_one_reports_the_thinking():
    """A --reasoning-parser needs to know where the rendering leaves the thinking: a worker of an older release
    (GetModelInfo without reports_prompt_thinking) among them has the tokenizer service render such chats."""
    policy = _policy()
    assert _router(policy, _worker("a:1"), _worker("b:1")).routes_chat(thinking=True)
    mixed = _router(policy, _worker("a:1"), _worker("b:1", thinking=False))
    assert mixed.routes_chat() and not mixed.routes_chat(thinking=True)
    assert not _router(policy, _worker("a:1"), _worker("b:1", template="OTHER")).routes_chat(thinking=True)
    assert not _router(policy, _worker("a:1"), template=None).routes_chat(thinking=True)


class _Vocabulary:
    """The tokenizer service's Tokenize of single words (a test double: `ids` maps the texts that are one token)."""

    def __init__(self, ids: dict[str, int]) -> None:
        self.ids, self.info = ids, None

    async def tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        one = self.ids.get(request.text)
        return tokenizer_pb2.TokenizeResponse(input_ids=[one] if one is not None else [5, 6], prompt=request.text)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize("vocab", [{"<think>": 7, "</think>": 8}, {"</think>": 8}, {"<think>": 7}],
                         ids=["both-tags-one-token", "end-only", "start-only"])
def test_a_worker_gates_a_constraint_as_the_router_does_from_the_tokenizer_services_rendering(parser, vocab):
    """A constrained chat under --reasoning-parser: the sampling params the engine gets are the same whether the
    router gated them from the tokenizer service's rendering, or sent the tags' tokens to the worker that renders
    the chat, which keeps of them what its rendering calls for (thinking.regate)."""
    from radixmesh.services.common import thinking
    from radixmesh.services.router.openai_api import _answer_constraint, _Prepared
    from radixmesh.services.router.openai_request import parse_chat_completion
    from radixmesh.services.router.reasoning import reasoning_format

    fmt = reasoning_format(parser)
    router = Router(RouterSettings(tokenizer_url="127.0.0.1:1", reasoning_parser=parser),
                    WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60), RoundRobin(), _Vocabulary(vocab))
    job = parse_chat_completion({"messages": [{"role": "user", "content": "hi"}], "regex": "a+"}, ("m",))
    seen = set()
    for prompt in ("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n",
                   "<|im_start|>assistant\n<think>\n\n</think>\n\n", "old <think>a</think> turn<|im_start|>"):
        state = thinking.prompt_thinking(prompt, fmt.start, fmt.end)
        seen.add(state)
        by_router = asyncio.run(_answer_constraint(router, job, _Prepared([1, 2], prompt)))
        by_worker = common_pb2.SamplingParams()
        by_worker.CopyFrom(asyncio.run(_answer_constraint(router, job, _Prepared(None, "", job.prompts[0].tokenize))))
        thinking.regate(by_worker, state, fmt.force)
        assert by_worker == by_router, (prompt, by_worker, by_router)
    assert seen == {thinking.OPEN, thinking.CLOSED, thinking.OUTSIDE}


def test_a_conversations_next_turn_is_routed_where_its_earlier_turns_went():
    """A chat the worker renders is matched on its messages, which grow at the end as the conversation goes on."""
    def chat(*turns: tuple[str, str]) -> tokenizer_pb2.ChatInput:
        return tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in turns])

    policy = _policy()
    workers = [SimpleNamespace(url=f"w{i}", in_flight=0) for i in range(4)]
    first = chat(("system", PREFIX), ("user", "Why is the sky blue? Explain it to a child, please."))
    url = policy.pick(workers, chat_routing_text(first)).url
    policy.pick(workers, chat_routing_text(chat(("user", "Something else entirely, about gardens and soil."))))
    second = chat(*((m.role, m.content) for m in first.messages), ("assistant", "Because of scattering."),
                  ("user", "And sunsets?"))
    assert chat_routing_text(second).startswith(chat_routing_text(first))
    assert policy.pick(workers, chat_routing_text(second)).url == url and policy.last_reason == "cache_hit"
    # the same words in other roles are another prompt
    assert chat_routing_text(chat(("user", "a"), ("assistant", "b"))) != chat_routing_text(chat(("user", "a"),
                                                                                              ("user", "b")))
