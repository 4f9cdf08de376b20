"""Text side of the tiny test checkpoints: corpus, tokenizer, chat templates, prompts.

Everything here is a pure function of its seed (``random.Random``), so the
tokenizer trained on ``corpus()`` and the ``check_prompts()`` are identical on
every run and every machine.
"""

import json
import random
from pathlib import Path

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOKENIZER_SIZE = 1000
# transformers 5 forces its Qwen2Tokenizer pipeline (NFC, this split, ByteLevel) on
# model_type qwen2/qwen3 whatever tokenizer.json says; every model uses exactly that
# pipeline so raw `tokenizers` and AutoTokenizer agree.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SUBJECTS = (
    "the cat", "a small robot", "my neighbour", "the old engine", "our team",
    "the river", "a quiet student", "the server", "every packet", "the baker",
    "this library", "the scheduler", "a tired pilot", "the garden", "her laptop",
    "the committee", "a lonely whale", "the compiler", "that mountain", "the cache",
)
VERBS = (
    "reads", "builds", "watches", "carries", "remembers", "paints", "answers",
    "forgets", "follows", "measures", "repairs", "sends", "finds", "opens",
    "closes", "counts", "sorts", "writes", "borrows", "returns", "shares",
)
OBJECTS = (
    "a long letter", "the red door", "twelve apples", "the blue map",
    "a broken clock", "the morning news", "seven tokens", "an empty box",
    "the final answer", "a warm coat", "the secret key", "four requests",
    "the prefix tree", "a heavy book", "the evening train", "a paper boat",
    "the last page", "a green lamp", "the weekly report", "a silver coin",
)
PLACES = (
    "in the kitchen", "near the station", "under the bridge", "at the market",
    "on the roof", "behind the school", "inside the data center", "by the lake",
    "across the street", "in a small village", "at midnight", "before lunch",
)
# Multi-byte UTF-8 material so byte-level BPE learns merges across bytes of
# one code point (2-byte Latin, 3-byte CJK, 4-byte emoji).
FOREIGN = (
    "café", "naïve", "über", "señor", "façade", "jalapeño", "crème brûlée",
    "Ærøskøbing", "Łódź", "garçon", "smörgåsbord", "déjà vu", "piñata",
    "東京", "日本語", "你好", "世界", "山", "水", "中文", "大学",
    "🙂", "🚀", "🌍", "🎉",
)
CONNECTIVES = ("and then", "because", "while", "but", "so", "although", "until")
QUESTIONS = (
    "What is the capital of France?", "How many legs does a spider have?",
    "Why is the sky blue?", "Can you explain how a hash map works?",
    "Where did you put the keys?", "Which train goes to the airport?",
    "Who wrote the weekly report?", "When does the market open?",
)
CODE_LINES = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "if x > 0:\n    y = x // 2\nelse:\n    y = -x\n",
    "import os\npath = os.path.join('a', 'b')\n",
    "class Node:\n    def __init__(self):\n        self.children = {}\n",
    '{"name": "radix", "size": 42, "ok": true}\n',
)


def _clause(rng: random.Random) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        parts.append(rng.choice(PLACES))
    if rng.random() < 0.25:
        parts.append(rng.choice(FOREIGN))
    return " ".join(parts)


def sentence(rng: random.Random) -> str:
    """One sentence; mixes clauses, numbers, foreign words and punctuation."""
    text = _clause(rng)
    if rng.random() < 0.4:
        text += " " + rng.choice(CONNECTIVES) + " " + _clause(rng)
    if rng.random() < 0.2:
        text += f" at {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    if rng.random() < 0.15:
        text += f", costing {rng.randint(1, 999)}.{rng.randint(0, 99):02d} euros"
    text = text[0].upper() + text[1:]
    return text + rng.choice((".", ".", ".", "!", "?", "..."))


def paragraph(rng: random.Random, n_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(n_sentences))


