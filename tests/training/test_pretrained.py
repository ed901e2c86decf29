"""Starting a run from a model: --pretrained-checkpoint (a tessera checkpoint or a Hugging Face
directory) and --use-checkpoint-args, against transformers' own forward pass."""

import pytest
import torch
import transformers

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist.launcher import run_distributed
from tests.hf_models import save_tiny_llama

RUN = ["--mock-data", "--lr", "1e-3", "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "2",
       "--log-interval", "1000", "--num-workers", "0", "--seq-length", "32", "--hidden-dropout", "0",
       "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf"))


def hf_logits(hf_dir, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def tessera_logits(trainer, tokens):
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(tokens)[..., :256]


def test_a_hugging_face_directory_starts_the_run_with_its_model_and_weights(hf_dir, capsys):
    config, _ = parse_run_config([*RUN, "--pretrained-checkpoint", str(hf_dir)], world_size=1)
    assert (config.model.num_layers, config.model.num_query_groups, config.model.swiglu) == (2, 2, True)
    assert "note: the model's flags are --pretrained-checkpoint" in config.notes[0]
    trainer = Trainer(config)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(tessera_logits(trainer, tokens), hf_logits(hf_dir, tokens), rtol=1e-5, atol=1e-5)
    assert trainer.iteration == 0
    history = trainer.train()
    assert len(history) == 2
    assert "starting from the weights of --pretrained-checkpoint" in capsys.readouterr().out


def test_a_tessera_checkpoint_starts_the_run_at_iteration_0_and_load_wins_once_it_holds_one(tmp_path, hf_dir):
    first = Trainer(parse_run_config([*RUN, "--pretrained-checkpoint", str(hf_dir), "--save", str(tmp_path / "a")],
                                     world_size=1)[0])
    first.train()
    weights = {name: p.detach().clone() for name, p in first.model.named_parameters()}
    # Another run starts from those weights, with its own optimizer and schedule.
    second = Trainer(parse_run_config([*RUN, "--pretrained-checkpoint", str(tmp_path / "a"), "--save",
                                       str(tmp_path / "b"), "--load", str(tmp_path / "b")], world_size=1)[0])
    assert second.iteration == 0
    for name, param in second.model.named_parameters():
        assert torch.equal(param, weights[name]), name
    second.train()
    # Relaunched, the same command resumes from --load rather than starting over.
    third = Trainer(parse_run_config([*RUN, "--train-iters", "3", "--pretrained-checkpoint", str(tmp_path / "a"),
                                      "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")], world_size=1)[0])
    assert third.iteration == 2


def test_use_checkpoint_args_takes_the_architecture_and_keeps_what_may_change(hf_dir):
    config, _ = parse_run_config([*RUN, "--model", "tiny-gpt", "--seq-length", "48", "--use-checkpoint-args",
                                  "--pretrained-checkpoint", str(hf_dir)], world_size=1)
    assert config.model.normalization == "RMSNorm" and config.model.swiglu     # the checkpoint's, not tiny-gpt's
    assert config.model.seq_length == 48                                         # the command line's


@pytest.mark.parametrize("flags, message", [
    (["--pretrained-checkpoint", "/nonexistent"], "--pretrained-checkpoint /nonexistent: neither a tessera "
     "checkpoint directory nor a Hugging Face model directory (config.json and *.safetensors)"),
    (["--model", "tiny-llama", "--use-checkpoint-args"], "--use-checkpoint-args needs a checkpoint in --load or a "
                                                         "--pretrained-checkpoint"),
])
def test_a_missing_start_is_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_run_config([*RUN, *flags], world_size=1)
    assert capsys.readouterr().err.strip() == f"tessera train: error: {message}"


def _first_loss(flags):
    config, _ = parse_run_config(flags, world_size=2)
    return Trainer(config).train()[0].loss


def test_tensor_parallel_ranks_start_from_the_same_hugging_face_model(hf_dir):
    flags = [*RUN, "--pretrained-checkpoint", str(hf_dir)]
    expected = Trainer(parse_run_config(flags, world_size=1)[0]).train()[0].loss
    losses = run_distributed(_first_loss, 2, [*flags, "--tensor-model-parallel-size", "2"])
    assert losses[0] == pytest.approx(expected, rel=1e-5)
