"""The MoE layer's CUDA path: bf16 grouped GEMMs against the loop over experts, and a compiled
MoE model against eager. Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models.gpt import initialize_parameters
from tessera.models.moe import MoELayer
from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=512,
              disable_bias_linear=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
              ffn_hidden_size=512, swiglu=True, moe_aux_loss_coeff=[1e-2])


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_bf16_grouped_gemm_matches_the_loop_over_experts():
    layers = []
    for grouped in (False, True):
        with torch.device("cuda"):
            layer = MoELayer(ModelConfig(**CONFIG, moe_grouped_gemm=grouped), output_std=0.02)
        initialize_parameters(layer, seed=1)
        layers.append(layer)
    x = torch.randn(4, 128, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    g = torch.randn_like(x)
    outs, grads = [], []
    for layer in layers:
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(xi)
        (out.float() * g).sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    assert _error(outs[1], outs[0]) < 1e-2   # bf16 GEMMs that add in another order
    for got, want in zip(grads[1], grads[0]):
        assert _error(got, want) < 2e-2


def test_compiled_moe_model_trains_like_eager():
    flags = ("--model", "tiny-moe", "--moe-grouped-gemm", "--bf16", "--train-iters", "4", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--device", "cuda", "--num-workers", "0")
    eager = [r.loss for r in Trainer(run_config(*flags, "--no-compile")).train()]
    compiled = [r.loss for r in Trainer(run_config(*flags, "--compile")).train()]
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=0)
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize("rows, ffn", [(1003, 300), (4096, 768), (0, 64)])
def test_weighted_swiglu_kernels_equal_autograd_of_the_formula(rows, ffn):
    """tessera.kernels.swiglu's Triton kernels against PyTorch's autograd of SiLU(gate) * up * probs in fp32,
    rounded to bf16; rows and columns that do not fill the kernels' tiles."""
    from tessera.kernels.swiglu import weighted_swiglu

    generator = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(rows, 2 * ffn, device="cuda", generator=generator).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=generator)
    grad = torch.randn(rows, ffn, device="cuda", generator=generator).bfloat16()
    results = []
    for kernel in (True, False):
        h, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        if kernel:
            out = weighted_swiglu(h, p)
        else:
            gate, up = h.float().chunk(2, dim=-1)
            out = (torch.nn.functional.silu(gate) * up * p[:, None]).to(torch.bfloat16)
        out.backward(grad)
        results.append((out, h.grad, p.grad))
    (out, d_hidden, d_probs), (want_out, want_hidden, want_probs) = results
    assert out.dtype == d_hidden.dtype == torch.bfloat16 and d_probs.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-6)   # a bf16 rounding apart at most
    torch.testing.assert_close(d_hidden, want_hidden, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(d_probs, want_probs, rtol=1e-5, atol=1e-5)
