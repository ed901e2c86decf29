"""Blockwise FP8 (--fp8-recipe blockwise): 1x128 tiles and 128x128 blocks against a per-tile
reference, an outlier's reach, the three GEMMs' orientation, errors against fp32, flags.

cuBLAS's block-scaled GEMM runs only on Hopper, so here the layer runs its CPU path: the
operands quantised as on the GPU, dequantised (exactly: the scales are powers of 2) and
multiplied in fp32. tests/gpu/test_fp8_cuda.py checks cuBLAS against this path.
"""

import math

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, TrainConfig
from tessera.kernels.fp8 import E4M3, Fp8Linear, Fp8Recipe
from tessera.kernels.fp8_blockwise import BlockwiseFp8Linear, dequantize, quantize_blocks, quantize_tiles
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values
from tessera.training import fp8

BLOCKWISE = Fp8Recipe(format="e4m3", recipe="blockwise")


def reference_quantize(x, tile_rows):
    """Tile by tile: the largest power of 2 that keeps the tile's amax within 448, then torch's
    saturating-free cast (nothing exceeds 448). Returns the FP8 copy and the dequantisation scales."""
    x = x.float()
    data = torch.empty(x.shape, dtype=E4M3)
    scale_inv = torch.empty(x.shape[0] // tile_rows, x.shape[1] // 128)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * tile_rows, (i + 1) * tile_rows), slice(j * 128, (j + 1) * 128)
            amax = x[rows, cols].abs().max().item()
            scale = 2.0 ** math.floor(math.log2(448.0 / amax))
            assert 224.0 < amax * scale <= 448.0
            data[rows, cols] = (x[rows, cols] * scale).to(E4M3)
            scale_inv[i, j] = 1 / scale
    return data, scale_inv


def reference_values(x, tile_rows):
    data, scale_inv = reference_quantize(x, tile_rows)
    return data.float() * scale_inv.repeat_interleave(tile_rows, 0).repeat_interleave(128, 1)


def spread(*shape, seed):
    """Normal values whose magnitude differs from tile to tile by up to 2^±12, with a few outliers."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator)
    x = x * 2.0 ** torch.randint(-12, 12, (shape[0], shape[1] // 128), generator=generator).repeat_interleave(128, 1)
    x.view(-1)[torch.randint(0, x.numel(), (8,), generator=generator)] *= 300
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_and_blocks_equal_the_per_tile_reference(dtype):
    x = spread(256, 384, seed=0).to(dtype)
    for quantize, tile_rows in ((quantize_tiles, 1), (quantize_blocks, 128)):
        data, scale_inv = quantize(x)
        expected_data, expected_scale_inv = reference_quantize(x, tile_rows)
        assert data.dtype == E4M3 and scale_inv.dtype == torch.float32
        assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
        assert torch.equal(scale_inv, expected_scale_inv)
        assert torch.equal(dequantize(data, scale_inv), reference_values(x, tile_rows))


def test_an_outlier_changes_only_its_own_tile_or_block():
    x = torch.randn(256, 512)
    hot = x.clone()
    hot[130, 300] = 1e3   # tile (130, 2); block (1, 2)
    for quantize, tile in ((quantize_tiles, (130, 2)), (quantize_blocks, (1, 2))):
        (data, scale_inv), (hot_data, hot_scale_inv) = quantize(x), quantize(hot)
        changed = (scale_inv != hot_scale_inv).nonzero().tolist()
        assert changed == [list(tile)]
        rows = slice(130, 131) if quantize is quantize_tiles else slice(128, 256)
        outside = torch.ones_like(x, dtype=torch.bool)
        outside[rows, 256:384] = False
        assert torch.equal(data.view(torch.uint8)[outside], hot_data.view(torch.uint8)[outside])


def test_a_zero_tile_has_a_finite_scale_and_stays_zero():
    x = torch.randn(2, 256)
    x[1, :128] = 0
    data, scale_inv = quantize_tiles(x)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    assert torch.equal(data[1, :128].float(), torch.zeros(128))


def run_layer(layer, x, weight, grad):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = layer(x, weight)
    y.backward(grad)
    return y.detach(), x.grad, weight.grad


def test_each_gemm_quantises_along_its_own_contraction():
    """fprop: x in tiles along features, W in blocks; dgrad: dy in tiles along out features;
    wgrad: dy^T and x^T in tiles along tokens, cast from the high-precision tensors."""
    x, weight, grad = spread(256, 384, seed=1), spread(256, 384, seed=2) * 0.02, spread(256, 256, seed=3)
    y, grad_x, grad_w = run_layer(BlockwiseFp8Linear(BLOCKWISE), x, weight, grad)
    torch.testing.assert_close(y, reference_values(x, 1) @ reference_values(weight, 128).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_x, reference_values(grad, 1) @ reference_values(weight, 128), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w, reference_values(grad.t(), 1) @ reference_values(x.t(), 1).t(),
                               rtol=1e-5, atol=1e-5)


def relative_error(actual, exact):
    return ((actual - exact).norm() / exact.norm()).item()


def test_blockwise_is_within_fp8_error_of_fp32_and_keeps_small_tiles_that_tensorwise_loses():
    """E4M3 rounds each element to 2^-4 relative; over a GEMM the errors average to ~2%. One
    outlier in x sets tensorwise's scale for the whole tensor and flushes the small tiles to zero."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(256, 384, generator=generator) * 1e-3
    x[0, 0] = 1e3
    weight = torch.randn(256, 384, generator=generator) * 0.02
    grad = torch.randn(256, 256, generator=generator)
    tensorwise_layer = Fp8Linear(Fp8Recipe(format="e4m3", recipe="tensorwise"))
    exact, blockwise, tensorwise = (run_layer(f, x, weight, grad) for f in (
        lambda x, w: x @ w.t(), BlockwiseFp8Linear(BLOCKWISE), tensorwise_layer))
    # y's rows and dW's columns but the outlier's (dx's operands, dy and W, hold none)
    away = [(slice(1, None), slice(None)), (slice(None), slice(None)), (slice(None), slice(1, None))]
    for name, where, b, e in zip(("y", "dx", "dW"), away, blockwise, exact):
        assert relative_error(b[where], e[where]) < 0.04, name
    for index in (0, 2):   # tensorwise flushed the small x values to zero
        assert relative_error(tensorwise[index][away[index]], exact[index][away[index]]) > 0.5


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision():
    x, weight, grad = spread(128, 256, seed=5), spread(128, 256, seed=6), spread(128, 128, seed=7)
    layer = BlockwiseFp8Linear(Fp8Recipe(format="e4m3", recipe="blockwise", fp8_wgrad=False))
    _, _, grad_w = run_layer(layer, x, weight, grad)
    torch.testing.assert_close(grad_w, grad.t() @ x, rtol=1e-5, atol=1e-5)


def test_batched_input_and_bias():
    x, weight, bias = spread(256, 128, seed=8).reshape(2, 128, 128), spread(128, 128, seed=9), torch.randn(128)
    y = BlockwiseFp8Linear(BLOCKWISE)(x, weight, bias)
    expected = reference_values(x.reshape(-1, 128), 1) @ reference_values(weight, 128).t() + bias
    torch.testing.assert_close(y, expected.reshape(2, 128, 128), rtol=1e-5, atol=1e-5)


def tiny_model(**overrides):
    # every linear's dimensions multiples of 128: qkv 256 x 128, proj 128 x 128, fc1 256 x 128, fc2 128 x 128
    values = {**preset_values("tiny-llama"), "hidden_size": 128, "ffn_hidden_size": 128, **overrides}
    model = GPTModel(ModelConfig(**values))
    initialize_parameters(model, seed=4)
    return model


def test_blockwise_model_trains_close_to_the_unquantised_one():
    tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(3))
    losses, grads = {}, {}
    for name in ("fp32", "fp8"):
        model = tiny_model()
        if name == "fp8":
            layers = fp8.apply_fp8(model.layers.items(), BLOCKWISE, set(), 128)
            assert len(layers) == 8 and all(isinstance(layer, BlockwiseFp8Linear) for layer in layers)
        losses[name] = model(tokens, labels=tokens).mean()
        losses[name].backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.layers.parameters()])
    assert abs(losses["fp8"].item() - losses["fp32"].item()) < 0.01 * losses["fp32"].item()
    # a weight's gradient passes through several E4M3 roundings (the dgrads above it, its wgrad):
    # ~6.5% here, as with E4M3 tensorwise scaling
    assert relative_error(grads["fp8"], grads["fp32"]) < 0.1


