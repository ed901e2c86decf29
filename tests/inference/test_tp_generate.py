"""Tensor-parallel generation (2 CPU processes, gloo) equals generation in one process.

Each rank loads its shard of the same Hugging Face model (vocabulary 101, padded to 102 for
two ranks) and runs the same engine on the same requests: greedy and seeded sampling, a
prompt longer than the token budget (chunked), and a cache small enough to preempt.
Llama with 2 KV groups (one per rank) and Qwen2 with 1 (replicated on both ranks).
The row-parallel all-reduce sums partial products in another order: log-probs agree to 1e-5.
"""

import torch
import torch.distributed as dist

from tessera.inference.engine import Engine
from tessera.inference.loading import load_model
from tessera.inference.sampling import SamplingParams
from tests.dist.launcher import run_distributed
from tests.inference.test_hf_generate import VOCAB, _save_hf_model

PARAMS = [SamplingParams(max_tokens=24, temperature=0, logprobs=2),
          SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=3, logprobs=0),
          SamplingParams(max_tokens=16, temperature=1.2, top_p=0.8, seed=4, logprobs=0)]


def _generate(directory: str, tp_group=None) -> list[tuple[list[int], list[float], str]]:
    model, info = load_model(hf=directory, dtype=torch.float32, tp_group=tp_group)
    assert model.layers[0].attention.num_heads == 4 // model.tp_size   # this rank's heads only
    engine = Engine(model, block_size=4, num_blocks=16, max_batched_tokens=16, eos_token_ids=info.eos_token_ids)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (5, 30, 11)]
    completions = engine.generate(prompts, PARAMS)
    assert engine.scheduler.preemptions > 0
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in completions]


def _tp_worker(directories: list[str]) -> list:
    return [_generate(d, dist.group.WORLD) for d in directories]


def test_tp2_generation_equals_tp1(tmp_path):
    directories = []
    for family in ("llama", "qwen2"):
        _save_hf_model(family, tmp_path / family)
        directories.append(str(tmp_path / family))
    expected = [_generate(d) for d in directories]
    for rank_result in run_distributed(_tp_worker, 2, directories):
        for model_expected, model_actual in zip(expected, rank_result):
            for (tokens, logprobs, reason), (tp_tokens, tp_logprobs, tp_reason) in zip(model_expected, model_actual):
                assert tp_tokens == tokens and tp_reason == reason
                torch.testing.assert_close(torch.tensor(tp_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5)
