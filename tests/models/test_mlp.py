"""The dense MLP's SwiGLU fused into fc2 (tessera.kernels.swiglu.swiglu_linear; the Triton kernels
run on CUDA, tests/gpu/test_swiglu_cuda.py): its torch path against finite differences, and the MLP
through the fused path against the plain one."""

import contextlib

import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_linear
from tessera.models.gpt import initialize_parameters
from tessera.models.mlp import MLP
from tests.conftest import fused_as_on_gpus


def test_swiglu_linear_gradients_are_the_numerical_ones():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 10, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(4, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_linear, (hidden, weight))
    gate, up = hidden.detach().chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_linear(hidden, weight), F.linear(F.silu(gate) * up, weight.detach()))
    torch.library.opcheck(swiglu_forward, (hidden.detach().flatten(0, 1).float(),))
    torch.library.opcheck(swiglu_backward, (torch.randn(6, 5), hidden.detach().flatten(0, 1).float()))
    assert swiglu_linear(hidden[:0], weight).shape == (0, 3, 4)


def test_the_fused_mlp_equals_the_plain_one():
    """fc2 takes the fused path when the kernels run (faked here, so that their torch path runs):
    output, input gradient and both weights' gradients as without it, and the activation not kept."""
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, swiglu=True,
                         disable_bias_linear=True, vocab_size=32, seq_length=8)
    mlp = MLP(config, output_std=0.02)
    initialize_parameters(mlp, seed=3)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        mlp.zero_grad()
        with fused_as_on_gpus() if fused else contextlib.nullcontext():
            out = mlp(xi)
            assert (type(out.grad_fn).__name__ == "_SwigluLinearBackward") == fused
            out.square().sum().backward()
        results.append([out, xi.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad])
    for fused, plain in zip(results[1], results[0]):
        assert (fused - plain).norm() <= 1e-6 * plain.norm()   # fp32: the same maths in another order
