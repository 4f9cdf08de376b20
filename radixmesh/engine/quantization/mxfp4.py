"""MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`: GPT-OSS as OpenAI publishes it): the experts'
codes and scales read as stored where kernels.moe_mxfp4 computes them (engine.models.gpt_oss), else dequantized
(`LazyMxfp4`, `dequantize`), and our writer of such checkpoints (tests, and the tiny models).

The format (OCP microscaling, as GPT-OSS stores it): a mixture-of-experts projection `<name>` of the bf16 layout
[experts, in, out] is stored transposed, as `<name>_blocks` [experts, out, in / 32, 16] uint8 (two 4-bit e2m1 codes a
byte, the low nibble first) and `<name>_scales` [experts, out, in / 32] uint8 (each group of 32 codes' power-of-two
scale, biased by 127). A code c is FP4_VALUES[c] (sign, 2 exponent bits, 1 mantissa bit), its weight that times
2^(scale - 127): every such value is exact in bfloat16 (and float32), so the dequantized weights are the checkpoint's
exactly. Other tensors (attention, router, embedding, biases) are stored as they are.

Dequantized, the experts take the model dtype's memory (gpt-oss-20b's ~38 GB in bf16 against ~10 GB of MXFP4;
-120b's ~229 GB against ~61). A checkpoint of another architecture declaring mxfp4 is refused by
engine.models.support.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# (no radixmesh.kernels import: the engine runs on CPU without Triton; kernels.moe_mxfp4 keeps its own twin)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # codes sharing a scale

ARCHITECTURES = ("GptOssForCausalLM",)  # whose mxfp4 checkpoints we read
_BLOCKS, _SCALES = "_blocks", "_scales"


def is_mxfp4(raw_config: dict) -> bool:
    quant = raw_config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


_CHUNK_ROWS = 1 << 16  # output rows dequantized at a time: ~1 GB of temporaries at 2,880 inputs (counted)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., out, in / 32, 16] codes and [..., out, in / 32] scales -> [..., out, in] weights in `dtype`, a chunk of
    rows at a time (a layer of gpt-oss-120b's experts is 1.1G weights)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: blocks are "
                         f"[..., groups, {GROUP // 2}] beside scales [..., groups]")
    *lead, groups, half = blocks.shape
    rows = blocks.reshape(-1, groups, half)
    exps = scales.reshape(-1, groups)
    out = torch.empty((rows.shape[0], groups * GROUP), dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    for r in range(0, rows.shape[0], _CHUNK_ROWS):
        codes = rows[r:r + _CHUNK_ROWS].to(torch.uint8)
        values = torch.stack([lut[(codes & 0x0F).int()], lut[(codes >> 4).int()]], dim=-1).flatten(-2)
        values = torch.ldexp(values, exps[r:r + _CHUNK_ROWS].to(torch.int32).unsqueeze(-1) - 127)  # [rows, groups, 32]
        out[r:r + _CHUNK_ROWS] = values.flatten(-2)
    return out.reshape(*lead, groups * GROUP)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] (in a multiple of 32) -> (blocks, scales) as dequantize reads them: each group's scale the
    smallest power of two that brings its largest magnitude within 6, each value rounded to the nearest code."""
    *lead, out, inner = w.shape
    if inner % GROUP:
        raise ValueError(f"MXFP4 groups {GROUP} values along the input dimension; {inner} is not a multiple")
    g = w.float().reshape(*lead, out, inner // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # [.., 32] magnitude codes 0..7
    codes = (nearest | ((scaled < 0) & (nearest > 0)).to(torch.long) << 3).to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], GROUP // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp.to(torch.int32) + 127).to(torch.uint8)


class LazyMxfp4:
    """A dequantized projection read as the loader reads a checkpoint tensor (engine.models.loader): its bf16 layout
    [experts, in, out] (the stored [experts, out, in] transposed); indexing reads only the experts and output rows
    asked for."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales
        experts, out, groups, _ = blocks.get_shape()
        self.shape = (experts, groups * GROUP, out)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "BF16"

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if index == (Ellipsis,):
            index = ()
        full = slice(None)
        experts, inner, out = (*index, full, full, full)[:3]
        if not all(isinstance(s, slice) for s in (experts, inner, out)):
            raise TypeError(f"MXFP4 tensors are read by slices, not {index!r}")
        w = dequantize(self.blocks[experts, out], self.scales[experts, out])  # [e, out rows, in]
        return w.transpose(1, 2)[:, inner]


def paired(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's (name, lazy tensor)s with every `<name>_blocks` / `<name>_scales` pair read as one `<name>`
    (LazyMxfp4), the rest as they are."""
    pending: dict[str, dict[str, Any]] = {}
    for name, lazy in tensors:
        suffix = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else None
        if suffix is None:
            yield name, lazy
            continue
        base = name[: -len(suffix)]
        pending.setdefault(base, {})[suffix] = lazy
        if len(pending[base]) == 2:
            parts = pending.pop(base)
            yield base, LazyMxfp4(parts[_BLOCKS], parts[_SCALES])
    if pending:
        raise ValueError(f"MXFP4 checkpoint: {', '.join(sorted(pending))} lack their "
                         f"{_BLOCKS} or {_SCALES} tensor")


_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_checkpoint(src: str, dst: str) -> str:
    """Our MXFP4 writer: the GPT-OSS checkpoint at `src` with every layer's experts' gate_up_proj and down_proj
    stored as GPT-OSS publishes them (module docstring), the rest as it is, config.json declaring mxfp4."""
    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(os.path.join(src, file), framework="pt") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if name.endswith(_EXPERTS):
                    out[name + _BLOCKS], out[name + _SCALES] = quantize(w.transpose(1, 2))
                else:
                    out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst


def dequantized_checkpoint(src: str, dst: str, dtype: torch.dtype = torch.float32) -> str:
    """The float twin of the MXFP4 checkpoint at `src` (its experts dequantized into the bf16 layout, in `dtype`),
    no quantization_config."""
    os.makedirs(dst, exist_ok=True)
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        tensors = [(name, f.get_slice(name)) for name in f.keys()]
        out = {name: (lazy[...].to(dtype).contiguous() if isinstance(lazy, LazyMxfp4) else lazy[:])
               for name, lazy in paired(iter(tensors))}
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst
