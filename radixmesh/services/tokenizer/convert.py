"""radixmesh.v1 tokenizer messages <-> the tokenizer service's Python types. JSON fields are parsed here;
malformed ones are a ValueError naming the field."""

from __future__ import annotations

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.tokenizer.backend import TokenizerInfo, Tokenized


def optional_bool(msg, name: str, default: bool) -> bool:
    return getattr(msg, name) if msg.HasField(name) else default


def tokenized_to_proto(out: Tokenized) -> tokenizer_pb2.TokenizeResponse:
    return tokenizer_pb2.TokenizeResponse(input_ids=out.input_ids, prompt=out.prompt)


def info_to_proto(info: TokenizerInfo) -> tokenizer_pb2.GetTokenizerInfoResponse:
    return tokenizer_pb2.GetTokenizerInfoResponse(
        vocab_size=info.vocab_size,
        special_tokens=[tokenizer_pb2.SpecialToken(name=t.name, content=t.content, id=t.id)
                        for t in info.special_tokens],
        chat_template=info.chat_template,
        tokenizer_path=info.tokenizer_path,
        eos_token_ids=list(info.eos_token_ids),
        context_length=info.context_length,
    )
