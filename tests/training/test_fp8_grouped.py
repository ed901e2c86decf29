"""FP8 grouped GEMMs of the MoE experts: per-row quantisation, the padded group layout, the three
GEMMs against fp32 products of the dequantised operands, the MoE layer in FP8 against fp32,
which modules get it, bad shapes. On CPU the GEMMs are emulated from the same FP8 operands
(tests/gpu/test_fp8_cuda.py holds torch._scaled_grouped_mm to the emulation on a GPU)."""

import pytest
import torch

from tessera.config import ConfigError, ModelConfig, TrainConfig
from tessera.kernels.fp8 import E4M3, Fp8Recipe, quantize, scale_for
from tessera.kernels.fp8_grouped import GROUP_ROWS, fp8_grouped_linear, padded_groups, quantize_rows
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.moe import GroupedExperts, MoELayer
from tessera.models.presets import preset_values
from tessera.training import fp8


def test_quantize_rows_maps_each_rows_amax_to_448():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    x8, scale = quantize_rows(x.t().contiguous().t())   # a column-major input comes back row-major
    assert x8.dtype == E4M3 and x8.is_contiguous() and scale.shape == (5,)
    assert x8.float().abs().amax(dim=1)[:4].tolist() == [448.0] * 4 and torch.all(x8[4].float() == 0)
    dequantised = x8.float() * scale[:, None]
    assert torch.all((dequantised - x).abs() <= x.abs().amax(dim=1, keepdim=True) * 2.0**-4)


def test_padded_groups_puts_each_expert_at_a_multiple_of_16_rows():
    where, ends, total = padded_groups(torch.tensor([3, 0, 17, 5]), rows=25)
    assert total == 32 + GROUP_ROWS * 4   # a bound that does not depend on the routing
    assert ends.dtype == torch.int32 and ends.tolist() == [16, 16, 48, total]   # the last group ends at the bound
    assert where.tolist() == [0, 1, 2] + list(range(16, 33)) + list(range(48, 53))


def dequantised_by_rows(t):
    scale = scale_for(t.abs().amax(dim=-1, keepdim=True), E4M3)
    return quantize(t, scale, E4M3).float() / scale


def groups(ends):
    starts = [0] + ends.tolist()[:-1]
    return list(zip(starts, ends.tolist()))


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_the_three_grouped_gemms_are_fp32_products_of_the_dequantised_operands(fp8_wgrad):
    torch.manual_seed(0)
    ends = torch.tensor([16, 16, 64, 96], dtype=torch.int32)   # an empty group among them
    x = torch.randn(96, 48, requires_grad=True)
    weight = torch.randn(4, 32, 48, requires_grad=True)
    y = fp8_grouped_linear(x, weight, ends, fp8_wgrad)
    grad = torch.randn_like(y)
    y.backward(grad)
    x_q, w_q, g_q = dequantised_by_rows(x.detach()), dequantised_by_rows(weight.detach()), dequantised_by_rows(grad)
    w_q_in = dequantised_by_rows(weight.detach().transpose(1, 2)).transpose(1, 2)   # scaled per input column
    g_q_cols, x_q_cols = dequantised_by_rows(grad.t()).t(), dequantised_by_rows(x.detach().t()).t()
    for e, (s, t) in enumerate(groups(ends)):
        torch.testing.assert_close(y[s:t], x_q[s:t] @ w_q[e].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad[s:t], g_q[s:t] @ w_q_in[e], rtol=1e-5, atol=1e-5)
        want = g_q_cols[s:t].t() @ x_q_cols[s:t] if fp8_wgrad else grad[s:t].t() @ x.detach()[s:t]
        torch.testing.assert_close(weight.grad[e], want, rtol=1e-5, atol=1e-4)
    exact = torch.cat([x.detach()[s:t] @ weight.detach()[e].t() for e, (s, t) in enumerate(groups(ends))])
    assert (y - exact).norm() / exact.norm() < 0.05   # E4M3's 3 mantissa bits


MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
           disable_bias_linear=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           ffn_hidden_size=128, swiglu=True, moe_grouped_gemm=True)


