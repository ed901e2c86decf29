"""tessera.kernels.swiglu's Triton kernels against PyTorch's autograd of the same formulas in fp32,
rounded to bf16: the experts' weighted SwiGLU on rows and columns that do not fill the kernels'
tiles, and a compiled LLaMA whose MLP fuses SwiGLU into fc2 (the fused linear itself:
test_activation_linear_cuda.py). Run on a GPU machine: `python3 -m pytest tests/gpu -q`."""

import pytest
import torch
import torch.nn.functional as F

from tessera.kernels.swiglu import weighted_swiglu
from tessera.training.trainer import Trainer
from tests.conftest import run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

@pytest.mark.parametrize("rows, ffn", [(1003, 300), (4096, 768), (0, 64)])
def test_weighted_swiglu_kernels_equal_autograd_of_the_formula(rows, ffn):
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
            out = (F.silu(gate) * up * p[:, None]).to(torch.bfloat16)
        out.backward(grad)
        results.append((out, h.grad, p.grad))
    (out, d_hidden, d_probs), (want_out, want_hidden, want_probs) = results
    assert out.dtype == d_hidden.dtype == torch.bfloat16 and d_probs.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-6)   # a bf16 rounding apart at most
    torch.testing.assert_close(d_hidden, want_hidden, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(d_probs, want_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["fp32 + autocast", "bf16"])
def test_compiled_llama_with_the_fused_mlp_trains_like_eager(weights):
    """Through torch.compile (the autograd function inside a compiled block), with fp32 weights cast
    under autocast and with bf16 weights (--use-distributed-optimizer)."""
    flags = ("--model", "tiny-llama", "--bf16", "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout",
             "0", "--device", "cuda", "--num-workers", "0") + (("--use-distributed-optimizer",) if weights == "bf16" else ())
    eager = [r.loss for r in Trainer(run_config(*flags, "--no-compile")).train()]
    compiled = [r.loss for r in Trainer(run_config(*flags, "--compile")).train()]
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=0)
    assert compiled[-1] < compiled[0]
