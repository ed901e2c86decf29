"""Multi-latent attention under tensor (and sequence) parallelism equals the single-process
model (gloo, 2 processes): loss, logits, every parameter's initialisation (exact) and
gradient, and the replicated down projections and latent norms agreeing over the ranks.
The single-process MLA itself is checked against transformers in tests/models/test_mla.py.

The harness and its tolerance are test_tensor_parallel's (relative 1e-5, fp32). Without
SP, a positional key whose gradient is not summed over the ranks' heads, or with SP, a
down projection whose gradient is not summed over the sequence shards, is off by order 1.
"""

from __future__ import annotations

import pytest

from tessera.config import ParallelConfig
from tessera.models.gpt import Recompute
from tessera.parallel.mesh import Mesh
from tests.dist.launcher import run_distributed
from tests.dist.test_tensor_parallel import MODEL_TOLERANCE, _model

_MLA = dict(multi_latent_attention=True, group_query_attention=False, num_query_groups=None, kv_lora_rank=16,
            qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
_YARN = dict(rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16, mscale=0.9, mscale_all_dim=0.7)
MODELS = {
    # name: (preset, sequence parallel, config overrides, recompute)
    "q-lora, latent norms, YaRN, SP": ("tiny-llama", True, dict(_MLA, **_YARN, q_lora_rank=24, qk_layernorm=True),
                                       Recompute()),
    "q-lora, latent norms, no SP": ("tiny-llama", False, dict(_MLA, q_lora_rank=24, qk_layernorm=True), Recompute()),
    # tiny-gpt: biases, LayerNorm latents, two documents per sample (positions restart, masked attention)
    "no q-lora, biases, documents, SP, selective recompute": (
        "tiny-gpt", True, dict(_MLA, position_embedding_type="rope", qk_layernorm=True), Recompute("selective")),
    "q-lora, biases, documents, no SP, full recompute": (
        "tiny-gpt", False, dict(_MLA, **_YARN, position_embedding_type="rope", q_lora_rank=24),
        Recompute("full", "uniform", 1)),
}


def _run_all() -> dict:
    group = Mesh.build(ParallelConfig(tensor_model_parallel_size=2), "cpu").tp_group
    return {name: _model(group, preset, sp, overrides, recompute)
            for name, (preset, sp, overrides, recompute) in MODELS.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run_all, 2)


@pytest.mark.parametrize("name", list(MODELS))
def test_mla_tp2_matches_single_process(results, name):
    for rank, result in enumerate(results):
        for quantity, error in result[name].items():
            limit = 0.0 if quantity.startswith(("init", "replicas")) else MODEL_TOLERANCE
            assert error <= limit, f"rank {rank}: {name}: {quantity} differs by {error:.2e}"
