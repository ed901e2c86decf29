"""The router's maths against hand-computed cases: scores, top-k, groups, expert bias,
capacity, and the load-balancing losses against their formulas written out plainly."""

import math

import pytest
import torch

from tessera.config import ConfigError, ModelConfig
from tessera.models.router import Router

BASE = dict(num_layers=1, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=16, disable_bias_linear=True)


def router(**fields) -> Router:
    return Router(ModelConfig(**{**BASE, "num_experts": 4, **fields}))


def route(r: Router, logits: torch.Tensor):
    """Routing of tokens whose router logits are `logits` (an identity gate on one-hot inputs)."""
    r.logits = lambda x: x   # the gate's GEMM is plain F.linear; the maths after it is under test
    return r(logits, batch_size=1)


def pairs(routing) -> dict[tuple[int, int], float]:
    return {(t, e): p for t, e, p in zip(routing.token_index.tolist(), routing.expert_index.tolist(),
                                         routing.probs.tolist())}


LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 1.0, 2.0]])


def test_softmax_over_the_chosen_k():
    got = pairs(route(router(), LOGITS)[0])
    a, b = math.exp(2) / (math.exp(2) + math.exp(1)), math.exp(3) / (math.exp(3) + math.exp(2))
    expected = {(0, 0): a, (0, 1): 1 - a, (1, 1): b, (1, 3): 1 - b}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6)


def test_pre_softmax_is_not_renormalised_and_scaling_multiplies():
    got = pairs(route(router(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5), LOGITS)[0])
    total = sum(math.exp(v) for v in (2.0, 1.0, 0.0, -1.0))
    assert got[(0, 0)] == pytest.approx(2.5 * math.exp(2) / total, rel=1e-6)
    assert got[(0, 1)] == pytest.approx(2.5 * math.exp(1) / total, rel=1e-6)


def test_sigmoid_renormalises_over_k_but_not_for_one_expert():
    s = torch.sigmoid(LOGITS[0])
    got = pairs(route(router(moe_router_score_function="sigmoid"), LOGITS)[0])
    assert got[(0, 0)] == pytest.approx((s[0] / (s[0] + s[1])).item(), rel=1e-6)
    single = pairs(route(router(moe_router_score_function="sigmoid", moe_router_topk=1), LOGITS)[0])
    assert single == {(0, 0): pytest.approx(s[0].item()), (1, 1): pytest.approx(torch.sigmoid(LOGITS[1, 1]).item())}


def test_expert_bias_chooses_but_does_not_weigh():
    r = router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))   # expert 2 always chosen
    got = pairs(route(r, LOGITS)[0])
    s = torch.sigmoid(LOGITS[0])
    assert {e for t, e in got if t == 0} == {0, 2}
    assert got[(0, 2)] == pytest.approx((s[2] / (s[0] + s[2])).item(), rel=1e-6)   # unbiased scores


def test_group_limited_routing_keeps_the_best_groups():
    # 8 experts in 4 groups of 2; a group scores the sum of its best k / g = 1 expert.
    logits = torch.tensor([[5.0, -9.0, 4.0, 4.0, 0.0, 4.5, -1.0, 3.0]])
    r = Router(ModelConfig(**{**BASE, "num_experts": 8, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                              "moe_router_topk": 2}))
    # group scores 5, 4, 4.5, 3 -> groups 0 and 2 -> experts {0, 1, 4, 5} -> top-2 {0, 5}, not 2 or 3
    assert {e for _, e in pairs(route(r, logits)[0])} == {0, 5}


@pytest.mark.parametrize("policy, kept", [("probs", {(1, 0), (2, 0)}), ("position", {(0, 0), (1, 0)})])
def test_capacity_drops_by_probs_or_by_position(policy, kept):
    # 4 tokens, top-1 over 2 experts, capacity factor 1: ceil(4 x 1 / 2) = 2 rows per expert.
    logits = torch.tensor([[1.0, 0.9], [3.0, 0.0], [2.0, 0.0], [1.5, 0.0]])
    r = Router(ModelConfig(**{**BASE, "num_experts": 2, "moe_router_topk": 1, "moe_expert_capacity_factor": 1.0,
                              "moe_token_drop_policy": policy, "moe_router_pre_softmax": True}))
    routing, _ = route(r, logits)
    assert set(pairs(routing)) == kept   # expert 0 keeps 2 of its 4 tokens; expert 1 has none


def test_padding_gives_every_expert_its_capacity_with_zero_weights():
    logits = torch.tensor([[1.0, 0.9], [3.0, 0.0], [2.0, 0.0], [1.5, 0.0]])
    r = Router(ModelConfig(**{**BASE, "num_experts": 2, "moe_router_topk": 1, "moe_expert_capacity_factor": 1.0,
                              "moe_token_drop_policy": "position", "moe_pad_expert_input_to_capacity": True,
                              "moe_router_pre_softmax": True}))
    routing, _ = route(r, logits)
    got = pairs(routing)
    assert routing.expert_index.tolist() == [0, 0, 1, 1]                  # exactly 2 rows each, expert-major
    assert {t for t, e in got if e == 0} == {0, 1} and all(got[(t, 0)] > 0 for t in (0, 1))
    assert all(got[(t, 1)] == 0.0 for t, e in got if e == 1)            # expert 1's rows are padding
    assert {t for t, e in got if e == 1} == {0, 1}                       # the first tokens, in order


def test_aux_loss_is_one_at_perfect_balance():
    # Equal scores for all experts and every expert chosen equally often.
    r = router(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[1.0])
    logits = torch.zeros(8, 4)
    assert r.losses(logits, batch_size=1)["aux_loss"].item() == pytest.approx(1.0)


