"""A parallel layout as the planner sees it, and the rules that make it runnable.

The fields are the settings of `tessera train` (Megatron-LM flag names); `check_layout`
rejects what `tessera train` would refuse, in its words, naming the flag, so the search and
`--explain` share one definition of "feasible" and no plan prints flags the trainer refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.config import ModelConfig, TrainConfig
from tessera.config.fields import flag, require
from tessera.parallel.pipeline_schedules import stage_layer_ranges
from tessera.perf.trainer_rules import trainer_config

RECOMPUTE = ("none", "selective", "full")
DISPATCHERS = ("allgather", "alltoall")
# `tessera train`'s FP8 and precision-aware optimizer settings (tessera.config.training), which
# Layout carries under the same names.
FP8_FIELDS = ("fp8_format", "fp8_recipe", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
              "num_layers_at_end_in_bf16", "no_fp8_wgrad", "fp8_experts", "fp8_param_gather")
MOMENT_FIELDS = ("exp_avg_dtype", "exp_avg_sq_dtype")


@dataclass(frozen=True)
class Layout:
    tp: int = 1                       # --tensor-model-parallel-size
    pp: int = 1                       # --pipeline-model-parallel-size
    dp: int = 1                       # what remains of the GPUs
    cp: int = 1                       # --context-parallel-size
    cp_comm_type: str = "p2p"         # --cp-comm-type (one for every layer)
    cp_a2a_size: int | None = None    # a2a+p2p: the all-to-all group, first of --hierarchical-context-parallel-sizes
    ep: int = 1                       # --expert-model-parallel-size (folded into TP x CP x DP)
    etp: int | None = None            # --expert-tensor-parallel-size (None: the TP size, as in Megatron)
    moe_dispatcher: str = "allgather"  # --moe-token-dispatcher-type
    virtual_stages: int = 1           # model chunks per pipeline rank (interleaved 1F1B)
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers (None: even split)
    last_stage_layers: int | None = None   # --decoder-last-pipeline-num-layers
    micro_batch_size: int = 1         # --micro-batch-size
    sequence_parallel: bool = False   # --sequence-parallel
    distributed_optimizer: bool = False  # --use-distributed-optimizer (ZeRO-1)
    exp_avg_dtype: str = "fp32"       # --exp-avg-dtype (bf16 with --use-precision-aware-optimizer)
    exp_avg_sq_dtype: str = "fp32"    # --exp-avg-sq-dtype
    fsdp: bool = False                # --use-torch-fsdp2 (ZeRO-3)
    recompute: str = "none"           # --recompute-granularity (none, selective, full)
    overlap_grad_reduce: bool = True  # --overlap-grad-reduce
    overlap_param_gather: bool = True  # --overlap-param-gather
    tp_comm_overlap: bool = False     # --tp-comm-overlap
    overlap_p2p_communication: bool = False   # --overlap-p2p-communication (tessera; Megatron always overlaps)
    compiled: bool = False            # --compile: torch.compile per block (tessera's default on GPUs)
    framework: str = "megatron"       # whose trainer: "megatron" (Megatron-Core's precision and layouts) or "tessera"
    # FP8 GEMMs in the transformer layers' linears (tessera.training.fp8); the defaults are tessera train's.
    fp8_format: str | None = None     # --fp8-format (None: bf16)
    fp8_recipe: str = TrainConfig.fp8_recipe                             # --fp8-recipe
    first_last_layers_bf16: bool = False                                 # --first-last-layers-bf16
    num_layers_at_start_in_bf16: int = TrainConfig.num_layers_at_start_in_bf16   # --num-layers-at-start-in-bf16
    num_layers_at_end_in_bf16: int = TrainConfig.num_layers_at_end_in_bf16       # --num-layers-at-end-in-bf16
    no_fp8_wgrad: bool = False                                           # --no-fp8-wgrad
    fp8_experts: bool = False                                            # --fp8-experts
    fp8_param_gather: bool = False                                       # --fp8-param-gather
    optimizer_cpu_offload: bool = False   # --optimizer-cpu-offload (with the distributed optimizer)
    optimizer_offload_fraction: float = 1.0   # --optimizer-offload-fraction
    offload_modules: tuple[str, ...] = ()   # --offload-modules (--fine-grained-activation-offloading; uncompiled)

    @property
    def moment_bytes(self) -> float:
        """Bytes a parameter of Adam's two moments (the distributed optimizer's; 4 each in fp32)."""
        return sum(2.0 if dtype == "bf16" else 4.0 for dtype in (self.exp_avg_dtype, self.exp_avg_sq_dtype))

    @property
    def master_bytes(self) -> float:
        """Bytes a parameter of the distributed optimizer's fp32 masters: 2 where tessera's
        precision-aware optimizer keeps only their remainders below the bf16 weights."""
        return 2.0 if self.framework == "tessera" and self.moment_bytes < 8 else 4.0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the replicas of each expert shard (ETP x EP x EDP = TP x CP x DP)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def dispatches(self) -> bool:
        """Whether MoE tokens leave the GPU (expert or expert-tensor parallelism)."""
        return self.ep * self.expert_tp > 1

    def num_micro_batches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each virtual stage, split as the trainer splits them."""
        return [len(stage) for stage in stage_layer_ranges(num_layers, self.pp, self.virtual_stages,
                                                           first_stage_layers=self.first_stage_layers,
                                                           last_stage_layers=self.last_stage_layers)]

    def rank_layers(self, num_layers: int) -> list[list[int]]:
        """Indices of the layers each pipeline rank holds over all its chunks (chunk c of rank r
        is stage c * pp + r)."""
        first, last = self.first_stage_layers, self.last_stage_layers
        stages = stage_layer_ranges(num_layers, self.pp, self.virtual_stages, first_stage_layers=first,
                                    last_stage_layers=last)
        return [[layer for chunk in range(self.virtual_stages) for layer in stages[chunk * self.pp + rank]]
                for rank in range(self.pp)]

    def layers_per_rank(self, num_layers: int) -> list[int]:
        return [len(layers) for layers in self.rank_layers(num_layers)]

    def fp8_layers(self, num_layers: int) -> list[bool]:
        """Whether each layer's linears run in FP8: all but the first and last few that
        --first-last-layers-bf16 keeps in bf16 (the blocks tessera.training.fp8.bf16_layers names)."""
        if self.fp8_format is None:
            return [False] * num_layers
        start, end = (self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16) \
            if self.first_last_layers_bf16 else (0, 0)
        return [start <= layer < num_layers - end for layer in range(num_layers)]

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.virtual_stages > 1:
            parts.append(f"VP{self.virtual_stages}")
        given = [f"{end} stage {layers} layers" for end, layers in (("first", self.first_stage_layers),
                                                                    ("last", self.last_stage_layers)) if layers]
        if given:
            parts.append("(" + ", ".join(given) + ")")
        if self.cp > 1:
            kind = {"p2p": "", "a2a+p2p": f"(a2a{self.cp_a2a_size}+p2p{self.cp // (self.cp_a2a_size or 1)})"}
            parts.append(f"CP{self.cp}" + kind.get(self.cp_comm_type, f"({self.cp_comm_type})"))
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"ETP{self.expert_tp}")
        parts += [f"DP{self.dp}", f"mbs{self.micro_batch_size}"]
        if self.dispatches and self.moe_dispatcher == "alltoall":
            parts.append("a2a")
        if self.sequence_parallel:
            parts.append("SP")
        if self.sequence_parallel and self.tp_comm_overlap:
            parts.append("tp-overlap")
        if self.pp > 1 and self.overlap_p2p_communication:
            parts.append("p2p-overlap")
        if self.fsdp:
            parts.append("FSDP")
        elif self.distributed_optimizer:
            parts.append("distopt")
        if self.recompute != "none":
            parts.append(f"recompute-{self.recompute}")
        if self.fp8_format:
            parts.append(f"FP8-{self.fp8_recipe}")
        if self.optimizer_cpu_offload:
            fraction = self.optimizer_offload_fraction
            parts.append("optimizer-offload" + (f"-{fraction:g}" if fraction < 1 else ""))
        if self.offload_modules:
            parts.append(f"offload({','.join(self.offload_modules)})")
        return " ".join(parts)

    @property
    def reduces_gradients(self) -> bool:
        """Whether some gradients are reduced over replicas: the dense ones over DP x CP, the experts' over EDP."""
        return self.dp * self.cp > 1 or self.edp > 1

    def train_settings(self, moe: bool = True) -> dict:
        """This layout as the `tessera train` config fields (tessera.config) it sets, in the order its
        flags print; the expert fields only for a `moe` model. One mapping for the printed flags
        and for asking the trainer's own config whether it runs the layout (tessera.perf.trainer_rules)."""
        settings = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                    "context_parallel_size": self.cp, "micro_batch_size": self.micro_batch_size,
                    "bf16": True}   # what the planner times; FP8 GEMMs read and return bf16 too
        if self.cp > 1:
            settings["cp_comm_type"] = [self.cp_comm_type]
        if self.cp > 1 and self.cp_comm_type == "a2a+p2p":
            settings["hierarchical_context_parallel_sizes"] = [self.cp_a2a_size, self.cp // self.cp_a2a_size]
        if self.virtual_stages > 1:
            settings["virtual_pipeline_model_parallel_size"] = self.virtual_stages
        if moe and self.ep > 1:
            settings["expert_model_parallel_size"] = self.ep
        if moe and self.expert_tp != self.tp:
            settings["expert_tensor_parallel_size"] = self.expert_tp
        if moe and self.dispatches:
            settings["moe_token_dispatcher_type"] = self.moe_dispatcher
        if self.first_stage_layers is not None:
            settings["decoder_first_pipeline_num_layers"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            settings["decoder_last_pipeline_num_layers"] = self.last_stage_layers
        settings.update(_switches(sequence_parallel=self.sequence_parallel,
                                  tp_comm_overlap=self.sequence_parallel and self.tp_comm_overlap,
                                  overlap_p2p_communication=self.pp > 1 and self.overlap_p2p_communication,
                                  use_torch_fsdp2=self.fsdp,
                                  use_distributed_optimizer=self.distributed_optimizer and not self.fsdp))
        if self.distributed_optimizer and not self.fsdp and self.moment_bytes < 8:
            settings.update(use_precision_aware_optimizer=True, exp_avg_dtype=self.exp_avg_dtype,
                            exp_avg_sq_dtype=self.exp_avg_sq_dtype)
        if self.recompute == "full":   # what memory.py models: each layer keeps only its input
            settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif self.recompute != "none":
            settings["recompute_granularity"] = self.recompute
        # As predicted: the gradients' reduction under backward wherever there are replicas (FSDP2
        # reduces per layer anyway), the parameters' gather under forward with the distributed optimizer.
        settings.update(_switches(
            overlap_grad_reduce=self.overlap_grad_reduce and self.reduces_gradients and not self.fsdp,
            overlap_param_gather=self.overlap_param_gather and self.reduces_gradients and self.distributed_optimizer
            and not self.fsdp))
        if self.fp8_format:
            settings.update(fp8_format=self.fp8_format, fp8_recipe=self.fp8_recipe)
        if self.fp8_format and self.first_last_layers_bf16:
            settings.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=self.num_layers_at_start_in_bf16,
                            num_layers_at_end_in_bf16=self.num_layers_at_end_in_bf16)
        # As set, so that the trainer refuses what it cannot run (these without --fp8-format).
        settings.update(_switches(no_fp8_wgrad=self.no_fp8_wgrad, fp8_experts=self.fp8_experts,
                                  fp8_param_gather=self.fp8_param_gather))
        if self.optimizer_cpu_offload:
            settings["optimizer_cpu_offload"] = True
            if self.optimizer_offload_fraction < 1:
                settings["optimizer_offload_fraction"] = self.optimizer_offload_fraction
        if self.offload_modules:
            settings.update(fine_grained_activation_offloading=True, offload_modules=list(self.offload_modules))
        if not self.compiled:   # tessera train compiles on GPUs unless told not to
            settings["compile"] = False
        return settings

    def flags(self, moe: bool = True) -> list[str]:
        """The `tessera train` flags of this layout (the expert flags only for a `moe` model)."""
        flags = []
        for name, value in self.train_settings(moe).items():
            if isinstance(value, bool):   # a switch; only --compile's is ever turned off (its default is on)
                flags.append(flag(name) if value else f"--no-{flag(name)[2:]}")
            else:
                flags += [flag(name), *map(str, value if isinstance(value, list) else [value])]
        return flags


def _switches(**on: bool) -> dict:
    """The switches that are on (a switch left off is the trainer's default and prints nothing)."""
    return {name: True for name, value in on.items() if value}


def check_layout(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int) -> None:
    """Raise ConfigError, naming the flag, unless `tessera train` runs this layout: the trainer's
    config itself (tessera.perf.trainer_rules), then what the trainer finds only when it builds
    the model and the pipeline schedule."""
    require(min(layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages, layout.micro_batch_size) >= 1,
            "parallel sizes must be positive")
    # What the settings could not express.
    require(not (layout.fsdp and layout.distributed_optimizer),
            "--use-torch-fsdp2 and --use-distributed-optimizer are exclusive")
    require(layout.recompute in RECOMPUTE, f"--recompute-granularity must be one of {', '.join(RECOMPUTE[1:])}")
    require(layout.moe_dispatcher in DISPATCHERS,
            f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)}")
    require(layout.cp_comm_type != "a2a+p2p" or layout.cp == 1 or layout.cp_a2a_size,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
    trainer_config(model if seq_length == model.seq_length else replace(model, seq_length=seq_length), layout,
                   global_batch_size)
    require(model.num_query_groups % layout.tp == 0,
            f"--num-query-groups ({model.num_query_groups}) must be divisible by --tensor-model-parallel-size "
            f"({layout.tp})")
    layout.layers_per_rank(model.num_layers)   # raises, naming --num-layers and the split flags
    if layout.virtual_stages > 1:
        micro_batches = layout.num_micro_batches(global_batch_size)
        require(micro_batches % layout.pp == 0,
                f"the interleaved schedule needs the number of micro-batches ({micro_batches}) to be a "
                f"multiple of --pipeline-model-parallel-size ({layout.pp})")
