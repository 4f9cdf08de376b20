"""Giving device memory back when an engine shuts down, whatever still refers to its tensors.

An engine's tensors can outlive it: a caller keeps the Engine, a traceback keeps a frame, a reference cycle waits for
the collector. Releasing a tensor's storage in place (`resize_(0)`, as sharded-training frameworks free parameters)
returns its memory to PyTorch's caching allocator at once; `empty_cache` then returns it to the device, so a second
engine in the same process sizes its KV pool from the whole device again (notebooks, test suites, RL loops).
"""

from __future__ import annotations

import gc
from typing import Iterable, Iterator

import torch


def tensors_of(obj) -> Iterator[torch.Tensor]:
    """The tensors among `obj`'s attributes, and in its lists, tuples and dicts of tensors (one level down)."""
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (x for x in value if isinstance(x, torch.Tensor))
        elif isinstance(value, dict):
            yield from (x for x in value.values() if isinstance(x, torch.Tensor))


def release(tensors: Iterable[torch.Tensor]) -> None:
    """Free the storage of every CUDA tensor given (host tensors are left to the collector). A tensor released so,
    and every view of it, must not be used again."""
    for t in tensors:
        if t.is_cuda:
            t.untyped_storage().resize_(0)


def return_to_device() -> None:
    """Collect unreachable engines' cycles, then give the caching allocator's free blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
