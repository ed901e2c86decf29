"""GPTModel: embedding, a stack of transformer blocks, final norm and output layer.

One class covers GPT-2/3 (learned positions, LayerNorm, GeLU, biases, tied output
layer) and LLaMA/Qwen/Mistral (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output).

    model = GPTModel(config, tp_group=mesh.tp_group, sequence_parallel=True)
    logits = model(input_ids)                 # [batch, seq, padded vocab], on every TP rank
    loss = model(input_ids, labels=labels)    # per-token loss [batch, seq], fp32, on every TP rank
    loss = model(input_ids, labels=labels, position_ids=positions, documents=documents)  # packed samples
    losses = model(input_ids, labels=labels, mtp=True)  # [1 + MTP depths, batch, seq]: LM, then each depth

With tensor parallelism the vocabulary is split too: the loss is computed from each
rank's slice of the logits, which are gathered only when the caller asks for logits.
With sequence parallelism the embedding reduce-scatters to sequence shards, the blocks
keep them, and the head all-gathers the sequence before the output layer. With
`tp_comm_overlap` (--tp-comm-overlap) every such all-gather before a column-parallel GEMM and
reduce-scatter after a row-parallel one runs in chunks under the GEMM (tessera.parallel.tp_overlap).

Under context parallelism (`context_parallel`, tessera.parallel.context) every tensor along
the sequence holds this rank's chunks of it, position ids (default: those of the chunks)
too, so RoPE and learned positions follow the tokens.

A MoE model (--num-experts) has MoELayers in place of the MLP in the layers --moe-layer-freq
names; `expert_groups` gives them the expert-parallel process groups.

With --mtp-num-layers the model ends in multi-token prediction depths (tessera.models.mtp)
after the final norm, sharing the embedding and the output layer; `mtp=True` returns their
per-token losses beside the LM's (the trainer weights them, tessera.training.losses).

A pipeline stage is the same class built with only some blocks (`layer_indices`, named by
their global index so that initialisation and checkpoints ignore the layout), the
embedding only with `pre_process` and the final norm and output layer only with
`post_process`, the MTP depths with it; with tied embeddings or MTP the last stage keeps its
own copy of the word embedding (tessera.parallel.pipeline keeps the copies equal).
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.models.documents import Documents
from tessera.models.hybrid import build_layer
from tessera.models.moe import MoELayer
from tessera.models.mtp import MultiTokenPrediction, shift_left
from tessera.models.norm import build_norm
from tessera.models.rope import build_rotary
from tessera.parallel.context import ContextParallel
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.random import DropoutRNG, checkpoint, dropout
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size
from tessera.parallel.tensor import (
    VocabParallelEmbedding, column_parallel_linear, enable_comm_overlap, gather_from_tp_region,
    scatter_to_sequence_region, vocab_parallel_cross_entropy,
)
from tessera.parallel.tp_overlap import all_gather_matmul, eager


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation: 'selective' = attention core only; 'full' = whole blocks."""

    granularity: str | None = None   # None, "selective" or "full"
    method: str | None = None        # "uniform" (chunks of num_layers) or "block" (first num_layers)
    num_layers: int | None = None


