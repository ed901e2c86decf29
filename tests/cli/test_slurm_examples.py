"""examples/slurm: each script trains the layout `tessera plan` proposes for its job, with flags tessera accepts."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tessera.cli import plan
from tessera.cli.args import parse_run_config

SCRIPTS = sorted((Path(__file__).parents[2] / "examples" / "slurm").glob("*.sbatch"))


def srun_flags(text: str) -> list[str]:
    """The `tessera train` arguments of the script's srun line, shell variables left as words."""
    command = re.search(r"^srun .*?python -m tessera train (.*?)(?<!\\)$", text, re.S | re.M).group(1)
    return shlex.split(command.replace("\\\n", " "))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_slurm_script_follows_the_plan(script):
    text = script.read_text()
    plan_command = re.search(r"^#\s+tessera plan (.*)$", text, re.M).group(1).split()
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert plan.main(plan_command) == 0
    proposed = output.getvalue().split("train with: ")[1].split()
    flags = srun_flags(text)
    for name, value in zip(proposed, proposed[1:] + ["--"]):
        if name.startswith("--"):
            assert name in flags, name
            if not value.startswith("--"):
                assert flags[flags.index(name) + 1] == value, name
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    tasks = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
    assert nodes * tasks == int(plan_command[plan_command.index("--gpus") + 1])
    config, _ = parse_run_config(flags, "tessera train", world_size=nodes * tasks)   # every flag is tessera's
    assert config.train.global_batch_size == int(plan_command[plan_command.index("--global-batch-size") + 1])


def test_there_are_slurm_examples():
    assert {p.stem for p in SCRIPTS} >= {"llama3-8b", "llama3-70b"}
