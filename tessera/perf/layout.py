"""A parallel layout as the planner sees it, and the rules that make it runnable.

The fields are the settings of `tessera train` (Megatron-LM flag names in the messages);
`check_layout` rejects what Megatron would reject, naming the flag, so the search and
`--explain` share one definition of "feasible".
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import ModelConfig, TrainConfig
from tessera.config.fields import require
from tessera.config.parallel import CP_COMM_TYPES
from tessera.config.moe import check_expert_layout
from tessera.parallel.pipeline_schedules import stage_layer_ranges

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
        if self.fsdp:
            parts.append("FSDP")
        elif self.distributed_optimizer:
            parts.append("distopt")
        if self.recompute != "none":
            parts.append(f"recompute-{self.recompute}")
        if self.fp8_format:
            parts.append(f"FP8-{self.fp8_recipe}")
        return " ".join(parts)

    def flags(self, moe: bool = True) -> list[str]:
        """The `tessera train` flags of this layout (the expert flags only for a `moe` model)."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                 "--context-parallel-size", str(self.cp), "--micro-batch-size", str(self.micro_batch_size)]
        if self.cp > 1:
            flags += ["--cp-comm-type", self.cp_comm_type]
        if self.cp > 1 and self.cp_comm_type == "a2a+p2p":
            flags += ["--hierarchical-context-parallel-sizes", str(self.cp_a2a_size), str(self.cp // self.cp_a2a_size)]
        if self.virtual_stages > 1:
            flags += ["--virtual-pipeline-model-parallel-size", str(self.virtual_stages)]
        if moe and self.ep > 1:
            flags += ["--expert-model-parallel-size", str(self.ep)]
        if moe and self.expert_tp != self.tp:
            flags += ["--expert-tensor-parallel-size", str(self.expert_tp)]
        if moe and self.dispatches:
            flags += ["--moe-token-dispatcher-type", self.moe_dispatcher]
        for flag, value in (("--decoder-first-pipeline-num-layers", self.first_stage_layers),
                            ("--decoder-last-pipeline-num-layers", self.last_stage_layers)):
            if value is not None:
                flags += [flag, str(value)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.sequence_parallel and self.tp_comm_overlap:
            flags.append("--tp-comm-overlap")
        if self.pp > 1 and self.overlap_p2p_communication:
            flags.append("--overlap-p2p-communication")
        if self.fsdp:
            flags.append("--use-torch-fsdp2")
        elif self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        if self.distributed_optimizer and not self.fsdp and self.moment_bytes < 8:
            flags += ["--use-precision-aware-optimizer", "--exp-avg-dtype", self.exp_avg_dtype,
                      "--exp-avg-sq-dtype", self.exp_avg_sq_dtype]
        if self.recompute == "full":   # what memory.py models: each layer keeps only its input
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif self.recompute != "none":
            flags += ["--recompute-granularity", self.recompute]
        if self.overlap_grad_reduce and self.dp > 1 and not self.fsdp:   # as predicted
            flags.append("--overlap-grad-reduce")
        if self.overlap_param_gather and self.distributed_optimizer and self.dp > 1:
            flags.append("--overlap-param-gather")
        if self.fp8_format:   # FP8 GEMMs read and return bf16
            flags += ["--bf16", "--fp8-format", self.fp8_format, "--fp8-recipe", self.fp8_recipe]
        if self.fp8_format and self.first_last_layers_bf16:
            flags += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(self.num_layers_at_start_in_bf16),
                      "--num-layers-at-end-in-bf16", str(self.num_layers_at_end_in_bf16)]
        if self.fp8_format and self.no_fp8_wgrad:
            flags.append("--no-fp8-wgrad")
        if self.fp8_format and self.fp8_experts:
            flags.append("--fp8-experts")
        if self.fp8_format and self.fp8_param_gather:
            flags.append("--fp8-param-gather")
            if self.fsdp:   # FSDP2's E4M3 gathers run uncompiled (tessera.config.run)
                flags.append("--no-compile")
        return flags


def check_layout(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int) -> None:
    """Raise ConfigError, naming the flag, if Megatron could not run this layout."""
    tp, pp, cp, vp = layout.tp, layout.pp, layout.cp, layout.virtual_stages
    require(min(tp, pp, cp, layout.dp, vp, layout.micro_batch_size) >= 1, "parallel sizes must be positive")
    require(model.num_attention_heads % tp == 0,
            f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})")
    require(model.num_query_groups % tp == 0,
            f"--num-query-groups ({model.num_query_groups}) must be divisible by --tensor-model-parallel-size ({tp})")
    require(pp > 1 or not layout.uneven, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    layout.layers_per_rank(model.num_layers)   # raises, naming --num-layers and the split flags
    require(vp == 1 or pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    require(not layout.sequence_parallel or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
    require(seq_length % (2 * cp) == 0 if cp > 1 else True,
            f"--seq-length ({seq_length}) must be divisible by 2 x --context-parallel-size ({cp})")
    _check_context_parallel(model, layout)
    require(not (layout.fsdp and layout.distributed_optimizer),
            "--use-torch-fsdp2 and --use-distributed-optimizer are exclusive")
    require(layout.recompute in RECOMPUTE, f"--recompute-granularity must be one of {', '.join(RECOMPUTE[1:])}")
    per_step = layout.micro_batch_size * layout.dp
    require(global_batch_size % per_step == 0,
            f"--global-batch-size ({global_batch_size}) must be divisible by --micro-batch-size "
            f"({layout.micro_batch_size}) x data-parallel size ({layout.dp}) = {per_step}")
    _check_experts(model, layout)
    if layout.fp8_format is not None or layout.fp8_param_gather:   # tessera train's own FP8 checks, in its words
        TrainConfig(train_iters=1, bf16=True, **{name: getattr(layout, name) for name in FP8_FIELDS})
    # The E4M3 copies are cast and gathered by the distributed optimizer (tessera.parallel.fp8_gather)
    # or by FSDP2 (tessera.parallel.fsdp_fp8), uncompiled.
    require(not layout.fp8_param_gather or layout.distributed_optimizer or layout.fsdp,
            "--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2")
    require(not (layout.fp8_param_gather and layout.fsdp and layout.compiled),
            "--fp8-param-gather with --use-torch-fsdp2 does not combine with --compile (use --no-compile)")
    if vp > 1:
        micro_batches = layout.num_micro_batches(global_batch_size)
        require(micro_batches % pp == 0,
                f"the interleaved schedule needs the number of micro-batches ({micro_batches}) to be a "
                f"multiple of --pipeline-model-parallel-size ({pp})")


def _check_context_parallel(model: ModelConfig, layout: Layout) -> None:
    """--cp-comm-type's own rules (tessera.config.parallel says the same to `tessera train`)."""
    kind, cp = layout.cp_comm_type, layout.cp
    require(kind in CP_COMM_TYPES, f"--cp-comm-type {kind}: choose from {', '.join(CP_COMM_TYPES)}")
    if cp == 1 or kind not in ("a2a", "a2a+p2p"):
        return
    require(kind == "a2a" or layout.cp_a2a_size, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
    inner = cp if kind == "a2a" else layout.cp_a2a_size
    require(cp % inner == 0, f"--hierarchical-context-parallel-sizes: {inner} must divide --context-parallel-size ({cp})")
    heads = model.num_attention_heads // layout.tp
    groups = heads if model.multi_latent_attention else max(model.num_query_groups // layout.tp, 1)
    require(heads % inner == 0 and groups % inner == 0,
            f"--cp-comm-type {kind}: attention heads ({heads}) and KV groups ({groups}) per "
            f"--tensor-model-parallel-size rank must be divisible by {inner}")


def _check_experts(model: ModelConfig, layout: Layout) -> None:
    """The trainer's rules for MoE layouts (tessera.config.moe), in its words."""
    check_expert_layout(model, tp=layout.tp, cp=layout.cp, dp=layout.dp, ep=layout.ep, etp=layout.expert_tp,
                        sequence_parallel=layout.sequence_parallel)
    require(layout.moe_dispatcher in DISPATCHERS,
            f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)}")