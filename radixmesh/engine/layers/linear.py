"""Tensor-parallel linear layers and the vocabulary-parallel embedding and LM head (engine.distributed).

Column-parallel layers keep a slice of the output features (q/k/v heads, gate/up rows), row-parallel ones the
matching slice of the input features and all-reduce their partial sums; the embedding and the LM head keep a slice of
the vocabulary (padded to equal shares). With one rank every layer is the plain computation.

Each layer says which part of a checkpoint tensor it holds (`checkpoint_shards`): the loader reads only that part
(safetensors slices), so no rank ever holds a full copy of a sharded weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.forward_context import current_forward_context
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.quantization.fp8_linear import fp8_linear

# Up to this many rows (a decode batch), a CUDA product runs kernels.gemv, which starts streaming its weights while
# the kernel before it still runs, where the model runner chose it for this GPU and this weight's shape, with the
# tiles it chose (engine.decode_products); at one row, kernels.gemv.gemv_row where the plan chose that; F.linear
# (cuBLAS) otherwise.
SKINNY_ROWS = 8


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a checkpoint tensor goes: rows `dest` of the parameter (None: all of it; an int: that one row) take the
    checkpoint's elements `start .. start + length` along `dim` (dim None: the whole tensor)."""

    dest: slice | int | None = None
    dim: int | None = None
    start: int = 0
    length: int = 0


WHOLE = Shard()
ELSEWHERE = Shard(dim=-1)  # a checkpoint tensor another rank holds (an expert placed there): this rank reads nothing


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), as F.linear."""
    if (x.dim() == 2 and 0 < x.shape[0] <= SKINNY_ROWS and use_kernels(x) and x.dtype in _SKINNY_DTYPES
            and x.stride(1) == 1 and weight.is_contiguous()):
        from radixmesh.kernels.runtime import gemv_plan, row_plan

        shape = tuple(weight.shape)
        if x.shape[0] == 1 and (row := row_plan(x, shape)) is not None:
            from radixmesh.kernels.gemv import gemv_row

            return gemv_row(x, weight, bias, pdl=True, config=row)
        on, config = gemv_plan(x, shape)
        if on:  # eager too, so that a graph's products and eager ones round alike
            from radixmesh.kernels.gemv import gemv

            return gemv(x, weight, bias, pdl=True, config=config)
    return F.linear(x, weight, bias)


def product(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ module.weight^T (+ bias): `linear`, or engine.quantization.fp8_linear for a weight held in fp8 (the
    module's `fp8` says how; its `weight_scale` buffer holds the scales)."""
    if module.fp8 is None:
        return linear(x, module.weight, bias)
    return fp8_linear(x, module.weight, module.weight_scale, module.fp8, bias)


