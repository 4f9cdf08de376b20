"""The flashinfer and triton attention backends against TorchNativeBackend on CUDA in bfloat16: ragged decode batches (1, 7, 64
requests of 1..4096 tokens) and extend batches (with and without cached prefixes, 1..300 new tokens), GQA groups 1,
4 and 8, head dims 64 and 128, the pool in shuffled pages of 16; sliding windows and soft-capped scores; a decode
CUDA graph replayed with new lengths and padding rows (with and without a window); plans that never wait for the GPU;
float32 refused (FlashInfer has no float32 kernels). fp8 KV caches (e4m3 and e5m2, per-tensor scales of 0.5 and 2):
FlashInfer's bfloat16 queries over fp8 pages against torch_native over the same pages dequantized (FlashInfer's
prefill reads its new tokens back from the fp8 pool: the reference is given them rounded alike), and graphs over fp8
pages replay as they run eagerly.

The first run JIT-compiles FlashInfer's kernels with nvcc (cached under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer,
$HOME by default)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from radixmesh.engine.attention import create_backend
from radixmesh.engine.attention.base import AttentionShape
from radixmesh.engine.attention.torch_native import TorchNativeBackend
from radixmesh.engine.batch import ForwardBatch, ForwardMode
from radixmesh.engine.cache.kv_pool import KVPool, _meant, _stored
from radixmesh.engine.cache.req_to_token import ReqToTokenPool

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
PAGE = 16
LAYER = 1  # of 2: layer 0 holds other random values, so a wrong layer shows
TOL = 1e-2  # relative L2 error per request; two bfloat16 kernels differ by ~0.5%
HEADS = [pytest.param((8, 8), id="group1"), pytest.param((32, 8), id="group4"), pytest.param((32, 4), id="group8")]
HEAD_DIMS = [64, 128]
BACKENDS = ["flashinfer", "triton"]
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
SCALES = ((0.5, 0.5), (2.0, 2.0))  # per layer: k_scale, v_scale (powers of two: dequantized bfloat16 is exact)


class Setup(NamedTuple):
    shape: AttentionShape
    pool: KVPool
    table: ReqToTokenPool
    rows: list[int]  # table row of request i


def make_setup(max_lens: list[int], heads: tuple[int, int], head_dim: int, seed: int, dtype=DTYPE,
               attention: dict | None = None) -> Setup:
    """Random KV in every slot; request i owns max_lens[i] tokens on shuffled pages, in a shuffled table row.
    `attention`: more AttentionShape fields (windows, softcap). `dtype`: the pool's (an fp8 one with SCALES; the
    queries then bfloat16)."""
    torch.manual_seed(seed)
    pages_each = [-(-n // PAGE) for n in max_lens]
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    pool = KVPool(sum(pages_each) + 3, PAGE, 2, heads[1], head_dim, dtype, DEV, scales=SCALES if fp8 else None)
    for buf in pool.buffers():
        buf.copy_(torch.randn(buf.shape, device=DEV))
    table = ReqToTokenPool(len(max_lens) + 2, max(max_lens) + PAGE, DEV)
    order = torch.randperm(len(max_lens) + 2).tolist()
    pages = torch.randperm(pool.allocator.num_pages) + 1  # page 0 is the scratch page
    at = 0
    for row, n, count in zip(order, max_lens, pages_each):
        table.write(row, 0, (pages[at:at + count, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n])
        at += count
    shape = AttentionShape(heads[0], heads[1], head_dim, head_dim ** -0.5, **(attention or {}),
                           dtype=DTYPE if fp8 else dtype)
    return Setup(shape, pool, table, order[:len(max_lens)])


def make_batch(setup: Setup, prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode,
               rows: list[int] | None = None) -> ForwardBatch:
    rows = setup.rows[:len(extend_lens)] if rows is None else rows
    loc = torch.cat([setup.table.device[r, p:p + e].cpu() for r, p, e in zip(rows, prefix_lens, extend_lens)])
    pos = [i for p, e in zip(prefix_lens, extend_lens) for i in range(p, p + e)]
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    return ForwardBatch.build(mode, [0] * len(pos), pos, loc, rows, seq, extend_lens, DEV)


def decode_batch(setup: Setup, lens: list[int], rows: list[int] | None = None) -> ForwardBatch:
    return make_batch(setup, [n - 1 for n in lens], [1] * len(lens), ForwardMode.DECODE, rows)


def random_qkv(shape: AttentionShape, num_tokens: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(num_tokens, h, shape.head_dim, generator=gen, device=DEV, dtype=DTYPE)
            for h in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads)]


def attend(backend, batch: ForwardBatch, qkv) -> torch.Tensor:
    return backend.forward(LAYER, *qkv, batch, backend.plan(batch))


def assert_matches(got: torch.Tensor, want: torch.Tensor, counts: list[int], what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    errs = [((g.float() - w.float()).norm() / w.float().norm()).item()
            for g, w in zip(got.split(counts), want.split(counts))]
    bad = [(i, round(e, 4)) for i, e in enumerate(errs) if not e < TOL]  # `not <` also catches NaN
    assert not bad, f"{what}: relative error above {TOL} for (request, error) {bad[:8]} of {len(counts)} requests"


def compare_with_torch_native(name: str, setup: Setup, batch: ForwardBatch, what: str) -> None:
    qkv = random_qkv(setup.shape, batch.num_tokens, seed=1)
    got = attend(create_backend(name, setup.shape, setup.pool, setup.table), batch, qkv)
    want = attend(TorchNativeBackend(setup.shape, setup.pool, setup.table), batch, qkv)
    assert_matches(got, want, batch.extend_lens_host, what)


def ragged_lens(bs: int, seed: int) -> list[int]:
    lens = torch.randint(1, 4097, (bs,), generator=torch.Generator().manual_seed(seed)).tolist()
    lens[-1] = 4096
    if bs > 1:
        lens[0] = 1
    return lens


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("bs", [1, 7, 64])
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_matches_torch_native(name, bs, heads, head_dim):
    lens = ragged_lens(bs, seed=bs)
    setup = make_setup(lens, heads, head_dim, seed=bs)
    compare_with_torch_native(name, setup, decode_batch(setup, lens), f"decode lens {lens[:8]}...")


def mixed_extends(n: int = 16) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 3000, (n,), generator=gen) * (torch.arange(n) % 3 != 0)  # every third: no prefix
    return prefix.tolist(), torch.randint(1, 301, (n,), generator=gen).tolist()


EXTENDS = {  # (cached prefix lengths, new-token counts)
    "fresh": ([0, 0, 0, 0], [300, 1, 77, 256]),
    "cached": ([17, 1000, 4000, 5, 1], [1, 300, 57, 129, 2]),
    "mixed": mixed_extends(),
}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", list(EXTENDS))
@pytest.mark.parametrize("name", BACKENDS)
def test_extend_matches_torch_native(name, case, heads, head_dim):
    prefix, new = EXTENDS[case]
    setup = make_setup([p + e for p, e in zip(prefix, new)], heads, head_dim, seed=len(prefix))
    batch = make_batch(setup, prefix, new, ForwardMode.EXTEND)
    compare_with_torch_native(name, setup, batch, f"extend {case}: prefixes {prefix[:8]}, new {new[:8]}")


# LAYER is 1: (None, w) slides the layer attended, (w, None) another one (FlashInfer plans a wrapper per window)
WINDOWED = {"window300": dict(windows=(None, 300)), "window1": dict(windows=(None, 1)),
            "window256-softcap": dict(windows=(None, 256), softcap=2.0), "softcap": dict(softcap=2.0),
            "other-layer-slides": dict(windows=(64, None), softcap=2.0)}


@pytest.mark.parametrize("attention", list(WINDOWED))
@pytest.mark.parametrize("name", BACKENDS)
def test_windows_and_soft_caps_match_torch_native(name, attention):
    """Decode and extend (over cached prefixes longer than the window) with the layer's window and soft-cap."""
    lens = ragged_lens(7, seed=5)
    setup = make_setup(lens, (32, 8), 128, seed=5, attention=WINDOWED[attention])
    compare_with_torch_native(name, setup, decode_batch(setup, lens), f"{attention} decode lens {lens}")
    prefix, new = EXTENDS["cached"]
    setup = make_setup([p + e for p, e in zip(prefix, new)], (32, 4), 64, seed=6, attention=WINDOWED[attention])
    batch = make_batch(setup, prefix, new, ForwardMode.EXTEND)
    compare_with_torch_native(name, setup, batch, f"{attention} extend: prefixes {prefix}, new {new}")


