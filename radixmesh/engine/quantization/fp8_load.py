"""fp8 weights held as fp8 (with --fp8-gemm-backend auto on a CUDA GPU of compute capability 8.9 or later, or
triton): which linear layers and experts keep their weights in float8_e4m3fn with their scales, and how the loader
fills them.

A layer is held so when it is one of the tensor-parallel projections (engine.layers.linear: QKV, merged gate/up,
column- and row-parallel; not one marked `keep_float`, as DeepSeek's kv_b_proj, whose blocks the model multiplies
itself) and every checkpoint tensor it reads is fp8 (a pre-quantized checkpoint; a layer the checkpoint left
unquantized stays as it is), or under `--quantization fp8` for an unquantized checkpoint (rounded here with a scale
per output row, as engine.quantization.fp8.quantized_online does). A mixture of experts' layer (engine.layers.moe)
is held the same way, its stacked `w13` and `w2` together (every expert's gate, up and down tensors fp8), and runs
kernels.moe_fp8's grouped GEMMs (scales [experts, N] or [experts, ceil(N/bn), ceil(K/bk)]). Other weights
(embedding, head, routers, a shared expert's gate) are dequantized as before.

Scales follow their weights' rows: per-tensor scales become one per output row (a fused QKV's q, k and v each keep
their own; each expert its own), per-channel ones are cut with their rows. Block scales [ceil(N/bn), ceil(K/bk)] are
cut by block rows and columns, which needs every part of a fused layer (an expert's up rows follow its gate rows in
w13) and every tensor-parallel cut (of an expert's intermediate rows, too) to start on a block boundary: a cut inside
a block is refused with the reason (the dequantized path, --fp8-gemm-backend's CPU default, serves it; experts cut
whole by --ep-size need no cut). Blocks the kernels do not take (not powers of two, or narrower than 32 columns)
leave the weights dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from radixmesh.engine.quantization.fp8 import FP8, Fp8Scheme, quantize
from radixmesh.engine.quantization.fp8_linear import Fp8Weights, scaled_mm_fits

FP8_GEMM_BACKENDS = ("auto", "triton")  # SGLang's --fp8-gemm-backend values we run


# `auto` holds fp8 weights in fp8 on GPUs with fp8 conversions (sm89+). Measured on an H100 (2026-12-05, the 8B
# shape; benchmarks/results/NOTES.md): per-channel fp8 held in fp8 is faster than its dequantized twin at every batch
# (3.64 against 5.56 ms at batch 1, 14.5 against 15.9 at 256) and in prefill; block-wise is faster up to batch 8 and
# slower from 64 on (18.5 against 15.9 ms at 256, prefill 266 against 238 ms), and holds half the weight memory
# either way, which is why fp8 checkpoints are published. The GPU tests pass (the activation quantization's last
# failure was the sign of a zero, fixed). False: `auto` keeps the dequantized path (outputs exact, memory and speed
# not) wherever `triton` is not asked for.
AUTO_HOLDS_FP8 = True


def kernels_wanted(backend: str, device: torch.device) -> bool:
    """Whether fp8 weights stay fp8 on `device`: `triton` always (the config allows it on CPU only in Triton's
    interpreter), `auto` on CUDA GPUs with fp8 conversions (sm89+: Ada, Hopper, Blackwell) while AUTO_HOLDS_FP8."""
    if backend == "triton":
        return True
    return AUTO_HOLDS_FP8 and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _servable_block(block: tuple[int, int] | None) -> bool:
    """Block shapes the kernels take: powers of two, bk at least 32 (fp8 MMA's K)."""
    return block is None or (block[0] & (block[0] - 1) == 0 and block[1] & (block[1] - 1) == 0 and block[1] >= 32)


def _held_parts(module: nn.Module) -> list[nn.Module]:
    """The modules whose weights hold_fp8 keeps in fp8 together: a projection alone (not one whose weight the model
    reads other than through its forward: `keep_float`), a layer's experts' stacked `w13` and `w2` both
    (kernels.moe_fp8 takes both in fp8; not experts whose biases or activation it does not compute: `holds_fp8`);
    [] for any other module."""
    from radixmesh.engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                                RowParallelLinear)
    from radixmesh.engine.layers.moe import FusedMoE

    if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear)):
        return [] if getattr(module, "keep_float", False) else [module]
    return [module.w13, module.w2] if isinstance(module, FusedMoE) and module.holds_fp8 else []


def hold_fp8(model: nn.Module, names_of: dict[int, list[str]], dtypes: dict[str, str] | None,
             scheme: Fp8Scheme | None, device: torch.device) -> int:
    """Give every projection, and every layer's stacked experts, whose checkpoint tensors are all fp8 (`dtypes`:
    name -> safetensors dtype; None: dummy weights, all of them) an fp8 `weight` and a `weight_scale` buffer (on the
    model's device, meta while it is built); `names_of`: id(weight) -> its checkpoint names. Returns the number of
    weights held so."""
    block = scheme.block if scheme is not None else None
    if not _servable_block(block):
        return 0
    held = 0
    for module in model.modules():
        parts = _held_parts(module)
        if not parts or (dtypes is not None and not all(_all_fp8(names_of.get(id(p.weight), []), dtypes)
                                                         for p in parts)):
            continue
        for part in parts:
            _hold(part, block, device)
        held += len(parts)
    return held