def lora_product(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`product` with the forward's LoRA adapters added (engine.lora.batch.LoraBatch; the product alone when the
    forward has none)."""
    ctx = current_forward_context()
    if ctx is None or ctx.lora is None:
        return product(module, x, bias)
    return ctx.lora.project(module.lora, x, lambda: product(module, x, bias))


_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _rows(dest: slice | None, start: int, length: int) -> Shard:
    return Shard(dest, 0, start, length)


class QKVParallelLinear(nn.Module):
    """The fused q/k/v projection of this rank's heads. KV heads are split like the query heads; with fewer KV heads
    than ranks each rank keeps the one KV head its query heads use (replicated on tp / num_kv_heads ranks)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 tp: TensorParallel):
        super().__init__()
        q_start, self.num_heads = tp.shard(num_heads, "the number of attention heads")
        if num_kv_heads >= tp.size:
            kv_start, self.num_kv_heads = tp.shard(num_kv_heads, "the number of KV heads")
        elif tp.size % num_kv_heads:
            raise ValueError(f"the tensor parallel size ({tp.size}) must be a multiple of the number of KV heads "
                             f"({num_kv_heads}) when it is larger")
        else:
            kv_start, self.num_kv_heads = tp.rank // (tp.size // num_kv_heads), 1
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_size, self.kv_size = q, kv
        self._shards = {"q": _rows(slice(0, q), q_start * head_dim, q),
                        "k": _rows(slice(q, q + kv), kv_start * head_dim, kv),
                        "v": _rows(slice(q + kv, q + 2 * kv), kv_start * head_dim, kv)}
        self.weight = nn.Parameter(torch.empty(q + 2 * kv, hidden))
        self.bias = nn.Parameter(torch.empty(q + 2 * kv)) if bias else None
        self.lora = None  # engine.lora.stacks.ModuleLora once LoRA is enabled (its adapters' device slots)
        self.fp8 = None  # engine.quantization.fp8_linear.Fp8Weights once the weight is held in fp8 (fp8_load)

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, Shard]]:
        return [(f"{name}_proj", shard) for name, shard in self._shards.items()]

    def lora_parts(self) -> dict[str, Shard]:
        """peft's name of each projection this layer fuses -> the rows of it this rank holds (where in the layer's
        output, and where in the whole projection): what of an adapter's B it keeps (engine.lora.stacks)."""
        return {f"{name}_proj": shard for name, shard in self._shards.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias) if self.lora is None else lora_product(self, x, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """gate and up projections fused, each cut to this rank's rows."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, names: tuple[str, str]):
        super().__init__()
        start, self.local = tp.shard(intermediate, "intermediate_size")
        self._shards = {names[0]: _rows(slice(0, self.local), start, self.local),
                        names[1]: _rows(slice(self.local, 2 * self.local), start, self.local)}
        self.weight = nn.Parameter(torch.empty(2 * self.local, hidden))
        self.lora = None
        self.fp8 = None

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, Shard]]:
        return list(self._shards.items())

    def lora_parts(self) -> dict[str, Shard]:
        return dict(self._shards)  # (the names are peft's: gate_proj, up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x) if self.lora is None else lora_product(self, x)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of the output features, and of the bias (Starcoder2's MLP c_fc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str):
        super().__init__()
        start, local = tp.shard(out_features, what)
        self._rows = _rows(None, start, local)
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None
        self.lora = None
        self.fp8 = None

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, self._rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self, x, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of the weight; the partial products are summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str):
        super().__init__()
        self.tp = tp
        start, local = tp.shard(in_features, what)
        self._weight = Shard(None, 1, start, local)
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = None
        self.fp8 = None

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, self._weight if leaf == "weight" else WHOLE)]

    def lora_parts(self) -> dict[str | None, Shard]:
        """The input columns this rank holds (dim 1): what of an adapter's A it keeps (engine.lora.stacks)."""
        return {None: self._weight}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return product(self, x, self.bias) if self.lora is None else lora_product(self, x, self.bias)
        # (an adapter's B (A x) is linear in x: each rank adds B times its columns' share of A x, and the all-reduce
        # sums the shares with the products')
        out = self.tp.all_reduce(product(self, x) if self.lora is None else lora_product(self, x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (equal shares; the last one padded with zero rows). Tokens outside the
    share embed to zeros, and the sum over the ranks is the embedding."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.held = max(0, min(vocab_size, self.start + self.per_rank) - self.start)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def checkpoint_shards(self, leaf: str) -> list[tuple[str | None, Shard]]:
        return [(None, _rows(slice(0, self.held), self.start, self.held))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head, sharded as the embedding is (see vocab_logits)."""


def vocab_logits(tp: TensorParallel, hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [n, vocab] from this rank's vocabulary share `weight` (the LM head's, or the embedding's when
    the model ties them) and of `bias` where the head has one (Phi), gathered from every rank: each takes part in the
    gather, the leader samples from it."""
    out = linear(hidden, weight, bias).float()
    if tp.size == 1:
        return out
    return tp.all_gather_last(out)[:, :vocab_size]


def zero_padding(module: nn.Module) -> None:
    """Zero the padded rows of vocabulary shards (they are never loaded): a padded row must add nothing."""
    for m in module.modules():
        if isinstance(m, VocabParallelEmbedding) and m.held < m.per_rank:
            m.weight.data[m.held:].zero_()
            if getattr(m, "bias", None) is not None:  # an LM head's bias (Phi's)
                m.bias.data[m.held:].zero_()
