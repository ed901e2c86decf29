"""ParallelConfig: how the model and the batch are split over GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.fields import flag, option, positive, require

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")   # Megatron's, least first


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
    data_parallel_sharding_strategy: str | None = option(
        None, "what each data-parallel rank keeps 1/DP of: no_shard (DDP), optim (fp32 masters and Adam "
        "moments: the distributed optimizer, ZeRO-1), optim_grads (also the gradients: FSDP2 keeping each "
        "block's gathered weights from its forward to its backward, ZeRO-2's peak memory and one all-gather "
        "per micro-batch; the weights sharded between steps), optim_grads_params (also the weights: FSDP2, "
        "ZeRO-3). Default: what --use-distributed-optimizer, --use-torch-fsdp2 or --use-megatron-fsdp ask "
        "for, else no_shard", SHARDING_STRATEGIES)
    use_distributed_optimizer: bool = option(
        False, "shard fp32 master weights and Adam moments over data-parallel ranks (ZeRO-1: "
        "--data-parallel-sharding-strategy optim)")
    overlap_grad_reduce: bool = option(False, "reduce each gradient bucket during backward, as soon as it is ready")
    overlap_param_gather: bool = option(
        False, "all-gather updated parameters during the next forward (distributed optimizer; FSDP2 prefetches "
        "the next block's gather on its own)")
    use_torch_fsdp2: bool = option(
        False, "shard parameters, gradients and optimizer state with PyTorch FSDP2 (ZeRO-3: "
        "--data-parallel-sharding-strategy optim_grads_params)")
    torch_fsdp2_no_reshard_after_forward: bool = option(
        False, "FSDP2 keeps each block's gathered weights from its forward to its backward instead of gathering "
        "them again (--data-parallel-sharding-strategy optim_grads)")
    use_megatron_fsdp: bool = option(
        False, "Megatron-FSDP's switch (also --use-custom-fsdp): tessera runs PyTorch FSDP2 with "
        "--data-parallel-sharding-strategy (default optim_grads_params, as Megatron's); no_shard and optim run "
        "DDP and the distributed optimizer. --use-distributed-optimizer, which Megatron-FSDP implies, is accepted")
    num_distributed_optimizer_instances: int = option(
        1, "copies of the sharded state (HSDP): each of --data-parallel-sharding-strategy's shards is spread "
        "over DP / N consecutive data-parallel ranks (x CP) and replicated over the N groups; gradients are "
        "summed over all. With optim: Megatron's partial distributed optimizer")
    outer_dp_sharding_strategy: str = option(
        "no_shard", "what the N copies of --num-distributed-optimizer-instances share: no_shard (HSDP) only; "
        "optim (Megatron-FSDP's hybrid FSDP) is not supported", ("no_shard", "optim"))
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
                  "ddp_bucket_size", "distributed_timeout_minutes", "num_distributed_optimizer_instances")
        fsdp2 = self._resolve_sharding_strategy()
        require(not self.overlap_param_gather or self.use_distributed_optimizer or self.use_megatron_fsdp,
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
                 f"{fsdp2} with --pipeline-model-parallel-size > 1 is not supported")
        self._check_hsdp()
        self._check_context_parallel()

    def _resolve_sharding_strategy(self) -> str:
        """Set --data-parallel-sharding-strategy and the switches it stands for (use_distributed_optimizer,
        use_torch_fsdp2, torch_fsdp2_no_reshard_after_forward) from whichever were given; refuse
        contradictions. Returns the flag that asked for FSDP2, for messages."""
        strategy, no_reshard = self.data_parallel_sharding_strategy, self.torch_fsdp2_no_reshard_after_forward
        require(not (self.use_distributed_optimizer and self.use_torch_fsdp2),
                 "--use-distributed-optimizer and --use-torch-fsdp2 are exclusive (FSDP2 already shards the optimizer)")
        require(not (self.use_megatron_fsdp and self.use_torch_fsdp2),
                "--use-megatron-fsdp and --use-torch-fsdp2 are exclusive (tessera runs FSDP2 for both)")
        fsdp = "--use-torch-fsdp2" if self.use_torch_fsdp2 else "--use-megatron-fsdp"
        if strategy is None:
            require(not no_reshard or self.use_torch_fsdp2 or self.use_megatron_fsdp,
                    "--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
            if self.use_torch_fsdp2 or self.use_megatron_fsdp:
                strategy = "optim_grads" if no_reshard else "optim_grads_params"
            else:
                strategy = "optim" if self.use_distributed_optimizer else "no_shard"
        else:
            given = f"--data-parallel-sharding-strategy {strategy}"
            # --use-distributed-optimizer asks for sharded optimizer state, which every strategy but
            # no_shard has; outside Megatron-FSDP (which implies it) it means the distributed optimizer.
            require(not (self.use_distributed_optimizer and strategy == "no_shard"),
                    f"{given} contradicts --use-distributed-optimizer (which shards the optimizer state)")
            require(not (self.use_distributed_optimizer and strategy != "optim" and not self.use_megatron_fsdp),
                    f"{given} runs FSDP2, which shards the optimizer itself: it contradicts "
                    "--use-distributed-optimizer (Megatron's distributed optimizer is strategy optim)")
            require(not (self.use_torch_fsdp2 and strategy in ("no_shard", "optim")),
                    f"{given} contradicts --use-torch-fsdp2 (which shards the weights and gradients too)")
            require(not (no_reshard and strategy != "optim_grads"),
                    f"{given} contradicts --torch-fsdp2-no-reshard-after-forward (which is strategy optim_grads)")
            fsdp = given
        self.data_parallel_sharding_strategy = strategy
        self.use_distributed_optimizer = strategy == "optim"
        self.use_torch_fsdp2 = strategy in ("optim_grads", "optim_grads_params")
        self.torch_fsdp2_no_reshard_after_forward = strategy == "optim_grads"
        return fsdp

    def _check_hsdp(self) -> None:
        """--num-distributed-optimizer-instances: what replicating the sharded state combines with."""
        flag_name = f"--num-distributed-optimizer-instances {self.num_distributed_optimizer_instances}"
        require(self.outer_dp_sharding_strategy == "no_shard",
                "--outer-dp-sharding-strategy optim (Megatron-FSDP's hybrid FSDP: optimizer state sharded over "
                "all data-parallel ranks) is not supported; use no_shard")
        if self.num_distributed_optimizer_instances == 1:
            return
        require(self.data_parallel_sharding_strategy != "no_shard",
                f"{flag_name} replicates sharded state: it needs --data-parallel-sharding-strategy optim, "
                "optim_grads or optim_grads_params (or --use-distributed-optimizer / --use-torch-fsdp2)")
        # PP: the tied embedding's gradient is summed over the stages' owners of each slice, one per
        # data-parallel rank, which replicas would count N times.
        require(self.pipeline_model_parallel_size == 1,
                f"{flag_name} with --pipeline-model-parallel-size > 1 is not supported")
        require(self.expert_model_parallel_size == 1 and self.expert_tensor_size == self.tensor_model_parallel_size,
                f"{flag_name} with --expert-model-parallel-size > 1 or --expert-tensor-parallel-size != "
                "--tensor-model-parallel-size is not supported (expert weights would need replicas of their own)")

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
        dp, replicas = world_size // self.model_parallel_size, self.num_distributed_optimizer_instances
        require(dp % replicas == 0, f"data-parallel size ({dp}) must be divisible by "
                f"--num-distributed-optimizer-instances ({replicas})")
        require(replicas == 1 or dp * self.context_parallel_size > replicas,
                f"--num-distributed-optimizer-instances ({replicas}) = data-parallel size ({dp}) x "
                f"--context-parallel-size ({self.context_parallel_size}): each copy of the state would sit unsharded "
                "on one rank (use --data-parallel-sharding-strategy no_shard)")
        return dp
