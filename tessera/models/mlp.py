"""The feed-forward block: GeLU or squared ReLU, or SwiGLU with gate and up projections fused in
one GEMM (the activation applied by fc2, tessera.parallel.tensor.RowParallelLinear); other gated
activations (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value) between the
GEMMs, tessera.models.gated_activation.

Column-parallel fc1 and row-parallel fc2: the inner features are split over tensor-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.models.gated_activation import gated_activation
from tessera.parallel.sharding import rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """Feed-forward block: GeLU, or SwiGLU with gate and up projections fused in one GEMM."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False,
                 ffn_hidden_size: int | None = None, ffn_flag: str = "--ffn-hidden-size"):
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_hidden_size   # a MoE's shared expert has its own width
        self.swiglu = config.swiglu
        self.activation = "swiglu" if config.swiglu else "squared_relu" if config.squared_relu \
            else "gelu_tanh" if config.openai_gelu else "gelu"
        self.gated_activation = gated_activation(config)
        gated = config.gated_linear_unit
        _, tp_size = rank_and_size(tp_group)
        if ffn % tp_size:
            raise ConfigError(f"{ffn_flag} ({ffn}) must be divisible by --tensor-model-parallel-size ({tp_size})")
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if gated else ffn, bias=config.add_bias_linear,
            init_std=config.init_method_std, segments=(ffn, ffn) if gated else None,
            tp_group=tp_group, sequence_parallel=sequence_parallel,
        )
        self.fc2 = RowParallelLinear(ffn, config.hidden_size, bias=config.add_bias_linear, init_std=output_std,
                                     tp_group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_activation is not None:
            return self.fc2(self.gated_activation(self.fc1(x)))
        return self.fc2(self.fc1(x), activation=self.activation)   # fused with fc2's GEMM where it can
