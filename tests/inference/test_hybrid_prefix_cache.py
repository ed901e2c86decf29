"""Prefix caching for models with recurrent layers: requests resume after cached blocks from the
Mamba-2 or Gated DeltaNet state saved at a block end (tessera.inference.state_snapshots).

Oracles: the same engine with prefix caching off (greedy tokens, token for token) and the model's
forward over the whole sequence (the logits of every sampled token, tolerance as in
tests/inference/test_engine.py: fp32 summed in another order). The hits are counted by the
scheduler's `cached_tokens`, the prompt tokens taken from the cache instead of computed.
"""

import pytest
import torch

from tessera.inference.engine import Engine
from tessera.inference.sampling import SamplingParams
from tests.inference.test_engine import Recorder, prompts, tiny_model

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _check_logits(model, engine, recorder, sequences):
    """Every sampled token's logits against the model's forward over the sequence before it."""
    with torch.no_grad():
        full = {rid: model(torch.tensor([seq[:-1]]))[0, :, :engine.vocab_size] for rid, seq in sequences.items()}
    for rid, length, logits in recorder.rows:
        want = full[rid][length - 1]
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-qwen3-next"])   # Mamba-2; Gated DeltaNet and MoE
def test_requests_sharing_a_prefix_resume_from_a_saved_state(preset):
    """One request after another (blocks of 4), a 20-token shared prefix S:
    1. S + a: nothing cached; saves its state after its last reusable block (24 tokens);
    2. S + b: finds S's KV blocks but no state after them: computes all, saves the state after S;
    3. S + c: resumes after S (20 tokens cached);
    4. S + c[:2] + d, diverging inside block 6: resumes after S, the last saved state before it;
    5. S + a again: resumes after 24 tokens (its last token is always computed).
    Tokens equal prefix caching off; logits equal the full forward."""
    model = tiny_model(preset)
    shared, (a, b, c, d) = prompts((20,), seed=3)[0], prompts((7, 6, 7, 5), seed=4)
    prompt_list = [shared + a, shared + b, shared + c, shared + c[:2] + d, shared + a]
    expected = [done.token_ids for done in Engine(model, block_size=BLOCK).generate(prompt_list, GREEDY)]

    engine = Engine(model, block_size=BLOCK, max_batched_tokens=16, prefix_caching=True)
    recorder = Recorder(engine)
    tokens, hits, sequences = [], [], {}
    for index, prompt in enumerate(prompt_list):
        before = engine.scheduler.cached_tokens
        completion = engine.generate([prompt], GREEDY)[0]
        tokens.append(completion.token_ids)
        hits.append(engine.scheduler.cached_tokens - before)
        sequences[f"generate-{index}-0"] = prompt + completion.token_ids
    assert tokens == expected
    assert hits == [0, 0, 20, 20, 24]
    _check_logits(model, engine, recorder, sequences)


def test_a_state_saved_inside_a_chunk_and_beside_other_requests():
    """tiny-hybrid, four requests at once in chunks of 10 tokens: the state after S (20 tokens) is
    saved in the middle of a chunk's prefill; the next round, sharing S, resumes there."""
    model = tiny_model("tiny-hybrid")
    shared = prompts((20,), seed=5)[0]
    first = [shared + tail for tail in prompts((5, 9, 3, 6), seed=6)]
    second = [shared + tail for tail in prompts((7, 2, 8, 4), seed=7)]
    reference = Engine(model, block_size=BLOCK)
    engine = Engine(model, block_size=BLOCK, max_batched_tokens=10, prefix_caching=True)
    for round_prompts in (first, second):
        before = engine.scheduler.cached_tokens
        got = [c.token_ids for c in engine.generate(round_prompts, GREEDY)]
        assert got == [c.token_ids for c in reference.generate(round_prompts, GREEDY)]
    assert engine.scheduler.cached_tokens - before == 4 * 20


@pytest.fixture(scope="module")
def turns():
    """tiny-qwen3-next; prompts on prefix A (12 tokens) x3, B (16) x3, A x2, and their greedy tokens
    with prefix caching off."""
    model = tiny_model("tiny-qwen3-next")
    a, b = prompts((12, 16), seed=8)
    prompt_list = [prefix + tail for prefix, tail in zip([a, a, a, b, b, b, a, a],
                                                         prompts((3, 5, 2, 6, 3, 5, 3, 2), seed=9))]
    expected = [done.token_ids for done in Engine(model, block_size=BLOCK).generate(prompt_list, GREEDY)]
    return model, prompt_list, expected


def _one_by_one(engine, prompt_list, expected) -> list[int]:
    """Each prompt alone, its tokens checked; the tokens it took from the cache. No snapshot may
    outlive the KV block it was saved after, nor exceed the budget."""
    hits, snapshots = [], engine.scheduler.snapshots
    for prompt, want in zip(prompt_list, expected):
        before = engine.scheduler.cached_tokens
        assert engine.generate([prompt], GREEDY)[0].token_ids == want
        hits.append(engine.scheduler.cached_tokens - before)
        assert len(snapshots.names()) <= snapshots.count
        assert all(name in engine.cache.allocator._block_named for name in snapshots.names())
    return hits


def test_snapshots_go_least_recently_used_first(turns):
    """Two snapshots: A+3 saves after A (its last reusable block), which the next two A prompts
    find; B's prompts save after B+4 and after B, pushing A's out, so the first A prompt after
    them computes all (and saves after A again, for the last one)."""
    model, prompt_list, expected = turns
    engine = Engine(model, block_size=BLOCK, max_requests=2, prefix_caching=True, state_snapshots=2)
    assert engine.states.num_slots == 1 + 2 + 2   # the null slot, one per request, the snapshots
    assert _one_by_one(engine, prompt_list, expected) == [0, 12, 12, 0, 0, 16, 0, 12]


def test_snapshots_go_with_their_blocks(turns):
    """Twelve KV blocks: B's prompts reuse A's freed blocks, and A's snapshots go with them."""
    model, prompt_list, expected = turns
    engine = Engine(model, block_size=BLOCK, num_blocks=12, max_requests=2, prefix_caching=True, state_snapshots=4)
    hits = _one_by_one(engine, prompt_list, expected)
    assert hits[1:3] == [12, 12] and hits[6] == 0


def test_without_snapshots_nothing_is_reused():
    """state_snapshots=0: the KV blocks are found, but no state to resume from, so none is taken."""
    model = tiny_model("tiny-hybrid")
    prompt = prompts((14,), seed=10)[0]
    engine = Engine(model, block_size=BLOCK, prefix_caching=True, state_snapshots=0)
    reference = Engine(model, block_size=BLOCK).generate([prompt, prompt], GREEDY)
    assert [c.token_ids for c in engine.generate([prompt], GREEDY) + engine.generate([prompt], GREEDY)] == \
        [c.token_ids for c in reference]
    assert engine.scheduler.cached_tokens == 0
    with pytest.raises(ValueError, match="state_snapshots must be >= 0"):
        Engine(model, prefix_caching=True, state_snapshots=-1)
