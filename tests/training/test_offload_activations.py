"""Fine-grained activation offloading (--fine-grained-activation-offloading, --offload-modules):
the same losses and weights as without it, bit for bit, alone and beside recomputation, and its
flags' errors. Pipeline layouts: tests/dist/test_offload_layouts.py.

On a CPU-only machine the host and the device are one memory: each offloaded tensor is still
copied into a tensor of its own in the forward pass and into a new one before its backward, and
the groups, their links and the reloads run as on a GPU, so these tests show that every saved
tensor comes back whole and in time. They cannot show what only a GPU has: pinned memory, the
copy streams and their overlap with compute, and the device memory freed.
"""

import pytest
import torch

from tests.conftest import run_config
from tessera.models import activation_offload
from tessera.training.trainer import Trainer

FLAGS = ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2"]
MOE = ["--model", "tiny-moe", "--num-layers", "2", "--moe-layer-freq", "1"]
DENSE_MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp"]


def offload(*modules: str) -> list[str]:
    return ["--fine-grained-activation-offloading", "--offload-modules", *modules, "--min-offloaded-tensor-size", "0"]


@pytest.fixture
def reloads(monkeypatch) -> list:
    """Every group brought back to the device, with how many tensors it held."""
    seen = []
    reload = activation_offload.ActivationOffload._reload

    def counted(self, group):
        if not group.reloaded:
            seen.append(sum(member() is not None for member in group.members))
        reload(self, group)

    monkeypatch.setattr(activation_offload.ActivationOffload, "_reload", counted)
    return seen


def _train(*flags):
    trainer = Trainer(run_config(*FLAGS, *flags))
    return trainer, [r.loss for r in trainer.train()]


def _assert_same(a: Trainer, b: Trainer) -> None:
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("base, modules, groups_per_micro_batch", [
    ([], DENSE_MODULES, 2 * 6),                                        # 2 layers x 6 modules
    (["--bf16", "--use-distributed-optimizer"], ["core_attn", "mlp"], 2 * 2),
    (MOE, ["expert_fc1", "core_attn"], 2 * 2),
], ids=["fp32-every-dense-module", "bf16", "moe-experts"])
def test_offloaded_activations_train_to_the_same_bits(base, modules, groups_per_micro_batch, reloads):
    reference, expected = _train(*base)
    reloads.clear()
    offloaded, losses = _train(*base, *offload(*modules))
    assert losses == expected
    _assert_same(offloaded, reference)
    micro_batches = 3 * 2
    assert len(reloads) == micro_batches * groups_per_micro_batch and all(reloads)


@pytest.mark.parametrize("recompute, modules", [
    (["--recompute-granularity", "selective"], ["qkv_linear", "attn_proj", "mlp"]),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
     ["core_attn", "mlp"]),
], ids=["selective", "full-first-layer"])
def test_offloading_composes_with_recompute(recompute, modules, reloads):
    """Selective recompute of core attention beside offloaded projections and MLP; full recompute
    of the first layer, the second offloaded (only its groups come back)."""
    reference, expected = _train(*recompute)
    reloads.clear()
    offloaded, losses = _train(*recompute, *offload(*modules))
    assert losses == expected
    _assert_same(offloaded, reference)
    layers = 1 if "full" in recompute else 2
    assert len(reloads) == 3 * 2 * layers * len(modules)


def test_small_tensors_stay_on_the_device(reloads):
    """Above the size limit nothing of this tiny model is offloaded, so nothing comes back."""
    _train("--fine-grained-activation-offloading", "--offload-modules", "mlp")
    assert reloads == []


@pytest.mark.parametrize("flags, message", [
    (["--fine-grained-activation-offloading"], "--fine-grained-activation-offloading and --offload-modules go"),
    (["--offload-modules", "mlp"], "--fine-grained-activation-offloading and --offload-modules go"),
    (offload("core_attn") + ["--recompute-granularity", "selective"], "core attention is recomputed"),
    (offload("mlp") + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"], "use --recompute-method block"),
    (offload("mlp") + ["--compile"], "does not combine with --compile"),
])
def test_flags_that_cannot_combine_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        run_config(*flags)
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_modules_no_layer_has_are_refused():
    with pytest.raises(Exception, match="--offload-modules expert_fc1: no layer of this model has"):
        Trainer(run_config(*FLAGS, *offload("expert_fc1")))
