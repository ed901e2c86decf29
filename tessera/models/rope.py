"""Rotary position embedding (RoPE): inverse frequencies, plain or scaled for long contexts
(YaRN; LLaMA-3.1's "llama3" scaling), the cos/sin tables, and the rotation.

Both scalings mix, per frequency, the original inverse frequency theta^(-2i/d) with the
same frequency divided by the factor s:

    inv_freq_i = inv_i * keep_i + (inv_i / s) * (1 - keep_i),   keep_i in [0, 1]

High frequencies, which turn many times within the original context, keep their value
(extrapolation); low frequencies, which never complete a turn there, are interpolated.
YaRN ramps `keep` down over the dimension index across its correction range; llama3 over
the number of turns in the original context, between low_freq_factor and high_freq_factor.
YaRN also multiplies cos and sin by a concentration factor mscale(s, mscale) /
mscale(s, mscale_all_dim) with mscale(s, m) = 0.1 m ln s + 1 (Megatron's and Hugging Face's
formulas: _yarn_get_mscale in Megatron's
megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py, _compute_yarn_parameters in
transformers' modeling_rope_utils.py; YaRN, arXiv:2309.00071).

Tables are computed in float64 and stored in float32: the angles of late positions are
large, and float32 inverse frequencies would shift them by many ulps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """theta^(-2i/dim) for i < dim/2 (float64): one frequency per pair of channels."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _mix(inv_freq: torch.Tensor, factor: float, keep: torch.Tensor) -> torch.Tensor:
    return inv_freq * keep + inv_freq / factor * (1.0 - keep)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023) with Megatron's parameters (--rotary-scaling-factor, --yarn-*, --mscale*)."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True   # HF's `truncate`

    def correction_range(self, dim: int, base: float) -> tuple[float, float]:
        """[low, high]: the dimension indices that turn beta_fast and beta_slow times in the
        original context; below low frequencies are kept, above high interpolated."""
        def dimension(turns: float) -> float:
            return dim * math.log(self.original_max_positions / (2 * math.pi * turns)) / (2 * math.log(base))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inverse_frequencies(self, dim: int, base: float) -> torch.Tensor:
        low, high = self.correction_range(dim, base)
        width = high - low if high != low else 0.001   # a one-step ramp, as both references do
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / width).clamp(0.0, 1.0)
        return _mix(inverse_frequencies(dim, base), self.factor, keep=1.0 - ramp)

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (so on q.k twice): the concentration of the attention."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


@dataclass(frozen=True)
class Llama3Scaling:
    """LLaMA-3.1's rope_scaling "llama3" (--use-rope-scaling, --rope-scaling-*)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    attention_factor: float = 1.0   # llama3 leaves cos and sin as they are

    def inverse_frequencies(self, dim: int, base: float) -> torch.Tensor:
        inv_freq = inverse_frequencies(dim, base)
        turns = self.original_max_positions * inv_freq / (2 * math.pi)   # turns in the original context
        keep = ((turns - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)).clamp(0.0, 1.0)
        return _mix(inv_freq, self.factor, keep)


RopeScaling = YarnScaling | Llama3Scaling


def rope_scaling(config) -> RopeScaling | None:
    """The frequency scaling a ModelConfig asks for (None: plain RoPE; YaRN at factor 1 is plain RoPE)."""
    if config.rope_type == "yarn" and config.rotary_scaling_factor > 1:
        return YarnScaling(config.rotary_scaling_factor, config.yarn_original_max_position_embeddings,
                           config.yarn_beta_fast, config.yarn_beta_slow, config.mscale, config.mscale_all_dim,
                           config.yarn_correction_range_round_to_int)
    if config.use_rope_scaling:
        return Llama3Scaling(config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                             config.rope_scaling_high_freq_factor, config.rope_scaling_original_max_position_embeddings)
    return None


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding."""

    def __init__(self, rotary_dim: int, base: float, max_positions: int, scaling: RopeScaling | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = scaling.inverse_frequencies(rotary_dim, base) if scaling else inverse_frequencies(rotary_dim, base)
        factor = scaling.attention_factor if scaling else 1.0
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Not saved in checkpoints: derived from the config.
        self.register_buffer("cos", (angles.cos() * factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * factor).float(), persistent=False)

    def forward(self, seq_length: int, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to broadcast over [batch, seq, heads, rotary_dim]."""
        if position_ids is None:
            return self.cos[:seq_length, None, :], self.sin[:seq_length, None, :]
        return self.cos[position_ids][:, :, None, :], self.sin[position_ids][:, :, None, :]


def build_rotary(config) -> RotaryEmbedding | None:
    """The model's rotary tables, or None without RoPE. Multi-latent attention rotates only
    its positional part (--qk-pos-emb-head-dim channels per head); other attention the first
    --rotary-percent of each head."""
    if config.position_embedding_type != "rope":
        return None
    dim = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.rotary_dim
    return RotaryEmbedding(dim, config.rotary_base, config.max_position_embeddings, rope_scaling(config))
