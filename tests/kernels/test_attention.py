"""The Triton attention kernels against their plain-torch twins: paged decode (GQA, split-KV, any page size, long
contexts) and extend over a cached prefix (ragged, causal). On CPU they run in Triton's interpreter with small
shapes; on CUDA (`make test-gpu`) with the Llama-3.1-8B head layout."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from radixmesh.kernels.decode_attention import decode_attention, decode_attention_reference, num_kv_splits
from radixmesh.kernels.extend_attention import extend_attention, extend_attention_reference
from radixmesh.kernels.online_softmax import tanh

CUDA = torch.cuda.is_available()
# Small shapes run wherever the suite runs: compiled on a GPU, in Triton's interpreter on CPU. The real shapes below
# are GPU-only.
DEVICES = [pytest.param("cuda" if CUDA else "cpu", id="small")]
# Cases about something other than the head layout (pages, dtypes, splits, windows, caps, an fp8 cache) take 4 query
# heads on 2 KV heads: a group of 2 in the same 16-row head tile as any group up to 16 (the GQA tests cover the
# ratios), and the interpreter runs a program per query head (extend, the decode merge) in turn.


class Pool:
    """A token-addressed KV pool whose requests own randomly placed pages of `page` slots, like the engine's."""

    def __init__(self, lens: list[int], kv_heads: int, head_dim: int, page: int, dtype, device, seed: int):
        gen = torch.Generator().manual_seed(seed)
        pages_each = [-(-n // page) for n in lens]
        total = sum(pages_each) + 3  # a few pages nobody owns
        perm = torch.randperm(total, generator=gen)
        self.req_to_token = torch.zeros((len(lens) + 2, max(lens) + page), dtype=torch.int64)
        self.rows = torch.randperm(len(lens) + 2, generator=gen)[:len(lens)]
        at = 0
        for i, (n, np_) in enumerate(zip(lens, pages_each)):
            pages = perm[at:at + np_]
            at += np_
            slots = (pages[:, None] * page + torch.arange(page)).reshape(-1)[:n]
            self.req_to_token[self.rows[i], :n] = slots
        shape = (total * page, kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.v = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.req_to_token = self.req_to_token.to(device)
        self.rows = self.rows.to(device)


def _tolerance(dtype) -> float:
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert not out.isnan().any(), "an output element was never written"
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < _tolerance(dtype), f"relative error {err:.2e}"


def _decode_case(lens, heads, kv_heads, head_dim, page, dtype, device, splits=None, seed=0, kv_dtype=None,
                 window=None, softcap=None, q_gain=1.0, sinks=None):
    """Checks the kernel against its twin; returns (its output, what was needed to run it again). `kv_dtype`: the
    pool's, when it is not the model's (an fp8 cache); `q_gain` scales the queries (larger scores)."""
    pool = Pool(lens, kv_heads, head_dim, page, dtype, device, seed)
    if kv_dtype is not None:
        pool.k, pool.v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    q = (q_gain * torch.randn((len(lens), heads, head_dim), generator=gen)).to(dtype).to(device)
    seq_lens = torch.tensor(lens, device=device)
    splits = splits or num_kv_splits(len(lens), kv_heads, torch.device(device))
    out = torch.full_like(q, float("nan"))
    args = (q, pool.k, pool.v, pool.req_to_token, pool.rows, seq_lens, head_dim ** -0.5, splits)
    decode_attention(*args, out=out, window=window, softcap=softcap,
                     sinks=sinks.to(device) if sinks is not None else None)
    ref = decode_attention_reference(q.cpu(), pool.k.cpu(), pool.v.cpu(), pool.req_to_token.cpu(), pool.rows.cpu(),
                                     seq_lens.cpu(), head_dim ** -0.5, window=window, softcap=softcap, sinks=sinks)
    _check(out.cpu(), ref, dtype)
    return out, args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2), (16, 2), (3, 1), (7, 7), (12, 3)])
def test_decode_gqa_ratios(device, heads, kv_heads):
    _decode_case([1, 5, 37, 100], heads, kv_heads, 32, 16, torch.float32, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page,dtype,splits", [(1, torch.float32, 1), (16, torch.bfloat16, 3), (64, torch.float16, 8),
                                               (64, torch.float32, 3), (1, torch.bfloat16, 8), (16, torch.float16, 1)])
