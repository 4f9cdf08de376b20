"""Strided host <-> device copies on a GPU's copy engines (cudaMemcpy2DAsync of the CUDA runtime, through ctypes),
for `--hicache-io-backend direct` (engine.cache.host_pool.KVMover).

Why the copy engines: a copy kernel (kernels.kv_pages) reads pinned host memory from SM programs, and while the
forward's GEMMs hold every SM its launches wait for free slots, so a forward waiting for its loads layer by layer
ran as long as the loads and the layers one after the other (H200, benchmarks.kv_copy: 6.3 ms of loads and 5.6 ms of
GEMMs took 10.4-13.0 ms layer by layer). A DMA takes no SM: the same bytes over the copy engine took 5.4 ms and the
layer-by-layer chain 5.65 ms, the longer of the two.

A host page is one block [2 * layers, page, heads, dim], so one layer's K and V of a run of consecutive host pages
is a 2-D copy: `count` rows of 2 * page_elems elements, `host page stride` apart.

Where the driver has them (CUDA 12.8+), two calls queue any number of copies at once. `copy_batch`
(cuMemcpyBatchAsync) takes 1-D copies: a layer's K and V of every page straight between host and device pages, with
no staging buffer and no scatter kernel, one copy per page and layer. `copy_2d_batch` (cuMemcpy3DBatchAsync) takes
2-D copies: one per K or V of a layer and a stretch of pages consecutive on both sides (host pages a host page apart,
device pages packed), still straight into place. The driver takes ~0.45 us to queue a 1-D copy whatever its
attributes (benchmarks.dma_issue, H200), so a multi-turn wave's ~66k page copies of the 8B shape cost ~30 ms of host
time before the forward's first kernel; in 2-D they are as many operations as there are stretches. KVMover uses the
2-D batches where a first one checks out (`batch_2d_available`). What a 2-D operation costs the driver is measured by
the same benchmark's `--runs`."""

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
    fn, legacy = _batch_fn()
    u64p, sizep = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    args = [dsts.ctypes.data_as(u64p), srcs.ctypes.data_as(u64p), sizes.ctypes.data_as(sizep), n,
            ctypes.byref(_ATTRS if attrs is None else attrs), _FIRST, 1]
    failed = ctypes.c_size_t(n)
    err = fn(*args, ctypes.byref(failed), stream) if legacy else fn(*args, stream)
    if err:
        where = f" at copy {failed.value} of {n}" if legacy and failed.value < n else f" ({n} copies)"
        raise RuntimeError(f"cuMemcpyBatchAsync failed{where}: CUDA error {err}")


# 2-D copies in batches (cuMemcpy3DBatchAsync, CUDA 12.8+): one operation per stretch of pages, where copy_batch needs
# one per page.


class _Operand(ctypes.Structure):  # CUmemcpy3DOperand, its union's pointer member
    _fields_ = [("type", ctypes.c_uint), ("ptr", ctypes.c_uint64), ("row_length", ctypes.c_size_t),
                ("layer_height", ctypes.c_size_t), ("loc_hint", _Location)]


class _Extent(ctypes.Structure):  # CUextent3D
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class _Op3D(ctypes.Structure):  # CUDA_MEMCPY3D_BATCH_OP
    _fields_ = [("src", _Operand), ("dst", _Operand), ("extent", _Extent), ("src_access_order", ctypes.c_uint),
                ("flags", ctypes.c_uint)]


OP3D = np.dtype(_Op3D)  # the same layout as a numpy record, so a batch's operations are filled as arrays
_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_batch_3d = None  # (function, takes a failure-index argument); False where the driver lacks it
_checked_3d: bool | None = None  # whether a first batch put every byte where it belongs (check_2d_batch)


def _batch_3d_fn():
    """cuMemcpy3DBatchAsync of the driver (_driver_entry)."""
    global _batch_3d
    if _batch_3d is None:
        _batch_3d = _driver_entry("cuMemcpy3DBatchAsync", [ctypes.c_size_t, ctypes.c_void_p],
                                  [ctypes.c_ulonglong, ctypes.c_void_p])
    return _batch_3d


