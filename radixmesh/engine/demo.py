"""`make run`: start the offline engine on a bundled tiny model and print a few generations.

    python -m radixmesh.engine.demo --model-path models/tiny-qwen2 [any engine flag]
"""

from __future__ import annotations

import argparse
import asyncio

from radixmesh.engine import Engine
from radixmesh.engine.config import EngineArgs
from radixmesh.settings import add_settings, resolve

PROMPTS = [
    "The river runs past the old mill and",
    "Once upon a time, in a quiet village,",
    "The recipe needs flour, sugar and",
    "The river runs past the old mill and then",
]


async def _stream_one(llm: Engine, prompt: str) -> None:
    print(f"\n[stream] {prompt!r} ->", end=" ", flush=True)
    shown = ""
    async for chunk in await llm.async_generate(prompt, {"max_new_tokens": 24, "temperature": 0}, stream=True):
        text = chunk["text"]  # cumulative unless the engine runs with --stream-output
        print(text if llm.args.stream_output else text[len(shown):], end="", flush=True)
        shown = text if not llm.args.stream_output else shown + text
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings(parser, EngineArgs)
    llm = Engine(**resolve(parser.parse_args(), EngineArgs)[0])
    try:
        outs = llm.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0})
        for prompt, out in zip(PROMPTS, outs):
            meta = out["meta_info"]
            print(f"\n{prompt!r} -> {out['text']!r}\n  tokens: prompt {meta['prompt_tokens']}, completion "
                  f"{meta['completion_tokens']}, cached {meta['cached_tokens']}, finish {meta['finish_reason']}")
        again = llm.generate(PROMPTS[0], {"max_new_tokens": 24, "temperature": 0})
        print(f"\nrepeat of the first prompt: cached_tokens={again['meta_info']['cached_tokens']}, "
              f"same text: {again['text'] == outs[0]['text']}")
        asyncio.run(_stream_one(llm, PROMPTS[1]))
        info = llm.get_server_info()
        print(f"\nKV pool: {info['max_total_num_tokens']} tokens, {info['available_kv_tokens']} available")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