def _all_fp8(names: list[str], dtypes: dict[str, str]) -> bool:
    return bool(names) and all(_dtype(dtypes, n) in ("F8_E4M3", "online") for n in names)


def _hold(module: nn.Module, block: tuple[int, int] | None, device: torch.device) -> None:
    """`module.weight` [..., N, K] (stacked experts lead with their index) made fp8, its scales [..., N] or
    [..., ceil(N/bn), ceil(K/bk)] added."""
    *lead, n, k = module.weight.shape
    where = module.weight.device
    module.weight = nn.Parameter(torch.empty((*lead, n, k), dtype=FP8, device=where), requires_grad=False)
    shape = (*lead, n) if block is None else (*lead, -(-n // block[0]), -(-k // block[1]))
    module.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32, device=where))
    module.fp8 = Fp8Weights(block, not lead and scaled_mm_fits(device, n, k))


def _dtype(dtypes: dict[str, str], name: str) -> str | None:
    return dtypes.get(name, dtypes.get(name.removeprefix("model.")))


def _place(shard) -> tuple[tuple, slice]:
    """Where a checkpoint part goes (a Shard's `dest`): (the leading index of the held weight and scales, an
    expert's in stacked experts, () for a projection; the rows it fills in that weight, all of them for None)."""
    dest = shard.dest if isinstance(shard.dest, tuple) else () if shard.dest is None else (shard.dest,)
    if dest and isinstance(dest[-1], slice):
        return dest[:-1], dest[-1]
    return dest, slice(0, None)


def _block_cut(scale: torch.Tensor, shard, full: tuple[int, int], block: tuple[int, int], name: str,
               experts: bool = False) -> torch.Tensor:
    """The block scales of the part `shard` cuts from a weight of shape `full`; ValueError for a cut inside a
    block (`experts`: the weight is an expert's, which expert parallelism would keep whole)."""
    if shard.dim is None:
        return scale
    size = block[shard.dim]
    end = shard.start + shard.length
    if shard.start % size or (shard.length % size and end != full[shard.dim]):
        what = "rows" if shard.dim == 0 else "columns"
        raise ValueError(f"{name}: this rank's {what} {shard.start}..{end} of {full[shard.dim]} cut a block of "
                         f"{size} {what} of the block-wise fp8 scales {tuple(block)}: the tensor parallel size "
                         "must split the weight on block boundaries (or run --fp8-gemm-backend auto on CPU, which "
                         "holds the weights dequantized" + ("; --ep-size keeps each expert whole)" if experts else ")"))
    return scale.narrow(shard.dim, shard.start // size, -(-end // size) - shard.start // size)


def fill(module: nn.Module, name: str, lazy, shard, scheme: Fp8Scheme | None, scales: dict, read) -> None:
    """Copy checkpoint tensor `name` (fp8 with its scales in `scales`, or unquantized under --quantization fp8) into
    the fp8-held `module`: its part `shard` (read(lazy, shard) reads a part from the file) into the weight's rows,
    and the matching scales into `weight_scale`."""
    block = module.fp8.block
    full = tuple(lazy.get_shape())
    lead, rows = _place(shard)
    weight, scales_held = module.weight.data[lead], module.weight_scale[lead]  # views: this expert's, or all
    if lazy.get_dtype() == "F8_E4M3":
        scale = scales.get(name, {}).get(scheme.scale_name)
        if scale is None:
            raise ValueError(f"fp8 tensor {name!r} has no {scheme.scale_name} beside it in the checkpoint")
        q = read(lazy, shard)
    else:  # --quantization fp8: rounded whole (a row's scale is its amax over all its columns), then cut
        whole, scale = quantize(lazy[:])
        q = whole if shard.dim is None else whole.narrow(shard.dim, shard.start, shard.length)
    weight[rows].copy_(q)
    scale = scale.to(torch.float32)
    if block is None:
        per_row = scale.reshape(-1).expand(full[0]) if scale.numel() == 1 else scale.reshape(full[0])
        if shard.dim == 0:
            per_row = per_row.narrow(0, shard.start, shard.length)
        scales_held[rows].copy_(per_row)
        return
    first = rows.start or 0
    if first % block[0]:
        raise ValueError(f"{name} fills rows from {first} of its fused layer, inside a block of {block[0]} rows of "
                         f"the block-wise fp8 scales {tuple(block)}: its block scales cannot be kept (run on CPU's "
                         "dequantized path)")
    cut = _block_cut(scale, shard, full, block, name, experts=bool(lead))
    scales_held[first // block[0]: first // block[0] + cut.shape[0]].copy_(cut)


def init_dummy(model: nn.Module, generator: torch.Generator) -> None:
    """Random fp8 weights for benchmarks (--load-format dummy): codes spread over e4m3's range, scales making the
    weights about as large as the dummy 16-bit ones (|w| <= 0.02)."""
    for module in model.modules():
        if getattr(module, "fp8", None) is None:
            continue
        w = module.weight
        w.data.copy_(torch.empty(w.shape, device=w.device).uniform_(-448, 448, generator=generator).to(FP8))
        module.weight_scale.fill_(0.02 / 448)
