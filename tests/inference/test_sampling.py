"""Sampling: each option against hand-computed cases, the draw against its distribution."""

import math
from dataclasses import dataclass, field

import pytest
import torch

from tessera.inference.sampling import (
    Sampler, SamplingParams, apply_presence_frequency_penalties, apply_repetition_penalty, min_p_filter,
    token_counts, top_k_filter, top_p_filter,
)

NEG = float("-inf")
PROBS = [0.6, 0.25, 0.1, 0.05]   # cumulative sums, ascending: 0.05, 0.15, 0.4, 1: far from every top_p below


@dataclass
class Row:
    params: SamplingParams
    seed: int = 0
    prompt_token_ids: list = field(default_factory=lambda: [0])
    output_token_ids: list = field(default_factory=list)


def _log(probs):
    return torch.tensor([probs]).log()


@pytest.mark.parametrize("field_name, value", [
    ("max_tokens", 0), ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("stop_token_ids", (-1,)),
    ("min_tokens", 20), ("seed", 1.5), ("logprobs", -1)])
def test_bad_params_name_their_field(field_name, value):
    with pytest.raises(ValueError, match=f"^{field_name} must be"):
        SamplingParams(**{field_name: value}).validate()


def test_top_k_keeps_the_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([[1.0, 2.0, 3.0, 3.0, 0.0]] * 3)
    out = top_k_filter(logits, torch.tensor([3, 1, 0]))
    assert out[0].tolist() == [NEG, 2.0, 3.0, 3.0, NEG]
    assert out[1].tolist() == [NEG, NEG, 3.0, 3.0, NEG]   # k = 1, but two tokens share the top logit
    assert out[2].tolist() == logits[2].tolist()           # 0 = off


@pytest.mark.parametrize("top_p, kept", [(0.5, [0]), (0.7, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_is_hugging_faces_nucleus(top_p, kept):
    out = top_p_filter(_log(PROBS), torch.tensor([[top_p]]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    out = min_p_filter(_log(PROBS), torch.tensor([[0.2]]))   # threshold 0.6 * 0.2 = 0.12
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = token_counts([[1, 0, 1]], 4, "cpu") > 0
    out = apply_repetition_penalty(logits, seen, torch.tensor([[2.0]]))
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0]


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = token_counts([[3, 3, 1]], 4, "cpu")
    assert counts[0].tolist() == [0, 1, 0, 2]
    out = apply_presence_frequency_penalties(logits, counts, torch.tensor([[0.5]]), torch.tensor([[0.25]]))
    assert out[0].tolist() == [1.0, 1.0 - 0.25 - 0.5, 1.0, 1.0 - 0.5 - 0.5]


def test_greedy_takes_the_argmax_after_the_penalties():
    sampler = Sampler(4)
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]] * 2)
    plain = Row(SamplingParams(temperature=0))
    penalised = Row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[0])   # 2 -> 1
    assert sampler(logits, [plain, penalised]).token_ids == [0, 1]
    presence = Row(SamplingParams(temperature=0, presence_penalty=1.0), output_token_ids=[0])      # 2 -> 1
    assert sampler(logits[:1], [presence]).token_ids == [1]


def test_the_draw_is_the_exponential_race_over_the_filtered_distribution():
    """By hand: p = softmax(logits / T) with top-k applied, E the noise of (seed, position): argmax p / E."""
    sampler = Sampler(4)
    logits = _log(PROBS).repeat(6, 1) * 2.0
    rows = [Row(SamplingParams(temperature=2.0, top_k=3), seed=seed) for seed in range(6)]
    positions = [1] * 6   # a one-token prompt, nothing generated yet
    noise = sampler.exponential_noise([r.seed for r in rows], positions, "cpu")
    probs = torch.tensor([PROBS[:3] + [0.0]]) / sum(PROBS[:3])
    expected = (probs / noise).argmax(dim=-1).tolist()
    assert sampler(logits, rows).token_ids == expected
    assert len(set(expected)) > 1   # the seeds do pick different tokens


def test_a_seed_gives_the_same_tokens_in_any_batch():
    sampler = Sampler(4)
    logits = _log(PROBS).repeat(3, 1)
    alone = sampler(logits[:1], [Row(SamplingParams(), seed=7)]).token_ids
    batched = sampler(logits, [Row(SamplingParams(), seed=s) for s in (3, 7, 9)]).token_ids
    assert batched[1] == alone[0]
    later = sampler(logits[:1], [Row(SamplingParams(), seed=7, output_token_ids=[1])]).token_ids   # next position
    first = [sampler(logits[:1], [Row(SamplingParams(), seed=7, output_token_ids=[1] * n)]).token_ids[0]
             for n in range(12)]
    assert later[0] == first[1] and len(set(first)) > 1   # the noise moves on with the position


def test_samples_follow_the_distribution_and_the_filters():
    sampler = Sampler(4)
    draws = 4000
    logits = _log(PROBS).repeat(draws, 1)
    counts = torch.bincount(torch.tensor(sampler(logits, [Row(SamplingParams(), seed=s) for s in range(draws)])
                                         .token_ids), minlength=4) / draws
    # fixed seeds, so fixed counts; 4 standard errors of a binomial proportion at most
    assert all(abs(c - p) < 4 * math.sqrt(p * (1 - p) / draws) for c, p in zip(counts.tolist(), PROBS))
    filtered = sampler(logits[:500], [Row(SamplingParams(top_p=0.7, min_p=0.0), seed=s) for s in range(500)])
    assert set(filtered.token_ids) == {0, 1}


def test_exponential_noise_has_the_exponential_moments():
    noise = Sampler(1000).exponential_noise(list(range(100)), [5] * 100, "cpu").double()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03
    assert noise.min().item() > 0


def test_min_tokens_masks_stop_and_eos_tokens_until_reached():
    sampler = Sampler(4, eos_token_ids=[0])
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    early = Row(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,)), output_token_ids=[3])
    assert sampler(logits, [early]).token_ids == [2]
    ignoring = Row(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output_token_ids=[3])
    assert sampler(logits, [ignoring]).token_ids == [0]   # EOS is no stop token with ignore_eos
    reached = Row(SamplingParams(temperature=0, min_tokens=2), output_token_ids=[3, 3])
    assert sampler(logits, [reached]).token_ids == [0]


def test_logprobs_are_the_raw_distributions():
    sampler = Sampler(4)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    rows = [Row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0), prompt_token_ids=[0]),
            Row(SamplingParams(temperature=0, logprobs=0)), ]
    samples = sampler(logits, rows)
    expected = logits.log_softmax(dim=-1)
    assert samples.token_ids == [1, 1]   # penalised 2 -> 0.667 for the first
    assert samples.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 1].item()], abs=1e-6)
    assert samples.top_logprobs[0] == pytest.approx({0: expected[0, 0].item(), 1: expected[0, 1].item()}, abs=1e-6)
    assert samples.top_logprobs[1] == {}
    assert sampler(logits, [Row(SamplingParams())] * 2).logprobs == [None, None]