@pytest.mark.parametrize("kv_dtype", [pytest.param(DTYPE, id="bf16"), FP8[0]])
@pytest.mark.parametrize("attention", [None, "window256-softcap", "other-layer-slides"])
@pytest.mark.parametrize("name", BACKENDS)
def test_cuda_graph_decode_replays_new_lengths(name, attention, kv_dtype):
    """Capture one decode forward for 8 requests, replay it for two other batches (longer lengths; then 6 requests
    plus 2 padding rows) and compare with eager runs of the same requests (bfloat16 pages and fp8 ones)."""
    bs = 8
    setup = make_setup([4096] * bs, (32, 8), 128, seed=3, attention=WINDOWED.get(attention), dtype=kv_dtype)
    backend = create_backend(name, setup.shape, setup.pool, setup.table)
    backend.init_cuda_graph(max_bs=16)
    static = decode_batch(setup, [1] * bs)
    q, k, v = (torch.zeros_like(t) for t in random_qkv(setup.shape, bs, seed=0))
    metadata = backend.capture_metadata(bs, static)
    backend.forward(LAYER, q, k, v, static, metadata)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(LAYER, q, k, v, static, metadata)

    pad = [setup.table.pad_row] * 2  # the all-zero device row: padding attends over and writes slot 0
    for step, (lens, rows) in enumerate([(ragged_lens(bs, seed=11), setup.rows),
                                         (ragged_lens(6, seed=12) + [1, 1], setup.rows[:6] + pad)]):
        batch = decode_batch(setup, lens, rows)
        qkv = random_qkv(setup.shape, bs, seed=20 + step)
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_lens"):
            getattr(static, name).copy_(getattr(batch, name))
        static.seq_lens_host, static.extend_lens_host = batch.seq_lens_host, batch.extend_lens_host
        for dst, src in zip((q, k, v), qkv):
            dst.copy_(src)
        backend.replay_metadata(bs, static, metadata)
        graph.replay()
        real = 8 if step == 0 else 6
        eager_batch = decode_batch(setup, lens[:real], rows[:real])
        eager = attend(backend, eager_batch, [t[:real] for t in qkv])
        assert_matches(out[:real], eager, [1] * real, f"replay {step} (lens {lens}) vs eager")


