"""RunConfig: every section of a training run, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from tessera.config.data import DataConfig
from tessera.config.fields import ConfigError, require
from tessera.config.hybrid import PIPE, check_hybrid_layout, stage_ranges
from tessera.config.model import ModelConfig
from tessera.config.moe import aux_loss_coefficients, check_expert_layout
from tessera.config.parallel import ParallelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.config.training import CheckpointConfig, OptimConfig, TrainConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "posttrain": PostTrainConfig,
}


@dataclass
class RunConfig:
    """Everything a training run needs; cross-section checks happen here."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(train_iters=1))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    posttrain: PostTrainConfig = field(default_factory=PostTrainConfig)
    world_size: int | None = None   # default: the job's (tessera.parallel.launch.job_world_size)
    notes: list[str] = field(default_factory=list, init=False)   # settings changed on the way, said at start

    def __post_init__(self) -> None:
        if self.world_size is None:
            from tessera.parallel.launch import LaunchError, job_world_size

            try:
                self.world_size = job_world_size()
            except LaunchError as exc:
                raise ConfigError(str(exc)) from None
        model, parallel, train = self.model, self.parallel, self.train
        dp = parallel.data_parallel_size(self.world_size)
        per_step = train.micro_batch_size * dp
        if train.global_batch_size is None:
            train.global_batch_size = per_step
        self._count_iterations()
        require(
            train.global_batch_size % per_step == 0,
            f"--global-batch-size ({train.global_batch_size}) must be divisible by --micro-batch-size "
            f"({train.micro_batch_size}) x data-parallel size ({dp}) = {per_step}",
        )
        tp = parallel.tensor_model_parallel_size
        if parallel.sequence_parallel and tp == 1:   # as Megatron-LM's validate_args: nothing to split
            parallel.sequence_parallel = False
            self.notes.append("note: --sequence-parallel is off: it splits the sequence over tensor-parallel "
                              "ranks, and --tensor-model-parallel-size is 1")
        # The chunked GEMMs run outside Fp8Linear's scaling and FP8 backward.
        require(not (parallel.tp_comm_overlap and train.fp8_format),
                "--tp-comm-overlap with --fp8-format is not supported")
        # The weights' E4M3 copies are cast by the distributed optimizer, slice by slice, or for
        # FSDP2's gathers shard by shard (tessera.parallel.fsdp_fp8).
        require(not train.fp8_param_gather or parallel.use_distributed_optimizer or parallel.use_torch_fsdp2,
                "--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2 (a "
                "--data-parallel-sharding-strategy other than no_shard)")
        # Dynamo would have to trace the gathered weight, a tensor subclass, through the FP8 GEMMs.
        require(not (train.fp8_param_gather and parallel.use_torch_fsdp2 and train.compile),
                "--fp8-param-gather with --use-torch-fsdp2 does not combine with --compile (use --no-compile)")
        # As Megatron: the moments' dtypes are the distributed optimizer's (its own AdamW kernel).
        require(not self.optim.use_precision_aware_optimizer or parallel.use_distributed_optimizer,
                "--use-precision-aware-optimizer needs the distributed optimizer (--use-distributed-optimizer, "
                f"--data-parallel-sharding-strategy optim); this run's strategy is "
                f"{parallel.data_parallel_sharding_strategy}")
        require(
            model.num_attention_heads % tp == 0,
            f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        parallel.virtual_pipeline_size(model.num_layers)  # checks --num-layers-per-virtual-pipeline-stage
        parallel.check_context_parallel_model(model)
        self._check_hybrid()
        # Each context-parallel rank holds pieces of the sequence: the tokens a depth shifts in
        # would come from another rank's piece.
        require(not model.mtp_num_layers or parallel.context_parallel_size == 1,
                "--mtp-num-layers with --context-parallel-size > 1 is not supported (the MTP depths' shifted "
                "tokens cross the context-parallel split)")
        self._check_dpo()
        self._check_grpo()
        self._check_optimizer()
        self._check_experts()
        self._check_cuda_graph()
        if train.recompute_granularity == "full" and train.recompute_method == "uniform":
            require(
                model.num_layers % train.recompute_num_layers == 0,
                f"--recompute-num-layers ({train.recompute_num_layers}) must divide --num-layers "
                f"({model.num_layers}) with --recompute-method uniform",
            )

    def _count_iterations(self) -> None:
        """--train-samples: as many iterations as whole global batches fit (Megatron-LM's
        update_train_iters, without a batch-size ramp)."""
        train = self.train
        self.optim.check_schedule_units(sample_based=train.train_samples is not None)
        if train.train_samples is None:
            return
        iterations = train.train_samples // train.global_batch_size
        require(iterations > 0, f"--train-samples ({train.train_samples}) is less than one --global-batch-size "
                                f"({train.global_batch_size})")
        require(train.train_iters in (None, iterations),
                f"give --train-iters or --train-samples, not both (--train-samples {train.train_samples} is "
                f"{iterations} iterations of {train.global_batch_size})")
        train.train_iters = iterations

    def _check_dpo(self) -> None:
        """What DPO's rows and reference ask of the layout (tessera.posttrain.dpo)."""
        if not self.posttrain.dpo:
            return
        require(self.train.micro_batch_size % 2 == 0, "--dpo: --micro-batch-size counts rows, and a preference "
                f"pair is two (chosen, rejected): give an even number (got {self.train.micro_batch_size})")
        require(not self.model.mtp_num_layers, "--dpo with --mtp-num-layers is not supported (DPO scores the answers "
                "with the LM head alone)")

    def _check_grpo(self) -> None:
        """What GRPO's rollouts ask of the run: the engine reads the trainer's weights, whole layers on
        every rank of a tensor-parallel group, the whole model on every rank of a pipeline group
        (tessera.posttrain.grpo_rollout, grpo_gather)."""
        post, parallel, model = self.posttrain, self.parallel, self.model
        if not post.grpo:
            return
        rows = self.train.global_batch_size // self.data_parallel_size
        require(rows % post.grpo_group_size == 0, f"--grpo: the {rows} rows a data-parallel rank trains each step "
                f"(--global-batch-size / data-parallel size) must hold whole groups of --grpo-group-size "
                f"{post.grpo_group_size}")
        refused = [("--pipeline-model-parallel-size > 1 and --moe-enable-routing-replay",
                    parallel.pipeline_model_parallel_size > 1 and post.moe_enable_routing_replay,
                    "the replay finds its rows by the model's forward, which a pipeline stage does not run"),
                   ("--context-parallel-size > 1", parallel.context_parallel_size > 1,
                    "the engine runs whole sequences"),
                   ("--sequence-parallel", parallel.sequence_parallel, "the engine's steps hold a few tokens"),
                   ("--use-torch-fsdp2", parallel.use_torch_fsdp2, "the engine reads whole weights"),
                   ("--expert-model-parallel-size or --expert-tensor-parallel-size > 1",
                    bool(model.num_experts) and parallel.expert_model_parallel_size * parallel.expert_tensor_size > 1,
                    "each rank's engine steps on its own prompts: the experts' collectives need the ranks in step"),
                   ("--moe-router-load-balancing-type global_aux_loss on data-parallel ranks",
                    bool(model.num_experts) and "global_aux_loss" in aux_loss_coefficients(model)
                    and self.data_parallel_size > 1,
                    "its expert counts are all-reduced over the ranks in every forward, and each rank's engine "
                    "steps on its own prompts"),
                   ("--mtp-num-layers", bool(model.mtp_num_layers), "GRPO scores the answers with the LM head alone"),
                   ("--fp8-format", bool(self.train.fp8_format), "the engine runs the weights as they are stored"),
                   ("--cuda-graph-impl full_iteration", self.train.cuda_graph_impl != "none",
                    "its per-row advantages are not in the captured step"),
                   ("--eval-interval", bool(self.train.eval_interval),
                    "score held-out prompts with tessera generate"),
                   ("--mock-data", self.data.mock_data, "GRPO reads prompts from --data-path")]
        for name, given, why in refused:
            require(not given, f"--grpo does not combine with {name} ({why})")
        if post.moe_enable_routing_replay:
            require(bool(model.num_experts), "--moe-enable-routing-replay needs a MoE model (--num-experts)")
            require(not model.moe_expert_capacity_factor, "--moe-enable-routing-replay does not combine with "
                    "--moe-expert-capacity-factor (an expert drops tokens by the batch they are in, which differs "
                    "between rollout and training)")

    def _check_optimizer(self) -> None:
        """What --optimizer sgd and muon take of the data-parallel layout (tessera.training.optimizer)."""
        optimizer, parallel = self.optim.optimizer, self.parallel
        # The distributed optimizer's own kernel is AdamW's.
        require(not (optimizer == "sgd" and parallel.use_distributed_optimizer),
                "--optimizer sgd with --use-distributed-optimizer is not supported yet (use --optimizer adam, or "
                "--data-parallel-sharding-strategy no_shard)")
        # Offload keeps the distributed optimizer's state (fp32 masters apart from the weights) on the host.
        if self.optim.optimizer_cpu_offload:
            require(parallel.use_distributed_optimizer, "--optimizer-cpu-offload needs --use-distributed-optimizer "
                    "(one GPU too: it keeps the fp32 masters apart from the weights)")
            require(optimizer == "adam", f"--optimizer-cpu-offload offloads AdamW's state: it does not combine with "
                    f"--optimizer {optimizer}")
            require(self.train.cuda_graph_impl == "none", "--optimizer-cpu-offload does not combine with "
                    "--cuda-graph-impl (its first copies start inside the captured backward)")
        if optimizer != "muon":
            return
        # Newton-Schulz needs whole matrices: FSDP2 cuts every one over the data-parallel ranks.
        require(not parallel.use_torch_fsdp2, "--optimizer muon does not combine with --use-torch-fsdp2 (a "
                "--data-parallel-sharding-strategy of optim_grads or optim_grads_params); use "
                "--use-distributed-optimizer, which gives each data-parallel rank whole matrices")
        require(parallel.num_distributed_optimizer_instances == 1,
                "--optimizer muon with --num-distributed-optimizer-instances > 1 is not supported yet")
        require(not self.train.fp8_param_gather, "--optimizer muon does not combine with --fp8-param-gather (Muon's "
                "matrices are gathered whole, in fp32)")

    def _check_hybrid(self) -> None:
        """What the layout asks of a hybrid stack: Mamba-2 heads and groups split over TP, no CP, and
        pipeline stages where the pattern's '|' put them (tessera.config.hybrid)."""
        model, parallel = self.model, self.parallel
        check_hybrid_layout(model, tp=parallel.tensor_model_parallel_size, cp=parallel.context_parallel_size)
        pp = parallel.pipeline_model_parallel_size
        if model.hybrid_layer_pattern is None or PIPE not in model.hybrid_layer_pattern or pp == 1:
            return
        require((parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers) == (None, None),
                "--decoder-first/last-pipeline-num-layers do not combine with '|' in --hybrid-layer-pattern (the "
                "pattern places the stages)")
        chunks = len(stage_ranges(model.hybrid_layer_pattern, pp)) // pp
        require(chunks == parallel.virtual_pipeline_size(model.num_layers),
                f"--hybrid-layer-pattern's '|' cut {chunks * pp} stages, {chunks} per pipeline rank: give "
                f"--virtual-pipeline-model-parallel-size {chunks} (or as many segments as "
                f"--pipeline-model-parallel-size {pp})")

    def _check_experts(self) -> None:
        parallel = self.parallel
        if self.model.num_experts is None:
            require(parallel.expert_tensor_parallel_size is None, "--expert-tensor-parallel-size needs --num-experts")
        check_expert_layout(self.model, tp=parallel.tensor_model_parallel_size, cp=parallel.context_parallel_size,
                            dp=self.data_parallel_size, ep=parallel.expert_model_parallel_size,
                            etp=parallel.expert_tensor_size, sequence_parallel=parallel.sequence_parallel)

    def _check_cuda_graph(self) -> None:
        """What a captured step cannot hold (tessera.training.cuda_graph)."""
        model, parallel, train, flag = self.model, self.parallel, self.train, "--cuda-graph-impl full_iteration"
        if train.cuda_graph_impl == "none":
            return
        require(self.world_size == 1, f"{flag} runs on one GPU so far: the collectives of {self.world_size} ranks "
                "are not captured")
        require(model.hidden_dropout == 0 and model.attention_dropout == 0,
                f"{flag} needs --hidden-dropout 0 and --attention-dropout 0 (dropout's random streams are "
                "switched on the host, which a replay skips)")
        require(train.recompute_granularity is None,
                f"{flag} does not combine with --recompute-granularity (recomputation restores random states "
                "on the host)")
        require(not (train.fp8_format and train.fp8_recipe == "delayed"),
                f"{flag} does not combine with --fp8-recipe delayed (its amax history moves between tensors each "
                "step); use tensorwise or blockwise")
        require(not parallel.use_torch_fsdp2, f"{flag} does not combine with --use-torch-fsdp2 (its hooks gather "
                "weights on the host's schedule)")
        require(not self.data.reset_attention_mask,
                f"{flag} does not combine with --reset-attention-mask (document boundaries are read on the host)")
        require(not (self.posttrain.sft or self.posttrain.dpo), f"{flag} does not combine with --sft or --dpo "
                "(their rows' boundaries and reference are read on the host)")
        if model.num_experts:
            require(model.moe_grouped_gemm, f"{flag} with --num-experts needs --moe-grouped-gemm (the loop over "
                    "experts reads their token counts on the host)")
            require(model.moe_expert_capacity_factor is None or model.moe_pad_expert_input_to_capacity,
                    f"{flag} with --moe-expert-capacity-factor needs --moe-pad-expert-input-to-capacity (else the "
                    "number of rows kept changes from step to step)")

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def num_micro_batches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