class GPTModel(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 tp_comm_overlap: bool = False, recompute: Recompute = Recompute(),
                 layer_indices: Sequence[int] | None = None, pre_process: bool = True, post_process: bool = True,
                 expert_groups: ExpertGroups | None = None, context_parallel: ContextParallel | None = None):
        super().__init__()
        self.config = config
        self.context_parallel = context_parallel
        self.recompute = recompute
        self.tp_group = tp_group
        tp_rank, self.tp_size = rank_and_size(tp_group)
        self.sequence_parallel = sp = sequence_parallel and self.tp_size > 1
        self.vocab_size = config.padded_vocab_size(self.tp_size)
        # Dropout on tensor-parallel shards draws from a per-rank stream seeded from the
        # default generator's seed (torch.manual_seed before building the model).
        self.dropout_rng = DropoutRNG(torch.initial_seed(), tp_rank)
        std = config.init_method_std
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = None
        if pre_process or (post_process and config.last_stage_embedding):
            self.embedding = VocabParallelEmbedding(self.vocab_size, config.hidden_size, init_std=std,
                                                    tp_group=tp_group, sequence_parallel=sp)
        if config.position_embedding_type == "learned_absolute" and pre_process:
            self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            weight = self.position_embedding.weight
            annotate(weight, ShardSpec(tuple(weight.shape), None, None, tp_rank, self.tp_size), init_std=std,
                     sequence_parallel=sp)
        else:
            self.position_embedding = None
        self.rotary = build_rotary(config)
        selective = recompute.granularity == "selective"
        moe = config.moe_layers()
        self.layers = LayerStack({
            index: build_layer(config, index, tp_group=tp_group, sequence_parallel=sp, rng=self.dropout_rng,
                               recompute_core=selective, moe=moe[index], expert_groups=expert_groups,
                               context=context_parallel.layer(index) if context_parallel else None)
            for index in (range(config.num_layers) if layer_indices is None else layer_indices)
        })
        self.final_norm = build_norm(config, tp_group, sp) if post_process else None
        self.mtp = MultiTokenPrediction(config, tp_group=tp_group, sequence_parallel=sp, rng=self.dropout_rng,
                                        recompute_core=selective, expert_groups=expert_groups) \
            if post_process and config.mtp_num_layers else None
        if config.tie_embeddings or not post_process:
            self.output_weight = None
        else:
            spec = ShardSpec((self.vocab_size, config.hidden_size), 0, None, tp_rank, self.tp_size)
            self.output_weight = annotate(
                nn.Parameter(torch.empty(self.vocab_size // self.tp_size, config.hidden_size)), spec, init_std=std)
        # Full recompute must replay the per-rank stream when a recomputed layer draws from it (LoRA's
        # dropout on split inputs too: tessera.posttrain.lora sets it then).
        uses_rng = config.attention_dropout > 0 or (sp and config.hidden_dropout > 0)
        self.recompute_rng = self.dropout_rng if uses_rng else None
        self.tp_comm_overlap = tp_comm_overlap and sp
        self._overlapped_gather = eager(all_gather_matmul) if self.tp_comm_overlap else None   # the output layer's
        if self.tp_comm_overlap:
            enable_comm_overlap(self)

    # -- the three stages of the forward pass (a pipeline stage runs a subset) ---------

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ position) embeddings [b, s, h]; under SP this rank's sequence shard [b, s / TP, h]."""
        if self.sequence_parallel and input_ids.shape[1] % self.tp_size:
            raise ConfigError(f"sequence length ({input_ids.shape[1]}) must be divisible by "
                              f"--tensor-model-parallel-size ({self.tp_size}) under --sequence-parallel")
        hidden = self.embedding(input_ids)
        position_ids = self._local_positions(position_ids, input_ids.shape[1], input_ids.device)
        if self.position_embedding is not None:
            positions = position_ids if position_ids is not None else torch.arange(
                input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            if self.sequence_parallel:
                positions = scatter_to_sequence_region(positions, self.tp_group)
            hidden = hidden + self.position_embedding(positions)
        return dropout(hidden, self.config.hidden_dropout, self.training,
                       self.dropout_rng if self.sequence_parallel else None)

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                   documents: Documents | None = None,
                   layers: Sequence[nn.Module] | None = None) -> torch.Tensor:
        """The blocks (default all this model holds; a pipeline chunk passes its own) over `hidden`;
        with `documents` (packed samples) attention stays within each document."""
        rope = self._rope(hidden, position_ids)
        layers = list(self.layers if layers is None else layers)
        for start, end, recomputed in self.layer_chunks(len(layers)):
            def run(h, chunk=layers[start:end]):
                for layer in chunk:
                    h = layer(h, rope, documents)
                return h
            if recomputed and self.training:
                hidden = checkpoint(run, hidden, rng=self.recompute_rng, replay=self._routers_paused)
            else:
                hidden = run(hidden)
        return hidden

    def _rope(self, hidden: torch.Tensor, position_ids: torch.Tensor | None):
        seq_length = hidden.shape[1] * (self.tp_size if self.sequence_parallel else 1)
        position_ids = self._local_positions(position_ids, seq_length, hidden.device)
        return self.rotary(seq_length, position_ids) if self.rotary is not None else None

    def _local_positions(self, position_ids: torch.Tensor | None, seq_length: int, device) -> torch.Tensor | None:
        """Under context parallelism, positions default to those of this rank's chunks."""
        if position_ids is not None or self.context_parallel is None:
            return position_ids
        return self.context_parallel.local_positions(seq_length, device)

    def moe_layers(self) -> dict[int, MoELayer]:
        """This model's MoE layers by global layer index (MTP depth k's: num_layers + k - 1)."""
        blocks = list(self.layers.items())
        if self.mtp is not None:
            blocks += [(self.config.num_layers + k, depth.layer) for k, depth in enumerate(self.mtp.layers)]
        return {index: block.mlp for index, block in blocks if isinstance(getattr(block, "mlp", None), MoELayer)}

    @contextlib.contextmanager
    def _routers_paused(self):
        """While full recomputation replays a forward, routers do not count its tokens again."""
        routers = [moe.router for moe in self.moe_layers().values()]
        for router in routers:
            router.recording = False
        try:
            yield
        finally:
            for router in routers:
                router.recording = True

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, v], or the fp32 per-token loss [b, s] when labels are given."""
        return self._output_layer(self.final_norm(hidden), labels)

    def head_with_mtp(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                      position_ids: torch.Tensor | None = None, documents: Documents | None = None) -> torch.Tensor:
        """fp32 per-token losses [1 + D, b, s]: the LM's, then MTP depth k's against the labels
        shifted k further left (its target at position t is token t + k + 1)."""
        hidden = self.final_norm(hidden)
        depths = self.mtp(hidden, input_ids, self.embed, self._rope(hidden, position_ids), documents)
        return torch.stack([self._output_layer(hidden, labels)] +
                           [self._output_layer(h, shift_left(labels, k)) for k, h in enumerate(depths, start=1)])

    def _output_layer(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        weight = self.embedding.weight if self.output_weight is None else self.output_weight
        logits = column_parallel_linear(hidden, weight, None, self.tp_group, sequence_parallel=self.sequence_parallel,
                                        overlapped_gather=self._overlapped_gather)  # this rank's vocabulary slice
        if labels is None:
            return gather_from_tp_region(logits, self.tp_group)
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                documents: Documents | None = None, *, mtp: bool = False) -> torch.Tensor:
        hidden = self.run_layers(self.embed(input_ids, position_ids), position_ids, documents)
        if mtp:
            return self.head_with_mtp(hidden, input_ids, labels, position_ids, documents)
        return self.head(hidden, labels)

    def layer_chunks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """(start, end, recomputed) ranges of layers run together."""
        r = self.recompute
        if r.granularity != "full":
            return [(0, num_layers, False)]
        if r.method == "uniform":
            return [(i, min(i + r.num_layers, num_layers), True) for i in range(0, num_layers, r.num_layers)]
        return [(i, i + 1, i < r.num_layers) for i in range(num_layers)]


class LayerStack(nn.Module):
    """Transformer blocks named by their global layer index: a pipeline stage holding layers
    4-7 names their parameters `layers.4...` to `layers.7...`, as the whole model does."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    def __iter__(self):
        return iter(self._modules.values())

    def items(self):
        return ((int(index), block) for index, block in self._modules.items())

    def __len__(self) -> int:
        return len(self._modules)


def _parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int) -> None:
    """Initialise every parameter from (seed, parameter name) alone.

    Each full tensor is drawn from its own generator and then cut to this rank's shard,
    so the same seed gives the same full model for any parallel layout.
    """
    for name, param in model.named_parameters():
        initialize_parameter(param, name, seed)


@torch.no_grad()
def initialize_parameter(param: nn.Parameter, name: str, seed: int) -> None:
    """One parameter of initialize_parameters (`name`: its name in the whole model)."""
    spec = getattr(param, "shard_spec", ShardSpec(tuple(param.shape)))
    std = getattr(param, "init_std", None)
    init_full = getattr(param, "init_full", None)   # a draw of its own: (shape, generator, device) -> tensor
    if std is None and init_full is None:
        full = torch.full(spec.full_shape, getattr(param, "init_value", 0.0), device=param.device)
    else:
        generator = torch.Generator(device=param.device).manual_seed(_parameter_seed(seed, name))
        if init_full is not None:
            full = init_full(spec.full_shape, generator, param.device)
        else:
            full = torch.empty(spec.full_shape, device=param.device).normal_(0.0, std, generator=generator)
    param.copy_(spec.shard(full))
