"""GPTModel: embedding, a stack of transformer blocks, final norm and output layer.

One class covers GPT-2/3 (learned positions, LayerNorm, GeLU, biases, tied output
layer) and LLaMA/Qwen/Mistral (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output).

    model = GPTModel(config)
    logits = model(input_ids)                 # [batch, seq, padded vocab]
    loss = model(input_ids, labels=labels)    # per-token loss [batch, seq], fp32
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.config import ModelConfig
from tessera.models.transformer import RotaryEmbedding, TransformerBlock, build_norm
from tessera.parallel.tensor import ShardSpec, VocabParallelEmbedding, vocab_parallel_cross_entropy


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation: 'selective' = attention core only; 'full' = whole blocks."""

    granularity: str | None = None   # None, "selective" or "full"
    method: str | None = None        # "uniform" (chunks of num_layers) or "block" (first num_layers)
    num_layers: int | None = None


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_group=None, recompute: Recompute = Recompute()):
        super().__init__()
        self.config = config
        self.recompute = recompute
        self.tp_group = tp_group
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.vocab_size = config.padded_vocab_size(tp_size)
        std = config.init_method_std
        self.embedding = VocabParallelEmbedding(self.vocab_size, config.hidden_size, init_std=std, tp_group=tp_group)
        if config.position_embedding_type == "learned_absolute":
            self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            self.position_embedding.weight.shard_spec = ShardSpec(tuple(self.position_embedding.weight.shape))
            self.position_embedding.weight.init_std = std
        else:
            self.position_embedding = None
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.rotary_base, config.max_position_embeddings)
                       if config.position_embedding_type == "rope" else None)
        selective = recompute.granularity == "selective"
        self.layers = nn.ModuleList(
            TransformerBlock(config, tp_group, recompute_core=selective) for _ in range(config.num_layers)
        )
        self.final_norm = build_norm(config)
        if config.tie_embeddings:
            self.output_weight = None
        else:
            self.output_weight = VocabParallelEmbedding(self.vocab_size, config.hidden_size,
                                                        init_std=std, tp_group=tp_group).weight

    # -- the three stages of the forward pass (a pipeline stage runs a subset) ---------

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embedding(input_ids)
        if self.position_embedding is not None:
            positions = position_ids if position_ids is not None else torch.arange(
                input_ids.shape[1], device=input_ids.device)
            hidden = hidden + self.position_embedding(positions)
        p = self.config.hidden_dropout
        return F.dropout(hidden, p, self.training) if p > 0 else hidden

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        rope = self.rotary(hidden.shape[1], position_ids) if self.rotary is not None else None
        layers = list(self.layers)
        for start, end, recomputed in self._layer_chunks(len(layers)):
            def run(h, chunk=layers[start:end]):
                for layer in chunk:
                    h = layer(h, rope, attention_mask)
                return h
            hidden = checkpoint(run, hidden, use_reentrant=False) if recomputed and self.training else run(hidden)
        return hidden

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, v], or the fp32 per-token loss [b, s] when labels are given."""
        weight = self.embedding.weight if self.output_weight is None else self.output_weight
        logits = F.linear(self.final_norm(hidden), weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.run_layers(self.embed(input_ids, position_ids), position_ids, attention_mask)
        return self.head(hidden, labels)

    def _layer_chunks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """(start, end, recomputed) ranges of layers run together."""
        r = self.recompute
        if r.granularity != "full":
            return [(0, num_layers, False)]
        if r.method == "uniform":
            return [(i, min(i + r.num_layers, num_layers), True) for i in range(0, num_layers, r.num_layers)]
        return [(i, i + 1, i < r.num_layers) for i in range(num_layers)]


def _parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int) -> None:
    """Initialise every parameter from (seed, parameter name) alone.

    Each full tensor is drawn from its own generator and then cut to this rank's shard,
    so the same seed gives the same full model for any parallel layout.
    """
    for name, param in model.named_parameters():
        spec = getattr(param, "shard_spec", ShardSpec(tuple(param.shape)))
        std = getattr(param, "init_std", None)
        if std is None:
            full = torch.full(spec.full_shape, getattr(param, "init_value", 0.0), device=param.device)
        else:
            generator = torch.Generator(device=param.device).manual_seed(_parameter_seed(seed, name))
            full = torch.empty(spec.full_shape, device=param.device).normal_(0.0, std, generator=generator)
        param.copy_(spec.shard(full))
