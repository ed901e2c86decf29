"""torch.compile's artifacts travel with a checkpoint (tessera.training.compile_artifacts), and the
start-up line says where the time went.

torch's save_cache_artifacts / load_cache_artifacts are replaced by recorders, so that nothing
compiles: a CPU compile in a fresh Inductor cache takes tens of seconds, which a round trip
through two fresh processes would pay twice (docs/performance.md gives the measured effect).
Checked: a save writes each rank's file with its fingerprint, a resume loads it, and a file made
for another model or layout, or unreadable, is passed over with one line.
"""

import json

import pytest
import torch

from tessera.cli.args import parse_run_config
from tessera.training import build, compile_artifacts
from tessera.training.checkpoint import iteration_dir
from tessera.training.trainer import Trainer

RUN = ["--model", "tiny-llama", "--mock-data", "--lr", "1e-2", "--micro-batch-size", "2", "--global-batch-size",
       "2", "--log-interval", "1", "--num-workers", "0"]


class Recorder:
    """torch.compiler's save/load of artifacts, replaced: what was saved and loaded."""

    def __init__(self):
        self.loaded: list[bytes] = []

    def save(self):
        return b"kernels of this run", None

    def load(self, artifacts: bytes):
        self.loaded.append(artifacts)


@pytest.fixture
def recorder(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", recorder.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", recorder.load)
    monkeypatch.setattr(build, "_compile", lambda model: None)   # "compiled", without compiling on a CPU
    return recorder


def test_a_checkpoint_carries_the_artifacts_and_a_resume_loads_them(recorder, tmp_path, capsys):
    flags = [*RUN, "--compile", "--save", str(tmp_path), "--load", str(tmp_path)]
    Trainer(parse_run_config(flags + ["--train-iters", "1"], world_size=1)[0]).train()
    saved = iteration_dir(tmp_path, 1) / compile_artifacts.FILE.format(rank=0)
    header, artifacts = saved.read_bytes().split(b"\n", 1)
    assert artifacts == b"kernels of this run" and json.loads(header)["torch"] == torch.__version__
    Trainer(parse_run_config(flags + ["--train-iters", "2"], world_size=1)[0])
    assert recorder.loaded == [b"kernels of this run"]
    # Made for another model (recomputation changes the kernels): passed over, in one line.
    capsys.readouterr()
    Trainer(parse_run_config(flags + ["--train-iters", "2", "--recompute-granularity", "full", "--recompute-method",
                                      "uniform", "--recompute-num-layers", "1"], world_size=1)[0])
    assert recorder.loaded == [b"kernels of this run"]
    assert "were made for another kernels: compiling from scratch" in capsys.readouterr().err
    saved.write_bytes(b"{not json\n")
    Trainer(parse_run_config(flags + ["--train-iters", "2"], world_size=1)[0])
    assert "cannot be read (JSONDecodeError): compiling from scratch" in capsys.readouterr().err


def test_no_artifacts_without_compile_or_with_no_compile_artifacts(recorder, tmp_path):
    for name, flags in {"eager": ["--no-compile"], "off": ["--compile", "--no-compile-artifacts"]}.items():
        Trainer(parse_run_config([*RUN, *flags, "--train-iters", "1", "--save", str(tmp_path / name)],
                                 world_size=1)[0]).train()
        assert not list((tmp_path / name).rglob("compile_artifacts*")), name


def test_the_start_up_line_comes_before_the_first_iteration(capsys):
    Trainer(parse_run_config([*RUN, "--train-iters", "1"], world_size=1)[0]).train()
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("start-up took"))
    assert start < next(i for i, line in enumerate(lines) if "iteration        1/" in line)
    for phase in ("import", "build", "load", "first step"):
        assert f"{phase} " in lines[start], phase
