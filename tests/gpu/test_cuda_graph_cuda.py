"""--cuda-graph-impl full_iteration: steps replayed from one CUDA graph compute exactly what eager
steps compute (the same kernels in the same order): losses every step and weights after them,
for autograd's gradients, the main-grad buffer of several micro-batches, torch's AdamW, a
compiled MoE model whose routers count tokens inside the graph (and move their expert biases
between steps), MLA with an MTP depth, and FP8 (tensorwise with FP8 experts, blockwise). Run on a GPU machine: `python3 -m pytest tests/gpu -q`."""

import pytest
import torch

from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 6


def _train(flags, graph: bool):
    extra = ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"] if graph else []
    trainer = Trainer(run_config(*flags, *extra, "--bf16", "--device", "cuda", "--hidden-dropout", "0",
                                 "--attention-dropout", "0", "--train-iters", str(STEPS)))
    losses = [trainer.train_step().resolve() for _ in range(STEPS)]
    trainer.optimizer.wait_for_parameters()
    return losses, [p.detach().clone() for p in trainer.model.parameters()], trainer


@pytest.mark.parametrize("flags", [
    ("--model", "tiny-llama", "--global-batch-size", "2", "--use-distributed-optimizer", "--no-compile"),
    ("--model", "tiny-llama", "--global-batch-size", "4", "--use-distributed-optimizer", "--no-compile"),
    ("--model", "tiny-llama", "--global-batch-size", "2", "--no-compile"),
    ("--model", "tiny-moe", "--moe-grouped-gemm", "--global-batch-size", "2", "--use-distributed-optimizer",
     "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
     "--moe-router-bias-update-rate", "1e-2"),
    ("--model", "tiny-deepseek", "--moe-grouped-gemm", "--global-batch-size", "2", "--use-distributed-optimizer", "--no-compile"),
    ("--model", "tiny-moe", "--moe-grouped-gemm", "--global-batch-size", "2", "--use-distributed-optimizer",
     "--no-compile", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-experts"),
    ("--model", "tiny-llama", "--global-batch-size", "2", "--use-distributed-optimizer", "--no-compile",
     "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--hidden-size", "128", "--ffn-hidden-size", "256",
     "--seq-length", "128"),   # 128-blocks: every GEMM dimension and the tokens per micro-batch
], ids=["autograd-grads", "main-grad-buffer-2-micro-batches", "torch-adamw", "moe-compiled", "mla-mtp",
        "fp8-tensorwise-moe", "fp8-blockwise"])
def test_replayed_steps_compute_what_eager_steps_compute(flags):
    eager, eager_weights, _ = _train(flags, graph=False)
    graphed, graphed_weights, trainer = _train(flags, graph=True)
    assert trainer.step_graph.graph is not None   # the later steps were replays
    assert [r.loss for r in graphed] == [r.loss for r in eager]
    assert [r.grad_norm for r in graphed] == [r.grad_norm for r in eager]
    assert [r.moe for r in graphed] == [r.moe for r in eager]
    for ours, theirs in zip(graphed_weights, eager_weights):
        assert torch.equal(ours, theirs)


def test_a_batch_of_another_shape_is_refused():
    flags = ("--model", "tiny-llama", "--global-batch-size", "2", "--no-compile")
    _, _, trainer = _train(flags, graph=True)
    batch = {key: value[:1] for key, value in trainer.step_graph.batches[0].items()}
    with pytest.raises(RuntimeError, match="every step must have the same shapes"):
        trainer.step_graph.run([batch], trainer.step_graph.loss_weight)