def _switch_loss(scores: torch.Tensor, k: int) -> float:
    """E / (k T^2) sum_e (sum_t p_te)(tokens routed to e), by loops."""
    tokens, experts = scores.shape
    chosen = [set(row.topk(k).indices.tolist()) for row in scores]
    total = 0.0
    for e in range(experts):
        mass = sum(scores[t, e].item() for t in range(tokens))
        count = sum(e in c for c in chosen)
        total += mass * count
    return experts / (k * tokens**2) * total


def test_load_balancing_losses_match_their_formulas():
    torch.manual_seed(0)
    logits = torch.randn(12, 4)   # 2 sequences of 6 tokens
    r = router(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
               moe_aux_loss_coeff=[1.0, 1.0, 1.0], moe_z_loss_coeff=1.0)
    losses = r.losses(logits, batch_size=2)
    scores = logits.softmax(dim=-1)
    assert losses["aux_loss"].item() == pytest.approx(_switch_loss(scores, 2), rel=1e-6)
    per_sequence = [_switch_loss(scores[i * 6:(i + 1) * 6], 2) for i in range(2)]
    assert losses["seq_aux_loss"].item() == pytest.approx(sum(per_sequence) / 2, rel=1e-6)
    assert losses["global_aux_loss"].item() == pytest.approx(_switch_loss(scores, 2), rel=1e-6)  # one micro-batch
    z = sum(torch.logsumexp(row, 0).item() ** 2 for row in logits) / 12
    assert losses["z_loss"].item() == pytest.approx(z, rel=1e-6)


def test_sigmoid_load_balancing_scores_are_normalised_over_all_experts():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    r = router(moe_router_score_function="sigmoid", moe_aux_loss_coeff=[1.0])
    s = logits.sigmoid()
    assert r.losses(logits, 1)["aux_loss"].item() == pytest.approx(_switch_loss(s / s.sum(-1, keepdim=True), 2),
                                                                   rel=1e-6)


def test_global_aux_loss_uses_the_running_mean_of_counts():
    r = router(moe_router_load_balancing_type=["global_aux_loss"], moe_aux_loss_coeff=[1.0])
    first, second = torch.randn(6, 4), torch.randn(6, 4)
    r.losses(first, 1)
    value = r.losses(second, 1)["global_aux_loss"].item()
    counts = sum(torch.zeros(6, 4).scatter_(1, x.softmax(-1).topk(2).indices, 1.0).sum(0) for x in (first, second)) / 2
    expected = 4 / (2 * 36) * (second.softmax(-1).sum(0) * counts).sum().item()
    assert value == pytest.approx(expected, rel=1e-6)


def test_the_router_records_counts_and_losses_while_training():
    r = router(moe_aux_loss_coeff=[1e-2])
    routing, weighted = route(r, LOGITS)
    assert r.tokens_per_expert.tolist() == [1.0, 2.0, 0.0, 1.0]
    assert weighted.item() == pytest.approx(1e-2 * r.loss_totals[0].item())
    r.eval()
    route(r, LOGITS)
    assert r.tokens_per_expert.tolist() == [1.0, 2.0, 0.0, 1.0]   # evaluation does not count


@pytest.mark.parametrize("fields, message", [
    ({"moe_router_topk": 5}, "--moe-router-topk (5) must not exceed --num-experts (4)"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk": 3},
     "cannot supply --moe-router-topk (3)"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "--num-experts (4) must be divisible by "
                                                                "--moe-router-num-groups (3)"),
    ({"moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    ({"moe_pad_expert_input_to_capacity": True}, "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ({"moe_layer_freq": "[1,0]"}, "gives 2 layers, --num-layers is 1"),
    ({"moe_layer_freq": "__import__('os')"}, "--moe-layer-freq"),
])
def test_bad_router_settings_name_the_flags(fields, message):
    with pytest.raises(ConfigError, match=None) as error:
        ModelConfig(**{**BASE, "num_experts": 4, **fields})
    assert message in str(error.value)


def test_a_moe_flag_without_experts_names_it():
    with pytest.raises(ConfigError, match="--moe-router-topk needs --num-experts"):
        ModelConfig(**BASE, moe_router_topk=4)


def test_layer_pattern_forms():
    config = ModelConfig(**{**BASE, "num_layers": 4, "num_experts": 4, "moe_layer_freq": "([0]*1+[1]*3)"})
    assert config.moe_layers() == [False, True, True, True]
    assert ModelConfig(**{**BASE, "num_layers": 4, "num_experts": 4, "moe_layer_freq": "2"}).moe_layers() == \
        [True, False, True, False]


def test_expert_bias_moves_towards_balance_once_per_step():
    """MoEBalance.finish_step: overloaded experts' bias goes down by the rate, underloaded up."""
    from tessera.models.gpt import GPTModel
    from tessera.parallel.mesh import Mesh
    from tessera.training.losses import MoEBalance

    config = ModelConfig(**{**BASE, "num_layers": 2, "num_experts": 4, "moe_router_score_function": "sigmoid",
                            "moe_router_enable_expert_bias": True, "moe_layer_freq": "[0,1]"})
    model = GPTModel(config)
    router = model.moe_layers()[1].router
    router.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 2.0, 0.0]))   # mean 2
    balance = MoEBalance(model, Mesh(), num_micro_batches=1, bias_update_rate=0.1)
    metrics = balance.finish_step(torch.device("cpu"))
    assert router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])
    assert metrics["expert_load_imbalance"].item() == pytest.approx(5 / 2)
    assert router.tokens_per_expert.sum() == 0   # counted afresh each step
