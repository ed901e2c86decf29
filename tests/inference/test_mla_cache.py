"""Multi-latent attention's paged cache: each token's normed latent and rotated positional key,
expanded into keys and values when attention reads them. The engine's logits equal full
recomputation at every step (prefill, chunked prefill beside decode rows, decode across
block boundaries, preemption), with and without q-LoRA; the pool holds kv_lora_rank +
qk_pos_emb_head_dim values per token per layer; greedy tokens equal transformers'
generate() (its own MLA cache) for a tiny DeepSeek-V3, and under tensor parallelism (each
rank holds every latent and expands them into its own heads) equal one process's.

Tolerance as tests/inference/test_engine.py (the same products in another order: rtol 1e-5,
atol 1e-5 for logits near 0).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import transformers

from tessera.inference.engine import Engine
from tessera.inference.kv_cache import LatentShape, LayerShape, PagedKVCache
from tessera.inference.loading import load_model
from tessera.inference.sampling import SamplingParams
from tessera.models.gpt import GPTModel, initialize_parameters
from tests.dist.launcher import run_distributed
from tests.inference.test_engine import GREEDY, SAMPLED, check_against_full_recompute, prompts, tiny_model
from tests.interop.test_hf_deepseek import CASES
from tests.interop.test_hf_moe import widened


def mla_model(q_lora: bool) -> GPTModel:
    """tiny-deepseek (q-LoRA 32), or the same with one q_proj (DeepSeek-V2-Lite's attention)."""
    model = tiny_model("tiny-deepseek")
    if q_lora:
        return model
    model = GPTModel(dataclasses.replace(model.config, q_lora_rank=None))
    initialize_parameters(model, seed=1)
    return model.eval()


@pytest.fixture(scope="module", params=[True, False], ids=["q-lora", "no-q-lora"])
def model(request):
    return mla_model(request.param)


@pytest.mark.parametrize("options, params", [
    (dict(block_size=4), GREEDY),                                          # prefill, decode over many blocks
    (dict(block_size=4, max_batched_tokens=8), GREEDY),                    # chunked prefill beside decode rows
    (dict(block_size=4, num_blocks=12, max_batched_tokens=12), SAMPLED),   # preempted and recomputed
], ids=["paged", "chunked-mixed", "preempted"])
def test_cached_latents_give_the_logits_of_full_recompute(model, options, params):
    engine = Engine(model, prefix_caching=False, decode_steps=1, **options)   # every token through the sampler
    check_against_full_recompute(model, engine, prompts(), params)
    assert all(isinstance(pool, torch.Tensor) for pool in engine.cache.pools.values())   # latent pools in use
    if "num_blocks" in options:
        assert engine.scheduler.preemptions > 0


def test_prefix_caching_shares_latent_blocks(model):
    shared = prompts([9])[0]
    engine = Engine(model, block_size=4, num_blocks=20, max_batched_tokens=12, prefix_caching=True)
    check_against_full_recompute(model, engine, [shared + tail for tail in prompts([3, 6, 1], seed=1)], SAMPLED[:3])
    assert engine.scheduler.cached_tokens > 0


def test_the_pool_holds_the_latent_and_positional_key_per_token():
    model = mla_model(q_lora=True)
    config = model.config
    width = config.kv_lora_rank + config.qk_pos_emb_head_dim   # 16 + 8
    engine = Engine(model, block_size=4, num_blocks=5, prefix_caching=False)
    assert {index: tuple(pool.shape) for index, pool in engine.cache.pools.items()} == \
        {index: (5 * 4, width) for index in range(config.num_layers)}
    shapes = PagedKVCache.model_shapes(model)
    assert set(shapes.values()) == {LatentShape(config.kv_lora_rank, config.qk_pos_emb_head_dim)}
    per_head = LayerShape(config.num_attention_heads, config.qk_head_dim + config.qk_pos_emb_head_dim,
                          config.v_head_dim)   # what caching each head's key and value would take
    assert PagedKVCache.bytes_per_block(shapes, 4, torch.bfloat16) == config.num_layers * width * 4 * 2
    assert per_head.values_per_token == 4 * (16 + 8 + 16) and per_head.values_per_token / width > 6


def _save_deepseek_v3(path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    reference = widened(transformers.AutoModelForCausalLM.from_config(
        CASES["v3-q-lora"](), experts_implementation="eager").eval())
    reference.save_pretrained(path)
    return reference


def _generate(directory: str, tp_group=None) -> list[list[int]]:
    model, _ = load_model(hf=directory, dtype=torch.float32, tp_group=tp_group)
    assert model.layers[0].attention.num_heads == 4 // model.tp_size   # this rank's heads only
    engine = Engine(model, block_size=4, max_batched_tokens=16)
    assert isinstance(engine.cache.pools[0], torch.Tensor)   # the latent pool
    generator = torch.Generator().manual_seed(1)
    prompt_list = [torch.randint(2, 101, (n,), generator=generator).tolist() for n in (3, 11, 20)]
    completions = engine.generate(prompt_list, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    return [prompt + completion.token_ids for prompt, completion in zip(prompt_list, completions)]


def _tp_worker(directory: str) -> list[list[int]]:
    return _generate(directory, dist.group.WORLD)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v3")
    return _save_deepseek_v3(path), str(path)


def test_greedy_tokens_equal_transformers_generate_for_deepseek_v3(deepseek_v3):
    reference, directory = deepseek_v3
    for sequence in _generate(directory):
        prompt = torch.tensor([sequence[:-32]])
        with torch.no_grad():
            expected = reference.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                          pad_token_id=0)[0].tolist()
        assert sequence == expected


def test_tensor_parallel_ranks_expand_their_heads_from_the_same_latents(deepseek_v3):
    _, directory = deepseek_v3
    expected = _generate(directory)
    for rank_result in run_distributed(_tp_worker, 2, directory):
        assert rank_result == expected
