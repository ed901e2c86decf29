"""The experts' grouped GEMMs through quack (tessera.kernels.grouped_gemm) against
torch._grouped_mm on the same bf16 operands: output and both gradients, with an empty group and
groups that fill no tile; and a compiled tiny MoE trained both ways. Skipped without a Hopper GPU
or the quack-kernels package. Run on a GPU machine: `python3 -m pytest tests/gpu -q`."""

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels import grouped_gemm
from tessera.kernels.grouped_gemm import grouped_linear
from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
    or grouped_gemm._quack_gemm() is None, reason="needs a Hopper GPU and the quack-kernels package")


def _torch_only(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "_quack_gemm", lambda: None)


def _op_and_grads(x, weight, bounds, grad):
    x, weight = (t.detach().requires_grad_() for t in (x, weight))
    out = grouped_linear(x, weight, bounds)
    out.backward(grad)
    return out, x.grad, weight.grad


def test_quack_grouped_linear_equals_torch_grouped_mm(monkeypatch):
    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes = [300, 0, 1000, 77, 513, 1, 260, 640]
    x = torch.randn(sum(sizes), 256, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(len(sizes), 384, 256, device="cuda", generator=generator) / 16).bfloat16()
    grad = torch.randn(sum(sizes), 384, device="cuda", generator=generator).bfloat16()
    bounds = F.pad(torch.tensor(sizes, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    quack = _op_and_grads(x, weight, bounds, grad)
    _torch_only(monkeypatch)
    torch_ = _op_and_grads(x, weight, bounds, grad)
    for name, got, want in zip(("out", "d x", "d weight"), quack, torch_):
        assert got.dtype == want.dtype and got.shape == want.shape
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 2e-3, (name, error)   # fp32 sums in another order, rounded to bf16
    assert quack[2][1].abs().sum() == 0   # the empty group's weight gets no gradient


def test_compiled_moe_trains_alike_through_quack_and_torch(monkeypatch):
    flags = ("--model", "tiny-moe", "--moe-grouped-gemm", "--bf16", "--use-distributed-optimizer",
             "--train-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cuda",
             "--num-workers", "0", "--compile")
    quack = [r.loss for r in Trainer(run_config(*flags)).train()]
    _torch_only(monkeypatch)
    torch_ = [r.loss for r in Trainer(run_config(*flags)).train()]
    torch.testing.assert_close(quack, torch_, rtol=1e-2, atol=0)
    assert quack[-1] < quack[0]