def ops_2d(dsts: np.ndarray, dst_pitch: int, srcs: np.ndarray, src_pitch: int, width: int,
           rows: np.ndarray) -> np.ndarray:
    """The batch's operations: copy i moves rows[i] rows of `width` bytes from srcs[i] (rows `src_pitch` bytes
    apart) to dsts[i] (`dst_pitch` apart). Pointer operands count their rows in bytes."""
    n = len(dsts)
    ops = np.zeros(n, dtype=OP3D)
    for side, addr, pitch in (("src", srcs, src_pitch), ("dst", dsts, dst_pitch)):
        operand = ops[side]
        operand["type"] = _OPERAND_POINTER
        operand["ptr"] = addr
        operand["row_length"] = pitch
        operand["layer_height"] = rows
    ops["extent"]["width"] = width
    ops["extent"]["height"] = rows
    ops["extent"]["depth"] = 1
    ops["src_access_order"] = _ORDER_STREAM
    ops["flags"] = _PREFER_OVERLAP_WITH_COMPUTE
    return ops


def copy_2d_batch(ops: np.ndarray, stream: int) -> None:
    """Queue the operations of `ops` (from ops_2d) on CUDA stream handle `stream` as one batch: in stream order as a
    whole, in any order among themselves. RuntimeError with the CUDA error code (and the failed operation's index,
    where the driver gives it) when the driver refuses the batch."""
    n = len(ops)
    if not n:
        return
    assert ops.dtype == OP3D and ops.flags.c_contiguous
    fn, legacy = _batch_3d_fn()
    failed = ctypes.c_size_t(n)
    err = fn(n, ops.ctypes.data, ctypes.byref(failed), 0, stream) if legacy else fn(n, ops.ctypes.data, 0, stream)
    if err:
        where = f" at operation {failed.value} of {n}" if legacy and failed.value < n else f" ({n} operations)"
        raise RuntimeError(f"cuMemcpy3DBatchAsync failed{where}: CUDA error {err}")


def batch_2d_available() -> bool:
    """Whether 2-D batches can be used here: the driver has the call, and a first batch (check_2d_batch) moved
    every byte where it belongs."""
    return bool(_batch_3d_fn()) and check_2d_batch()


def check_2d_batch() -> bool:
    """Once per process: a small batch of strided host rows into a device buffer, compared byte for byte; a driver
    that reads the operations otherwise than this module writes them (or refuses them) is not used, with a warning,
    and loads keep one copy per page."""
    global _checked_3d
    if _checked_3d is None:
        import logging

        import torch

        _checked_3d = False
        try:
            width, pitch = 256, 1024  # 3 runs of rows 1024 bytes apart on the host, packed on the device
            host = torch.arange(8 * pitch, dtype=torch.int32).view(torch.uint8)[:8 * pitch].pin_memory()
            runs = [(0, 2), (3, 1), (5, 3)]  # (first row, rows)
            dev = torch.zeros(6 * width, dtype=torch.uint8, device="cuda")
            dsts = np.array([dev.data_ptr() + width * k for k in (0, 2, 3)], dtype=np.uint64)
            srcs = np.array([host.data_ptr() + pitch * first for first, _ in runs], dtype=np.uint64)
            rows = np.array([count for _, count in runs], dtype=np.uint64)
            stream = torch.cuda.current_stream()
            copy_2d_batch(ops_2d(dsts, width, srcs, pitch, width, rows), stream.cuda_stream)
            stream.synchronize()
            want = torch.cat([host[pitch * r:pitch * r + width] for first, count in runs
                              for r in range(first, first + count)])
            _checked_3d = bool(torch.equal(dev.cpu(), want))
            if not _checked_3d:
                logging.getLogger(__name__).warning(
                    "cuMemcpy3DBatchAsync moved other bytes than asked in its check; host loads keep one copy per page")
        except Exception as e:  # noqa: BLE001 - a driver that refuses the call: the other paths remain
            logging.getLogger(__name__).warning("cuMemcpy3DBatchAsync is not usable here (%s); host loads keep one "
                                                "copy per page", e)
    return _checked_3d
