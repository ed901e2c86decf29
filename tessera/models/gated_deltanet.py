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

For generation it keeps, per request, the last --linear-conv-kernel-dim - 1 inputs of its conv and
the delta rule's state [value heads, K, V] (tessera.inference.recurrent_state, as transformers'
Qwen3-Next cache keeps conv_states and recurrent_states): a prompt runs the chunked rule from it, a
decode step one token of the recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.delta_rule import gated_delta_rule, gated_delta_step
from tessera.models.documents import Documents
from tessera.models.mamba import (a_log_init, causal_conv1d, gated_rms_norm, sharded_parameter, silu_conv_after,
                                  uniform_init)
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
        qkv, z, b, a = self._project(hidden)   # the whole sequence, this rank's heads
        ids = documents.token_ids() if documents is not None else None
        q, k, v, decay, beta = self._rule_inputs(F.silu(causal_conv1d(qkv, self.conv_weight, None, ids)), b, a)
        return self._output(gated_delta_rule(q, k, v, decay, beta, document_ids=ids), z, hidden.dtype)

    # -- generation: the state one request carries between steps (tessera.inference.recurrent_state) --

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One request's state: the last conv-kernel - 1 inputs of the conv, and the delta rule's state
        [value heads, K, V] (this rank's heads)."""
        channels, _, kernel = self.conv_weight.shape
        return {"conv": (kernel - 1, channels),
                "recurrent": (self.num_value_heads, self.key_head_dim, self.value_head_dim)}

    def prefill(self, hidden: torch.Tensor, state: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """hidden [rows, s, hidden] after `state` (each [rows, *state_shapes()]) -> (output, the state after
        them): the chunked rule from the given state."""
        qkv, z, b, a = self._project(hidden)
        conv, conv_state = silu_conv_after(qkv, state["conv"], self.conv_weight, None)
        out, recurrent = gated_delta_rule(*self._rule_inputs(conv, b, a), initial_states=state["recurrent"],
                                          return_final_states=True)
        return self._output(out, z, hidden.dtype), {"conv": conv_state, "recurrent": recurrent}

    def step(self, hidden: torch.Tensor, state: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One token a row, hidden [rows, 1, hidden]: the recurrence advances the state (no chunks)."""
        qkv, z, b, a = self._project(hidden)
        conv, conv_state = silu_conv_after(qkv, state["conv"], self.conv_weight, None)
        out, recurrent = gated_delta_step(state["recurrent"], *(t[:, 0] for t in self._rule_inputs(conv, b, a)))
        return self._output(out[:, None], z, hidden.dtype), {"conv": conv_state, "recurrent": recurrent}

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[q | k | v], z, b and a of the whole sequence, this rank's heads."""
        keys, values = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        heads = self.num_value_heads
        return self.in_proj(hidden).split([2 * keys + values, values, heads, heads], dim=-1)

    def _rule_inputs(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k [b, s, key heads, K], v [b, s, value heads, V] from the activated conv; the log decay g
        and beta [b, s, value heads] (fp32)."""
        batch, seq, _ = qkv.shape
        keys = self.num_key_heads * self.key_head_dim
        q, k, v = qkv.split([keys, keys, self.num_value_heads * self.value_head_dim], dim=-1)
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return (q.view(batch, seq, -1, self.key_head_dim), k.view(batch, seq, -1, self.key_head_dim),
                v.view(batch, seq, -1, self.value_head_dim), decay, b.float().sigmoid())

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj of the per-head normed, gated out [b, s, value heads, V]."""
        heads = self.num_value_heads
        normed = gated_rms_norm(out.flatten(2), z, self.norm_weight.repeat(heads), heads, self.eps,
                                norm_before_gate=True)
        return self.out_proj(normed.to(dtype))
