"""Stop strings: matched on the detokenized output (also across token boundaries), trimmed from the text unless
no_stop_trim, and never streamed past."""

from __future__ import annotations

import pytest

from tests.conftest import model_path
from tests.engine_utils import running_engine

PROMPT = "Once upon a time, in a quiet village,"
GREEDY = {"max_new_tokens": 32, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    with running_engine(model_path("tiny-qwen2")) as engine:
        yield engine


def split_stop(llm) -> tuple[str, list[int], str]:
    """A stop string made of the end of one output token and the start of the next."""
    out = llm.generate(PROMPT, GREEDY)
    ids, tok = out["output_ids"], llm.tokenizer
    for i in range(3, len(ids) - 1):
        a, b = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b and a.isprintable() and b.isprintable():
            stop = a[-2:] + b[:2]
            if stop not in tok.decode(ids[: i + 1]):
                return stop, ids, out["text"]
    pytest.skip("no suitable token pair in the greedy output")


def test_stop_string_across_tokens_cuts_the_text(llm):
    stop, ids, full = split_stop(llm)
    out = llm.generate(PROMPT, {**GREEDY, "stop": [stop, "never-appears"]})
    assert out["text"] == full[: full.find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    got = out["output_ids"]
    assert got == ids[: len(got)]
    assert stop in llm.tokenizer.decode(got) and stop not in llm.tokenizer.decode(got[:-1])


def test_no_stop_trim_keeps_the_stop_string(llm):
    stop, _, _ = split_stop(llm)
    out = llm.generate(PROMPT, {**GREEDY, "stop": stop, "no_stop_trim": True})
    assert out["text"].find(stop) >= 0 and out["text"] == llm.tokenizer.decode(out["output_ids"])


def test_stream_never_emits_past_the_stop_string(llm):
    stop, _, full = split_stop(llm)
    chunks = list(llm.generate(PROMPT, {**GREEDY, "stop": stop}, stream=True))
    for c in chunks:  # cumulative text: every snapshot is a prefix of the trimmed output
        assert stop not in c["text"] and full[: full.find(stop)].startswith(c["text"])
    assert chunks[-1]["text"] == full[: full.find(stop)]


def test_stop_strings_need_a_tokenizer():
    with running_engine(model_path("tiny-qwen2"), skip_tokenizer_init=True) as eng:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            eng.generate(input_ids=[5, 6], sampling_params={"stop": "x"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_no_stop_trim(llm, stream):
    """As SGLang: the output ends on the stop token (it is in output_ids), its text is not in the text; with
    skip_special_tokens false a special EOS would otherwise show (GPT-OSS's <|return|>, DeepSeek's end of sentence)."""
    ids = llm.generate(PROMPT, GREEDY)["output_ids"]
    stop = next(t for t in ids[3:] if llm.tokenizer.decode([t]).strip())
    k = ids.index(stop)
    for trim in (True, False):
        params = {**GREEDY, "stop_token_ids": [stop], "skip_special_tokens": False, "no_stop_trim": not trim}
        out = llm.generate(PROMPT, params, stream=stream)
        out = list(out)[-1] if stream else out
        assert out["output_ids"] == ids[:k + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"] == llm.tokenizer.decode(ids[:k] if trim else ids[:k + 1], skip_special_tokens=False)
