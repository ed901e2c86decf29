"""The MoE layer against a plain per-token loop, grouped GEMMs against the loop over experts,
and the load-balancing loss's way into the gradient."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.models.gpt import initialize_parameters
from tessera.models.moe import MoELayer, grouped_mm_available

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32, disable_bias_linear=True,
            num_experts=4, moe_ffn_hidden_size=12, ffn_hidden_size=32, swiglu=True)


def layer(**fields) -> MoELayer:
    moe = MoELayer(ModelConfig(**{**BASE, **fields}), output_std=0.02)
    initialize_parameters(moe, seed=3)
    return moe


def inputs(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def per_token_reference(moe: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """sum over each token's chosen experts of weight x expert(token), one token at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    probs, experts = moe.router.top_k(F.linear(tokens, moe.router.weight))
    rows = []
    for t in range(tokens.shape[0]):
        out = 0
        for p, e in zip(probs[t], experts[t]):
            gate, up = F.linear(tokens[t], moe.experts.fc1[e]).chunk(2)
            out = out + p * F.linear(F.silu(gate) * up, moe.experts.fc2[e])
        rows.append(out)
    out = torch.stack(rows).view_as(x)
    if moe.shared_expert is not None:
        shared = moe.shared_expert(x)
        out = out + (shared * torch.sigmoid(F.linear(x, moe.shared_expert_gate))
                     if moe.shared_expert_gate is not None else shared)
    return out


def gradients(moe: MoELayer, out: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    moe.zero_grad()
    x.grad = None
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    return {"input": x.grad.clone(), **{name: p.grad.clone() for name, p in moe.named_parameters()}}


@pytest.mark.parametrize("fields", [{}, {"moe_shared_expert_intermediate_size": 8, "moe_shared_expert_gate": True},
                                    {"moe_router_score_function": "sigmoid", "moe_router_topk": 3}])
def test_layer_matches_the_per_token_loop_forward_and_backward(fields):
    moe = layer(**fields)
    x = inputs()
    out = moe(x)
    expected = per_token_reference(moe, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    got, want = gradients(moe, out, x), gradients(moe, per_token_reference(moe, x), x)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not grouped_mm_available("cpu", torch.float32), reason="torch._grouped_mm has no CPU kernel")
@pytest.mark.parametrize("fields", [{}, {"swiglu": False}, {"moe_ffn_hidden_size": 8, "moe_router_topk": 1}])
def test_grouped_gemm_equals_the_loop_over_experts(fields):
    loop, grouped = layer(**fields), layer(moe_grouped_gemm=True, **fields)
    x = inputs(1)
    out_loop, out_grouped = loop(x), grouped(x)
    torch.testing.assert_close(out_grouped, out_loop, rtol=1e-6, atol=1e-6)
    got, want = gradients(grouped, out_grouped, x), gradients(loop, out_loop, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not grouped_mm_available("cpu", torch.float32), reason="torch._grouped_mm has no CPU kernel")
@pytest.mark.parametrize("grouped", [False, True])
def test_empty_experts_and_one_expert_taking_every_token(grouped):
    moe = layer(moe_grouped_gemm=grouped, moe_router_topk=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0   # every token's largest logit is expert 2's (inputs shifted positive)
    x = (inputs(2).detach().abs() + 0.1).requires_grad_()
    out = moe(x)
    torch.testing.assert_close(out, per_token_reference(moe, x), rtol=1e-5, atol=1e-6)
    grads = gradients(moe, out, x)
    assert grads["experts.fc1"][[0, 1, 3]].abs().sum() == 0 and grads["experts.fc1"][2].abs().sum() > 0


def test_the_load_balancing_loss_gets_the_scale_as_its_gradient():
    """Backward through the layer gives the router what autograd of (output . g + scale x aux) gives."""
    moe = layer(moe_aux_loss_coeff=[0.1], moe_z_loss_coeff=0.01)
    moe.aux_loss_scale.fill_(0.25)
    x = inputs(3)
    g = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    (moe(x) * g).sum().backward()
    attached = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_loss_scale.fill_(0.0)   # the same forward, the aux loss added to the objective by hand
    out = moe(x)
    tokens = x.reshape(-1, 16)
    losses = moe.router.losses(F.linear(tokens, moe.router.weight), batch_size=2)
    aux = 0.1 * losses["aux_loss"] + 0.01 * losses["z_loss"]
    ((out * g).sum() + 0.25 * aux).backward()
    torch.testing.assert_close(attached, moe.router.weight.grad, rtol=1e-6, atol=1e-9)
    moe.zero_grad()
    (moe(x) * g).sum().backward()   # scale 0: no load-balancing gradient at all
    assert not torch.allclose(moe.router.weight.grad, attached)


def test_dispatch_then_combine_gives_back_k_copies_of_each_token():
    moe = layer(moe_router_topk=3)
    tokens = torch.randn(10, 16)
    routing, _ = moe.router(tokens, batch_size=1)
    rows = moe.dispatcher.dispatch(tokens, routing)
    assert rows.tokens_per_expert.sum() == 30 and torch.equal(rows.tokens_per_expert,
                                                              torch.bincount(routing.expert_index, minlength=4))
    torch.testing.assert_close(moe.dispatcher.combine(rows.hidden, rows), 3 * tokens)


def test_weighted_swiglu_gradients_are_the_numerical_ones():
    """The experts' activation (tessera.kernels.swiglu, one kernel each way on CUDA): its torch path
    in fp64 against finite differences, and its registration (fake tensors, autograd) by opcheck."""
    from tessera.kernels.swiglu import weighted_swiglu

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    probs = torch.rand(5, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(weighted_swiglu, (hidden, probs))
    gate, up = hidden.detach().chunk(2, dim=-1)
    torch.testing.assert_close(weighted_swiglu(hidden, probs), F.silu(gate) * up * probs.detach()[:, None])
    torch.library.opcheck(weighted_swiglu, (hidden.float().detach().requires_grad_(), probs.float().detach()))
    assert weighted_swiglu(hidden[:0].bfloat16(), probs[:0].float()).shape == (0, 3)


@pytest.mark.skipif(not grouped_mm_available("cpu", torch.float32), reason="torch._grouped_mm has no CPU kernel")
def test_grouped_linear_equals_a_linear_per_group():
    """The experts' grouped GEMM op (tessera.kernels.grouped_gemm): output and both gradients
    against F.linear on each group's rows, an empty group among them; its registration by opcheck."""
    from tessera.kernels.grouped_gemm import grouped_linear

    generator = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 2]
    x = torch.randn(sum(sizes), 8, generator=generator, requires_grad=True)
    weight = torch.randn(len(sizes), 16, 8, generator=generator, requires_grad=True)
    bounds = F.pad(torch.tensor(sizes).cumsum(0), (1, 0)).to(torch.int32)
    grad = torch.randn(sum(sizes), 16, generator=generator)
    got = grouped_linear(x, weight, bounds)
    got_grads = torch.autograd.grad(got, (x, weight), grad)
    want = torch.cat([F.linear(rows, w) for rows, w in zip(x.split(sizes), weight)])
    want_grads = torch.autograd.grad(want, (x, weight), grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert got_grads[1][1].abs().sum() == 0   # the empty group's weight gets no gradient
    torch.library.opcheck(grouped_linear, (x, weight, bounds))