def test_decode_pages_dtypes_splits(device, page, dtype, splits):
    _decode_case([1, 17, 64, 129, 200], 4, 2, 48, page, dtype, device, splits=splits, seed=page + splits)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_context_split_kv(device):
    """One request of 32k tokens, split across many programs; a short request rides along."""
    heads, kv_heads, head_dim = (32, 8, 128) if device == "cuda" else (4, 1, 16)
    _decode_case([32768, 3], heads, kv_heads, head_dim, 16, torch.bfloat16, device, splits=16, seed=7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens,heads,kv_heads,splits,dtype", [
    ([1, 17, 64, 129, 200], 4, 2, 3, torch.float32),  # splits left empty by the short requests
    ([300, 2], 12, 3, 8, torch.bfloat16),
    # more live splits (1100 keys in 64-key splits: 18) than the merge reads at a time (MERGE_CHUNK, 16), and empty
    # ones (24 - 18): the fewest keys that do so, as the interpreter walks every 64-key block
    ([1100, 5], 4, 1, 24, torch.float32),
])
def test_decode_reads_no_split_the_length_leaves_empty(device, lens, heads, kv_heads, splits, dtype):
    """An empty split's program writes nothing and the merge reads only the splits the lengths fill, so scratch left
    full of NaN (as a CUDA graph's fixed scratch holds whatever an earlier, longer batch wrote) changes nothing; the
    merge walks more live splits than its chunk in several chunks."""
    from radixmesh.kernels.decode_attention import partial_buffers

    want, args = _decode_case(lens, heads, kv_heads, 32, 16, dtype, device, splits=splits, seed=splits)
    partials = partial_buffers(len(lens), heads, splits, 32, torch.device(device))
    for buf in partials:
        buf.fill_(float("nan"))
    for _ in range(2):  # the same scratch twice, as graph replays use it
        again = torch.full_like(want, float("nan"))
        decode_attention(*args, out=again, partials=partials)
        assert torch.equal(again, want)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,ctx", [(1, 512), (64, 2048), (256, 1024)])
def test_decode_llama8b_shape_cuda(bs, ctx):
    lens = torch.randint(1, ctx + 1, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
    _decode_case(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=bs)


def _extend_case(prefixes, extends, heads, kv_heads, head_dim, page, dtype, device, seed=0, tiles=None,
                 kv_dtype=None, window=None, softcap=None, q_gain=1.0, sinks=None):
    lens = [p + e for p, e in zip(prefixes, extends)]
    pool = Pool(lens, kv_heads, head_dim, page, dtype, device, seed)
    if kv_dtype is not None:
        pool.k, pool.v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    n = sum(extends)
    q = (q_gain * torch.randn((n, heads, head_dim), generator=gen)).to(dtype).to(device)
    k_new = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    v_new = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    ext = torch.tensor(extends, device=device)
    args = (q, k_new, v_new, pool.k, pool.v, pool.req_to_token, pool.rows, torch.tensor(prefixes, device=device),
            ext, ext.cumsum(0) - ext)
    out = torch.full_like(q, float("nan"))
    extend_attention(*args, max(extends), head_dim ** -0.5, out=out, tiles=tiles, window=window, softcap=softcap,
                     sinks=sinks.to(device) if sinks is not None else None)
    ref = extend_attention_reference(*(a.cpu() for a in args), head_dim ** -0.5, window=window, softcap=softcap,
                                     sinks=sinks)
    _check(out.cpu(), ref, dtype)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1), (3, 1), (12, 3)])
def test_extend_gqa_ragged(device, heads, kv_heads):
    _extend_case([0, 10, 33, 0], [7, 1, 40, 19], heads, kv_heads, 32, 16, torch.float32, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page,dtype", [(1, torch.float32), (16, torch.bfloat16), (64, torch.float16),
                                        (64, torch.bfloat16)])
