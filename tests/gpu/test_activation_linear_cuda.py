"""The dense MLP's activation fused into fc2 (tessera.kernels.activation_linear) with its Triton
kernels, against PyTorch's autograd of the unfused layer, on rows and widths that do not fill the
kernels' tiles; and compiled GPTs with the fused GeLU against eager. Run on a GPU machine:
`python3 -m pytest tests/gpu -q`."""

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels.activation_linear import ACTIVATIONS, activation_linear
from tessera.kernels.gelu import gelu_backward, gelu_forward
from tessera.training.trainer import Trainer
from tests.conftest import run_config
from tests.models.test_mlp import reference_activation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rows, ffn", [(1003, 300), (4096, 768), (0, 64)])
def test_activation_linear_kernels_equal_autograd_of_the_formula(activation, rows, ffn):
    """The same GEMMs either way (d act = dy W, d W = dy^T act): differences are the activation's
    roundings, a bf16 ulp in act and d hidden where fp32 values near a rounding midpoint round
    either way, carried through the GEMMs: a sum of ~1,000 products whose terms cancel can then
    differ by more than its own value allows, hence an absolute slack relative to the largest."""
    generator = torch.Generator("cuda").manual_seed(1)
    width = 2 * ffn if activation == "swiglu" else ffn
    hidden = (3 * torch.randn(rows, width, device="cuda", generator=generator)).bfloat16()
    weight = (torch.randn(96, ffn, device="cuda", generator=generator) / ffn**0.5).bfloat16()
    grad = torch.randn(rows, 96, device="cuda", generator=generator).bfloat16()
    results = []
    for kernel in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if kernel:
            out = activation_linear(h, w, activation)
        else:
            out = F.linear(reference_activation(h.float(), activation).to(torch.bfloat16), w)
        out.backward(grad)
        results.append((out, h.grad, w.grad))
    for got, want in zip(*results):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-8 * want.abs().max().item() if rows else 0)


@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_kernels_equal_pytorchs_gelu_in_fp32(tanh):
    """Elementwise, fp32 in and out, a length that is no multiple of the kernels' block, values far
    into both tails: the kernels against PyTorch's GeLU and its backward op."""
    generator = torch.Generator("cuda").manual_seed(2)
    hidden = 6 * torch.randn(3, 10_007, device="cuda", generator=generator)
    grad = torch.randn(3, 10_007, device="cuda", generator=generator)
    approximate = "tanh" if tanh else "none"
    torch.testing.assert_close(gelu_forward(hidden, tanh), F.gelu(hidden, approximate=approximate))
    d_hidden, act = gelu_backward(grad, hidden, tanh)
    torch.testing.assert_close(d_hidden, torch.ops.aten.gelu_backward(grad, hidden, approximate=approximate))
    torch.testing.assert_close(act, F.gelu(hidden, approximate=approximate))


def test_the_exact_gelu_of_every_bf16_value_is_correctly_rounded():
    """The erf form's kernels approximate the normal tail (tessera.kernels.gelu): over every finite
    bf16 input, GeLU and its slope (d hidden for a gradient of one) rounded to bf16 against the
    fp64 values (erfc, accurate in both tails). PyTorch's own fp32 ops miss ~200 of 65,280 each
    way (its 1 + erf cancels in the negative tail); the kernels may miss no more than they do."""
    every = torch.arange(-2**15, 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    hidden = every[torch.isfinite(every)]
    exact = hidden.double()
    cdf = 0.5 * torch.special.erfc(-exact / 2**0.5)
    want_act = (exact * cdf).bfloat16()
    want_slope = (cdf + exact * torch.exp(-0.5 * exact * exact) / (2 * torch.pi) ** 0.5).bfloat16()
    ones = torch.ones_like(hidden)
    d_hidden, act = gelu_backward(ones, hidden, False)
    misses = {"forward": (gelu_forward(hidden, False) != want_act).sum().item(),
              "backward's act": (act != want_act).sum().item(), "slope": (d_hidden != want_slope).sum().item()}
    pytorchs = {"forward": (F.gelu(hidden.float()).bfloat16() != want_act).sum().item(),
                "slope": (torch.ops.aten.gelu_backward(ones.float(), hidden.float()).bfloat16() != want_slope).sum().item()}
    pytorchs["backward's act"] = pytorchs["forward"]
    assert all(misses[k] <= pytorchs[k] for k in misses), (misses, pytorchs)


@pytest.mark.parametrize("openai_gelu", [False, True])
def test_compiled_gpt_with_the_fused_gelu_trains_like_eager(openai_gelu):
    """The autograd function inside a compiled block, bf16 weights (--use-distributed-optimizer)."""
    flags = ("--model", "tiny-gpt", "--bf16", "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout",
             "0", "--device", "cuda", "--num-workers", "0", "--use-distributed-optimizer") \
        + (("--openai-gelu",) if openai_gelu else ())
    eager = [r.loss for r in Trainer(run_config(*flags, "--no-compile")).train()]
    compiled = [r.loss for r in Trainer(run_config(*flags, "--compile")).train()]
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=0)
    assert compiled[-1] < compiled[0]
