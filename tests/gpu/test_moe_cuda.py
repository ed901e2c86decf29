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