def test_undivisible_layers_and_token_counts_name_the_layer_and_the_flag():
    with pytest.raises(ConfigError, match=r"--fp8-recipe blockwise: layer 0's attention.qkv has a 128 x 64 weight "
                                          r"on each rank; FP8 GEMMs need both dimensions divisible by 128 \(or use "
                                          r"--fp8-recipe tensorwise\)"):
        fp8.apply_fp8(tiny_model(hidden_size=64).layers.items(), BLOCKWISE, set(), 128)
    with pytest.raises(ConfigError, match=r"--fp8-recipe blockwise: .* tokens per micro-batch per rank \(64\) "
                                          r"divisible by 128"):
        fp8.apply_fp8(tiny_model().layers.items(), BLOCKWISE, set(), 64)


def test_blockwise_flags():
    train = TrainConfig(train_iters=1, bf16=True, fp8_format="e4m3", fp8_recipe="blockwise", no_fp8_wgrad=True)
    assert fp8.recipe_of(train) == Fp8Recipe(format="e4m3", recipe="blockwise", fp8_wgrad=False)
    with pytest.raises(ConfigError, match=r"--fp8-recipe blockwise needs --fp8-format e4m3"):
        TrainConfig(train_iters=1, bf16=True, fp8_format="hybrid", fp8_recipe="blockwise")


@pytest.mark.parametrize("capability, error", [((9, 0), None), ((8, 9), "--fp8-recipe blockwise needs a Hopper GPU"),
                                               ((10, 0), "--fp8-recipe blockwise needs a Hopper GPU")])
def test_blockwise_needs_hopper(monkeypatch, capability, error):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    fp8.check_device(torch.device("cuda"), Fp8Recipe(format="e4m3", recipe="tensorwise"))   # any FP8 GPU will do
    if error is None:
        fp8.check_device(torch.device("cuda"), BLOCKWISE)
    else:
        with pytest.raises(ConfigError, match=error):
            fp8.check_device(torch.device("cuda"), BLOCKWISE)
