"""--cuda-graph-impl full_iteration's refusals, on any machine. That a replayed step computes
what an eager one does is proven on a GPU: tests/gpu/test_cuda_graph_cuda.py."""

import pytest

from tests.conftest import TINY, run_config
from tessera.cli.args import parse_run_config
from tessera.config import ConfigError
from tessera.training.trainer import Trainer

GRAPH = ["--cuda-graph-impl", "full_iteration", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("flags, world_size, message", [
    (["--hidden-dropout", "0.1"], 1, "needs --hidden-dropout 0 and --attention-dropout 0"),
    (["--attention-dropout", "0.1"], 1, "needs --hidden-dropout 0 and --attention-dropout 0"),
    (["--recompute-granularity", "selective"], 1, "does not combine with --recompute-granularity"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"], 1,
     "does not combine with --fp8-recipe delayed"),
    (["--reset-attention-mask"], 1, "does not combine with --reset-attention-mask"),
    (["--cuda-graph-warmup-steps", "-1"], 1, "--cuda-graph-warmup-steps must be >= 0"),
    ([], 2, "runs on one GPU so far: the collectives of 2 ranks are not captured"),
    (["--model", "tiny-moe"], 1, "with --num-experts needs --moe-grouped-gemm"),
    (["--model", "tiny-moe", "--moe-grouped-gemm", "--moe-expert-capacity-factor", "1.5"], 1,
     "with --moe-expert-capacity-factor needs --moe-pad-expert-input-to-capacity"),
])
def test_what_a_graph_cannot_hold_is_refused_naming_the_flags(flags, world_size, message, capsys):
    with pytest.raises(SystemExit):
        parse_run_config([*TINY, *GRAPH, *flags], world_size=world_size)
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessera train: error: ") and message in err


def test_a_graph_needs_a_cuda_device():
    with pytest.raises(ConfigError, match="--cuda-graph-impl full_iteration needs a CUDA device"):
        Trainer(run_config(*GRAPH, "--device", "cpu"))
