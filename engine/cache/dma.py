"""Strided host <-> device copies on a GPU's copy engines (cudaMemcpy2DAsync of the CUDA runtime, through ctypes),
for `--hicache-io-backend direct` (engine.cache.host_pool.KVMover).

Why the copy engines: a copy kernel (kernels.kv_pages) reads pinned host memory from SM programs, and while the
forward's GEMMs hold every SM its launches wait for free slots, so a forward waiting for its loads layer by layer
ran as long as the loads and the layers one after the other (H200, benchmarks.kv_copy: 6.3 ms of loads and 5.6 ms of
GEMMs took 10.4-13.0 ms layer by layer). A DMA takes no SM: the same bytes over the copy engine took 5.4 ms and the
layer-by-layer chain 5.65 ms, the longer of the two.

A host page is one block [2 * layers, page, heads, dim], so one layer's K and V of a run of consecutive host pages
is a 2-D copy: `count` rows of 2 * page_elems elements, `host page stride` apart."""

from __future__ import annotations

import ctypes

_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
_lib = None
_missing = False


def runtime():
    """The CUDA runtime library torch loaded (by its soname), or None where there is none."""
    global _lib, _missing
    if _lib is None and not _missing:
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                lib = ctypes.CDLL(name)
                fn = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _lib = lib
            break
        else:
            _missing = True
    return _lib


def available() -> bool:
    return runtime() is not None


def copy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, to_device: bool,
            stream: int) -> None:
    """`rows` rows of `width` bytes from address `src` (rows `src_pitch` apart) to `dst` (`dst_pitch` apart), queued
    on CUDA stream handle `stream`. RuntimeError with the CUDA error code when the runtime refuses it."""
    err = runtime().cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                      _HOST_TO_DEVICE if to_device else _DEVICE_TO_HOST, stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: CUDA error {err}")
