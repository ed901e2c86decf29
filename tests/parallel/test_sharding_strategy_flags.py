"""--data-parallel-sharding-strategy, Megatron-FSDP's flags and HSDP's: which switches they set,
and the one line each contradiction gets."""

import dataclasses

import pytest

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError, ParallelConfig

BASE = ["--model", "tiny-llama", "--mock-data", "--lr", "1e-3", "--train-iters", "1", "--micro-batch-size", "1"]
STRATEGY = "--data-parallel-sharding-strategy"


def switches(*flags: str, world_size: int = 2) -> tuple:
    parallel = parse_run_config([*BASE, *flags], "tessera train", world_size=world_size)[0].parallel
    return (parallel.data_parallel_sharding_strategy, parallel.use_distributed_optimizer, parallel.use_torch_fsdp2,
            parallel.torch_fsdp2_no_reshard_after_forward)


@pytest.mark.parametrize("flags, strategy", [
    ([], "no_shard"),
    (["--use-distributed-optimizer"], "optim"),
    (["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], "optim_grads"),
    (["--use-torch-fsdp2"], "optim_grads_params"),
    # Megatron-FSDP: its default strategy, and the flags Megatron's example scripts pass with it.
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "optim_grads_params"),
    (["--use-megatron-fsdp", STRATEGY, "optim_grads", "--use-distributed-optimizer"], "optim_grads"),
    (["--use-megatron-fsdp", STRATEGY, "optim"], "optim"),
    (["--use-custom-fsdp"], "optim_grads_params"),   # Megatron's older spelling
])
def test_switches_and_strategies_agree(flags, strategy):
    assert switches(*flags) == switches(STRATEGY, strategy)
    assert switches(*flags)[0] == strategy


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_a_resolved_config_reads_back_the_same(strategy):
    """A saved config (every switch written out) is consistent when it is read again."""
    parallel = ParallelConfig(data_parallel_sharding_strategy=strategy)
    assert ParallelConfig(**dataclasses.asdict(parallel)) == parallel


def error_of(capsys, flags: list[str], world_size: int = 4) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config([*BASE, *flags], "tessera train", world_size=world_size)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags, named", [
    ([STRATEGY, "no_shard", "--use-distributed-optimizer"], [f"{STRATEGY} no_shard", "--use-distributed-optimizer"]),
    ([STRATEGY, "no_shard", "--use-torch-fsdp2"], [f"{STRATEGY} no_shard", "--use-torch-fsdp2"]),
    ([STRATEGY, "optim", "--use-torch-fsdp2"], [f"{STRATEGY} optim", "--use-torch-fsdp2"]),
    ([STRATEGY, "optim_grads", "--use-distributed-optimizer"], [f"{STRATEGY} optim_grads", "--use-distributed-optimizer"]),
    ([STRATEGY, "optim_grads_params", "--torch-fsdp2-no-reshard-after-forward"],
     [f"{STRATEGY} optim_grads_params", "--torch-fsdp2-no-reshard-after-forward"]),
    (["--torch-fsdp2-no-reshard-after-forward"], ["--torch-fsdp2-no-reshard-after-forward", "--use-torch-fsdp2"]),
    (["--use-megatron-fsdp", "--use-torch-fsdp2"], ["--use-megatron-fsdp", "--use-torch-fsdp2"]),
    ([STRATEGY, "optim_grads", "--pipeline-model-parallel-size", "2"],
     [f"{STRATEGY} optim_grads", "--pipeline-model-parallel-size"]),
    (["--num-distributed-optimizer-instances", "2"], ["--num-distributed-optimizer-instances 2", STRATEGY]),
    (["--num-distributed-optimizer-instances", "3", "--use-distributed-optimizer"],
     ["data-parallel size (4)", "--num-distributed-optimizer-instances (3)"]),
    (["--num-distributed-optimizer-instances", "4", "--use-torch-fsdp2"],
     ["--num-distributed-optimizer-instances (4)", f"{STRATEGY} no_shard"]),
    (["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer", "--pipeline-model-parallel-size",
      "2"], ["--num-distributed-optimizer-instances 2", "--pipeline-model-parallel-size"]),
    (["--num-distributed-optimizer-instances", "2", "--use-torch-fsdp2", "--outer-dp-sharding-strategy", "optim"],
     ["--outer-dp-sharding-strategy optim", "no_shard"]),
])
def test_contradictions_are_one_line_naming_the_flags(capsys, flags, named):
    message = error_of(capsys, flags)
    assert all(name in message for name in named), message


def test_hsdp_refuses_expert_parallelism():
    with pytest.raises(ConfigError, match="--num-distributed-optimizer-instances 2 with --expert-model-parallel-size"):
        ParallelConfig(use_torch_fsdp2=True, num_distributed_optimizer_instances=2, expert_model_parallel_size=2)
