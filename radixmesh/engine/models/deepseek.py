"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi K2 and other V3-shaped models),
and GLM-4.7-Flash (Glm4MoeLiteForCausalLM: V3's layers, its sparse ones listed in `mlp_layer_types`): multi-head
latent attention (MLA) over mixture-of-experts layers.

MLA, as transformers computes it: q comes from `q_proj`, or through a low-rank `q_a_proj` -> `q_a_layernorm` ->
`q_b_proj`; `kv_a_proj_with_mqa` compresses the token into a `kv_lora_rank` latent (normed by `kv_a_layernorm`) and
one `qk_rope_head_dim` key part shared by every head, which RoPE rotates with q's last `qk_rope_head_dim` dimensions;
`kv_b_proj` expands the latent into each head's un-rotated key part and its value; scores are scaled by
1 / sqrt(qk_head_dim), times YaRN's mscale squared at `mscale_all_dim` (engine.models.attention_spec.mla_scale).

What we cache and compute instead (the same scores and outputs, summed in another order): each token's latent and
its rotated key part, one vector of kv_lora_rank + qk_rope_head_dim a layer, as the key of a single KV head whose
value is the same vector (engine.cache.kv_pool's `shared_kv`: one buffer). Each head's q is carried into the latent
space through its block of `kv_b_proj` (q_nope . W_uk c = (W_uk^T q_nope) . c) and attends there; the leading
kv_lora_rank dimensions of its output are carried out through its value block (W_uv). So the cache holds 576 numbers
a token and layer for DeepSeek-V3 instead of 128 heads x (192 + 128), and every attention backend runs it as
grouped-query attention with one KV head.

RoPE pairs: DeepSeek-V2 rotates interleaved pairs in float32 with a float32 table (transformers' complex product);
V3 rotates interleaved pairs in the model dtype (`rope_interleave`, true by default) or rotate-half without it. Our
interleaved rotation keeps the pairs in place where transformers' V3 gathers them apart; q and k are laid out alike,
so their products are the same terms.

The experts (engine.models.moe.BiasRoutedMoeBlock): V3 routes as GLM-4.5 does (sigmoid scores, the correction bias in
the float32 router, the best `topk_group` of `n_group` groups by their two best choices, renormalized with
`norm_topk_prob`, times `routed_scaling_factor`); V2 by softmax scores without a bias, either all experts
(`topk_method` greedy) or those of the best groups by their single best score (group_limited_greedy), never
renormalized, times `routed_scaling_factor`. Both add `n_shared_experts` ungated shared experts; the first
`first_k_dense_replace` layers are dense. V3 checkpoints' multi-token-prediction layers (`model.layers.<N>.*`) are
skipped at load. Heads shard over tensor-parallel ranks; the latent cache is whole on every rank.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from radixmesh.engine.attention import mla_expanded
from radixmesh.engine.distributed import TensorParallel
from radixmesh.engine.forward_context import get_forward_context
from radixmesh.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixmesh.engine.layers.norm import RMSNorm
from radixmesh.engine.layers.rotary import RopeInputs, RotaryEmbedding, apply_rotary
from radixmesh.engine.layers.triton_ops import use_kernels
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import DecoderLayer, DecoderModel, DecoderSpec
from radixmesh.engine.models.moe import BiasRoutedMoeBlock, MoeForCausalLM, NextnLayers, noaux_tc_block

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon, not rms_norm_eps
LATENT_NORM_EPS = 1e-6
# On a GPU the absorbed query's and the key's rows are built in one launch (kernels.mla_rope, bit for bit the torch
# path); RADIXMESH_MLA_FUSED_QK=0 keeps torch's ~16 launches a layer (an A/B switch for benchmarks)
FUSED_QUERY_KEY = os.environ.get("RADIXMESH_MLA_FUSED_QK", "1") != "0"
# On a GPU a decode batch of up to kernels.mla_absorb.MAX_ROWS rows runs the absorbed products (each head's query into
# the latent space, its output back out) in kernels of their own, the query's with the rows above; torch.bmm (cuBLAS)
# took ~8-10 us a product at one row. RADIXMESH_MLA_ABSORB=0 keeps torch.bmm; RADIXMESH_MLA_ABSORB_EARLY=1 loads the
# kernels' weights before their PDL wait (A/B switches for benchmarks)
ABSORB_KERNELS = os.environ.get("RADIXMESH_MLA_ABSORB", "1") != "0"
ABSORB_EARLY = os.environ.get("RADIXMESH_MLA_ABSORB_EARLY", "0") == "1"


class MlaAttention(nn.Module):
    """One layer's multi-head latent attention (module docstring); this rank's heads."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        mla = cfg.mla
        if cfg.num_heads % tp.size:
            raise ValueError(f"{cfg.num_heads} attention heads do not split over tensor-parallel size {tp.size}")
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, 1  # (the latent: whole on every rank)
        self.nope, self.rope_dim, self.rank, self.v_dim = (mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                           mla.kv_lora_rank, mla.v_head_dim)
        whole, heads, bias = TensorParallel.single(), cfg.num_heads, cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * mla.qk_head_dim, False, tp, "q_proj's rows")
        else:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, mla.q_lora_rank, bias, whole, "q_lora_rank")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, False, tp, "q_b_proj's rows")
        self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, mla.latent_dim, bias, whole, "the latent")
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (self.nope + self.v_dim), False, tp,
                                              "kv_b_proj's rows")
        self.kv_b_proj.keep_float = True  # (its head blocks are multiplied here, never run as a product: fp8_load)
        self.kv_b_proj.decode_product = False  # (nor timed at start-up: engine.decode_products)
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, bias, tp, "heads x v_head_dim")

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _up_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' blocks of kv_b_proj: W_uk [heads, nope, rank] and W_uv [heads, v_dim, rank] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [m, rank] -> each of this rank's heads' un-rotated key part [m, heads, nope] and value [m, heads,
        v_dim] (kv_b_proj, as transformers computes them; engine.attention.mla_expanded)."""
        kv = self.kv_b_proj(latents.to(self.kv_b_proj.weight.dtype)).view(-1, self.num_heads, self.nope + self.v_dim)
        return kv.split([self.nope, self.v_dim], dim=-1)

    def forward(self, hidden: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        n = hidden.shape[0]
        q_nope, q_pe = self._query(hidden).view(n, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope_dim], dim=-1)
        table = rope.table
        cos, sin = (rope.cos, rope.sin) if rope.cos is not None else table.lookup(rope.positions, hidden.dtype)
        ctx = get_forward_context()
        # (a long prefill; never under --enable-deterministic-inference, whose rows attend alone over the latent)
        expanded = not getattr(ctx.backend, "rows_alone", False) and mla_expanded.wanted(
            ctx.batch, self.rank, self.rope_dim, self.nope, self.v_dim)
        if not expanded and ABSORB_KERNELS and use_kernels(hidden) and self._absorbs(q_nope):
            return self._absorbed_in_kernels(ctx, q_nope, q_pe, latent, k_pe, cos, sin, table)
        latent = self.kv_a_layernorm(latent)  # (a strided view: the norm writes a new tensor)
        if expanded:
            query, key = _query_key(q_nope, q_pe, latent, k_pe, cos, sin, table)
            values = mla_expanded.expanded_attention(ctx, self.layer_id, query, key, self.rank, self._expand)
            return self.o_proj(values.reshape(n, self.num_heads * self.v_dim))
        w_uk, w_uv = self._up_blocks()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, heads, rank]
        if FUSED_QUERY_KEY and use_kernels(hidden):  # one launch for the rotations and both rows (kernels.mla_rope)
            from radixmesh.kernels.mla_rope import mla_query_key

            query, key = mla_query_key(q_latent, q_pe, latent, k_pe, cos, sin, table.interleaved, table.upcast_pairs)
        else:
            query, key = _query_key(q_latent, q_pe, latent, k_pe, cos, sin, table)
        out = ctx.attend(self.layer_id, query, key, key)  # [n, heads, rank + rope]
        values = torch.bmm(out[..., :self.rank].transpose(0, 1), w_uv.transpose(1, 2))  # [heads, n, v_dim]
        return self.o_proj(values.transpose(0, 1).reshape(n, self.num_heads * self.v_dim))

    def _absorbs(self, q_nope: torch.Tensor) -> bool:
        """Whether kernels.mla_absorb takes these rows: a decode batch's few, kv_b_proj held whole in their dtype."""
        from radixmesh.kernels.mla_absorb import MAX_ROWS

        weight = self.kv_b_proj.weight
        return 0 < q_nope.shape[0] <= MAX_ROWS and weight.dtype == q_nope.dtype and weight.is_contiguous()

    def _absorbed_in_kernels(self, ctx, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                             k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             table: RotaryEmbedding) -> torch.Tensor:
        """The decode path on a GPU (kernels.mla_absorb): the absorbed query with the query and key rows in one
        launch (the latent, not normed yet, normed there; the key rows stored in the pool there on a decode step),
        attention, then each head's value straight into o_proj's input in another."""
        from radixmesh.kernels.mla_absorb import absorbed_query_key, absorbed_values

        weight, norm = self.kv_b_proj.weight, self.kv_a_layernorm
        cache = ctx.pool_rows(self.layer_id, q_nope.dtype)  # (a decode step: the key rows straight into the pool)
        query, key = absorbed_query_key(q_nope, weight, self.v_dim, q_pe, latent, k_pe, cos, sin, table.interleaved,
                                        table.upcast_pairs, early=ABSORB_EARLY, cache=cache,
                                        loc=None if cache is None else ctx.batch.out_cache_loc,
                                        norm=(norm.weight, norm.eps))
        out = ctx.attend(self.layer_id, query, key, key) if cache is None else ctx.attend_written(self.layer_id, query)
        return self.o_proj(absorbed_values(out, weight, self.nope, self.v_dim, early=ABSORB_EARLY))


def _query_key(q_head: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, table: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's query row (q_head: its absorbed or un-rotated part [n, heads, d]) beside its rotated rope part, and
    the key row [n, 1, rank + rope]: the latent beside the rotated shared rope part (kernels.mla_rope's twin)."""
    q_pe, k_pe = apply_rotary(q_pe, k_pe[:, None, :], cos, sin, table.interleaved, table.upcast_pairs)
    key = torch.cat([latent, k_pe[:, 0].to(latent.dtype)], dim=-1)[:, None, :]
    return torch.cat([q_head, q_pe.to(q_head.dtype)], dim=-1), key


def mla_decoder_layer(cfg: ModelConfig, tp: TensorParallel, sparse: bool) -> DecoderLayer:
    """One DeepSeek-V3 decoder layer alone (the multi-token-prediction head's, engine.speculative.nextn): layer 0 of
    a cache of its own; its MLP the experts (`sparse`) or dense."""
    layer = DecoderLayer(cfg, DecoderSpec(), 0, tp)
    layer.self_attn = MlaAttention(cfg, 0, tp)
    if sparse:
        layer.mlp = noaux_tc_block(cfg, tp)
    return layer


def v3_rope_options(cfg: ModelConfig) -> dict:
    """RotaryEmbedding.for_model's options for DeepSeek-V3's RoPE: interleaved pairs (rope_interleave, true by
    default) or rotate-half, in the model dtype either way; looked up once per forward (the latent attention's
    kernels take the rows)."""
    return dict(interleaved=bool(cfg.raw.get("rope_interleave", True)), upcast_pairs=False, looked_up=True)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__(cfg, tp)
        self.skipped_tensors = NextnLayers(cfg.num_layers)

    def body(self, cfg: ModelConfig) -> nn.Module:
        model = DecoderModel(cfg, DecoderSpec(), self.tp)
        for i, layer in enumerate(model.layers):
            layer.self_attn = MlaAttention(cfg, i, self.tp)
        return model

    def init_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding.for_model(self.config, max_positions, device, **self.rope_options())

    def rope_options(self) -> dict:
        # transformers' DeepSeek-V2: interleaved pairs rotated in float32 by a float32 table (a complex product)
        return dict(interleaved=True, upcast_pairs=True, float32_table=True, looked_up=True)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        moe = cfg.moe
        grouped = cfg.raw.get("topk_method") == "group_limited_greedy"
        return BiasRoutedMoeBlock(cfg, self.tp, self.names, False, scoring="softmax", bias_at="none",
                                  shared_intermediate=moe.shared_expert_intermediate_size,
                                  groups=moe.groups if grouped else 1, group_best=1)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def rope_options(self) -> dict:
        return v3_rope_options(self.config)

    def sparse_block(self, cfg: ModelConfig) -> nn.Module:
        return noaux_tc_block(cfg, self.tp)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's attention and experts (GLM-4.5's router is the same rule); which layers are sparse
    follows `mlp_layer_types` (engine.model_config: a dense first layer by default)."""
