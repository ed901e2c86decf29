"""LoRA through the trainer: a frozen base from --pretrained-checkpoint (or --load --finetune),
adapter-only checkpoints, an exact resume."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tessera.cli.args import parse_run_config
from tessera.training.checkpoint import iteration_dir
from tessera.training.trainer import Trainer

RUN = ["--model", "tiny-llama", "--mock-data", "--lr", "1e-2", "--micro-batch-size", "2", "--global-batch-size",
       "4", "--log-interval", "1000", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def trainer(*flags) -> Trainer:
    return Trainer(parse_run_config([*RUN, *flags], world_size=1)[0])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A pretrained tiny model: two steps of full training."""
    path = tmp_path_factory.mktemp("base")
    trainer("--train-iters", "2", "--save", str(path)).train()
    return path


def test_the_base_stays_as_loaded_and_only_the_adapters_train(base, tmp_path):
    run = trainer(*LORA, "--train-iters", "3", "--pretrained-checkpoint", str(base), "--save", str(tmp_path / "out"))
    loaded = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    run.train()
    for name, param in run.model.named_parameters():
        adapter = "lora_" in name
        assert param.requires_grad == adapter, name
        assert torch.equal(param, loaded[name]) != adapter, name   # the base bit for bit; A and B moved
    # The checkpoint holds the adapters alone: the base is --pretrained-checkpoint's.
    saved = dcp.FileSystemReader(iteration_dir(tmp_path / "out", 3)).read_metadata().state_dict_metadata
    model_keys = {key for key in saved if key.startswith("model.")}
    assert model_keys and all("lora_" in key for key in model_keys)


def test_an_adapter_checkpoint_resumes_exactly(base, tmp_path):
    flags = [*LORA, "--pretrained-checkpoint", str(base), "--save", str(tmp_path / "out"), "--load",
             str(tmp_path / "out")]
    uninterrupted = [r.loss for r in trainer(*flags[:-4], "--train-iters", "4").train()]
    first = trainer(*flags, "--train-iters", "4", "--exit-interval", "2").train()
    resumed = trainer(*flags, "--train-iters", "4")
    assert resumed.iteration == 2
    assert [r.loss for r in first] + [r.loss for r in resumed.train()] == uninterrupted


def test_load_finetune_takes_the_base_from_a_full_checkpoint(base):
    run = trainer(*LORA, "--train-iters", "1", "--load", str(base), "--finetune")
    reference = trainer("--train-iters", "1", "--load", str(base), "--finetune")
    assert run.iteration == 0
    weights = dict(reference.model.named_parameters())
    for name, param in run.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, weights[name]), name


def test_adapters_without_their_base_are_one_line(base, tmp_path):
    trainer(*LORA, "--train-iters", "1", "--pretrained-checkpoint", str(base), "--save", str(tmp_path)).train()
    with pytest.raises(Exception, match="holds LoRA adapters without their base model: give the base with "
                                        "--pretrained-checkpoint"):
        trainer(*LORA, "--train-iters", "2", "--load", str(tmp_path))
