"""RunConfig: every section of a training run, and the checks that span sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from tessera.config.data import DataConfig
from tessera.config.fields import require
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.training import CheckpointConfig, OptimConfig, TrainConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
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
    world_size: int = 1

    def __post_init__(self) -> None:
        model, parallel, train = self.model, self.parallel, self.train
        dp = parallel.data_parallel_size(self.world_size)
        per_step = train.micro_batch_size * dp
        if train.global_batch_size is None:
            train.global_batch_size = per_step
        require(
            train.global_batch_size % per_step == 0,
            f"--global-batch-size ({train.global_batch_size}) must be divisible by --micro-batch-size "
            f"({train.micro_batch_size}) x data-parallel size ({dp}) = {per_step}",
        )
        tp = parallel.tensor_model_parallel_size
        require(parallel.sequence_parallel is False or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        require(
            model.num_attention_heads % tp == 0,
            f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        parallel.virtual_pipeline_size(model.num_layers)  # checks --num-layers-per-virtual-pipeline-stage
        self._check_experts()
        if train.recompute_granularity == "full" and train.recompute_method == "uniform":
            require(
                model.num_layers % train.recompute_num_layers == 0,
                f"--recompute-num-layers ({train.recompute_num_layers}) must divide --num-layers "
                f"({model.num_layers}) with --recompute-method uniform",
            )

    def _check_experts(self) -> None:
        """Expert parallelism re-slices each stage's TP x CP x DP ranks as EDP x EP x ETP (Megatron's folding)."""
        model, parallel = self.model, self.parallel
        ep, etp, tp = parallel.expert_model_parallel_size, parallel.expert_tensor_size, parallel.tensor_model_parallel_size
        if model.num_experts is None:
            require(ep == 1 and parallel.expert_tensor_parallel_size is None,
                    "--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts")
            return
        stage_ranks = tp * parallel.context_parallel_size * self.data_parallel_size
        require(stage_ranks % (ep * etp) == 0,
                f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must divide "
                f"--tensor-model-parallel-size x --context-parallel-size x data-parallel size ({stage_ranks})")
        require(model.num_experts % ep == 0,
                f"--num-experts ({model.num_experts}) must be divisible by --expert-model-parallel-size ({ep})")
        require(model.moe_ffn_hidden_size % etp == 0,
                f"--moe-ffn-hidden-size ({model.moe_ffn_hidden_size}) must be divisible by "
                f"--expert-tensor-parallel-size ({etp})")
        # Each TP rank must route its own tokens, or experts would see every token TP times.
        require(tp == 1 or parallel.sequence_parallel,
                "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel")

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
