"""The layers of a hybrid stack (--hybrid-layer-pattern, tessera.config.hybrid): one pre-norm residual
layer per symbol, as Megatron-Core's HybridModel and transformers' NemotronH build them.

    M  x + mixer(norm(x))       the Mamba-2 mixer (tessera.models.mamba)
    G  x + mixer(norm(x))       the Gated DeltaNet mixer (tessera.models.gated_deltanet)
    *  x + attention(norm(x))   the transformer block's attention (RoPE when the model has it)
    -  x + mlp(norm(x))         the transformer block's MLP
    E  x + mlp(norm(x))         a MoELayer

Without a pattern every layer is a TransformerBlock (attention and MLP in one layer);
`build_layer` gives GPTModel the right one for a global layer index.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.config.hybrid import ATTENTION, GATED_DELTANET, MAMBA, MLP as MLP_SYMBOL, layer_symbols
from tessera.models.attention import Attention
from tessera.models.documents import Documents
from tessera.models.gated_deltanet import GatedDeltaNet
from tessera.models.mamba import MambaMixer
from tessera.models.mlp import MLP
from tessera.models.moe import MoELayer
from tessera.models.norm import build_norm
from tessera.models.transformer import TransformerBlock
from tessera.parallel.context import ContextAttention
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.random import DropoutRNG, dropout


def build_layer(config: ModelConfig, index: int, *, moe: bool, **kwargs) -> nn.Module:
    """Layer `index` of the model: a TransformerBlock, or the pattern's layer of a hybrid stack."""
    if config.hybrid_layer_pattern is None:
        return TransformerBlock(config, moe=moe, window=config.window_layers()[index], **kwargs)
    return HybridLayer(config, layer_symbols(config.hybrid_layer_pattern)[index], **kwargs)


class HybridLayer(nn.Module):
    """x + dropout(f(norm(x))) for one symbol's f; its module is named as in a TransformerBlock
    (`attention`, `mlp`) or `mixer` for Mamba-2 and Gated DeltaNet, so that checkpoints read alike."""

    def __init__(self, config: ModelConfig, symbol: str, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False,
                 expert_groups: ExpertGroups | None = None, context: ContextAttention | None = None):
        super().__init__()
        self.symbol = symbol
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        split = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.input_norm = build_norm(config, tp_group, sequence_parallel)
        if symbol == MAMBA:
            self.mixer = MambaMixer(config, output_std, **split)
        elif symbol == GATED_DELTANET:
            self.mixer = GatedDeltaNet(config, output_std, **split)
        elif symbol == ATTENTION:
            self.attention = Attention(config, output_std, rng=rng, recompute_core=recompute_core, context=context,
                                       **split)
        elif symbol == MLP_SYMBOL:
            self.mlp = MLP(config, output_std, **split)
        else:
            self.mlp = MoELayer(config, output_std, groups=expert_groups, **split)
        self.hidden_dropout = config.hidden_dropout
        self.hidden_rng = rng if sequence_parallel else None   # as TransformerBlock's residual dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        hidden = self.input_norm(x)
        if hasattr(documents, "mix"):   # generation: the engine's per-request state (tessera.inference.recurrent_state)
            return x + documents.mix(self.mixer, hidden)
        if self.symbol in (MAMBA, GATED_DELTANET):
            hidden = self.mixer(hidden, documents)
        elif self.symbol == ATTENTION:
            hidden = self.attention(hidden, rope, documents)
        else:
            hidden = self.mlp(hidden)
        return x + dropout(hidden, self.hidden_dropout, self.training, self.hidden_rng)
