"""A stand-in tokenizer for the benchmark model configs (no real tokenizer can be downloaded on our machines).

    python scripts/make_bench_tokenizer.py --config benchmarks/configs/llama-3.1-8b --out build/llama-3.1-8b

copies config.json and writes a byte-level BPE tokenizer with exactly the model's vocabulary: the 256 bytes, every
two-byte pair, then three-byte tokens up to the first special id, and the special tokens above it (for Llama-3:
ids 128000-128255, <|begin_of_text|> and the end-of-turn ids as the config names them). Decoding random ids costs
what a real byte-level BPE's does (bytes that are not valid UTF-8 included), so the serving benchmark's tokenizer
and detokenizer work is realistic while the text is meaningless.
"""

from __future__ import annotations

import argparse
import json
import shutil
from itertools import product
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

NUM_SPECIAL = 256


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (the alphabet of byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def build(vocab_size: int) -> Tokenizer:
    regular = vocab_size - NUM_SPECIAL
    sym = byte_symbols()
    vocab = {s: i for i, s in enumerate(sym)}
    merges: list[tuple[str, str]] = []
    for a, b in product(sym, sym):
        if len(vocab) >= regular:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for ab, c in product([a + b for a, b in merges], sym):
        if len(vocab) >= regular:
            break
        vocab[ab + c] = len(vocab)
        merges.append((ab, c))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL)])
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="model directory holding config.json")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(ns.config) / "config.json", out / "config.json")
    cfg = json.loads((out / "config.json").read_text())
    tok = build(cfg["vocab_size"])
    tok.save(str(out / "tokenizer.json"))
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    special = cfg["vocab_size"] - NUM_SPECIAL
    name = lambda i: f"<|reserved_special_token_{i - special}|>" if i is not None and i >= special else None  # noqa
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(cfg.get("bos_token_id")),
        "eos_token": name(eos), "model_max_length": cfg.get("max_position_embeddings", 131072)}, indent=1))
    print(f"wrote a {tok.get_vocab_size()}-token byte-level BPE to {out}")


if __name__ == "__main__":
    main()
