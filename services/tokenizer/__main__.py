"""`python -m services.tokenizer --model-path PATH [--port N] [--chat-template NAME_OR_FILE]`: serve
radixmesh.v1.TokenizerService until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from services.common.logs import setup_logging
from services.common.server import GrpcService
from services.common.settings import parse_settings
from services.tokenizer.backend import TokenizerBackend
from services.tokenizer.servicer import TokenizerServicer, add_to_server
from services.tokenizer.settings import TokenizerSettings

log = logging.getLogger("services.tokenizer")


async def serve(settings: TokenizerSettings, backend: TokenizerBackend) -> None:
    servicer = TokenizerServicer(backend)

    async def on_stop() -> None:
        backend.close()

    service = GrpcService(settings, lambda server: add_to_server(servicer, server), on_stop)
    await service.run_until_signal()


def main(argv: Sequence[str] | None = None) -> int:
    (settings,) = parse_settings("radixmesh tokenizer service: chat templates, tokenization, detokenization.",
                                 TokenizerSettings, argv)
    setup_logging("tokenizer", settings.log_level)
    try:
        backend = TokenizerBackend.from_settings(settings)
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    asyncio.run(serve(settings, backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
