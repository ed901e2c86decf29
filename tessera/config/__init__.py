"""Run configuration: one dataclass per concern, Megatron-LM flag names, validated once.

Every field is a command-line flag: field `foo_bar` is `--foo-bar`, exactly as in
Megatron-LM's `pretrain_gpt.py`, so existing launch scripts keep their flags. The same
names (with `_` or `-`) are the keys of a YAML config file. Values are layered:
dataclass defaults < `--model PRESET` < `--config run.yaml` < command-line flags.
`tessera.cli.args` turns these dataclasses into the argument parser.

    fields.py    ConfigError, option(), the checks every section uses
    model.py     ModelConfig (architecture; its MoE checks in moe.py, MLA and RoPE-scaling checks in attention.py)
    parallel.py  ParallelConfig        data.py  DataConfig
    training.py  OptimConfig, TrainConfig, CheckpointConfig
    posttrain.py PostTrainConfig (SFT, LoRA, DPO)
    inference.py InferenceConfig, GenerateConfig, ServeConfig (`tessera generate` and `tessera serve`)
    run.py       RunConfig (all sections, checks across them), SECTIONS
"""

from tessera.config.data import DataConfig
from tessera.config.fields import ConfigError, flag, option
from tessera.config.inference import GenerateConfig, InferenceConfig, ServeConfig
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.config.run import SECTIONS, RunConfig
from tessera.config.training import CheckpointConfig, OptimConfig, TrainConfig

__all__ = ["SECTIONS", "CheckpointConfig", "ConfigError", "DataConfig", "GenerateConfig", "InferenceConfig",
           "ModelConfig", "OptimConfig", "ParallelConfig", "PostTrainConfig", "RunConfig", "ServeConfig", "TrainConfig",
           "flag", "option"]
