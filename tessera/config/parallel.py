"""ParallelConfig: how the model and the batch are split over GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.fields import flag, option, positive, require

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass
class ParallelConfig:
    """How the model and the batch are split over GPUs; data parallel takes what remains."""

    tensor_model_parallel_size: int = option(1, "tensor-parallel ranks (split each layer's weights)")
    pipeline_model_parallel_size: int = option(1, "pipeline stages (split the layers)")
    context_parallel_size: int = option(1, "context-parallel ranks (split the sequence in attention)")
    cp_comm_type: list[str] = option(
        ["p2p"], "how context-parallel attention reaches other ranks' tokens (tessera.parallel.context): one "
        "value, or one per layer", CP_COMM_TYPES + ("allgather",))
    hierarchical_context_parallel_sizes: list[int] | None = option(
        None, "a2a+p2p: the all-to-all group size, then the ring's (their product is --context-parallel-size)")
    expert_model_parallel_size: int = option(1, "expert-parallel ranks (split each MoE layer's experts)")
    expert_tensor_parallel_size: int | None = option(
        None, "tensor-parallel ranks inside each expert (default --tensor-model-parallel-size)")
    moe_token_dispatcher_type: str = option(
        "allgather", "how tokens reach experts on other ranks (tessera.parallel.experts)", ("allgather", "alltoall"))
    sequence_parallel: bool = option(False, "shard norms and dropout along the sequence (needs TP > 1)")
    tp_comm_overlap: bool = option(
        False, "overlap the sequence-parallel all-gathers and reduce-scatters with the linear layers' GEMMs, "
        "in chunks passed round the TP ranks (needs --sequence-parallel)")
    use_distributed_optimizer: bool = option(False, "shard fp32 master weights and Adam moments over data-parallel ranks (ZeRO-1)")
    overlap_grad_reduce: bool = option(False, "reduce each gradient bucket during backward, as soon as it is ready")
    overlap_param_gather: bool = option(False, "all-gather updated parameters during the next forward (distributed optimizer)")
    use_torch_fsdp2: bool = option(False, "shard parameters, gradients and optimizer state with PyTorch FSDP2 (ZeRO-3)")
    ddp_bucket_size: int | None = option(None, "elements per gradient bucket (default max(40M, 1M x DP))")
    accumulate_allreduce_grads_in_fp32: bool = option(False, "with --bf16, reduce gradients in fp32 (default: bf16 on the wire)")
    virtual_pipeline_model_parallel_size: int | None = option(None, "model chunks per pipeline rank (interleaved 1F1B)")
    num_layers_per_virtual_pipeline_stage: int | None = option(None, "layers per model chunk (interleaved 1F1B; instead of --virtual-pipeline-model-parallel-size)")
    decoder_first_pipeline_num_layers: int | None = option(None, "layers on the first pipeline stage (the others split the rest evenly)")
    decoder_last_pipeline_num_layers: int | None = option(None, "layers on the last pipeline stage (the others split the rest evenly)")
    pipeline_schedule: str = option("1f1b", "pipeline schedule (1f1b interleaves with virtual stages)", ("1f1b", "gpipe"))
    overlap_p2p_communication: bool = option(
        False, "keep pipeline sends and receives in flight while the next micro-batch computes (not yet measured on GPUs)")
    distributed_timeout_minutes: float = option(
        10.0, "how long a collective (or the start-up rendezvous) may wait before it fails, naming what hung")
    print_schedule: bool = option(
        False, "print every pipeline rank's schedule and exit (without torchrun: WORLD_SIZE=N tessera train ...)")

    def __post_init__(self) -> None:
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                  "ddp_bucket_size", "distributed_timeout_minutes")
        require(not (self.use_distributed_optimizer and self.use_torch_fsdp2),
                 "--use-distributed-optimizer and --use-torch-fsdp2 are exclusive (FSDP2 already shards the optimizer)")
        require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer")
        require(not self.tp_comm_overlap or self.sequence_parallel, "--tp-comm-overlap needs --sequence-parallel")
        require(not self.tp_comm_overlap or self.tensor_model_parallel_size > 1,
                "--tp-comm-overlap needs --tensor-model-parallel-size > 1")
        positive(self, "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        require(self.virtual_pipeline_model_parallel_size is None or self.num_layers_per_virtual_pipeline_stage is None,
                 "give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, not both")
        pipeline_flags = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                          "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        for name in pipeline_flags:
            require(getattr(self, name) is None or self.pipeline_model_parallel_size > 1,
                     f"{flag(name)} needs --pipeline-model-parallel-size > 1")
        require(not self.overlap_p2p_communication or self.pipeline_model_parallel_size > 1,
                "--overlap-p2p-communication needs --pipeline-model-parallel-size > 1")
        require(not (self.use_torch_fsdp2 and self.pipeline_model_parallel_size > 1),
                 "--use-torch-fsdp2 with --pipeline-model-parallel-size > 1 is not supported")
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        # Megatron's help text spells it allgather, Transformer Engine all_gather: both mean one thing.
        self.cp_comm_type = ["all_gather" if kind == "allgather" else kind for kind in self.cp_comm_type]
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if sizes is not None:
            require(len(sizes) == 2 and all(size > 0 for size in sizes) and sizes[0] * sizes[1] == cp,
                    f"--hierarchical-context-parallel-sizes ({' '.join(map(str, sizes))}) must be two positive "
                    f"sizes whose product is --context-parallel-size ({cp})")
        require("a2a+p2p" not in self.cp_comm_type or sizes is not None,
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
        unknown = sorted(set(self.cp_comm_type) - set(CP_COMM_TYPES))
        require(not unknown, f"--cp-comm-type {' '.join(unknown)}: choose from {', '.join(CP_COMM_TYPES)}")

    def check_context_parallel_model(self, model) -> None:
        """What context parallelism asks of the model (a ModelConfig) and its sequence."""
        cp, tp, kinds = self.context_parallel_size, self.tensor_model_parallel_size, self.cp_comm_type
        require(len(kinds) in (1, model.num_layers),
                f"--cp-comm-type: give one value or one per layer (--num-layers {model.num_layers}), got {len(kinds)}")
        if cp == 1:
            return
        seq = model.seq_length
        require(seq % (2 * cp) == 0,
                f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size ({cp})")
        require(not self.sequence_parallel or (seq // cp) % tp == 0,
                f"--seq-length ({seq}) / --context-parallel-size ({cp}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}) under --sequence-parallel")
        require(model.attention_dropout == 0,
                "--attention-dropout > 0 with --context-parallel-size > 1 is not supported (set it to 0)")
        # Each CP rank holds other tokens, but the residual dropout streams are per TP rank only:
        # every CP rank would draw the same mask for its own tokens.
        require(model.hidden_dropout == 0,
                "--hidden-dropout > 0 with --context-parallel-size > 1 is not supported (set it to 0)")
        heads = model.num_attention_heads // tp
        groups = heads if model.multi_latent_attention else max(model.num_query_groups // tp, 1)
        for kind, ranks, flag_name in (("a2a", cp, "--context-parallel-size"),
                                       ("a2a+p2p", (self.hierarchical_context_parallel_sizes or [1])[0],
                                        "the first --hierarchical-context-parallel-sizes")):
            require(kind not in kinds or (heads % ranks == 0 and groups % ranks == 0),
                    f"--cp-comm-type {kind}: attention heads ({heads}) and KV groups ({groups}) per "
                    f"--tensor-model-parallel-size rank must be divisible by {flag_name} ({ranks})")

    def virtual_pipeline_size(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        per_chunk = self.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return self.virtual_pipeline_model_parallel_size or 1
        pp = self.pipeline_model_parallel_size
        require(num_layers % (pp * per_chunk) == 0,
                 f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                 f"--num-layers-per-virtual-pipeline-stage ({per_chunk})")
        return num_layers // (pp * per_chunk)

    @property
    def expert_tensor_size(self) -> int:
        """--expert-tensor-parallel-size, defaulting to --tensor-model-parallel-size as in Megatron."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        require(
            world_size % self.model_parallel_size == 0,
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size "
            f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
            f"({self.pipeline_model_parallel_size}) x --context-parallel-size ({self.context_parallel_size})",
        )
        return world_size // self.model_parallel_size
