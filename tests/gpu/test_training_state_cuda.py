"""Training state on a GPU: a checkpoint of bf16 weights beside the distributed optimizer's masters
(fp32, or kept as remainders below the weights) loads back bit for bit and resumes on the
uninterrupted curve; the NaN/Inf check's CUDA-event path stops a run at a bad iteration before any
update; a Hugging Face model's logits on the GPU equal transformers'. Run on a GPU machine:
`python3 -m pytest tests/gpu -q`."""

import pytest
import torch
import transformers

from tessera.interop.hf import load_hf
from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FLAGS = ("--model", "tiny-llama", "--bf16", "--use-distributed-optimizer", "--train-iters", "6", "--hidden-dropout",
         "0", "--attention-dropout", "0", "--device", "cuda", "--num-workers", "0", "--lr", "1e-2")


def _state(trainer: Trainer) -> list[torch.Tensor]:
    """Every tensor a resume needs: the masters, the model's weights and Adam's moments."""
    inner = trainer.optimizer.inner
    tensors = [master.cpu() for master, _, _ in inner.master_weights()]
    tensors += [weight.detach().cpu() for weight in trainer.model.parameters()]
    return tensors + [inner.optimizer.state[master][kind].cpu() for master, *_ in inner.slices()
                      for kind in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("masters", [(), ("--use-precision-aware-optimizer",)], ids=["fp32 masters", "remainders"])
def test_a_checkpoint_loads_back_exactly_and_resumes_on_the_curve(masters, tmp_path):
    flags = (*FLAGS, *masters)
    expected = [r.loss for r in Trainer(run_config(*flags)).train()]
    first = Trainer(run_config(*flags, "--save", str(tmp_path), "--exit-interval", "3"))
    before = [r.loss for r in first.train()]
    resumed = Trainer(run_config(*flags, "--load", str(tmp_path)))
    for saved, loaded in zip(_state(first), _state(resumed), strict=True):
        assert saved.dtype == loaded.dtype and torch.equal(saved, loaded)
    after = [r.loss for r in resumed.train()]
    # The GPU's attention backward may sum in another order from run to run: close, not equal.
    torch.testing.assert_close(before + after, expected, rtol=1e-4, atol=0)


def test_a_nan_stops_the_run_before_any_update_on_the_gpu():
    trainer = Trainer(run_config(*FLAGS, "--check-for-nan-in-loss-and-grad"))
    with torch.no_grad():
        trainer.model.embedding.weight[:, 0] = float("nan")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(FloatingPointError, match="iteration 1"):   # read behind an event, one iteration late
        trainer.train()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]) or name == "embedding.weight", name
    assert trainer.model.embedding.weight[:, 1:].equal(before["embedding.weight"][:, 1:])


def test_hf_logits_on_the_gpu_equal_transformers(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).cuda().eval()
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        expected = reference(ids).logits
        actual = load_hf(tmp_path).cuda()(ids)
    assert actual.shape == expected.shape and actual.is_cuda
    assert (actual - expected).abs().max().item() <= 1e-4