def test_extend_pages_dtypes(device, page, dtype):
    _extend_case([70, 0, 5], [23, 50, 1], 4, 2, 48, page, dtype, device, seed=page)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_empty_prefix_single_request(device):
    _extend_case([0], [45], 2, 1, 64, 1, torch.bfloat16, device, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("prefixes,extends", [([0], [8192]), ([4096, 0, 100], [512, 1000, 3]),
                                              ([0] * 8, [1024] * 8)])
def test_extend_llama8b_shape_cuda(prefixes, extends):
    _extend_case(prefixes, extends, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=len(extends))


def test_extend_tiles_from_the_environment(monkeypatch):
    """RADIXMESH_EXTEND_TILES (benchmarks.extend_tiles' choice) is BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES; anything
    else is refused with the expected form."""
    from radixmesh.kernels import extend_attention as ea

    monkeypatch.setenv(ea.TILES_ENV, "64,128,8,3")
    assert ea._tiles_from_env() == (64, 128, 8, 3)
    monkeypatch.delenv(ea.TILES_ENV)
    assert ea._tiles_from_env() is None
    for bad in ("64,128,8", "a,b,c,d", "64,0,8,3"):
        monkeypatch.setenv(ea.TILES_ENV, bad)
        with pytest.raises(ValueError, match="BLOCK_M,BLOCK_N,NUM_WARPS,NUM_STAGES"):
            ea._tiles_from_env()


@pytest.mark.parametrize("device", DEVICES)
def test_extend_with_tiles_given(device):
    """The same extend with tiles passed explicitly (the sweep's path) equals the reference."""
    _extend_case([40, 0], [24, 9], 4, 2, 16, 4, torch.float32, device, seed=5, tiles=(16, 32, 4, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_an_fp8_cache_is_read_back_in_the_models_dtype(device, kv_dtype, dtype):
    """--kv-cache-dtype fp8_*: decode and the prefix part of extend read fp8 keys and values and attend in the
    model's dtype, as their twins do with the same fp8 values."""
    _decode_case([5, 40, 17], 4, 2, 64, 16, dtype, device, kv_dtype=kv_dtype)
    _extend_case([0, 30, 9], [12, 5, 20], 4, 2, 64, 16, dtype, device, kv_dtype=kv_dtype)


# ---- sliding windows and soft-capping (Gemma 2/3, Mistral, Qwen2 windows) ------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,splits", [(1, 1), (8, 3), (16, 1), (64, 8), (37, 2), (500, 3)])
def test_decode_sliding_window(device, window, splits):
    """The query at position seq_len - 1 sees the last `window` keys (all of them when the request is shorter); the
    splits cover only those, short requests leaving splits empty."""
    _decode_case([1, 5, 37, 100, 130], 4, 2, 32, 16, torch.float32, device, splits=splits, seed=window, window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,page,dtype", [(1, 1, torch.float32), (5, 4, torch.float32), (16, 16, torch.float32),
                                               (17, 1, torch.bfloat16), (40, 16, torch.float32),
                                               (300, 4, torch.float32)])
def test_extend_sliding_window(device, window, page, dtype):
    """Windows that end inside the cached prefix, inside the new tokens and across tile edges (16-row tiles in the
    interpreter), with requests that have no prefix, a short one, and a prefix longer than the window."""
    _extend_case([0, 10, 33, 0, 70], [7, 1, 40, 19, 33], 4, 2, 32, page, dtype, device, seed=window, window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 12])
def test_soft_capped_scores(device, window):
    """Scores soft-capped at 5 (queries scaled up so most scores pass the cap) in decode and extend, alone and under
    a window."""
    _decode_case([1, 17, 64, 129], 4, 2, 32, 16, torch.float32, device, splits=3, seed=3, window=window, softcap=5.0,
                 q_gain=6.0)
    _extend_case([0, 30, 9], [12, 5, 20], 4, 2, 32, 16, torch.float32, device, seed=4, window=window, softcap=5.0,
                 q_gain=6.0)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_cap_changes_the_output(device):
    """The cap is applied at all: with it the kernel differs from the uncapped twin."""
    _, args = _decode_case([40, 9], 4, 2, 32, 16, torch.float32, device, splits=1, softcap=2.0, q_gain=6.0)
    capped = decode_attention(*args, softcap=2.0)
    plain = decode_attention_reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args[:7]))
    assert (capped.cpu() - plain).abs().max() > 1e-2


# ---- attention sinks (GPT-OSS) ----------------------------------------------------------------------------------

SINKS = torch.tensor([0.5, -1.0, 3.0, 8.0])  # per query head: one near the scores, one far above them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,splits,dtype", [(None, 1, torch.float32), (None, 3, torch.float32),
                                                 (12, 2, torch.float32), (None, 8, torch.bfloat16)])
def test_sinks_join_the_softmax(device, window, splits, dtype):
    """Each head's sink is one more logit of its softmax that weighs no value: decode with one split (stage 1
    normalizes) and several (the merge does), extend over cached prefixes, alone and under a window; requests of one
    token and splits the length leaves empty included."""
    _decode_case([1, 17, 64, 129], 4, 2, 32, 16, dtype, device, splits=splits, seed=5, window=window, sinks=SINKS)
    _extend_case([0, 30, 9], [12, 5, 20], 4, 2, 32, 16, dtype, device, seed=6, window=window, sinks=SINKS)


@pytest.mark.parametrize("device", DEVICES)
def test_sinks_change_the_output(device):
    """The sink is applied at all: a large one shrinks the output toward zero, against the kernel without it."""
    with_sink, args = _decode_case([40, 9], 4, 2, 32, 16, torch.float32, device, splits=2, sinks=SINKS)
    plain = decode_attention(*args)
    ratio = with_sink.cpu().norm(dim=-1) / plain.cpu().norm(dim=-1)
    assert (ratio[:, 3] < 0.05).all() and (ratio[:, 0] < 1).all()


@triton.jit
def _tanh_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tanh(tl.load(X + i)))


def test_kernel_tanh_matches_torch():
    """online_softmax.tanh (exp2 based, with a series near 0) within a few float32 ulp of torch.tanh."""
    device = "cuda" if CUDA else "cpu"
    x = torch.cat([torch.linspace(-12, 12, 900), torch.logspace(-8, 0, 24), -torch.logspace(-8, 0, 24)])
    x = torch.cat([x, torch.zeros(1024 - x.numel())]).to(device)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=1024)
    want = x.double().tanh()
    assert ((y.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()
