"""Strided host -> device copies for the host tier's layer-by-layer loads: `cudaMemcpy2DAsync` of the CUDA runtime
PyTorch has loaded (found by name in /proc/self/maps, so both use one runtime), through ctypes.

A host page holds every layer ([2 * layers, page_size, heads, head_dim]); a load that overlaps the prefill copies
one layer's K and V of many pages at a time: rows of `width` bytes, `src_pitch` apart on the host (one whole page),
packed on the device. One 2D copy moves a run of consecutive host pages on the copy engine, where PyTorch's `copy_`
of a strided pinned tensor would first gather it on the CPU."""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)
_HOST_TO_DEVICE = 1  # cudaMemcpyKind
_lib: ctypes.CDLL | None | bool = None  # False: not found


def _runtime() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        path = None
        try:
            with open("/proc/self/maps") as f:
                path = next((line.split()[-1] for line in f if "/libcudart.so" in line), None)
            lib = ctypes.CDLL(path or "libcudart.so")
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError) as e:
            log.info("no CUDA runtime to call (%s): host-tier loads copy whole pages before the forward", e)
            _lib = False
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _lib = lib
    return _lib or None


def available() -> bool:
    """Whether strided copies can be made (CUDA, and the runtime's library found)."""
    return torch.cuda.is_available() and _runtime() is not None


def copy_rows(dst: int, src: int, width: int, src_pitch: int, rows: int, stream: torch.cuda.Stream) -> None:
    """Copy `rows` rows of `width` bytes from pinned host address `src` (rows `src_pitch` apart) to device address
    `dst` (rows packed), asynchronously on `stream`."""
    err = _runtime().cudaMemcpy2DAsync(dst, width, src, src_pitch, width, rows, _HOST_TO_DEVICE, stream.cuda_stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
