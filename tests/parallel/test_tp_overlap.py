"""--tp-comm-overlap: the flags it needs and refuses, and the layers' single-process path.

The chunked collectives themselves are proven in tests/dist/test_tp_overlap.py.
"""

import pytest
import torch
import torch.nn.functional as F

from tessera.cli.args import parse_run_config
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tessera.parallel.tp_overlap import all_gather_matmul, matmul_reduce_scatter

BASE = ["--model", "tiny-gpt", "--lr", "1e-3", "--train-iters", "10"]


def error_of(capsys, argv, world_size=1) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(argv, "tessera train", world_size=world_size)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one clear line
    return lines[0]


@pytest.mark.parametrize("flags, world_size, expected", [
    (["--tensor-model-parallel-size", "2", "--tp-comm-overlap"], 2, "--tp-comm-overlap needs --sequence-parallel"),
    (["--sequence-parallel", "--tp-comm-overlap"], 1, "--tp-comm-overlap needs --tensor-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap", "--bf16",
      "--fp8-format", "hybrid"], 2, "--tp-comm-overlap with --fp8-format is not supported"),
])
def test_bad_combinations_name_the_flags(capsys, flags, world_size, expected):
    assert expected in error_of(capsys, BASE + flags, world_size)


def test_flag_parses():
    config, _ = parse_run_config(BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                         "--tp-comm-overlap"], "tessera train", world_size=2)
    assert config.parallel.tp_comm_overlap


def test_layers_need_sequence_parallelism():
    with pytest.raises(ValueError, match="comm_overlap needs sequence_parallel"):
        ColumnParallelLinear(8, 8, bias=False, init_std=0.02, comm_overlap=True)
    with pytest.raises(ValueError, match="comm_overlap needs sequence_parallel"):
        RowParallelLinear(8, 8, bias=False, init_std=0.02, comm_overlap=True)


def test_without_a_tp_group_they_are_plain_linears():
    x, weight, bias = torch.randn(2, 4, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(all_gather_matmul(x, weight, bias, None), F.linear(x, weight, bias))
    assert torch.equal(matmul_reduce_scatter(x, weight, None), F.linear(x, weight))


@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_compiled_layers_call_the_overlapped_gemms_eagerly(kind):
    """Dynamo cannot trace their point-to-point ops: each call is a break in the compiled graph."""
    layer = kind(8, 6, bias=kind is ColumnParallelLinear, init_std=0.02, sequence_parallel=True, comm_overlap=True)
    with torch.no_grad():   # the parameters are created empty (the trainer initialises them)
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape))
    x = torch.randn(2, 4, 8)
    explanation = torch._dynamo.explain(lambda x: layer(x * 2) + 1)(x)
    assert explanation.graph_break_count == 1, explanation.break_reasons
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_importing_the_trainer_leaves_dynamo_unloaded():
    """torch._dynamo takes ~2 s to import: every command that loads a model without training it
    (generate, serve, convert: 4.7 -> 2.8 s to import) paid it when this module wrapped its functions
    with torch.compiler.disable at import. (Training loads it anyway: torch.optim's optimizers do.)"""
    import subprocess
    import sys

    code = "import sys, tessera.training.trainer; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