def moe_layers_and_grads(x, exact_fp8=None):
    """An fp32 MoE layer and its FP8 twin (same weights): outputs and gradients on x."""
    results = []
    for with_fp8 in (False, True):
        layer = MoELayer(ModelConfig(**MOE), output_std=0.02)
        initialize_parameters(layer, seed=5)
        layer.experts.fp8 = Fp8Recipe(recipe="tensorwise", experts=True) if with_fp8 else None
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out, xi.grad, layer.experts.fc1.grad, layer.experts.fc2.grad, layer.router.weight.grad])
    return results


def error(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_moe_layer_in_fp8_follows_fp32_with_uneven_groups():
    torch.manual_seed(2)
    x = torch.randn(3, 17, 64)   # 51 tokens x top-2 over 4 experts: groups that are not multiples of 16
    fp32, fp8_run = moe_layers_and_grads(x)
    assert error(fp8_run[0], fp32[0]) < 0.1   # two E4M3 GEMMs in a row
    for got, want in zip(fp8_run[1:], fp32[1:]):
        assert error(got, want) < 0.15


def test_the_padded_layout_computes_exactly_the_unpadded_experts(monkeypatch):
    # With the cast to E4M3 taken out, the FP8 path is exact fp32 arithmetic: only the padded
    # layout, the scales (which then cancel) and the GEMMs' operand order are left to differ.
    import tessera.kernels.fp8_grouped as grouped
    monkeypatch.setattr(grouped, "quantize", lambda x, scale, dtype: x.float() * scale)
    torch.manual_seed(2)
    fp32, fp8_run = moe_layers_and_grads(torch.randn(3, 17, 64))
    for got, want in zip(fp8_run, fp32):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def tiny_moe(**overrides):
    model = GPTModel(ModelConfig(**{**preset_values("tiny-moe"), **overrides}))
    initialize_parameters(model, seed=4)
    return model


def test_fp8_experts_gives_the_experts_grouped_fp8_gemms_and_refuses_undivisible_ones():
    plain = tiny_moe()
    fp8.apply_fp8(plain.layers.items(), Fp8Recipe(recipe="tensorwise"), set(), 64)
    assert all(m.fp8 is None for m in plain.modules() if isinstance(m, GroupedExperts))   # without --fp8-experts
    model = tiny_moe()
    recipe = Fp8Recipe(recipe="tensorwise", experts=True)
    fp8.apply_fp8(model.layers.items(), recipe, {1}, 64)
    experts = {name: module.fp8 for name, module in model.named_modules() if isinstance(module, GroupedExperts)}
    assert experts and all(r is (None if name.startswith("layers.1.") else recipe) for name, r in experts.items())
    with pytest.raises(ConfigError, match=r"layer 1's mlp.experts.fc2 has 64 x 72 expert weights .* "
                                          r"divisible by 16 \(--hidden-size, --moe-ffn-hidden-size\)"):
        fp8.apply_fp8(tiny_moe(moe_ffn_hidden_size=72).layers.items(), recipe, set(), 64)


def test_fp8_moe_model_trains_close_to_the_unquantised_one():
    torch.manual_seed(3)
    tokens = torch.randint(0, 200, (2, 32))
    losses = {}
    for name in ("fp32", "fp8"):
        model = tiny_moe()
        if name == "fp8":
            fp8.apply_fp8(model.layers.items(), Fp8Recipe(recipe="tensorwise", experts=True), set(), 64)
        losses[name] = model(tokens, labels=tokens).mean()
        losses[name].backward()
    assert abs(losses["fp8"].item() - losses["fp32"].item()) < 0.01 * losses["fp32"].item()


def test_fp8_experts_with_any_recipe_and_only_with_fp8():
    with pytest.raises(ConfigError, match="--fp8-experts needs --fp8-format"):
        TrainConfig(train_iters=1, bf16=True, fp8_experts=True)
    train = TrainConfig(train_iters=1, bf16=True, fp8_format="e4m3", fp8_recipe="delayed", fp8_experts=True)
    model = tiny_moe()
    fp8.apply_fp8(model.layers.items(), fp8.recipe_of(train), set(), 64)
    assert all(m.fp8 is not None for m in model.modules() if isinstance(m, GroupedExperts))
