"""What a training run is built of, before its first step: the job's device, this rank's model
(its pipeline stage's layers, adapters, FP8 GEMMs, compiled blocks, FSDP2 shards) and its
pipeline stage (None without pipeline parallelism). The trainer (tessera.training.trainer)
puts these together with the data, the optimizer and the objective, and runs the loop.

Order matters, and is kept here once: LoRA's adapters go on the initialised base (under --bf16
the base is then stored in bf16) before FP8, compile, FSDP2 and the optimizer see the parameters;
compile wraps the blocks before FSDP2 shards them; the pipeline's runners are made after the
optimizer (which may cast the weights, and the activations it sends take their dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.config import ConfigError, RunConfig
from tessera.config.hybrid import stage_ranges
from tessera.models.activation_offload import install_activation_offload
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.parallel.context import ContextParallel
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.fsdp import apply_fsdp2
from tessera.parallel.launch import init_distributed, job_world_size
from tessera.parallel.mesh import Mesh
from tessera.parallel.pipeline import PipelineGroups, PipelineRunner
from tessera.parallel.pipeline_actions import Schedule
from tessera.parallel.pipeline_schedules import build_schedule, stage_layer_ranges
from tessera.training import fp8

# Inductor times a few block sizes for each kernel it generates (Triton only, at the first
# compile): config A's norms, adds and sums 0.5-0.7% faster a step on an H200
# (docs/performance.md, 2026-12-04).
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return torch.device(name)


def join_job(config: RunConfig) -> torch.device:
    """Join the job this process belongs to; this rank's device."""
    device = init_distributed(resolve_device(config.train.device), config)
    if job_world_size() != config.world_size:
        raise ConfigError(f"the configuration is for {config.world_size} processes (RunConfig.world_size) "
                          f"but the job has {job_world_size()}: leave world_size out to take the job's")
    return device


def stage_chunks(config: RunConfig, mesh: Mesh) -> list[range] | None:
    """The layers of each of this rank's model chunks (chunk c is virtual stage c * pp + rank):
    where a hybrid pattern's '|' put the boundaries, else split as the flags say; None without
    pipeline parallelism."""
    if mesh.pp_size == 1:
        return None
    parallel, layers, pattern = config.parallel, config.model.num_layers, config.model.hybrid_layer_pattern
    ranges = (stage_ranges(pattern, mesh.pp_size) if pattern else None) or stage_layer_ranges(
        layers, mesh.pp_size, parallel.virtual_pipeline_size(layers),
        first_stage_layers=parallel.decoder_first_pipeline_num_layers,
        last_stage_layers=parallel.decoder_last_pipeline_num_layers)
    return ranges[mesh.pp_rank::mesh.pp_size]


@dataclass
class BuiltModel:
    model: GPTModel
    context_parallel: ContextParallel | None
    fp8_layers: list           # the FP8 GEMM layers (tessera.training.fp8), empty without --fp8-format
    compiled: bool             # the blocks and the head are torch.compile'd


def build_model(config: RunConfig, mesh: Mesh, device: torch.device, chunks: list[range] | None) -> BuiltModel:
    """This rank's part of the model, initialised, with its adapters, FP8 GEMMs, compiled blocks
    and FSDP2 shards as the flags ask."""
    train, parallel = config.train, config.parallel
    torch.manual_seed(train.seed)
    recompute = Recompute(train.recompute_granularity, train.recompute_method, train.recompute_num_layers)
    stage = {} if chunks is None else dict(layer_indices=[i for chunk in chunks for i in chunk],
                                           pre_process=mesh.pp_rank == 0, post_process=mesh.pp_rank == mesh.pp_size - 1)
    expert_groups = ExpertGroups.from_mesh(mesh, parallel.moe_token_dispatcher_type) if config.model.num_experts \
        else None
    context_parallel = ContextParallel(tuple(parallel.cp_comm_type), mesh.group("cp"), mesh.group("cp_inner"),
                                       mesh.group("cp_outer")) if mesh.cp_size > 1 else None
    with torch.device(device):
        model = GPTModel(config.model, tp_group=mesh.tp_group, sequence_parallel=parallel.sequence_parallel,
                         tp_comm_overlap=parallel.tp_comm_overlap, recompute=recompute, expert_groups=expert_groups,
                         context_parallel=context_parallel, **stage)
    initialize_parameters(model, train.seed)
    if config.posttrain.lora:
        from tessera.posttrain.lora import apply_lora, store_base_in_bf16

        apply_lora(model, config.posttrain, train.seed)
        # Here, once the adapters have taken their fp32 from the weights and before FP8, compile and
        # FSDP2 see them; checkpoints load into the bf16 weights, converting. Not under --grpo: its
        # inference engine runs the trainer's model outside autocast, in one dtype.
        if train.bf16 and not config.posttrain.grpo:
            store_base_in_bf16(model)
    fp8_layers = _apply_fp8(model, config, mesh, device)
    if train.fine_grained_activation_offloading:
        install_activation_offload(model, train.offload_modules, device, train.min_offloaded_tensor_size,
                                   skip_layers=_recomputed_layers(model, chunks))
    compiled = train.compile if train.compile is not None else device.type == "cuda"   # on CUDA by default
    if compiled:
        if parallel.use_torch_fsdp2 and train.fp8_param_gather:
            raise ConfigError("--fp8-param-gather with --use-torch-fsdp2 does not combine with torch.compile "
                              "(use --no-compile)")
        _compile(model)
    if parallel.use_torch_fsdp2:
        apply_fsdp2(model, mesh, param_dtype=torch.bfloat16 if train.bf16 else None,
                    fp8_weights=fp8.gathered_weights(model) if train.fp8_param_gather else ())
    return BuiltModel(model, context_parallel, fp8_layers, compiled)


