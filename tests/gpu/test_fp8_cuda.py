"""FP8 linear layers on an FP8 GPU: cuBLAS's scaled GEMMs against the dequantised products,
compiled against eager, and delayed scaling under torch.compile.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.kernels.fp8 import E4M3, E5M2, Fp8Linear, Fp8Recipe, quantize, scale_for
from tessera.training import fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs an FP8 GPU")


def dequantized(t, dtype):
    scale = scale_for(t.abs().amax(), dtype)
    return quantize(t, scale, dtype).float() / scale


def run(layer, x, weight, grad):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16):
        y = layer(x, weight)
    y.backward(grad)
    return y, x.grad, weight.grad


def test_scaled_gemms_equal_the_dequantised_products_on_cuda():
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(256, 512, device="cuda", generator=generator)
    weight = torch.randn(384, 512, device="cuda", generator=generator) * 0.02
    grad = torch.randn(256, 384, device="cuda", generator=generator, dtype=torch.bfloat16)
    y, grad_x, grad_w = run(Fp8Linear(Fp8Recipe(recipe="tensorwise")), x, weight, grad)
    x_q, w_q, g_q = dequantized(x, E4M3), dequantized(weight, E4M3), dequantized(grad.float(), E5M2)
    # bf16 outputs: compare at bf16's precision (fp32 accumulation, one rounding at the end)
    torch.testing.assert_close(y.float(), x_q @ w_q.t(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_x.float(), g_q @ w_q, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(grad_w, g_q.t() @ x_q, rtol=1e-2, atol=1e-2)   # FP8 tensor cores' own accumulation


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_compiled_fp8_layer_equals_eager(recipe):
    generator = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(128, 256, device="cuda", generator=generator)
    weight = torch.randn(512, 256, device="cuda", generator=generator) * 0.05
    grad = torch.randn(128, 512, device="cuda", generator=generator, dtype=torch.bfloat16)
    eager, compiled = (Fp8Linear(Fp8Recipe(recipe=recipe), device="cuda") for _ in range(2))
    step = torch.compile(lambda layer, x, w: layer(x, w))
    for _ in range(3):   # delayed: a calibration step, then two from the history
        expected = run(eager, x, weight, grad)
        actual = run(lambda x, w: step(compiled, x, w), x, weight, grad)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2)
        fp8.end_step([eager, compiled], group=None)
    if recipe == "delayed":
        torch.testing.assert_close(compiled.amax_history, eager.amax_history)
        torch.testing.assert_close(compiled.scales, eager.scales)
