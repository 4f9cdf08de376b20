"""Strided host <-> device copies on a GPU's copy engines (cudaMemcpy2DAsync of the CUDA runtime, through ctypes),
for `--hicache-io-backend direct` (engine.cache.host_pool.KVMover).

Why the copy engines: a copy kernel (kernels.kv_pages) reads pinned host memory from SM programs, and while the
forward's GEMMs hold every SM its launches wait for free slots, so a forward waiting for its loads layer by layer
ran as long as the loads and the layers one after the other (H200, benchmarks.kv_copy: 6.3 ms of loads and 5.6 ms of
GEMMs took 10.4-13.0 ms layer by layer). A DMA takes no SM: the same bytes over the copy engine took 5.4 ms and the
layer-by-layer chain 5.65 ms, the longer of the two.

A host page is one block [2 * layers, page, heads, dim] (a latent cache's one buffer a layer: [layers, ...]), so one
layer's K and V of a run of consecutive host pages is a 2-D copy: `count` rows of 2 * page_elems elements, `host page
stride` apart.

Where the driver has it (CUDA 12.8+), one call queues any number of copies at once: `copy_batch`
(cuMemcpyBatchAsync) takes 1-D copies: a layer's K and V of every page straight between host and device pages, with
no staging buffer and no scatter kernel, one copy per page and layer. The driver takes ~0.45 us to queue a copy
whatever its attributes (benchmarks.dma_issue, H200), so a multi-turn wave's ~66k page copies of the 8B shape cost
~30 ms of host time. 2-D batches (cuMemcpy3DBatchAsync, one operation per stretch of pages consecutive on both sides)
would queue fewer operations, but the driver takes 3.5-5.5 us an operation and the copy engine moves strided rows at
17-36 GB/s for stretches of 1-4 pages (the engine's are 1.3-1.6), against 53 GB/s for page copies (the same
benchmark's --runs, H200): they are not used."""

from __future__ import annotations

import ctypes

import numpy as np

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


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_uint), ("src_loc_hint", _Location), ("dst_loc_hint", _Location),
                ("flags", ctypes.c_uint)]


_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order
_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: the copy engines, not SMs
_batch = None  # (function, takes a failure-index argument) once looked up; False where the driver lacks it


def _driver_entry(name: str, head: list, tail: list):
    """(function, legacy) for the driver's `name`: its CUDA 13 `_v2` entry point (no failure index) where it exists,
    else CUDA 12.8's, whose argument after `head` receives the index of a failed copy; False where there is neither."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    for symbol, legacy in ((name + "_v2", False), (name, True)):
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn.argtypes = head + ([ctypes.POINTER(ctypes.c_size_t)] if legacy else []) + tail
            fn.restype = ctypes.c_int
            return fn, legacy
    return False


def _batch_fn():
    """cuMemcpyBatchAsync of the driver (_driver_entry)."""
    global _batch
    if _batch is None:
        u64p, sizep = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
        _batch = _driver_entry("cuMemcpyBatchAsync", [u64p, u64p, sizep, ctypes.c_size_t,
                                                      ctypes.POINTER(_CopyAttributes), sizep, ctypes.c_size_t],
                               [ctypes.c_void_p])
    return _batch


def batch_available() -> bool:
    return bool(_batch_fn())


def _not_null(stream: int) -> None:
    if not stream:  # the driver answers CUDA error 1 (invalid value), which names nothing
        raise ValueError("copy batches cannot be queued on the legacy NULL stream: use a stream of its own")


_ATTRS = _CopyAttributes(_ORDER_STREAM, _Location(0, 0), _Location(0, 0), _PREFER_OVERLAP_WITH_COMPUTE)
_FIRST = (ctypes.c_size_t * 1)(0)  # one attribute entry, for every copy from the first on


def copy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
               attrs: _CopyAttributes | None = None) -> None:
    """Queue len(dsts) copies (addresses and byte counts: C-contiguous uint64 arrays; pinned host or device memory)
    on CUDA stream handle `stream`, as one batch: they run in stream order as a whole, in any order among themselves
    (so no copy may depend on another). The arrays are read before this returns. RuntimeError with the CUDA error
    code (and the failed copy's index, where the driver gives it) when the driver refuses the batch. `attrs`: the
    copies' attributes (default: stream order, on the copy engines; benchmarks.dma_issue compares others)."""
    n = len(dsts)
    if not n:
        return
    assert len(srcs) == n and len(sizes) == n and dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    assert dsts.flags.c_contiguous and srcs.flags.c_contiguous and sizes.flags.c_contiguous
    _not_null(stream)
    fn, legacy = _batch_fn()
    u64p, sizep = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    args = [dsts.ctypes.data_as(u64p), srcs.ctypes.data_as(u64p), sizes.ctypes.data_as(sizep), n,
            ctypes.byref(_ATTRS if attrs is None else attrs), _FIRST, 1]
    failed = ctypes.c_size_t(n)
    err = fn(*args, ctypes.byref(failed), stream) if legacy else fn(*args, stream)
    if err:
        where = f" at copy {failed.value} of {n}" if legacy and failed.value < n else f" ({n} copies)"
        raise RuntimeError(f"cuMemcpyBatchAsync failed{where}: CUDA error {err}")
