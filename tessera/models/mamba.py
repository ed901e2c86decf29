"""The Mamba-2 mixer (arXiv 2405.21060), as Megatron-Core's MambaMixer (megatron/core/ssm/mamba_mixer.py)
and transformers' Mamba2Mixer compute it:

    [z, x, B, C, dt] = in_proj(u)                      one GEMM, the five parts side by side
    x, B, C = silu(causal depthwise conv1d([x, B, C]))  kernel 4, a bias per channel
    y = SSD scan(x, softplus(dt + dt_bias), -exp(A_log), B, C) + D x    (tessera.kernels.ssd)
    out = out_proj(RMSNorm_per_group(y * silu(z)))     the gate before the norm, one norm per group

Shapes: d_inner = heads x head_dim channels in heads of `--mamba-head-dim`; B and C are
`--mamba-num-groups` x `--mamba-state-dim`, each group shared by heads // groups consecutive heads.

Tensor parallelism splits heads and groups over ranks: `in_proj` is column-parallel with each of
its five parts cut separately (a rank holds its heads' z, x and dt and its groups' B and C), the
conv channels, dt_bias, A_log, D and the norm follow them (each norm group lies on one rank), and
`out_proj` is row-parallel. Under sequence parallelism `in_proj` all-gathers the sequence and
`out_proj` reduce-scatters it, as for attention. With packed documents the conv and the scan
restart at each document: the same outputs as running each document alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.ssd import ssd_scan, ssd_step
from tessera.models.documents import Documents
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear

CONV_KERNEL = 4                        # Megatron's d_conv
A_INIT_RANGE = (1.0, 16.0)             # A = -uniform(1, 16), stored as log
DT_RANGE, DT_FLOOR = (1e-3, 1e-1), 1e-4   # softplus(dt_bias) starts log-uniform in this range


class MambaMixer(nn.Module):
    """Mamba-2 mixer: [b, s, hidden] (under SP a sequence shard) -> the same."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        rank, tp_size = rank_and_size(tp_group)
        heads, groups = config.mamba_num_heads, config.mamba_num_groups
        if heads % tp_size or groups % tp_size:
            raise ConfigError(f"--mamba-num-heads ({heads}) and --mamba-num-groups ({groups}) must be divisible by "
                              f"--tensor-model-parallel-size ({tp_size})")
        self.head_dim, self.state_dim = config.mamba_head_dim, config.mamba_state_dim
        self.num_heads, self.num_groups = heads // tp_size, groups // tp_size
        self.eps = config.norm_epsilon
        inner, states = heads * self.head_dim, groups * self.state_dim
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, 2 * inner + 2 * states + heads, bias=config.add_bias_linear,
            init_std=config.init_method_std, segments=(inner, inner, states, states, heads),
            tp_group=tp_group, sequence_parallel=sequence_parallel)
        conv_parts = (inner, states, states)   # x, B, C
        split = lambda *shape: ShardSpec((sum(conv_parts), *shape), 0, conv_parts, rank, tp_size)  # noqa: E731
        self.conv_weight = sharded_parameter(split(1, CONV_KERNEL), uniform_init(CONV_KERNEL ** -0.5))
        self.conv_bias = sharded_parameter(split(), uniform_init(CONV_KERNEL ** -0.5))
        per_head = ShardSpec((heads,), 0, None, rank, tp_size)
        self.dt_bias = sharded_parameter(per_head, _dt_bias)
        self.A_log = sharded_parameter(per_head, a_log_init)
        self.D = annotate(nn.Parameter(torch.empty(self.num_heads)), per_head, init_value=1.0)
        self.norm_weight = annotate(nn.Parameter(torch.empty(inner // tp_size)),
                                    ShardSpec((inner,), 0, None, rank, tp_size), init_value=1.0)
        self.out_proj = RowParallelLinear(inner, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                          tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        z, xbc, dt = self._project(hidden)
        ids = documents.token_ids() if documents is not None else None
        x, dt, B, C = self._scan_inputs(F.silu(causal_conv1d(xbc, self.conv_weight, self.conv_bias, ids)), dt)
        y = ssd_scan(x, dt, -self.A_log.float().exp(), B, C, self.D, document_ids=ids)
        return self._output(y, z, hidden.dtype)

    # -- generation: the state one request carries between steps (tessera.inference.recurrent_state) --

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One request's state: the last CONV_KERNEL - 1 conv inputs, and the SSM state (this rank's heads)."""
        channels = self.num_heads * self.head_dim + 2 * self.num_groups * self.state_dim
        return {"conv": (CONV_KERNEL - 1, channels), "ssm": (self.num_heads, self.head_dim, self.state_dim)}

    def prefill(self, hidden: torch.Tensor, state: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """hidden [rows, s, hidden] after `state` (each [rows, *state_shapes()]) -> (output, the state after
        them): the chunked scan from the given state."""
        z, xbc, dt = self._project(hidden)
        conv, conv_state = silu_conv_after(xbc, state["conv"], self.conv_weight, self.conv_bias)
        x, dt, B, C = self._scan_inputs(conv, dt)
        y, ssm = ssd_scan(x, dt, -self.A_log.float().exp(), B, C, self.D, initial_states=state["ssm"],
                          return_final_states=True)
        return self._output(y, z, hidden.dtype), {"conv": conv_state, "ssm": ssm}

    def step(self, hidden: torch.Tensor, state: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One token a row, hidden [rows, 1, hidden]: the recurrence advances the state (no scan)."""
        z, xbc, dt = self._project(hidden)
        conv, conv_state = silu_conv_after(xbc, state["conv"], self.conv_weight, self.conv_bias)
        x, dt, B, C = self._scan_inputs(conv, dt)
        y, ssm = ssd_step(state["ssm"], x[:, 0], dt[:, 0], -self.A_log.float().exp(), B[:, 0], C[:, 0], self.D)
        return self._output(y[:, None], z, hidden.dtype), {"conv": conv_state, "ssm": ssm}

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z, [x | B | C] and dt of the whole sequence, this rank's heads and groups."""
        inner, states = self.num_heads * self.head_dim, self.num_groups * self.state_dim
        return self.in_proj(hidden).split([inner, inner + 2 * states, self.num_heads], dim=-1)

    def _scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [b, s, heads, P], dt after softplus (fp32), B and C [b, s, groups, N]."""
        batch, seq, _ = xbc.shape
        inner, states = self.num_heads * self.head_dim, self.num_groups * self.state_dim
        x, B, C = xbc.split([inner, states, states], dim=-1)
        groups = (batch, seq, self.num_groups, self.state_dim)
        return (x.view(batch, seq, self.num_heads, self.head_dim), F.softplus(dt.float() + self.dt_bias.float()),
                B.view(groups), C.view(groups))

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj of the gated, group-normed y [b, s, heads, P]."""
        return self.out_proj(gated_rms_norm(y.flatten(2), z, self.norm_weight, self.num_groups, self.eps).to(dtype))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence of x [b, s, channels] (weight [channels, 1, k],
    bias [channels] or None); with `document_ids` [b, s], the taps that reach into an earlier
    document read zeros."""
    kernel = weight.shape[-1]
    if document_ids is None:
        out = F.conv1d(x.transpose(1, 2), weight, bias, padding=kernel - 1, groups=x.shape[-1])
        return out[..., :x.shape[1]].transpose(1, 2)
    out = bias.to(x.dtype).expand_as(x) if bias is not None else torch.zeros_like(x)
    for shift in range(kernel):   # tap k - 1 - shift reads the token `shift` places back
        earlier = F.pad(x, (0, 0, shift, 0))[:, :x.shape[1]]
        same = F.pad(document_ids, (shift, 0), value=-1)[:, :x.shape[1]] == document_ids
        out = out + earlier * same.unsqueeze(-1) * weight[:, 0, kernel - 1 - shift]
    return out


def silu_conv_after(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the causal conv of x [rows, s, channels] following the inputs of `conv_state` [rows, k - 1,
    channels], and the last k - 1 inputs after x (fp32, as the engine keeps states): generation's conv."""
    kernel = weight.shape[-1]
    window = torch.cat([conv_state.to(x.dtype), x], dim=1)
    return F.silu(causal_conv1d(window, weight, bias)[:, kernel - 1:]), window[:, x.shape[1]:].float()


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float, *,
                   norm_before_gate: bool = False) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over each group's channels separately, in fp32 (Megatron's
    norm_before_gate=False; transformers' Mamba2RMSNormGated); with `norm_before_gate`,
    RMSNorm(y) * silu(gate) (Gated DeltaNet's, transformers' Qwen3NextRMSNormGated)."""
    gate = F.silu(gate.float())
    grouped = (y.float() if norm_before_gate else y.float() * gate).unflatten(-1, (groups, -1))
    normed = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    return normed * gate if norm_before_gate else normed


# -- initialisation of the full tensors (tessera.models.gpt.initialize_parameter), as Megatron's mixer --

def sharded_parameter(spec: ShardSpec, init_full) -> nn.Parameter:
    """This rank's rows of a parameter whose full tensor `init_full` draws (the same for any layout)."""
    rows = sum(piece.length for piece in spec.pieces())
    param = annotate(nn.Parameter(torch.empty(rows, *spec.full_shape[1:])), spec)
    param.init_full = init_full
    return param


def uniform_init(bound: float):
    """nn.Conv1d's default: uniform in +-1/sqrt(fan in), fan in = the kernel width."""
    return lambda shape, generator, device: torch.empty(shape, device=device).uniform_(-bound, bound,
                                                                                       generator=generator)


def a_log_init(shape, generator, device) -> torch.Tensor:
    """log A for A uniform in A_INIT_RANGE (Megatron's A_init_range, Mamba-2's and Gated DeltaNet's)."""
    low, high = A_INIT_RANGE
    return torch.empty(shape, device=device).uniform_(low, high, generator=generator).log()


def _dt_bias(shape, generator, device) -> torch.Tensor:
    """The inverse softplus of time steps drawn log-uniformly in DT_RANGE (floored at DT_FLOOR)."""
    low, high = (math.log(v) for v in DT_RANGE)
    dt = (torch.rand(shape, device=device, generator=generator) * (high - low) + low).exp().clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))
