"""Checkpoints in one process: exact resume against an uninterrupted run, what --load
accepts and refuses, the lines saving and loading print, and the failure paths (NaN, SIGTERM,
SIGKILL in the middle of a save)."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import run_config
from tessera.config import ConfigError
from tessera.training.checkpoint_files import TRACKER, iteration_dir, read_tracker
from tessera.training.trainer import Trainer

# Dropout on, so that the random-number states must be restored too.
FLAGS = ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-warmup-iters", "2"]


def _run(*flags):
    trainer = Trainer(run_config(*FLAGS, *flags))
    return trainer, [r.loss for r in trainer.train()]


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_resume_gives_the_uninterrupted_losses_bitwise(tmp_path, mode):
    reference, expected = _run()
    first, before = _run("--save", str(tmp_path), "--exit-interval", "3", *mode)
    assert first.iteration == 3 and read_tracker(tmp_path) == 3
    resumed, after = _run("--load", str(tmp_path), *mode)
    assert before + after == expected
    for (name, a), b in zip(resumed.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name


def test_finetune_loads_weights_only_and_restarts_at_zero(tmp_path):
    saved, _ = _run("--save", str(tmp_path), "--train-iters", "2")
    tuned = Trainer(run_config(*FLAGS, "--load", str(tmp_path), "--finetune"))
    assert tuned.iteration == 0 and tuned.consumed_samples == 0
    assert all(torch.equal(a, b) for a, b in zip(tuned.model.parameters(), saved.model.parameters()))
    assert not tuned.optimizer.inner.state  # Adam starts fresh


def test_a_different_model_is_refused_naming_the_fields(tmp_path):
    _run("--save", str(tmp_path), "--train-iters", "1")
    with pytest.raises(ConfigError, match="--num-layers: checkpoint 2, this run 3") as error:
        Trainer(run_config(*FLAGS, "--load", str(tmp_path), "--num-layers", "3", "--rotary-base", "5000"))
    assert "--rotary-base" in str(error.value)


def test_incomplete_and_corrupt_checkpoints_are_skipped_by_name(tmp_path, capsys):
    _run("--save", str(tmp_path), "--save-interval", "2", "--train-iters", "4")
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    for data in iteration_dir(tmp_path, 4).glob("*.distcp"):
        data.write_bytes(b"garbage")                        # corrupt
    iteration_dir(tmp_path, 9).mkdir()                      # a save that never finished
    trainer = Trainer(run_config(*FLAGS, "--load", str(tmp_path)))
    assert trainer.iteration == 2
    err = capsys.readouterr().err
    assert "iter_0000009" in err and "iter_0000004" in err


def test_keep_last_removes_older_checkpoints(tmp_path):
    _run("--save", str(tmp_path), "--save-interval", "1", "--train-iters", "4", "--keep-last", "2")
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004"]


def test_nan_stops_the_run_before_the_update(tmp_path):
    trainer = Trainer(run_config(*FLAGS))
    with torch.no_grad():
        trainer.model.embedding.weight[:, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(FloatingPointError, match="iteration 1"):
        trainer.train()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]) or name == "embedding.weight", name
    assert trainer.model.embedding.weight[:, 1:].equal(before["embedding.weight"][:, 1:])


def test_sigterm_saves_at_the_end_of_the_iteration_and_stops(tmp_path):
    trainer = Trainer(run_config(*FLAGS, "--save", str(tmp_path), "--exit-signal-handler"))
    step = trainer.train_step

    def step_then_signal():
        result = step()
        if trainer.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    trainer.train_step = step_then_signal
    before = signal.getsignal(signal.SIGTERM)
    assert len(trainer.train()) == 2
    assert read_tracker(tmp_path) == 2
    assert signal.getsignal(signal.SIGTERM) is before   # the handler is training's only


_KILLED_IN_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint as dcp
from tests.conftest import run_config
from tessera.training.trainer import Trainer
finish = dcp.FileSystemWriter.finish
def die_before_metadata(self, *args, **kwargs):
    if "iter_0000002" in str(self.path):   # every file written but .metadata: then SIGKILL
        os.kill(os.getpid(), signal.SIGKILL)
    return finish(self, *args, **kwargs)
dcp.FileSystemWriter.finish = die_before_metadata
Trainer(run_config(*sys.argv[1:])).train()
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    flags = [*FLAGS, "--save", str(tmp_path), "--save-interval", "1"]
    process = subprocess.run([sys.executable, "-c", _KILLED_IN_SAVE, *flags], capture_output=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    assert (tmp_path / TRACKER).read_text() == "1"
    assert any(iteration_dir(tmp_path, 2).glob("*.distcp"))   # the interrupted save's files are there
    assert Trainer(run_config(*FLAGS, "--load", str(tmp_path))).iteration == 1


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_each_save_is_one_line_with_its_iteration_directory_time_and_size(tmp_path, mode, capsys):
    _run("--save", str(tmp_path), "--save-interval", "2", "--train-iters", "4", *mode)
    lines = _lines(capsys.readouterr().out, "saved checkpoint")
    assert len(lines) == 2
    for line, iteration in zip(lines, (2, 4)):
        directory = iteration_dir(tmp_path, iteration)
        size = sum(path.stat().st_size for path in directory.glob("*.distcp")) / 1e6   # DCP's data files
        assert f"saved checkpoint at iteration {iteration} to {directory} in " in line
        assert line.endswith(f" s ({size:.2f} MB)") if not mode else line.endswith(f" s) ({size:.2f} MB)")
        assert ("async save: the time training was blocked" in line) == bool(mode)


def test_a_load_directory_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=f"--load {tmp_path / 'typo'}: no such directory"):
        Trainer(run_config(*FLAGS, "--load", str(tmp_path / "typo"), "--save", str(tmp_path / "ckpt")))


def test_load_and_save_the_same_new_directory_starts_fresh_in_one_line(tmp_path, capsys):
    """Megatron's auto-resume: `--save $CKPT --load $CKPT` on a job's first launch, then on its next."""
    ckpt = str(tmp_path / "ckpt")
    first = Trainer(run_config(*FLAGS, "--load", ckpt, "--save", ckpt, "--train-iters", "2"))
    captured = capsys.readouterr()
    assert first.iteration == 0 and not captured.err
    assert _lines(captured.out, "--load") == [f"tessera checkpoint: --load {ckpt}: no checkpoint yet (the --save "
                                              "directory), starting from scratch"]
    first.train()
    assert Trainer(run_config(*FLAGS, "--load", ckpt, "--save", ckpt)).iteration == 2


def test_an_empty_load_directory_starts_fresh_with_a_warning(tmp_path, capsys):
    trainer = Trainer(run_config(*FLAGS, "--load", str(tmp_path)))
    err = capsys.readouterr().err
    assert trainer.iteration == 0
    assert err.splitlines() == [f"tessera checkpoint: warning: --load {tmp_path}: no checkpoint in it, starting "
                                "from scratch"]


def test_loading_one_iteration_directory_names_its_parent(tmp_path):
    _run("--save", str(tmp_path), "--train-iters", "1")
    with pytest.raises(ConfigError, match=f"--load takes the directory that holds them \\({tmp_path}\\)"):
        Trainer(run_config(*FLAGS, "--load", str(iteration_dir(tmp_path, 1))))
