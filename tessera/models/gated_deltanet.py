"""The Gated DeltaNet mixer (arXiv 2412.06464), as Megatron-Core's GatedDeltaNet
(megatron/core/ssm/gated_delta_net/gdn.py) and transformers' Qwen3NextGatedDeltaNet compute it:

    [q, k, v, z, b, a] = in_proj(u)                    one GEMM, the six parts side by side
    q, k, v = silu(causal depthwise conv1d([q, k, v]))  --linear-conv-kernel-dim taps, no bias
    beta = sigmoid(b)        g = -exp(A_log) * softplus(a + dt_bias)      (fp32)
    o = gated delta rule(q, k, v, g, beta)             q and k L2-normalised (tessera.kernels.delta_rule)
    out = out_proj(RMSNorm_per_head(o) * silu(z))      the norm before the gate, one weight for all heads

Shapes: q and k have --linear-num-key-heads heads of --linear-key-head-dim channels; v and z
--linear-num-value-heads heads of --linear-value-head-dim, each query/key head serving
value heads // key heads consecutive value heads; b and a one value per value head.

Tensor parallelism splits the heads over ranks as Megatron does: `in_proj` is column-parallel with
each of its six parts cut separately, the conv channels, dt_bias and A_log follow their heads,
the norm's weight (one head wide) is on every rank, and `out_proj` is row-parallel. Under
sequence parallelism `in_proj` all-gathers the sequence and `out_proj` reduce-scatters it. With
packed documents the conv and the delta rule restart at each document: the same outputs as
running each document alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.delta_rule import gated_delta_rule
from tessera.models.documents import Documents
from tessera.models.mamba import a_log_init, causal_conv1d, gated_rms_norm, sharded_parameter, uniform_init
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer: [b, s, hidden] (under SP a sequence shard) -> the same."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        rank, tp_size = rank_and_size(tp_group)
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if key_heads % tp_size or value_heads % tp_size:
            raise ConfigError(f"--linear-num-key-heads ({key_heads}) and --linear-num-value-heads ({value_heads}) "
                              f"must be divisible by --tensor-model-parallel-size ({tp_size})")
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = key_heads // tp_size, value_heads // tp_size
        self.eps = config.norm_epsilon
        keys, values = key_heads * self.key_head_dim, value_heads * self.value_head_dim
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, 2 * keys + 2 * values + 2 * value_heads, bias=config.add_bias_linear,
            init_std=config.init_method_std, segments=(keys, keys, values, values, value_heads, value_heads),
            tp_group=tp_group, sequence_parallel=sequence_parallel)
        kernel = config.linear_conv_kernel_dim
        conv_parts = (keys, keys, values)   # q, k, v
        self.conv_weight = sharded_parameter(ShardSpec((sum(conv_parts), 1, kernel), 0, conv_parts, rank, tp_size),
                                             uniform_init(kernel ** -0.5))
        per_head = ShardSpec((value_heads,), 0, None, rank, tp_size)
        self.dt_bias = annotate(nn.Parameter(torch.empty(self.num_value_heads)), per_head, init_value=1.0)
        self.A_log = sharded_parameter(per_head, a_log_init)
        # One head's width, applied to this rank's heads: its gradient is a partial sum over TP ranks.
        self.norm_weight = annotate(nn.Parameter(torch.empty(self.value_head_dim)),
                                    ShardSpec((self.value_head_dim,), None, None, rank, tp_size), init_value=1.0,
                                    sequence_parallel=True)
        self.out_proj = RowParallelLinear(values, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                          tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        projected = self.in_proj(hidden)   # the whole sequence, this rank's heads
        batch, seq, _ = projected.shape
        keys, values = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        heads = self.num_value_heads
        qkv, z, b, a = projected.split([2 * keys + values, values, heads, heads], dim=-1)
        ids = documents.token_ids() if documents is not None else None
        q, k, v = F.silu(causal_conv1d(qkv, self.conv_weight, None, ids)).split([keys, keys, values], dim=-1)
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_rule(q.view(batch, seq, -1, self.key_head_dim), k.view(batch, seq, -1, self.key_head_dim),
                               v.view(batch, seq, heads, self.value_head_dim), decay, b.float().sigmoid(),
                               document_ids=ids)
        normed = gated_rms_norm(out.reshape(batch, seq, values), z, self.norm_weight.repeat(heads), heads, self.eps,
                                norm_before_gate=True)
        return self.out_proj(normed.to(hidden.dtype))