def activation_dtype(model: GPTModel) -> torch.dtype:
    """The dtype of the hidden states between pipeline stages: that of the model's weights (bf16 once
    the distributed optimizer casts a model that trains whole), as the embedding and the norms hold
    it, not that of a LoRA base stored in bf16 (tessera.posttrain.lora.store_base_in_bf16)."""
    return next(p.dtype for p in model.parameters() if not getattr(p, "stored_bf16", False))


def _recomputed_layers(model: GPTModel, chunks: list[range] | None) -> set[int]:
    """The layers --recompute-granularity full recomputes: they save only their input."""
    runs = [list(chunk) for chunk in chunks] if chunks is not None else [[index for index, _ in model.layers.items()]]
    return {run[i] for run in runs for start, end, recomputed in model.layer_chunks(len(run)) if recomputed
            for i in range(start, end)}


def _apply_fp8(model: GPTModel, config: RunConfig, mesh: Mesh, device: torch.device) -> list:
    """--fp8-format: FP8 GEMMs in this rank's transformer blocks (tessera.training.fp8)."""
    recipe = fp8.recipe_of(config.train)
    if recipe is None:
        return []
    fp8.check_device(device, recipe)
    return fp8.apply_fp8(model.layers.items(), recipe, fp8.bf16_layers(config.train, config.model.num_layers),
                         config.train.micro_batch_size * config.model.seq_length // mesh.cp_size)


def _compile(model: GPTModel) -> None:
    """Compile each block and the output head separately: small graphs compile fast and every
    block reuses the first one's kernels."""
    mtp_blocks = [depth.layer for depth in model.mtp.layers] if model.mtp is not None else []
    for layer in [*model.layers, *mtp_blocks]:
        layer.compile(options=COMPILE_OPTIONS)
    model.head = torch.compile(model.head, options=COMPILE_OPTIONS)  # shadows the method


@dataclass
class PipelineStage:
    """This rank's pipeline stage: its chunks' layers, the stages' groups, and the runners of
    the training schedule and of the forward-only one (evaluation, DPO's reference)."""

    chunks: list[range]
    groups: PipelineGroups
    schedule: Schedule
    runner: PipelineRunner
    eval_runner: PipelineRunner

    @staticmethod
    def groups_of(config: RunConfig, mesh: Mesh) -> PipelineGroups | None:
        return PipelineGroups.build(mesh, shared_embedding=config.model.last_stage_embedding) \
            if mesh.pp_size > 1 else None

    @classmethod
    def build(cls, config: RunConfig, mesh: Mesh, chunks: list[range], groups: PipelineGroups,
              dtype: torch.dtype, device: torch.device) -> "PipelineStage":
        """The runners of a stage whose activations are [micro-batch, local sequence, hidden] in `dtype`."""
        seq_length = config.model.seq_length // mesh.cp_size
        if config.parallel.sequence_parallel:
            seq_length //= mesh.tp_size
        overlap, name = config.parallel.overlap_p2p_communication, config.parallel.pipeline_schedule

        def schedule(forward_only: bool) -> Schedule:
            return build_schedule(name, mesh.pp_size, config.num_micro_batches, len(chunks),
                                  forward_only=forward_only, overlap_p2p=overlap)

        def runner(of: Schedule) -> PipelineRunner:
            return PipelineRunner(of, mesh.pp_rank, groups, device=device, dtype=dtype,
                                  activation_shape=(config.train.micro_batch_size, seq_length,
                                                    config.model.hidden_size))

        training = schedule(forward_only=False)
        return cls(chunks, groups, training, runner(training), runner(schedule(forward_only=True)))
