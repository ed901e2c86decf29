"""The padded layout that PromptGraphs replays (tessera.inference.cuda_graphs): its documents
hold every prompt where it was and no empty one, and the padded step computes what the
unpadded step computes; an engine whose steps of decode rows and prompts run as two passes
(the runner's path with prompt graphs) generates what the one-pass engine generates. Run
eagerly here (CPU, fp32); the graphs' replay is tests/gpu's."""

import copy
import random

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.cuda_graphs import padded_prompts, row_bucket, token_bucket
from tessera.inference.engine import Engine
from tessera.inference.kv_cache import PagedKVCache
from tessera.inference.paged_attention import StepAttention
from tessera.inference.runner import forward_tokens
from tessera.inference.sampling import SamplingParams
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, initialize_parameters

CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
              ffn_hidden_size=96, seq_length=128, vocab_size=100, position_embedding_type="rope",
              normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
              init_method_std=0.2)


def test_padded_layouts_keep_the_prompts_and_have_no_empty_document():
    rng = random.Random(0)
    cases = [[128], [2048], [64, 64], [5, 37], [1, 2, 3]] + \
        [[rng.randint(1, 700) for _ in range(rng.randint(1, 70))] for _ in range(500)]
    for lengths in cases:
        tokens, bounds = padded_prompts(lengths)
        assert bounds[:len(lengths) + 1] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert bounds[-1] == tokens == token_bucket(tokens) >= sum(lengths)
        assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds
        assert len(bounds) - 1 == row_bucket(len(bounds) - 1)
    assert padded_prompts([128]) == (128, [0, 128])          # a full bucket is not padded
    assert padded_prompts([5, 37]) == (64, [0, 5, 42, 43, 64])


@pytest.mark.parametrize("lengths", [[5, 13, 2], [16], [7]])
def test_the_padded_step_equals_the_unpadded_one(lengths):
    model = GPTModel(ModelConfig(**CONFIG))
    initialize_parameters(model, seed=0)
    model.eval()
    block_size = 4
    caches = [PagedKVCache(PagedKVCache.model_shapes(model), 20, block_size, dtype=torch.float32, device="cpu")]
    caches.append(copy.deepcopy(caches[0]))
    generator = torch.Generator().manual_seed(1)
    total = sum(lengths)
    ids = torch.randint(0, 100, (total,), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.randperm(19 * block_size, generator=generator)[:total] + block_size   # never the null block
    expected_step = StepAttention(caches[0].pools, block_size, slots)
    expected_step.fresh = StepAttention.fresh_documents(lengths, "cpu", torch.float32)
    tokens, bounds = padded_prompts(lengths)
    padding = torch.zeros(tokens - total, dtype=torch.int64)   # token 0 at position 0 into slot 0
    padded_step = StepAttention(caches[1].pools, block_size, torch.cat([slots, padding]))
    padded_step.fresh = Documents.from_cu_seqlens(torch.tensor(bounds), 1, tokens, backend="per_document",
                                                  device="cpu")
    with torch.no_grad():
        expected = forward_tokens(model, ids[None], positions[None], expected_step,
                                  torch.tensor(lengths).cumsum(0) - 1)
        padded = forward_tokens(model, torch.cat([ids, padding])[None], torch.cat([positions, padding])[None],
                                padded_step, torch.tensor(bounds[1:]) - 1)
    torch.testing.assert_close(padded[:len(lengths)], expected, rtol=1e-5, atol=1e-5)
    for index in caches[0].pools:
        for e, a in zip(caches[0].pools[index], caches[1].pools[index]):
            torch.testing.assert_close(a[block_size:], e[block_size:], rtol=0, atol=0)   # beyond the null block


class EagerPromptGraphs:
    """PromptGraphs' interface, padded as the graphs pad but run eagerly; counts its calls."""

    def __init__(self, model, cache):
        self.model, self.cache, self.calls = model, cache, []

    def fits(self, lengths):
        return True

    def __call__(self, ids, positions, slots, lengths):
        self.calls.append(list(lengths))
        tokens, bounds = padded_prompts(lengths)
        padding = torch.zeros(tokens - len(ids), dtype=torch.int64)
        step = StepAttention(self.cache.pools, self.cache.block_size, torch.cat([slots, padding]))
        step.fresh = Documents.from_cu_seqlens(torch.tensor(bounds), 1, tokens, backend="per_document", device="cpu")
        return forward_tokens(self.model, torch.cat([ids, padding])[None], torch.cat([positions, padding])[None],
                              step, torch.tensor(bounds[1:]) - 1)[:len(lengths)]


def test_decode_rows_and_prompts_in_two_passes_generate_what_one_pass_generates():
    model = GPTModel(ModelConfig(**CONFIG))
    initialize_parameters(model, seed=2)
    model.eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=generator).tolist() for n in (6, 10, 2, 11, 19, 40)]
    params = [SamplingParams(max_tokens=9, temperature=0, logprobs=2),
              SamplingParams(max_tokens=9, temperature=0.9, seed=4, logprobs=2)] * 3

    def generate(two_passes: bool):
        # a token budget that makes steps of decode rows beside new prompts, and chunked prompts
        engine = Engine(model, max_requests=4, block_size=4, max_batched_tokens=24, prefix_caching=False)
        if two_passes:
            engine.runner.prompt_graphs = EagerPromptGraphs(model, engine.cache)
        return engine.generate(prompts, params), engine.runner.prompt_graphs

    expected, _ = generate(False)
    actual, graphs = generate(True)
    assert len(graphs.calls) >= 3 and any(len(lengths) > 1 for lengths in graphs.calls)
    for e, a in zip(expected, actual):
        assert a.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-5)
