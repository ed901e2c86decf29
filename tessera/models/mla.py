"""Multi-latent attention (MLA, DeepSeek-V2/V3): queries and keys/values expanded from
low-rank latents, with RoPE on a decoupled positional part.

    query     x -> q_down -> q_norm -> q_up  (or one q_proj without --q-lora-rank)
              per head: [q_nope (--qk-head-dim) | q_pos (--qk-pos-emb-head-dim)]
    key/value x -> kv_down -> [latent (--kv-lora-rank) | k_pos (--qk-pos-emb-head-dim)]
              latent -> kv_norm -> kv_up, per head [k_nope | v (--v-head-dim)]
    attention q = [q_nope | rope(q_pos)], k = [k_nope | rope(k_pos)] with one positional key
              shared by all heads; softmax(q k^T * scale) v; then proj back to the hidden size

The norms are on with --qk-layernorm (Megatron's switch; DeepSeek has them), with epsilon
--latent-norm-epsilon (default --norm-epsilon). RoPE pairs neighbouring channels
(DeepSeek's interleaved layout). The softmax scale is 1/sqrt(qk_head_dim +
qk_pos_emb_head_dim), times YaRN's mscale(s, --mscale-all-dim)^2.

Tensor parallelism as Megatron-Core: the down projections are small and replicated, the
up projections column-parallel (heads split over ranks), the output projection
row-parallel. With sequence parallelism the down projections and norms run on this
rank's sequence shard and the up projections all-gather their latents. Gradients of
the replicated pieces: without SP every rank sees the whole sequence and the up
projections' input gradients are all-reduced, so they are already whole; with SP each
rank sees its own tokens, so they are marked `sequence_parallel` and summed after
backward. The positional key is used by every rank's heads: its gradient is summed over
the TP group (all-reduce, or reduce-scatter when gathered along the sequence).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.rope import apply_rotary
from tessera.models.attention import attend_and_project, core_attention
from tessera.models.documents import Documents
from tessera.models.norm import build_norm
from tessera.models.rope import yarn_mscale
from tessera.parallel.context import ContextAttention
from tessera.parallel.random import DropoutRNG
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, copy_to_tp_region, gather_from_sequence_region,
)


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(query head dim), times YaRN's mscale(s, mscale_all_dim)^2 (DeepSeek-V3: 0.135234)."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    if config.rope_type == "yarn":
        scale *= yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2
    return scale


def _replicated_linear(in_features: int, out_features: int, *, bias: bool, init_std: float, tp_group,
                       sequence_parallel: bool) -> nn.Linear:
    """nn.Linear held whole by every TP rank; `sequence_parallel`: it sees only this rank's tokens."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    rank, size = rank_and_size(tp_group)
    annotate(linear.weight, ShardSpec((out_features, in_features), None, None, rank, size), init_std=init_std,
             sequence_parallel=sequence_parallel)
    if bias:
        annotate(linear.bias, ShardSpec((out_features,), None, None, rank, size), sequence_parallel=sequence_parallel)
    return linear


class MultiLatentAttention(nn.Module):
    """Causal self-attention through compressed query and key/value latents (DeepSeek's MLA)."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False, context: ContextAttention | None = None):
        super().__init__()
        _, tp_size = rank_and_size(tp_group)
        heads = config.num_attention_heads
        if heads % tp_size:
            raise ConfigError(f"--num-attention-heads ({heads}) must be divisible by "
                              f"--tensor-model-parallel-size ({tp_size})")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_heads = heads // tp_size
        self.qk_head_dim, self.pos_dim, self.v_head_dim = (
            config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim)
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.softmax_scale = softmax_scale(config)
        self.dropout = config.attention_dropout
        self.rng = rng  # attention probabilities of this rank's heads: a dropout mask of their own
        self.recompute_core = recompute_core
        self.context = context   # context parallelism (tessera.parallel.context)
        hidden, std, bias = config.hidden_size, config.init_method_std, config.add_bias_linear
        parallel = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        q_out = heads * (self.qk_head_dim + self.pos_dim)

        def latent_norm(width: int) -> nn.Module:
            if not config.qk_layernorm:
                return nn.Identity()
            return build_norm(config, tp_group, sequence_parallel, width=width, eps=config.latent_norm_epsilon)

        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, bias=bias, init_std=std, **parallel)
        else:
            self.q_down = _replicated_linear(hidden, config.q_lora_rank, bias=bias, init_std=std, **parallel)
            self.q_norm = latent_norm(config.q_lora_rank)
            self.q_up = ColumnParallelLinear(config.q_lora_rank, q_out, bias=bias, init_std=std, **parallel)
        self.kv_down = _replicated_linear(hidden, self.kv_lora_rank + self.pos_dim, bias=bias, init_std=std,
                                          **parallel)
        self.kv_norm = latent_norm(self.kv_lora_rank)
        self.kv_up = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim),
                                          bias=bias, init_std=std, **parallel)
        self.proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias, init_std=output_std, **parallel)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """softmax(q k^T * scale) v on [b, heads, s, d]: causal, within each document when given.

        Values are narrower than queries and keys (128 vs 192 channels in DeepSeek-V3). SDPA
        takes that as it is: its math and memory-efficient kernels (and cuDNN's, where its
        shape rules allow) accept a value dim of their own, and it picks among those;
        FlashAttention would need the values padded to the query width.
        """
        dropout_p = self.dropout if self.training else 0.0
        with self.rng.fork(q.device) if dropout_p > 0 and self.rng is not None else nullcontext():
            return core_attention(q, k, v, documents, dropout_p=dropout_p, scale=self.softmax_scale,
                                  context=self.context)

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed latents [b, s, kv_lora_rank] -> this rank's heads' k_nope [b, s, heads, qk_head_dim], v."""
        kv = self.kv_up(latent)
        return kv.view(*kv.shape[:2], self.num_heads, -1).split([self.qk_head_dim, self.v_head_dim], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                documents: Documents | None = None) -> torch.Tensor:
        # The up projections see the whole sequence (under SP, x and the latents are shards).
        query = self.q_proj(x) if self.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        latent, k_pos = self.kv_down(x).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        latent = self.kv_norm(latent)
        batch, seq, _ = query.shape
        q_nope, q_pos = query.view(batch, seq, self.num_heads, -1).split([self.qk_head_dim, self.pos_dim], dim=-1)
        # One positional key for all heads: whole sequence, gradient summed over the ranks' heads.
        enter = gather_from_sequence_region if self.sequence_parallel else copy_to_tp_region
        k_pos = apply_rotary(enter(k_pos, self.tp_group).unsqueeze(2), *rope, interleaved=True)
        q = torch.cat([q_nope, apply_rotary(q_pos, *rope, interleaved=True)], dim=-1)
        if hasattr(documents, "attend_latent"):   # inference's paged cache keeps the latent, not keys and values
            out = documents.attend_latent(self, q.transpose(1, 2), latent, k_pos[:, :, 0])
            return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))
        k_nope, v = self.expand_latent(latent)
        k = torch.cat([k_nope, k_pos.expand(-1, -1, self.num_heads, -1)], dim=-1)
        if v.requires_grad:   # attention's backward keeps v: as a view it would keep k_nope's half of kv_up's output
            v = v.contiguous()
        return attend_and_project(self, *(t.transpose(1, 2) for t in (q, k, v)), documents)
