"""Optimizer state offload (--optimizer-cpu-offload): the same losses and weights as without it,
bit for bit, and checkpoints that load either way.

On a CPU-only machine the host and the device are one memory: the offloaded state is still kept
in tensors of its own and copied into new ones for each chunk's step and back, so these tests run
the real bookkeeping (which slices go to the host, the chunks, the swaps of each tensor's storage,
the state made by the first step and by a checkpoint load). They cannot show what only a GPU has:
pinned memory, the copy streams and their overlap with the step, and the memory the device saves.
"""

import pytest
import torch

from tests.conftest import run_config
from tessera.training.optim import offload
from tessera.training.trainer import Trainer

FLAGS = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2",
         "--use-distributed-optimizer"]
OFFLOAD = ["--optimizer-cpu-offload"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of a few slices each, so that a step streams several."""
    monkeypatch.setattr(offload, "CHUNK_ELEMENTS", 20_000)


def _train(*flags):
    trainer = Trainer(run_config(*FLAGS, *flags))
    return trainer, [r.loss for r in trainer.train()]


def _assert_same_weights_and_state(a: Trainer, b: Trainer) -> None:
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), name
    adam_a, adam_b = a.optimizer.inner.optimizer, b.optimizer.inner.optimizer
    for (master_a, *_), (master_b, *_) in zip(a.optimizer.inner.slices(), b.optimizer.inner.slices()):
        assert torch.equal(master_a, master_b)
        for kind in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(adam_a.state[master_a][kind].cpu(), adam_b.state[master_b][kind].cpu()), kind


@pytest.mark.parametrize("flags", [["--bf16", "--optimizer-offload-fraction", "0.6"],
                                   ["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
                                   []], ids=["bf16-masters-part", "remainders-bf16-moment", "fp32-moments"])
def test_offloaded_state_trains_to_the_same_bits(flags, capsys):
    """fp32 masters apart from bf16 weights (60% offloaded), their remainders with a bf16 moment,
    and fp32 weights that are their own masters (only the moments offloaded). The start-up line
    says how much of the state is in host memory."""
    reference, expected = _train(*flags)
    assert "in host memory" not in capsys.readouterr().out
    offloaded, losses = _train(*flags, *OFFLOAD)
    assert f"({offloaded.optimizer.host_state_bytes() / 2**30:.3f} GiB of it in host memory)" in capsys.readouterr().out
    assert losses == expected
    _assert_same_weights_and_state(offloaded, reference)
    state = offloaded.optimizer.inner.offload
    assert len(state.chunks) > 1
    adam = offloaded.optimizer.inner.optimizer
    held = sum(t.nbytes for m in state.offloaded for t in (adam.state[m]["exp_avg"], adam.state[m]["exp_avg_sq"]))
    assert state.host_bytes() == held + sum(m.nbytes for m in state.apart) > 0
    masters = [master for master, *_ in offloaded.optimizer.inner.slices()]
    assert 0 < len(state.offloaded) <= len(masters)
    # Each offloaded tensor kept its identity: the optimizer's state is still keyed by the masters.
    assert set(state.offloaded) <= set(offloaded.optimizer.inner.optimizer.state)


@pytest.mark.parametrize("save_with, load_with", [(OFFLOAD, []), ([], OFFLOAD)],
                         ids=["offloaded-to-not", "not-to-offloaded"])
def test_a_checkpoint_loads_with_or_without_offload(tmp_path, save_with, load_with):
    """Saved at iteration 3 one way and resumed the other, a run has the uninterrupted run's losses
    and ends with its weights and state."""
    reference, expected = _train("--bf16")
    _, before = _train("--bf16", *save_with, "--save", str(tmp_path), "--exit-interval", "3")
    resumed, after = _train("--bf16", *load_with, "--load", str(tmp_path))
    assert before + after == expected
    _assert_same_weights_and_state(resumed, reference)


@pytest.mark.parametrize("flags, message", [
    (OFFLOAD, "--optimizer-cpu-offload needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", *OFFLOAD, "--optimizer", "muon"], "does not combine with --optimizer muon"),
    (["--use-distributed-optimizer", *OFFLOAD, "--cuda-graph-impl", "full_iteration"],
     "--optimizer-cpu-offload does not combine with --cuda-graph-impl"),
    (["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction must be in [0, 1]"),
])
def test_flags_that_cannot_combine_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        run_config(*flags)
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
