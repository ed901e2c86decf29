"""The transformer block: pre-norm attention, then pre-norm MLP or Mixture of Experts.

Activations are [batch, seq, hidden]. Linear layers come from tessera.parallel.tensor,
so the same code runs unsplit (TP=1) or split over tensor-parallel ranks: attention
heads and KV groups and the MLP's inner features are split; the block's input and output
are whole, or with sequence parallelism split along the sequence, and so are the norms
and the residual dropout. The parts are modules of their own: attention.py, mlp.py,
moe.py (router.py, and tessera.parallel.experts for the token dispatch), norm.py, rope.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.models.attention import Attention
from tessera.models.documents import Documents
from tessera.models.mla import MultiLatentAttention
from tessera.models.mlp import MLP
from tessera.models.moe import MoELayer
from tessera.models.norm import build_norm
from tessera.parallel.context import ContextAttention
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.random import DropoutRNG, dropout


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)), with dropout on each branch.

    With `moe=True` the MLP is a MoELayer (router, experts, optional shared expert); `window`
    makes the attention a sliding window over that many earlier tokens (--window-size).
    """

    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False, moe: bool = False,
                 expert_groups: ExpertGroups | None = None, context: ContextAttention | None = None,
                 window: int | None = None):
        super().__init__()
        # Output projections are scaled by 1/sqrt(2 * layers) so the residual stream's
        # variance does not grow with depth (GPT-2, Megatron).
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.input_norm = build_norm(config, tp_group, sequence_parallel)
        attention = MultiLatentAttention if config.multi_latent_attention else Attention
        self.attention = attention(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   rng=rng, recompute_core=recompute_core, context=context,
                                   **({"window": window} if window is not None else {}))
        self.post_attention_norm = build_norm(config, tp_group, sequence_parallel)
        if moe:
            self.mlp = MoELayer(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                groups=expert_groups)
        else:
            self.mlp = MLP(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.hidden_dropout = config.hidden_dropout
        # The residual stream is replicated over TP ranks (same mask: default generator)
        # or, under SP, split along the sequence (each rank's own mask).
        self.hidden_rng = rng if sequence_parallel else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.input_norm(x), rope, documents))
        return x + self._dropout(self.mlp(self.post_attention_norm(x)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.hidden_rng)
