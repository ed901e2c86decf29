"""The MoE experts' FP8 grouped GEMMs on a Hopper GPU: torch._scaled_grouped_mm against the CPU
emulation of the same FP8 operands, FP8 MoE training against bf16, compiled against eager.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.kernels.fp8 import Fp8Recipe
from tessera.kernels.fp8_grouped import fp8_grouped_linear
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.moe import GroupedExperts
from tessera.models.presets import preset_values
from tessera.training import fp8
from tessera.training.trainer import Trainer
from tests.conftest import run_config
from tests.gpu.memorise import memorise

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="torch's FP8 grouped GEMM (CUTLASS, rowwise scales) is Hopper's")


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_scaled_grouped_gemms_equal_the_cpu_emulation(fp8_wgrad):
    generator = torch.Generator("cuda").manual_seed(0)
    ends = torch.tensor([32, 32, 96, 160, 256], dtype=torch.int32)   # an empty group; multiples of 16
    x = torch.randn(256, 128, device="cuda", generator=generator).bfloat16()
    weight = torch.randn(5, 64, 128, device="cuda", generator=generator).bfloat16()
    grad = torch.randn(256, 64, device="cuda", generator=generator).bfloat16()
    results = []
    for device in ("cuda", "cpu"):   # the CPU runs the same FP8 operands through fp32 products
        # detach(): fresh leaves, so that the CUDA pass's requires_grad does not reach the CPU copies
        xi = x.to(device, torch.float32 if device == "cpu" else x.dtype).detach().requires_grad_()
        wi = weight.to(device, xi.dtype).detach().requires_grad_()
        y = fp8_grouped_linear(xi, wi, ends.to(device), fp8_wgrad)
        y.backward(grad.to(device, xi.dtype))
        results.append((y, xi.grad, wi.grad))
    for got, want in zip(*results):
        assert _error(got, want) < 1e-2   # bf16 outputs and fast accumulation


def test_fp8_moe_training_follows_bf16():
    """A small MoE memorising one batch with AdamW, experts and linears in FP8 (per-row scales in the
    experts): the first loss within 1% of bf16's, both falling below 40% of it in 20 steps and ending
    within 15% of each other (as test_fp8_cuda's blockwise test)."""
    tokens = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    values = {**preset_values("tiny-moe"), "hidden_size": 256, "ffn_hidden_size": 512, "moe_ffn_hidden_size": 128,
              "vocab_size": 1024, "seq_length": 128, "moe_grouped_gemm": True}
    curves = {}
    for name in ("bf16", "fp8"):
        model = GPTModel(ModelConfig(**values)).cuda()
        initialize_parameters(model, seed=5)
        if name == "fp8":
            fp8.apply_fp8(model.layers.items(), Fp8Recipe(recipe="tensorwise", experts=True), set(), 4 * 128)
            assert all(m.fp8 is not None for m in model.modules() if isinstance(m, GroupedExperts))
        curves[name], _ = memorise(model, tokens)
    bf16, fp8_curve = curves["bf16"], curves["fp8"]
    assert abs(fp8_curve[0] - bf16[0]) < 0.01 * bf16[0], curves
    assert max(bf16[-1] / bf16[0], fp8_curve[-1] / fp8_curve[0]) < 0.4, curves
    assert abs(fp8_curve[-1] - bf16[-1]) < 0.15 * bf16[-1], curves


def test_compiled_fp8_moe_trains_like_eager():
    flags = ("--model", "tiny-moe", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-experts",
             "--use-distributed-optimizer", "--global-batch-size", "2", "--train-iters", "4", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--device", "cuda", "--num-workers", "0")
    eager = [r.loss for r in Trainer(run_config(*flags, "--no-compile")).train()]
    compiled = [r.loss for r in Trainer(run_config(*flags, "--compile")).train()]
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=0)
    assert compiled[-1] < compiled[0]
