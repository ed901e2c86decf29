"""The transformer block: normalization, attention (SDPA, RoPE, GQA) and MLP (GeLU or SwiGLU).

Activations are [batch, seq, hidden]. Linear layers come from tessera.parallel.tensor,
so the same code runs unsplit (TP=1) or split over tensor-parallel ranks: attention
heads and KV groups (replicated when there are fewer groups than ranks) and the MLP's
inner features are split; the block's input and output are whole, or with sequence
parallelism split along the sequence, and so are the norms and the residual dropout.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.parallel.random import DropoutRNG, checkpoint, dropout
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def build_norm(config: ModelConfig, tp_group=None, sequence_parallel: bool = False) -> nn.Module:
    """LayerNorm or RMSNorm, replicated on every TP rank (on sequence shards under SP)."""
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, bias=True)
    rank, size = rank_and_size(tp_group)
    for name, param in norm.named_parameters():
        annotate(param, ShardSpec(tuple(param.shape), None, None, rank, size),
                 init_value=1.0 if name == "weight" else 0.0, sequence_parallel=sequence_parallel)
    return norm


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding (rotate-half convention, as LLaMA/Megatron)."""

    def __init__(self, rotary_dim: int, base: float, max_positions: int):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Not saved in checkpoints: derived from the config.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, seq_length: int, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to broadcast over [batch, seq, heads, rotary_dim]."""
        if position_ids is None:
            return self.cos[:seq_length, None, :], self.sin[:seq_length, None, :]
        return self.cos[position_ids][:, :, None, :], self.sin[position_ids][:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [b, s, heads, d]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)
    return torch.cat([rotated, passed], dim=-1) if passed.shape[-1] else rotated


class Attention(nn.Module):
    """Causal self-attention with fused QKV projection, GQA/MQA and SDPA kernels."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False):
        super().__init__()
        _, tp_size = rank_and_size(tp_group)
        heads, groups = config.num_attention_heads, config.num_query_groups
        if heads % tp_size or (groups % tp_size and tp_size % groups):
            raise ConfigError(f"--num-attention-heads ({heads}) must be divisible by --tensor-model-parallel-size "
                              f"({tp_size}), and --num-query-groups ({groups}) must divide or be divisible by it")
        self.head_dim = config.kv_channels
        self.num_heads = heads // tp_size
        self.num_groups = max(groups // tp_size, 1)  # one replicated group when groups < TP ranks
        self.dropout = config.attention_dropout
        self.rng = rng  # attention probabilities of this rank's heads: a dropout mask of their own
        self.recompute_core = recompute_core
        q, kv = heads * self.head_dim, groups * self.head_dim
        kv_splits = min(groups, tp_size)
        self.qkv = ColumnParallelLinear(
            config.hidden_size, q + 2 * kv, bias=config.add_bias_linear or config.add_qkv_bias,
            init_std=config.init_method_std, segments=(q, kv, kv), splits=(tp_size, kv_splits, kv_splits),
            tp_group=tp_group, sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(q, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                      tp_group=tp_group, sequence_parallel=sequence_parallel)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attention_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v on [b, heads, s, d]; causal unless a mask is given."""
        dropout_p = self.dropout if self.training else 0.0
        with self.rng.fork(q.device) if dropout_p > 0 and self.rng is not None else nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None,
                dropout_p=dropout_p, enable_gqa=self.num_groups != self.num_heads,
            )

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # whole sequence, this rank's heads (under SP, x is a sequence shard)
        batch, seq, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_groups * d, self.num_groups * d], dim=-1)
        q, k, v = (t.view(batch, seq, -1, d) for t in (q, k, v))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attention_mask is not None:
            attention_mask = attention_mask[:, None]  # [b, 1, s, s]: same mask for every head
        if self.recompute_core and self.training:
            out = checkpoint(self.core, q, k, v, attention_mask, rng=self.rng if self.dropout > 0 else None)
        else:
            out = self.core(q, k, v, attention_mask)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Feed-forward block: GeLU, or SwiGLU with gate and up projections fused in one GEMM."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        ffn, self.swiglu, self.openai_gelu = config.ffn_hidden_size, config.swiglu, config.openai_gelu
        _, tp_size = rank_and_size(tp_group)
        if ffn % tp_size:
            raise ConfigError(f"--ffn-hidden-size ({ffn}) must be divisible by "
                              f"--tensor-model-parallel-size ({tp_size})")
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn, bias=config.add_bias_linear,
            init_std=config.init_method_std, segments=(ffn, ffn) if self.swiglu else None,
            tp_group=tp_group, sequence_parallel=sequence_parallel,
        )
        self.fc2 = RowParallelLinear(ffn, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                     tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh" if self.openai_gelu else "none")
        return self.fc2(hidden)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)), with dropout on each branch."""

    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False):
        super().__init__()
        # Output projections are scaled by 1/sqrt(2 * layers) so the residual stream's
        # variance does not grow with depth (GPT-2, Megatron).
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.input_norm = build_norm(config, tp_group, sequence_parallel)
        self.attention = Attention(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   rng=rng, recompute_core=recompute_core)
        self.post_attention_norm = build_norm(config, tp_group, sequence_parallel)
        self.mlp = MLP(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.hidden_dropout = config.hidden_dropout
        # The residual stream is replicated over TP ranks (same mask: default generator)
        # or, under SP, split along the sequence (each rank's own mask).
        self.hidden_rng = rng if sequence_parallel else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.input_norm(x), rope, attention_mask))
        return x + self._dropout(self.mlp(self.post_attention_norm(x)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.hidden_rng)
