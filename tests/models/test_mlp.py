"""The dense MLP's activation fused into fc2 (tessera.kernels.activation_linear; the Triton kernels
run on CUDA, tests/gpu/test_swiglu_cuda.py and test_gelu_cuda.py): its torch path against finite
differences and PyTorch's own activations, and the MLP through the fused path against the plain one."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.kernels.activation_linear import ACTIVATIONS, activation_linear
from tessera.kernels.gelu import gelu_backward, gelu_forward
from tessera.kernels.swiglu import swiglu_backward, swiglu_forward
from tessera.models.gpt import initialize_parameters
from tessera.models.mlp import MLP
from tests.conftest import fused_as_on_gpus


def reference_activation(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    """PyTorch's own ops, written out apart from tessera's `activate`."""
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "squared_relu":
        return torch.relu(hidden) ** 2
    return F.gelu(hidden, approximate="tanh" if activation == "gelu_tanh" else "none")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_linear_gradients_are_the_numerical_ones(activation):
    generator = torch.Generator().manual_seed(0)
    width = 5 if activation == "swiglu" else 10
    hidden = torch.randn(2, 3, 10, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(4, width, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(activation_linear, (hidden, weight, activation))
    torch.testing.assert_close(activation_linear(hidden, weight, activation),
                               F.linear(reference_activation(hidden.detach(), activation), weight.detach()))
    assert activation_linear(hidden[:0], weight, activation).shape == (0, 3, 4)


def test_the_activation_ops_pass_torchs_op_checks():
    rows = torch.randn(6, 10)
    checks = [torch.library.opcheck(swiglu_forward, (rows,)),
              torch.library.opcheck(swiglu_backward, (torch.randn(6, 5), rows))]
    for tanh in (False, True):
        checks += [torch.library.opcheck(gelu_forward, (rows, tanh)),
                   torch.library.opcheck(gelu_backward, (torch.randn(6, 10), rows, tanh))]
    assert all(set(check.values()) == {"SUCCESS"} for check in checks)


def test_an_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'relu'.*swiglu, gelu, gelu_tanh"):
        activation_linear(torch.randn(2, 4), torch.randn(3, 4), "relu")


@pytest.mark.parametrize("swiglu, openai_gelu, squared_relu",
                         [(True, False, False), (False, False, False), (False, True, False), (False, False, True)])
def test_the_fused_mlp_equals_the_plain_one(swiglu, openai_gelu, squared_relu):
    """fc2 takes the fused path when the kernels run (faked here, so that their torch path runs):
    output, input gradient and every weight's gradient as without it, and the activation not kept."""
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, swiglu=swiglu,
                         openai_gelu=openai_gelu, squared_relu=squared_relu, disable_bias_linear=swiglu,
                         vocab_size=32, seq_length=8)
    mlp = MLP(config, output_std=0.02)
    initialize_parameters(mlp, seed=3)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        mlp.zero_grad()
        with fused_as_on_gpus() if fused else contextlib.nullcontext():
            out = mlp(xi)
            fused_node = out.grad_fn if swiglu else out.grad_fn.next_functions[0][0]   # GeLU's fc2 adds a bias
            assert (type(fused_node).__name__ == "_ActivationLinearBackward") == fused
            out.square().sum().backward()
        results.append([out, xi.grad] + [p.grad for p in mlp.parameters()])
    assert len(results[0]) == (4 if swiglu else 6)
    for fused, plain in zip(results[1], results[0]):
        assert (fused - plain).norm() <= 1e-6 * plain.norm()   # fp32: the same maths in another order
