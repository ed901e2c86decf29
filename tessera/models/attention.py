"""Causal self-attention: fused QKV projection, GQA/MQA, optional per-head QK norm, RoPE, SDPA.

Heads and KV groups are split over tensor-parallel ranks (KV groups replicated when there
are fewer groups than ranks); under sequence parallelism the input is a sequence shard
and the QKV projection all-gathers it. With packed documents (tessera.models.documents)
each token attends within its own document only; in generation the same `documents` slot
holds a layer's view of the paged KV cache (tessera.inference.paged_attention.LayerCache),
whose `attend` stores k and v and attends over the cached context. Under context
parallelism the sequence is split over ranks and attention reaches the others' tokens
(tessera.parallel.context). Attention sinks and sliding windows (GPT-OSS: --softmax-type,
--window-size) run through tessera.models.attention_sinks. With --attention-output-gate (Qwen3-Next,
Megatron's attention_output_gate) the QKV projection also gives a gate per query channel, and the
heads' output is multiplied by its sigmoid before the output projection.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.rope import apply_rotary, rotary_qkv
from tessera.models.attention_sinks import sink_window_attention
from tessera.models.documents import Documents
from tessera.models.norm import build_norm
from tessera.parallel.context import ContextAttention
from tessera.parallel.random import DropoutRNG, checkpoint
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class Attention(nn.Module):
    """Causal self-attention with fused QKV projection, GQA/MQA and SDPA kernels."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False, context: ContextAttention | None = None,
                 window: int | None = None):
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
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
        self.context = context   # context parallelism: this rank's queries attend over the whole sequence
        q, kv = heads * self.head_dim, groups * self.head_dim
        kv_splits = min(groups, tp_size)
        self.gate_width = self.num_heads * self.head_dim if config.attention_output_gate else 0   # this rank's
        gate = (q,) * config.attention_output_gate   # [q; k; v; gate], the gate split with its heads
        self.qkv = ColumnParallelLinear(
            config.hidden_size, q + 2 * kv + len(gate) * q, bias=config.add_bias_linear or config.add_qkv_bias,
            init_std=config.init_method_std, segments=(q, kv, kv, *gate),
            splits=(tp_size, kv_splits, kv_splits, *(tp_size,) * len(gate)),
            tp_group=tp_group, sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(q, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                      tp_group=tp_group, sequence_parallel=sequence_parallel)
        if config.qk_layernorm:
            # One norm over the head dimension, shared by all heads; each TP rank applies it to
            # its own heads, so its gradient is a partial sum over the TP group.
            self.q_norm = build_norm(config, tp_group, sequence_parallel=True, width=self.head_dim)
            self.k_norm = build_norm(config, tp_group, sequence_parallel=True, width=self.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.window = window   # sliding window: keys this many tokens back at most (None: all)
        if config.softmax_type == "off-by-one":   # a logit 0 in every denominator
            self.register_buffer("sinks", torch.zeros(self.num_heads), persistent=False)
        else:
            self.sinks = _learned_sinks(config, tp_rank, tp_size, self.num_heads)
        if context is not None and (self.sinks is not None or window is not None):
            raise ConfigError("--context-parallel-size > 1 does not support --softmax-type learnable/off-by-one or "
                              "--window-size yet")

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: Documents | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v on [b, heads, s, d]: causal, within each document when given."""
        if self.sinks is not None or self.window is not None:
            return sink_window_attention(q, k, v, self.sinks, self.window, documents,
                                         enable_gqa=self.num_groups != self.num_heads)
        dropout_p = self.dropout if self.training else 0.0
        with self.rng.fork(q.device) if dropout_p > 0 and self.rng is not None else nullcontext():
            return core_attention(q, k, v, documents, dropout_p=dropout_p,
                                  enable_gqa=self.num_groups != self.num_heads, context=self.context)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # whole sequence, this rank's heads (under SP, x is a sequence shard)
        batch, seq, _ = qkv.shape
        d = self.head_dim
        gate = None
        if self.gate_width:
            qkv, gate = qkv.split([qkv.shape[-1] - self.gate_width, self.gate_width], dim=-1)
        if rope is not None and self.q_norm is None and rope[0].shape[-1] == d and gate is None:
            q, k, v = rotary_qkv(qkv, *rope, self.num_heads, self.num_groups)   # one pass each way
            return attend_and_project(self, *(t.transpose(1, 2) for t in (q, k, v)), documents)
        q, k, v = qkv.split([self.num_heads * d, self.num_groups * d, self.num_groups * d], dim=-1)
        q, k, v = (t.view(batch, seq, -1, d) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if v.requires_grad and (rope is not None or self.q_norm is not None):
            # q and k are new tensors: attention's backward keeps v, which as a view of the QKV
            # output would keep all of it alive (two thirds of it or more for nothing).
            v = v.contiguous()
        return attend_and_project(self, *(t.transpose(1, 2) for t in (q, k, v)), documents, gate)


def _learned_sinks(config: ModelConfig, tp_rank: int, tp_size: int, local_heads: int) -> nn.Parameter | None:
    """This rank's heads' learned sink logits (--softmax-type learnable), or None."""
    if config.softmax_type != "learnable":
        return None
    spec = ShardSpec((config.num_attention_heads,), 0, None, tp_rank, tp_size)
    return annotate(nn.Parameter(torch.empty(local_heads)), spec, init_std=config.init_method_std)


def attend_and_project(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: Documents | None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """layer.core on [b, heads, s, d] (recomputed in the backward with selective recompute),
    then layer.proj on the heads side by side (times sigmoid(gate) [b, s, heads x d] first, when
    given): the tail that Attention and MLA share."""
    if layer.recompute_core and layer.training:
        out = checkpoint(layer.core, q, k, v, documents, rng=layer.rng if layer.dropout > 0 else None)
    else:
        out = layer.core(q, k, v, documents)
    batch, _, seq, _ = out.shape
    out = out.transpose(1, 2).reshape(batch, seq, -1)
    return layer.proj(out if gate is None else out * torch.sigmoid(gate))


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None, *,
                   dropout_p: float, enable_gqa: bool = False, scale: float | None = None,
                   context: ContextAttention | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence (SDPA), or within each packed document; under
    context parallelism (`context`) q, k, v hold this rank's pieces of the sequence, and
    `documents` says how they were cut (tessera.parallel.context_split.SplitDocuments)."""
    if context is not None:
        return context.attend(q, k, v, documents, scale=scale, full_attention=functools.partial(
            core_attention, dropout_p=dropout_p, enable_gqa=enable_gqa, scale=scale))
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa,
                                              scale=scale)
    return documents.attend(q, k, v, dropout_p=dropout_p, enable_gqa=enable_gqa, scale=scale)
