"""FP8 linear layers: quantisation, the three scaled GEMMs, delayed scaling's history, which layers, bad input.

torch._scaled_mm runs on CPU too, so the GEMMs are checked here against fp32 matmuls of the
dequantised operands (exact up to fp32 rounding) and against the unquantised product (within
E4M3's precision); speed lives on the GPU (bench/).
"""

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, TrainConfig
from tessera.kernels.fp8 import E4M3, E5M2, FP8_MAX, Fp8Linear, Fp8Recipe, quantize, scale_for
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values
from tessera.training import fp8
from tests.conftest import run_config


def test_quantize_is_torchs_cast_of_the_scaled_value_and_saturates():
    x = torch.randn(1000) * 3
    scale = torch.tensor(7.5)
    assert torch.equal(quantize(x, scale, E4M3), (x * scale).to(E4M3))   # in range: round to nearest even
    big = torch.tensor([1e6, -1e6, 500.0, -449.0])
    assert quantize(big, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 448.0, -448.0]
    assert quantize(torch.tensor([1e9]), torch.tensor(1.0), E5M2).float().item() == 57344.0


def test_scale_maps_amax_to_the_format_maximum_with_margin():
    amax = torch.tensor(3.5)
    assert scale_for(amax, E4M3).item() * 3.5 == pytest.approx(448.0)
    assert scale_for(amax, E5M2, margin=2).item() * 3.5 == pytest.approx(57344.0 / 4)
    assert torch.isfinite(scale_for(torch.tensor(0.0), E4M3))   # an all-zero tensor


def dequantized(t, dtype):
    """What FP8 with a per-tensor current scale turns t into, and that scale."""
    scale = scale_for(t.abs().amax(), dtype)
    return quantize(t, scale, dtype).float() / scale


@pytest.mark.parametrize("form", ["hybrid", "e4m3"])
def test_the_three_gemms_are_fp32_products_of_the_dequantised_operands(form):
    torch.manual_seed(0)
    x = torch.randn(48, 64, requires_grad=True)
    weight = torch.randn(32, 64, requires_grad=True)
    layer = Fp8Linear(Fp8Recipe(format=form, recipe="tensorwise"))
    y = layer(x, weight)
    grad = torch.randn_like(y)
    y.backward(grad)
    x_q, w_q, g_q = dequantized(x.detach(), E4M3), dequantized(weight.detach(), E4M3), \
        dequantized(grad, E5M2 if form == "hybrid" else E4M3)
    torch.testing.assert_close(y, x_q @ w_q.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, g_q @ w_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, g_q.t() @ x_q, rtol=1e-5, atol=1e-5)
    # and close to the unquantised products: E4M3 keeps 3 mantissa bits (2^-4 relative per element)
    exact = x.detach() @ weight.detach().t()
    assert (y - exact).norm() / exact.norm() < 0.05


def test_no_fp8_wgrad_keeps_the_weight_gradient_in_high_precision():
    torch.manual_seed(1)
    x, weight = torch.randn(32, 48, requires_grad=True), torch.randn(16, 48, requires_grad=True)
    y = Fp8Linear(Fp8Recipe(recipe="tensorwise", fp8_wgrad=False))(x, weight)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(weight.grad, grad.t() @ x.detach(), rtol=1e-5, atol=1e-5)


def test_batched_input_and_bias():
    torch.manual_seed(2)
    x, weight, bias = torch.randn(2, 16, 32), torch.randn(48, 32), torch.randn(48)
    y = Fp8Linear(Fp8Recipe(recipe="tensorwise"))(x, weight, bias)
    expected = dequantized(x.reshape(-1, 32), E4M3) @ dequantized(weight, E4M3).t() + bias
    torch.testing.assert_close(y, expected.reshape(2, 16, 48), rtol=1e-5, atol=1e-5)


def test_delayed_scaling_history():
    """Step 1 scales by its own amax; each step's max over micro-batches enters the history;
    the next scales come from the most recent amax or the window's max, less the margin."""
    recipe = Fp8Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo="max", margin=1)
    layer = Fp8Linear(recipe)
    weight = torch.full((16, 16), 0.5, requires_grad=True)
    steps = [[1.0, 4.0], [2.0, 2.0], [0.5, 0.25], [0.125, 0.125]]   # the input's amax in each micro-batch
    for step, micro_batches in enumerate(steps):
        for value in micro_batches:
            x = torch.full((16, 16), value, requires_grad=True)
            y = layer(x, weight)
            if step == 0:   # no history yet: this tensor's own amax (less the margin)
                assert layer.scale(0, x, E4M3).item() == pytest.approx(448.0 / value / 2)
            else:
                assert layer.scale(0, x, E4M3).item() == pytest.approx(layer.scales[0].item())
            y.sum().backward()
        fp8.end_step([layer], group=None)
        assert layer.amax_history[0, 0].item() == max(micro_batches)
        window = [max(s) for s in steps[max(0, step - 2):step + 1]]
        assert layer.scales[0].item() == pytest.approx(448.0 / max(window) / 2)
        assert layer.scales[1].item() == pytest.approx(448.0 / 0.5 / 2)          # the weight's amax
        assert layer.scales[2].item() == pytest.approx(57344.0 / layer.amax_history[2].max().item() / 2)
    assert layer.amax_history[0].tolist() == [0.125, 0.5, 2.0]   # newest first, the oldest dropped


