"""Name -> backend class, imported on first use (so `import engine` needs neither Triton nor FlashInfer)."""

from __future__ import annotations

import importlib
import importlib.util

from radixmesh.engine.attention.base import AttentionBackend, AttentionShape

_BACKENDS = {
    "torch_native": "radixmesh.engine.attention.torch_native:TorchNativeBackend",
    "triton": "radixmesh.engine.attention.triton_backend:TritonBackend",
    "flashinfer": "radixmesh.engine.attention.flashinfer_backend:FlashInferBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


# What FlashInfer's attention kernels cover (float16/bfloat16 only, these head sizes).
_FLASHINFER_DTYPES = ("float16", "bfloat16")
FLASHINFER_HEAD_DIMS = (64, 128, 256)


# The widest head our Triton kernels tile (Gemma's 256); a wider one attends in plain torch, except a latent KV cache
# (multi-head latent attention's 576-wide latent), which kernels.mla_decode and kernels.mla_extend compute
TRITON_MAX_HEAD_DIM = 256


def default_backend(device: str, dtype: str, head_dim: int) -> str:
    """SGLang's choice: FlashInfer on CUDA when it is installed and covers the model (its kernels have no float32
    and fixed head sizes), else Triton where its kernels tile the head, else plain torch; plain torch on CPU."""
    if not device.startswith("cuda") or head_dim > TRITON_MAX_HEAD_DIM:
        return "torch_native"
    fits = dtype in _FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS
    return "flashinfer" if fits and importlib.util.find_spec("flashinfer") is not None else "triton"


def default_latent_backend(device: str) -> str:
    """Attention over a latent KV cache (multi-head latent attention) where no backend flag is given: Triton's latent
    kernels (kernels.mla_extend, kernels.mla_decode in CUDA graphs) on CUDA; plain torch elsewhere. (FlashInfer's
    paged kernels take no latent.)"""
    return "triton" if device.startswith("cuda") and importlib.util.find_spec("triton") is not None \
        else "torch_native"


def default_decode_backend(device: str, attention_backend: str) -> str:
    """The decode batches' backend when neither --attention-backend nor --decode-attention-backend is given: Triton's
    where the default is FlashInfer on a Hopper-or-later GPU, else the default itself. There the whole decode step
    was faster on Triton at every batch size measured (H200, Llama-3.1-8B shape, 512-token context, GPU ms a step:
    batch 1 3.92 against 4.42, 8 4.93 against 5.50, 64 6.63 against 7.44, 256 13.32 against 13.74); only batch 1 at
    32k was FlashInfer's, 5.37 against 5.56 (benchmarks/results/NOTES.md, 2026-11-29). Those are synchronous steps,
    where FlashInfer's per-step plan delays the graph; under the overlap scheduler the plan is hidden, and at 256
    running requests its decode gave 1-4% more output tok/s while batch 1 stayed Triton's by ~4% (NOTES,
    2026-11-29 (afternoon)): batch 1 is what this default serves. Prefill stays on FlashInfer. An explicit backend
    flag is always obeyed."""
    if attention_backend != "flashinfer" or not device.startswith("cuda"):
        return attention_backend
    import torch

    if not torch.cuda.is_available():  # the device check that follows says so clearly
        return attention_backend
    index = torch.device(device).index
    if torch.cuda.get_device_capability(index or 0)[0] < 9 or importlib.util.find_spec("triton") is None:
        return attention_backend
    return "triton"


def check_backend_name(name: str, flag: str = "attention_backend") -> None:
    if name not in _BACKENDS:
        raise ValueError(f"unknown {flag} {name!r}; available: {', '.join(available_backends())}")


def _backend_class(name: str) -> type[AttentionBackend]:
    check_backend_name(name)
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def supports_cuda_graph(name: str) -> bool:
    """Whether backend `name` can run inside a captured CUDA graph (known before any backend is built)."""
    return _backend_class(name).supports_cuda_graph


def create_backend(name: str, shape: AttentionShape, kv_pool, req_to_token) -> AttentionBackend:
    return _backend_class(name)(shape, kv_pool, req_to_token)


def create_attention(prefill: str, decode: str, shape: AttentionShape, kv_pool, req_to_token) -> AttentionBackend:
    """One backend, or a hybrid when prefill and decode batches use different ones."""
    first = create_backend(prefill, shape, kv_pool, req_to_token)
    if decode == prefill:
        return first
    from radixmesh.engine.attention.hybrid import HybridBackend

    return HybridBackend(first, create_backend(decode, shape, kv_pool, req_to_token))
