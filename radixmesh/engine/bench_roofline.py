"""The GPU's two ceilings, measured in the run that reports against them, and the work a forward must do.

Bandwidth counts bytes read plus bytes written by a large device-to-device copy; the matmul rate is a large bf16
product on random data (never zeros: they run faster than real data), and for models holding fp8 weights the fp8
product's rate too (row-wise scales, as their prefill runs it).
"""

from __future__ import annotations

import torch

from radixmesh.engine.model_config import ModelConfig


def _time_ms(fn, iters: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / iters


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters, device)
    return 2 * nbytes / (ms / 1e3)


def measure_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """bf16 n x n x n matrix product rate in TFLOP/s (cuBLAS through torch), on random inputs."""
    a = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    out = torch.empty((n, n), dtype=torch.bfloat16, device=device)
    ms = _time_ms(lambda: torch.matmul(a, b, out=out), iters, device)
    return 2 * n ** 3 / (ms / 1e3) / 1e12


def measure_fp8_matmul_tflops(device: torch.device, n: int = 8192, iters: int = 20) -> float | None:
    """fp8 (e4m3) n x n x n product rate in TFLOP/s, bf16 out, with row-wise scales as the fp8 prefill of per-channel
    weights runs it (torch._scaled_mm, cuBLAS/CUTLASS), on random codes; None where the GPU has no fp8 product
    (compute capability below 8.9) or torch lacks it."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = (torch.randn((n, n), device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn((n, n), device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).t()  # column-major
    scale_a = torch.rand((n, 1), device=device) + 0.5
    scale_b = torch.rand((1, n), device=device) + 0.5
    try:
        ms = _time_ms(lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16),
                      iters, device)
    except (RuntimeError, NotImplementedError):  # no row-wise fp8 product in this build
        return None
    return 2 * n ** 3 / (ms / 1e3) / 1e12


def holds_fp8(model: torch.nn.Module) -> bool:
    """Whether any of the model's weights is held in fp8 (engine.quantization.fp8_load)."""
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in model.parameters())


def moe_blocks(model) -> list:
    """The model's mixture-of-experts blocks (engine.models.moe.SparseMoeBlock), in layer order (none if dense)."""
    from radixmesh.engine.models.moe import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _experts(model) -> list[tuple[int, int, int, int]]:
    """(bytes of one expert's weights, elements of one expert's weights, experts a token takes, experts held) per
    mixture-of-experts layer of the model (none for a dense one)."""
    out = []
    for block in moe_blocks(model):
        w13, w2 = block.experts.w13, block.experts.w2
        if getattr(w13, "mxfp4", False):  # codes (two weights a byte) and scales (one a 32)
            nbytes = sum(t[0].numel() for t in (w13.q, w13.s, w2.q, w2.s))
            out.append((nbytes, 2 * (w13.q[0].numel() + w2.q[0].numel()), block.top_k, w13.q.shape[0]))
            continue
        stacked = (w13.weight, w2.weight)
        per = sum(w[0].numel() for w in stacked)
        out.append((per * stacked[0].element_size(), per, block.top_k, stacked[0].shape[0]))
    return out


def decode_weight_bytes(runner, experts_read: list[float] | None = None) -> int:
    """Bytes of weights one decode step must read: every parameter except the embedding table (only a few rows are
    gathered), plus the lm_head (the embedding again when tied); of a mixture of experts' layers, the router, any
    shared expert and the experts the step's tokens take: `experts_read` per sparse layer (what a step of a batch
    reads is the union of its tokens' top-k; engine.bench_one_batch counts it), by default one token's top-k."""
    model = runner.model
    layers = _experts(model)
    read = experts_read if experts_read is not None else [min(top_k, held) for _, _, top_k, held in layers]
    if len(read) != len(layers):
        raise ValueError(f"experts_read names {len(read)} sparse layers; the model has {len(layers)}")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total -= sum(nbytes * (held - n) for (nbytes, _, _, held), n in zip(layers, read))
    emb = model.model.embed_tokens.weight
    emb_bytes = emb.numel() * emb.element_size()
    return round(total if model.lm_head is None else total - emb_bytes)


def linear_flops(runner, tokens: int) -> int:
    """Multiply-adds (x2) of every weight matrix over `tokens` tokens, except the embedding gather; the lm_head runs
    on the last token only, as the engine computes it; each token runs its top-k experts of a MoE layer."""
    model = runner.model
    lm_head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    body = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
               and "lm_head" not in n)
    experts = sum(elements * top_k for _, elements, top_k, _ in _experts(model))
    return 2 * (body + experts) * tokens + 2 * lm_head.numel()


def attention_flops(cfg: ModelConfig, tokens: int) -> int:
    """Causal attention of one fresh prompt: QK^T and PV over the lower triangle, every layer and head."""
    pairs = tokens * (tokens + 1) // 2
    return 2 * 2 * pairs * cfg.head_dim * cfg.num_heads * cfg.num_layers