@pytest.mark.parametrize("kv_dtype", [pytest.param(DTYPE, id="bf16"), FP8[0]])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("name", BACKENDS)
def test_plan_never_waits_for_the_gpu(name, mode, kv_dtype):
    setup = make_setup([700, 33, 2000], (32, 8), 128, seed=4, dtype=kv_dtype)
    backend = create_backend(name, setup.shape, setup.pool, setup.table)
    if mode is ForwardMode.DECODE:
        batch = decode_batch(setup, [700, 33, 2000])
    else:
        batch = make_batch(setup, [0, 30, 1000], [700, 3, 1000], ForwardMode.EXTEND)
    backend.plan(batch)  # loads (or compiles) the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.plan(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_registered_and_float32_is_refused():
    setup = make_setup([8], (8, 8), 64, seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        create_backend("flashinfer", setup.shape, setup.pool, setup.table)


def test_flashinfer_refuses_a_head_size_its_kernels_lack():
    setup = make_setup([8], (4, 2), 32, seed=6)  # the tiny models' head size: FlashInfer's merge kernels lack it
    with pytest.raises(ValueError, match="head sizes .* not this model's 32"):
        create_backend("flashinfer", setup.shape, setup.pool, setup.table)


def dequantized(pool: KVPool) -> KVPool:
    """A bfloat16 pool holding an fp8 pool's values as it means them (times its scales)."""
    out = KVPool(pool.allocator.num_pages, PAGE, 2, pool.k[0].shape[1], pool.k[0].shape[2], DTYPE, DEV)
    slots = torch.arange(pool.num_slots, device=DEV)
    for layer in range(2):
        k, v = pool.read(layer, slots, DTYPE)
        out.k[layer].copy_(k)
        out.v[layer].copy_(v)
    return out


def compare_fp8_with_torch_native(setup: Setup, batch: ForwardBatch, what: str) -> None:
    """FlashInfer over setup's fp8 pool against torch_native over it dequantized, the new tokens' K and V given to
    the reference as the fp8 pool stores and means them."""
    pool = setup.pool
    q, k, v = random_qkv(setup.shape, batch.num_tokens, seed=1)
    reference = TorchNativeBackend(setup.shape, dequantized(pool), setup.table)
    rounded = [_meant(_stored(x, pool.k[LAYER].dtype, scale), DTYPE, scale)
               for x, scale in ((k, pool.k_scale[LAYER]), (v, pool.v_scale[LAYER]))]
    got = attend(create_backend("flashinfer", setup.shape, pool, setup.table), batch, (q, k, v))
    want = attend(reference, batch, (q, *rounded))
    assert_matches(got, want, batch.extend_lens_host, what)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
def test_flashinfer_reads_fp8_pages_as_torch_native_reads_them_dequantized(heads, head_dim, kv_dtype):
    pytest.importorskip("flashinfer")
    lens = ragged_lens(7, seed=8)
    setup = make_setup(lens, heads, head_dim, seed=8, dtype=kv_dtype)
    compare_fp8_with_torch_native(setup, decode_batch(setup, lens), f"fp8 decode lens {lens}")
    for case in ("cached", "mixed"):
        prefix, new = EXTENDS[case]
        setup = make_setup([p + e for p, e in zip(prefix, new)], heads, head_dim, seed=9, dtype=kv_dtype)
        batch = make_batch(setup, prefix, new, ForwardMode.EXTEND)
        compare_fp8_with_torch_native(setup, batch, f"fp8 extend {case}: prefixes {prefix[:8]}, new {new[:8]}")


@pytest.mark.parametrize("attention", ["window256-softcap", "other-layer-slides"])
def test_flashinfer_fp8_pages_with_windows_and_soft_caps(attention):
    pytest.importorskip("flashinfer")
    lens = ragged_lens(7, seed=5)
    setup = make_setup(lens, (32, 8), 128, seed=5, dtype=torch.float8_e4m3fn, attention=WINDOWED[attention])
    compare_fp8_with_torch_native(setup, decode_batch(setup, lens), f"fp8 {attention} decode lens {lens}")
    prefix, new = EXTENDS["cached"]
    setup = make_setup([p + e for p, e in zip(prefix, new)], (32, 4), 64, seed=6, dtype=torch.float8_e4m3fn,
                       attention=WINDOWED[attention])
    batch = make_batch(setup, prefix, new, ForwardMode.EXTEND)
    compare_fp8_with_torch_native(setup, batch, f"fp8 {attention} extend: prefixes {prefix}, new {new}")


def tree_batch(setup: Setup, prefixes: list[int], parents: list[int]) -> ForwardBatch:
    """A draft tree's verify rows (one per node of `parents`' tree and the root) for each request, over its prefix,
    with the tree's mask and key counts as engine.scheduler.batch_builder.build_tree_verify makes them."""
    from radixmesh.engine.speculative.tree import as_signed, depths, seen_bits, tree_row_keys

    bits = seen_bits(parents)
    n = len(bits)
    rows, locs, pos, lens, starts, seen = [], [], [], [], [], []
    for row, p in zip(setup.rows, prefixes):
        rows += [row] * n
        locs.append(setup.table.device[row, p:p + n].cpu())
        pos += [p + d for d in depths(parents)]
        lens += [p + j + 1 for j in range(n)]
        starts += [p] * n
        seen += [as_signed(b) for b in bits]
    batch = ForwardBatch.build(ForwardMode.DECODE, [0] * len(pos), pos, torch.cat(locs), rows, lens, [1] * len(pos),
                               DEV)
    batch.tree_mask = torch.tensor([starts, seen], dtype=torch.int64, device=DEV)
    batch.tree_keys_host = [tree_row_keys(s, b, m) for s, b, m in zip(starts, seen, lens)]
    return batch


@pytest.mark.parametrize("parents", [[0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 1, 1, 2, 5, 5, 7], list(range(63))])
def test_flashinfer_decodes_a_draft_tree_through_its_page_lists(parents):
    """FlashInfer's decode kernel over each tree row's page list (the keys it sees, no mask) against torch_native's
    tree mask, requests with prefixes of 0 to 3000 keys."""
    pytest.importorskip("flashinfer")
    prefixes = [0, 17, 3000, 400]
    setup = make_setup([p + len(parents) + 1 for p in prefixes], (32, 8), 128, seed=12)
    batch = tree_batch(setup, prefixes, parents)
    compare_with_torch_native("flashinfer", setup, batch, f"tree {parents[:12]}, prefixes {prefixes}")