def test_most_recent_uses_the_last_step_only():
    layer = Fp8Linear(Fp8Recipe(recipe="delayed", amax_history_len=4))
    weight = torch.ones(16, 16)
    for value in (8.0, 2.0):
        layer(torch.full((16, 16), value), weight)
        fp8.end_step([layer], group=None)
    assert layer.scales[0].item() == pytest.approx(448.0 / 2.0)


def tiny_model(**overrides):
    model = GPTModel(ModelConfig(**{**preset_values("tiny-llama"), "num_layers": 4, **overrides}))
    initialize_parameters(model, seed=4)
    return model


def test_fp8_goes_to_the_blocks_linears_only():
    model = tiny_model()
    train = TrainConfig(train_iters=1, bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise",
                        first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert fp8.bf16_layers(train, 4) == {0, 2, 3}
    layers = fp8.apply_fp8(model.layers.items(), fp8.recipe_of(train), fp8.bf16_layers(train, 4), 64)
    with_fp8 = {name for name, module in model.named_modules() if getattr(module, "fp8", None) is not None}
    assert with_fp8 == {"layers.1.attention.qkv", "layers.1.attention.proj", "layers.1.mlp.fc1", "layers.1.mlp.fc2"}
    assert len(layers) == 4 and all(layer.recipe.grad_dtype == E5M2 for layer in layers)
    assert set(model.state_dict()) == set(tiny_model().state_dict())   # checkpoints are those of bf16 runs


def test_fp8_model_trains_close_to_the_unquantised_one():
    torch.manual_seed(3)
    tokens = torch.randint(0, 200, (2, 32))
    losses = {}
    for name in ("fp32", "fp8"):
        model = tiny_model(hidden_size=64, ffn_hidden_size=192)
        if name == "fp8":
            fp8.apply_fp8(model.layers.items(), Fp8Recipe(recipe="tensorwise"), set(), 64)
        losses[name] = model(tokens, labels=tokens).mean()
        losses[name].backward()
    assert abs(losses["fp8"].item() - losses["fp32"].item()) < 0.01 * losses["fp32"].item()


@pytest.mark.parametrize("flags, message", [
    (dict(fp8_format="hybrid"), "--fp8-format needs --bf16"),
    (dict(bf16=True, fp8_format="e4m3", fp8_recipe="mxfp8"), "--fp8-recipe mxfp8 needs a Blackwell GPU"),
    (dict(bf16=True, fp8_format="hybrid", fp8_recipe="blockwise"), "--fp8-recipe blockwise needs --fp8-format e4m3"),
    (dict(bf16=True, fp8_format="hybrid", first_last_layers_bf16=True),
     "--first-last-layers-bf16 does not combine with --fp8-recipe delayed"),
    (dict(bf16=True, fp8_format="hybrid", fp8_amax_history_len=0), "--fp8-amax-history-len must be positive"),
    (dict(bf16=True, fp8_param_gather=True), "--fp8-param-gather needs --fp8-format"),
])
def test_bad_fp8_settings_name_their_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(train_iters=1, **flags)


@pytest.mark.parametrize("flags, message", [
    ([], "--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2 (a "
         "--data-parallel-sharding-strategy other than no_shard)"),
    (["--use-torch-fsdp2", "--compile"], "--fp8-param-gather with --use-torch-fsdp2 does not combine with --compile "
                                         "(use --no-compile)"),
])
def test_fp8_param_gather_needs_a_sharded_layout_and_no_compile_under_fsdp2(flags, message, capsys):
    with pytest.raises(SystemExit):
        run_config("--bf16", "--fp8-format", "hybrid", "--fp8-param-gather", *flags)
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def test_fp8_on_cpu_and_on_undivisible_shapes_is_refused():
    with pytest.raises(ConfigError, match="--fp8-format needs a CUDA GPU with FP8 tensor cores .* on cpu"):
        fp8.check_device(torch.device("cpu"), Fp8Recipe(recipe="tensorwise"))
    recipe = Fp8Recipe(recipe="tensorwise")
    with pytest.raises(ConfigError, match=r"layer 0's attention.qkv has a 144 x 72 weight"):
        fp8.apply_fp8(tiny_model(hidden_size=72, num_attention_heads=4, num_query_groups=2).layers.items(),
                      recipe, set(), 64)
    with pytest.raises(ConfigError, match=r"tokens per micro-batch per rank \(40\) divisible by 16"):
        fp8.apply_fp8(tiny_model().layers.items(), recipe, set(), 40)


def test_fp8_limits_are_the_formats():
    assert (FP8_MAX[E4M3], FP8_MAX[E5M2]) == (448.0, 57344.0)
