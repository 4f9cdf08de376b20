"""--enable-deterministic-inference (SGLang's flag): a request's tokens and logprobs do not depend on what else the
engine runs beside it: the other requests of its batches and their number, whether its prefix came from the radix
cache (or the host and L3 tiers, or a prefill worker) or was computed for it, how its prompt was chunked, or whether
its KV was recomputed from its tokens after a migration (a prefill of generated tokens gives the bits their decode
steps gave).

Where a row's bits come from. Everything a forward does is elementwise or reduces along one row (norms, softmax, the
sampler's), whose bits do not depend on the other rows, except three things:
- matrix products: the CPU's BLAS picks other kernels and blockings by the number of rows (torch 2.13 on x86: row 0 of
  `x[:m] @ W.T` has other bits for m = 1, 2-3 and 4+);
- the CPU's exp-based elementwise functions (below);
- attention over a batch: engine.attention.torch_native pads every request to the batch's longest context and runs one
  fused kernel over it, so a row's sums run over a length (and a tiling) the other requests set.
Under the flag, `row_products` (a torch function mode around each forward) runs every product a row at a time: one
torch.bmm over [rows, 1, k] with the weight broadcast, i.e. one single-row GEMM per row, the same call whatever the
row count (then the bias, added after), and the elementwise functions built on exp (sigmoid, tanh, SiLU, GELU, ...)
a row at a time too (their vectorized and scalar paths round differently, and which elements take which depends on
the tensor's size: `_TRANSCENDENTAL`); and the attention backend runs each query row over exactly the keys it sees
(TorchNativeBackend.rows_alone), so a prefill row and the decode step of the same position reduce over the same
keys in the same way. A sampled request without a sampling_seed draws as if seeded with --random-seed (plus its
index among the prompt's n; engine.Engine._make_req), since the engine's generator would hand it the draws of its batch
order. What costs: products a row at a time (~5x a batched GEMM's time at 64 rows on this VM's CPU)
and attention a row at a time in Python; meant for tests, evaluation and RL rollouts that need reproducible bits.

What runs only on the paths above: the CPU (the GPU's Triton, FlashInfer and cuBLAS kernels choose tiles and split
counts by batch; batch-invariant GPU kernels are not built) and attention on plain torch (multi-head latent attention
over its latent cache included, never in its expanded prefill form); draft trees are refused with the flag
(engine.config).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b) (broadcast as matmul does) with every output row from its own single-row product."""
    if b.dim() == 1:
        return row_matmul(a, b[:, None])[..., 0]
    if a.dim() == 1:
        return row_matmul(a[None], b)[..., 0, :]
    if b.dim() == 2:  # a weight: broadcast to every row without a copy (a stride-0 batch)
        k, n = b.shape
        rows = a.reshape(-1, 1, k)
        out = torch.bmm(rows, b.unsqueeze(0).expand(rows.shape[0], k, n))
        return out.reshape(*a.shape[:-1], n)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    left = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    right = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.stack([row_matmul(x, y) for x, y in zip(left, right)]) if left.shape[0] else \
        a.new_empty(0, a.shape[-2], b.shape[-1])
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = row_matmul(x, weight.t())
    return out if bias is None else out + bias


def _addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    prod = row_matmul(m1, m2)
    return (bias if beta == 1 else bias * beta) + (prod if alpha == 1 else prod * alpha)


def _row_by_row(fn):
    """`fn` (an elementwise function whose first argument is the tensor) applied to each row alone."""
    def rows(x, *args, **kwargs):
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] == 0:
            return fn(x, *args, **kwargs)
        inplace = bool(kwargs.pop("inplace", False))
        flat = x.reshape(-1, x.shape[-1])
        out = torch.stack([fn(row, *args, **kwargs) for row in flat]).reshape(x.shape)
        return x.copy_(out) if inplace else out
    return rows


def _refused(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} ran under --enable-deterministic-inference, whose row-at-a-time products and "
                           f"attention do not cover it: this path is not batch-invariant")
    return refuse


# Elementwise functions whose vectorized and scalar CPU implementations round differently (exp and what is built on
# it): TensorIterator runs a tensor's last (numel % vector) elements, and each thread's chunk's, through the scalar one,
# so which of a row's elements take which path depends on the other rows (DeepSeek-V3's sigmoid router over 8 experts:
# scalar alone, vectorized beside 11 other rows). Under the mode they run a row at a time.
_TRANSCENDENTAL = (torch.exp, torch.Tensor.exp, torch.sigmoid, torch.Tensor.sigmoid, torch.tanh, torch.Tensor.tanh,
                   torch.log, torch.Tensor.log, torch.erf, torch.Tensor.erf, torch.expm1, torch.log1p, F.silu, F.gelu,
                   torch.sin, torch.Tensor.sin, torch.cos, torch.Tensor.cos, F.softplus, F.mish, F.elu, F.selu,
                   F.logsigmoid)

_ROWS = {F.linear: _linear, torch.matmul: row_matmul, torch.Tensor.matmul: row_matmul,
         torch.Tensor.__matmul__: row_matmul, torch.mm: row_matmul, torch.Tensor.mm: row_matmul,
         torch.bmm: row_matmul, torch.Tensor.bmm: row_matmul, torch.addmm: _addmm, torch.Tensor.addmm: _addmm,
         torch.baddbmm: _addmm, torch.Tensor.baddbmm: _addmm,
         torch.Tensor.__rmatmul__: lambda b, a: row_matmul(a, b),
         **{f: _row_by_row(f) for f in _TRANSCENDENTAL},
         torch.einsum: _refused("torch.einsum"),
         F.scaled_dot_product_attention: _refused("scaled_dot_product_attention")}


class _RowProducts(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        rows = _ROWS.get(func)
        if rows is None:
            return func(*args, **kwargs)
        out = kwargs.pop("out", None)
        result = rows(*args, **kwargs)
        return result if out is None else out.copy_(result)


def row_products(on: bool):
    """A context under which every matrix product (F.linear, matmul and @, mm, bmm, addmm, baddbmm) computes each
    output row alone (`row_matmul`); einsum and fused attention raise. `on` False: a context that changes nothing."""
    return _RowProducts() if on else contextlib.nullcontext()
