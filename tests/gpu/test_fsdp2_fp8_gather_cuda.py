"""--fp8-param-gather under FSDP2 on a GPU, one process (a one-rank NCCL group): FSDP2's CUDA
copy-in and copy-out of the E4M3 shards, the FP8 GEMMs reading the gathered bytes. Training with
the flag is bit for bit training without it (tests/dist/test_fp8_param_gather.py proves the same
on CPU ranks), for the tensorwise and blockwise recipes. Run on a GPU machine:
`python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch
import torch.distributed as dist

from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an FP8 GPU")
RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--hidden-size", "128",
                  "--ffn-hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128"],
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_fp8_gathers_train_as_fsdp2_gathers_do(one_rank, recipe):
    if recipe == "blockwise" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("blockwise FP8 needs a Hopper GPU")
    flags = ("--model", "tiny-llama", "--bf16", "--train-iters", "4", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--device", "cuda", "--num-workers", "0", "--use-torch-fsdp2",
             "--no-compile", *RECIPES[recipe])
    runs = {}
    for gather in (False, True):
        trainer = Trainer(run_config(*flags, *(["--fp8-param-gather"] if gather else [])))
        runs[gather] = ([r.loss for r in trainer.train()],
                        {name: p.full_tensor().detach().clone() for name, p in trainer.model.named_parameters()})
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(weight, runs[True][1][name]) for name, weight in runs[False][1].items())
    assert runs[True][0][-1] < runs[True][0][0]