def chat_turns(rng: random.Random) -> str:
    """Role names and blank lines as they appear between chat-template specials."""
    turns = ["system\nYou are a helpful assistant.\n\n"] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 2)):
        turns.append("user\n" + rng.choice(QUESTIONS) + "\n\n")
        turns.append("assistant\n" + sentence(rng) + "\n\n")
    return "".join(turns)


def corpus(seed: int = 1234, n_docs: int = 3000) -> list[str]:
    """Training documents for the tokenizer (prose, questions, chat, code, foreign)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        kind = i % 10
        if kind < 5:
            docs.append(paragraph(rng, rng.randint(1, 6)))
        elif kind < 7:
            docs.append(rng.choice(QUESTIONS) + " " + sentence(rng))
        elif kind == 7:
            docs.append(chat_turns(rng))
        elif kind == 8:
            docs.append("".join(rng.sample(CODE_LINES, 2)))
        else:
            docs.append(" ".join(rng.sample(FOREIGN, 6)) + "\n" + sentence(rng))
    return docs


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE, 1000 ids with the specials first; training is deterministic."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_SIZE, tok.get_vocab_size()
    return tok


def dump_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(tok: Tokenizer, out: Path, name: str, bos: str, eos: str, pad: str) -> None:
    """tokenizer.json + tokenizer_config.json; Llama-3 style encode() prepends BOS."""
    tok = Tokenizer.from_str(tok.to_str())
    added = ADDED_TOKENS.get(name, [])
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if bos == "<|begin_of_text|>":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(out / "tokenizer.json"))
    dump_json({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
               "pad_token": pad, "model_max_length": 1024, "clean_up_tokenization_spaces": False,
               "chat_template": CHAT_TEMPLATES[name]}, out / "tokenizer_config.json")


def check_prompts(seed: int = 99) -> list[str]:
    """Fourteen varied prompts for the --check mode, short to a few hundred tokens."""
    rng = random.Random(seed)
    prompts = [
        "Hello there, how are you?", "What is the capital of France?",
        "東京 is a city in 日本語 🙂", "def add(a, b):\n    return",
        "Once upon a time in a small village",
    ]
    sizes = (1, 2, 3, 5, 7, 9, 12, 15, 19)
    prompts.extend(paragraph(rng, n) for n in sizes)
    return prompts


CHECK_CHATS = (
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Why is the sky blue? 🙂"}],
)

# Llama-3 header style; BOS comes from the template (the tokenizer's post-processor
# adds it too, so templated text must be encoded with add_special_tokens=False).
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def chatml_template(default_system: str | None) -> str:
    """ChatML; Qwen2-style models inject a default system turn, Qwen3-style do not."""
    head = ""
    if default_system:
        head = ("{%- if messages[0]['role'] != 'system' %}"
                "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
                "{%- endif %}")
    return (head + "{%- for m in messages %}"
            "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# Qwen3's conventions: tools listed in the system turn, calls as <tool_call> JSON, tool results as a user turn of
# <tool_response> blocks, and thinking: a past assistant turn keeps only its answer; with enable_thinking=false the
# generation prompt holds an empty <think></think> block, so the model answers at once.
QWEN3_TEMPLATE = (
    "{%- set rest = messages -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{{- '# Tools\\nTo call a function, reply with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.'"
    " + '\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or rest[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (m['content'] or '') + '\\n</tool_response>' -}}"
    "{%- if loop.last or rest[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- if m['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content -}}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if 'function' in call else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

CHAT_TEMPLATES = {
    "tiny-llama": LLAMA_TEMPLATE,
    "tiny-qwen2": chatml_template("You are a helpful assistant."),
    "tiny-qwen3": QWEN3_TEMPLATE,
}
# Tokens a model's tokenizer adds after training, as its real counterpart has them (Qwen3's think and tool-call
# markers are single, non-special tokens: they survive skip_special_tokens).
ADDED_TOKENS = {"tiny-qwen3": ["<think>", "</think>", "<tool_call>", "</tool_call>"]}
