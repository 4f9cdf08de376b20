"""GPU tests size their KV pools from the free memory: give back what the previous test's engine held first."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
