"""The tokenizer service's process leaves torch out: transformers imports it whenever it is installed (AutoTokenizer
needs transformers' configuration module, which imports torch for its rope helpers), though no tokenizer runs on it.
That import was half of the service's start-up CPU (1.4 of 2.7 s for tiny-llama in a launched mesh), paid by every
mesh launch and restart. With torch marked absent (`sys.modules["torch"] = None`, Python's own way to block an
import), transformers sees it as not installed, as it supports (tokenizers need no framework), and loads the same
tokenizer class from the same files: ids, texts, special tokens and chat template renderings are unchanged
(tests/services/test_tokenizer_without_torch.py compares every bundled model).

Not done where code we cannot see may want torch (--trust-remote-code), nor where torch is already imported. A
tokenizer that needs torch anyway (an ImportError while loading) gets the process started again, as it was started,
with torch allowed (ALLOW_ENV=1)."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

log = logging.getLogger(__name__)

ALLOW_ENV = "RADIXMESH_TOKENIZER_TORCH"  # "1": let transformers import torch in the tokenizer service


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' one-time notice that PyTorch is missing (its models are not used here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def leave_out(trust_remote_code: bool) -> bool:
    """Marks torch absent for this process unless remote code may run, torch is imported already or ALLOW_ENV is
    set; True when it did. Modifies sys.modules and the `transformers` logger's filters."""
    if trust_remote_code or os.environ.get(ALLOW_ENV) == "1" or sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment] - `import torch` raises, find_spec says not installed
    logging.getLogger("transformers").addFilter(_NoTorchAdvice())
    return True


def restart_with_torch(error: ImportError) -> NoReturn:
    """Replaces this process (same pid, same command line) by one that lets torch be imported."""
    log.warning("the tokenizer needs torch (%s): starting again with torch", error)
    os.environ[ALLOW_ENV] = "1"
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
