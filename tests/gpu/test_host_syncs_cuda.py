"""A training step never makes the host wait for the GPU: the host queues the next step's
kernels while the GPU runs this one's (a wait drains the queue, and the GPU then idles while
the host catches up: 9.5 ms a step on config M before; docs/performance-notes.md). CUDA's sync debug
mode turns every synchronizing call into an error. Run on a GPU machine:
`python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("flags", [
    ("--model", "tiny-llama", "--global-batch-size", "2"),
    ("--model", "tiny-llama", "--global-batch-size", "4"),   # two micro-batches: the gradient buffer
    ("--model", "tiny-moe", "--moe-grouped-gemm", "--global-batch-size", "2"),
], ids=["dense", "dense-2-micro-batches", "moe"])
def test_a_training_step_never_waits_for_the_gpu(flags):
    trainer = Trainer(run_config(*flags, "--bf16", "--use-distributed-optimizer", "--device", "cuda", "--no-compile",
                                 "--hidden-dropout", "0", "--attention-dropout", "0"))
    for _ in range(2):   # the first steps build what later steps reuse
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [trainer.train_step() for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(r.loss) for r in results)
