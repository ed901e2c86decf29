"""Multi-token prediction (DeepSeek-V3; Megatron-Core's MultiTokenPredictionBlock): D more
depths after the decoder, depth k predicting, at position t, the token t + k + 1.

    h_0 = final_norm(decoder output)                              # what the output layer reads
    for k = 1 .. D:
        e_k = embedding(tokens shifted k to the left)              # the model's own embedding
        x   = eh_proj(cat[enorm(e_k), hnorm(h_{k-1})])             # 2h -> h, embedding first
        h_k = final_norm_k(transformer_layer_k(x))                 # one block, dense or MoE
        logits_k = output_layer(h_k)                               # the model's own output layer

Shifting moves a [batch, seq] tensor left along the sequence with zeros coming in at the
end (Megatron's roll_tensor), so depth k's last k positions have no target; their loss
mask is 0 (`depth_loss_mask`), and with packed documents so is every position whose target
lies in the next document. Such positions only ever feed later positions of their own
document, which are masked too, so the tokens they read do not matter.

The transformer layer is built like the main model's last layer (MoE if that one is), as
Megatron builds it; GPTModel holds the blocks on its last pipeline stage, next to the
output layer, and weights the losses through tessera.training.losses. Under tensor
parallelism eh_proj is column-parallel; its output is gathered (and under sequence
parallelism split along the sequence again) before the layer, as in Megatron.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.models.documents import Documents
from tessera.models.norm import build_norm
from tessera.models.transformer import TransformerBlock
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.random import DropoutRNG
from tessera.parallel.sharding import rank_and_size
from tessera.parallel.tensor import ColumnParallelLinear, scatter_to_sequence_region


def shift_left(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """A [batch, seq] tensor moved `shift` positions left along the sequence, zeros coming in."""
    shift = min(shift, tensor.shape[1])
    return torch.cat([tensor[:, shift:], tensor.new_zeros(tensor.shape[0], shift)], dim=1)


def depth_loss_mask(loss_mask: torch.Tensor, depth: int, documents: Documents | None = None) -> torch.Tensor:
    """Depth `depth`'s loss mask [batch, seq]: the LM mask of its target (shifted left), and 0
    where the target lies past the sample's end or, with packed documents, in the next document."""
    mask = shift_left(loss_mask, depth)
    if documents is None:
        return mask
    # Tokens left in each token's document, itself included (documents fill the samples row after row).
    cu_seqlens = documents.cu_seqlens.long()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    ends = torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=loss_mask.numel())
    remaining = ends - torch.arange(loss_mask.numel(), device=ends.device)
    return mask * (remaining.view_as(loss_mask) > depth).to(mask.dtype)


class MTPLayer(nn.Module):
    """One depth: the two norms, the projection of their concatenation, a transformer block, its final norm."""

    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False, moe: bool = False,
                 expert_groups: ExpertGroups | None = None):
        super().__init__()
        h = config.hidden_size
        _, tp_size = rank_and_size(tp_group)
        if h % tp_size:
            raise ConfigError(f"--hidden-size ({h}) must be divisible by --tensor-model-parallel-size ({tp_size}) "
                              "with --mtp-num-layers (the MTP projection is split over the ranks)")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.enorm = build_norm(config, tp_group, sequence_parallel)
        self.hnorm = build_norm(config, tp_group, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, init_std=config.init_method_std, tp_group=tp_group,
                                            gather_output=True, sequence_parallel=sequence_parallel)
        self.layer = TransformerBlock(config, tp_group=tp_group, sequence_parallel=sequence_parallel, rng=rng,
                                      recompute_core=recompute_core, moe=moe, expert_groups=expert_groups)
        self.final_norm = build_norm(config, tp_group, sequence_parallel)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: Documents | None = None) -> torch.Tensor:
        """embedded: the shifted tokens' embedding; hidden: the previous depth's output (both
        [b, s, h], or sequence shards under SP) -> this depth's output, the same shape."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_region(x, self.tp_group)
        return self.final_norm(self.layer(x, rope, documents))


class MultiTokenPrediction(nn.Module):
    """The --mtp-num-layers depths, `layers[k - 1]` being depth k."""

    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 rng: DropoutRNG | None = None, recompute_core: bool = False,
                 expert_groups: ExpertGroups | None = None):
        super().__init__()
        kinds = config.moe_layers(with_mtp=True)[config.num_layers:]
        self.layers = nn.ModuleList(
            MTPLayer(config, tp_group=tp_group, sequence_parallel=sequence_parallel, rng=rng,
                     recompute_core=recompute_core, moe=moe, expert_groups=expert_groups)
            for moe in kinds)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor] | None, documents: Documents | None = None
                ) -> list[torch.Tensor]:
        """Every depth's output h_1 .. h_D from h_0 (the decoder's output after its final norm);
        `embed` is the model's embedding of token ids [b, s]."""
        outputs = []
        for depth, layer in enumerate(self.layers, start=1):
            hidden = layer(embed(shift_left(input_ids, depth)), hidden, rope, documents)
            outputs.append(hidden)
        return outputs
