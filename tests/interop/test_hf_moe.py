"""Hugging Face interop for the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) against
transformers itself: tiny random models built from configs (nothing downloaded), saved in
both layouts transformers 5 writes (per expert, its default; fused, save_original_format=False).

transformers runs its eager experts loop, so its router is the plain softmax / top-k /
renormalise code of each family. Weights are drawn wider than HF's init (std 0.1, router
0.5) so that a wrong router or expert mix-up moves the logits far beyond the 1e-4 bound,
and so that near-ties between experts (which rounding could break either way) are
unlikely; the seeds are fixed. fp32 logits of size ~3 agree to about 2e-6.
"""

import dataclasses
import json
import re

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.config import ModelConfig
from tessera.interop.hf import load_hf, read_hf_dir
from tessera.interop.hf_config import hf_config_from_model, infer_family, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel, qwen_moe_layers
from tessera.models.gpt import GPTModel
from tessera.models.moe import grouped_mm_available
from tests.interop.conversions import assert_logits_match, round_trip
from tests.interop.test_hf_presets import wide_model

VOCAB = 101
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=32, num_experts_per_tok=2, initializer_range=0.1)
_QWEN = dict(_COMMON, intermediate_size=96, moe_intermediate_size=48, num_experts=4)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_hidden_layers=2, intermediate_size=48,
                                                  num_local_experts=4, router_aux_loss_coef=0.02),
    # layer 1 dense through mlp_only_layers; the pre-softmax router (no renormalisation)
    "qwen2_moe-shared-mlp-only": lambda: transformers.Qwen2MoeConfig(
        **_QWEN, num_hidden_layers=3, shared_expert_intermediate_size=32, mlp_only_layers=[1]),
    # decoder_sparse_step 2: layers 1 and 3 MoE, then layer 3 dense through mlp_only_layers; tied, renormalised
    "qwen2_moe-sparse-step-tied": lambda: transformers.Qwen2MoeConfig(
        **_QWEN, num_hidden_layers=4, shared_expert_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
        norm_topk_prob=True, tie_word_embeddings=True),
    # head_dim 24 is not hidden / heads
    "qwen3_moe-norm-topk": lambda: transformers.Qwen3MoeConfig(**_QWEN, num_hidden_layers=2, head_dim=24,
                                                               norm_topk_prob=True),
    "qwen3_moe-no-norm-dense-first": lambda: transformers.Qwen3MoeConfig(
        **_QWEN, num_hidden_layers=3, head_dim=24, norm_topk_prob=False, mlp_only_layers=[0]),
}
LAYOUTS = {"per-expert": True, "fused": False}   # save_original_format


def widened(model):
    """`model` with its norms away from 1, biases away from 0 and a decisive router."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


def assert_routes_alike(hf_gate, router, hidden: torch.Tensor) -> None:
    """Same experts (as sets) and the same weights per token from an HF router and tessera's."""
    _, hf_weights, hf_experts = hf_gate(hidden)
    weights, experts = router.top_k(router.logits(hidden))
    hf_order, order = hf_experts.argsort(dim=-1), experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    assert _max_diff(weights.gather(1, order), hf_weights.gather(1, hf_order).float()) <= 1e-6


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(eager HF model, {layout: its saved directory}) of one family."""
    torch.manual_seed(0)
    model = widened(transformers.AutoModelForCausalLM.from_config(FAMILIES[request.param](),
                                                                  experts_implementation="eager").eval())
    root = tmp_path_factory.mktemp(request.param)
    for layout, original_format in LAYOUTS.items():
        model.save_pretrained(root / layout, save_original_format=original_format)
    return model, {layout: root / layout for layout in LAYOUTS}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_the_models_are_moe_models_of_both_layouts(saved):
    model, dirs = saved
    assert model.config._experts_implementation == "eager"
    _, per_expert = read_hf_dir(dirs["per-expert"])
    _, fused = read_hf_dir(dirs["fused"])
    assert any(".experts.0." in name for name in per_expert) and not any("gate_up_proj" in n for n in per_expert)
    assert any("gate_up_proj" in name for name in fused) and not any(".experts.0." in name for name in fused)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(saved, layout):
    reference, dirs = saved
    model = assert_logits_match(reference, dirs[layout], _ids())
    if not grouped_mm_available("cpu", torch.float32):
        pytest.skip("no torch._grouped_mm on this CPU build")
    with torch.no_grad():
        grouped = GPTModel(dataclasses.replace(model.config, moe_grouped_gemm=True)).eval()
        grouped.load_state_dict(model.state_dict())
        assert _max_diff(grouped(_ids()), reference(_ids()).logits) <= 1e-4


def test_router_matches_transformers(saved):
    """Same experts and the same weights per token, layer by layer, on the same inputs."""
    reference, dirs = saved
    model = load_hf(dirs["per-expert"])
    hidden = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    moe_layers = [i for i, moe in enumerate(model.config.moe_layers()) if moe]
    assert moe_layers
    with torch.no_grad():
        for i in moe_layers:
            assert_routes_alike(reference.model.layers[i].mlp.gate, model.layers[i].mlp.router, hidden)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_a_tessera_checkpoint_is_exact(saved, layout, tmp_path):
    reference, dirs = saved
    # Export writes the per-expert layout, whichever layout was imported.
    export = round_trip(dirs[layout], tmp_path, expected_dir=dirs["per-expert"], experts_implementation="eager")
    changed = export.changed_fields()
    assert changed.keys() <= {"head_dim"}, changed   # Mixtral's None
    with torch.no_grad():
        assert torch.equal(export.model(_ids()).logits, reference(_ids()).logits)


def test_the_checkpoint_says_which_layers_are_moe(saved):
    reference, dirs = saved
    config = model_config_from_hf(json.loads((dirs["per-expert"] / "config.json").read_text()))
    hf_layers = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in reference.model.layers]
    assert config.moe_layers() == hf_layers
    assert (config.moe_layer_freq == "1") == all(hf_layers)


# -- config mapping without weights ------------------------------------------------------

def _hf(family: str, **changes) -> dict:
    config = {"mixtral": FAMILIES["mixtral"], "qwen2_moe": FAMILIES["qwen2_moe-shared-mlp-only"],
              "qwen3_moe": FAMILIES["qwen3_moe-norm-topk"]}[family]().to_dict()
    return {**config, **changes}


def test_router_and_experts_fields_map_onto_megatron_flags():
    mixtral = model_config_from_hf(_hf("mixtral"))
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (4, 2, 48)
    assert not mixtral.moe_router_pre_softmax and mixtral.moe_aux_loss_coeff == [0.02]
    qwen2 = model_config_from_hf(_hf("qwen2_moe"))
    assert qwen2.moe_router_pre_softmax and qwen2.add_qkv_bias and qwen2.moe_shared_expert_gate
    assert (qwen2.ffn_hidden_size, qwen2.moe_ffn_hidden_size, qwen2.moe_shared_expert_intermediate_size) == (96, 48, 32)
    assert not model_config_from_hf(_hf("qwen2_moe", qkv_bias=False)).add_qkv_bias
    qwen3 = model_config_from_hf(_hf("qwen3_moe"))
    assert qwen3.qk_layernorm and not qwen3.moe_router_pre_softmax and qwen3.kv_channels == 24
    assert not qwen3.add_qkv_bias and qwen3.moe_shared_expert_intermediate_size is None
    # the Hub's Qwen3-MoE configs name the count num_experts; transformers 5.24 writes num_local_experts
    hub = {key: value for key, value in _hf("qwen3_moe").items() if key != "num_local_experts"}
    assert model_config_from_hf({**hub, "num_experts": 6}).num_experts == 6


# The published config.json values of each family's flagship (the fields the mapping reads).
_PUBLISHED = {
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1e6, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, router_aux_loss_coef=0.02, sliding_window=None),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                              norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=8192,
                              rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=151936, sliding_window=32768,
                              use_sliding_window=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                          vocab_size=151936, sliding_window=None, use_sliding_window=False),
}


@pytest.mark.parametrize("preset", _PUBLISHED)
def test_an_import_loads_into_a_run_of_its_preset(preset):
    """--model PRESET --load IMPORT --finetune finds no differing architecture flag."""
    from tessera.models.presets import preset_values
    from tessera.training.checkpoint import model_config_differences

    imported = model_config_from_hf(_PUBLISHED[preset])
    assert model_config_differences(dataclasses.asdict(imported), ModelConfig(**preset_values(preset))) == []


@pytest.mark.parametrize("pattern", ["1", "[1,0,1,1]", "[0,1,0,1]", "[0,0,1,0]"])
def test_any_layer_pattern_is_written_as_qwen_fields_that_give_it_back(pattern):
    model = model_config_from_hf(_hf("qwen3_moe", num_hidden_layers=4))
    model = dataclasses.replace(model, moe_layer_freq=pattern)
    hf = hf_config_from_model(model, "qwen3_moe")
    assert qwen_moe_layers(hf["decoder_sparse_step"], hf["mlp_only_layers"], 4) == model.moe_layers()
    assert model_config_from_hf(hf).moe_layer_freq == pattern


def test_the_export_infers_the_family_from_the_architecture():
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        assert infer_family(model_config_from_hf(_hf(family))) == family


@pytest.mark.parametrize("family, changes, message", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("mixtral", dict(sliding_window=16), "sliding_window 16"),
    ("mixtral", dict(num_experts=3), "num_local_experts"),          # two counts that disagree
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(num_local_experts=0), "num_experts 0"),
    ("qwen2_moe", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen2_moe", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}), "dynamic"),
])
def test_hf_features_tessera_does_not_compute_are_refused(family, changes, message):
    with pytest.raises(UnsupportedModel, match=message):
        model_config_from_hf(_hf(family, **changes))


_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=VOCAB,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             num_experts=4, moe_ffn_hidden_size=48)


@pytest.mark.parametrize("changes, message", [
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function"),
    (dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax without --qk-layernorm"),   # Mixtral renormalises
    (dict(moe_layer_freq="[1,0]"), "--moe-layer-freq '[1,0]' (dense layers)"),                # Mixtral has none
    (dict(moe_shared_expert_intermediate_size=32), "without --moe-shared-expert-gate"),      # Qwen2-MoE's is gated
    (dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, qk_layernorm=True),
     "--qk-layernorm with a shared expert"),
    (dict(add_qkv_bias=True), "--add-qkv-bias in a MoE model without a shared expert"),
    (dict(num_experts=None, moe_ffn_hidden_size=None, qk_layernorm=True), "--qk-layernorm in a dense model"),
    (dict(rotary_percent=0.5), "--rotary-percent 0.5 has no Hugging Face equivalent"),
    (dict(position_embedding_type="learned_absolute"), "--normalization RMSNorm has no Hugging Face equivalent"),
])
def test_tessera_models_no_hf_family_computes_are_refused(changes, message):
    with pytest.raises(UnsupportedModel, match=re.escape(message)) as error:
        infer_family(ModelConfig(**{**_TINY, **changes}))
    assert "\n" not in str(error.value) and "has no" in str(error.value)


@pytest.mark.parametrize("changes", [
    dict(),                                                                          # mixtral
    dict(add_qkv_bias=True, moe_layer_freq="[0,1,1]", moe_shared_expert_intermediate_size=32,
         moe_shared_expert_gate=True, moe_router_pre_softmax=True),                  # qwen2_moe
    dict(qk_layernorm=True, kv_channels=24, moe_layer_freq="[1,0,1]", moe_router_dtype="fp32"),  # qwen3_moe
], ids=["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_model_trained_in_tessera_exports_to_what_transformers_computes(changes, tmp_path):
    """No imported config to start from: the written config.json alone must describe the model."""
    from tessera.training.checkpoint_files import save_model_checkpoint

    config = ModelConfig(**{**_TINY, "num_layers": 3, "group_query_attention": True, "num_query_groups": 2,
                            "ffn_hidden_size": 96, "init_method_std": 0.1, "untie_embeddings_and_output_weights": True,
                            **changes})
    model = wide_model(config)
    save_model_checkpoint(tmp_path / "ckpt", config, model.state_dict())
    assert run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert _max_diff(model(_ids())[..., :VOCAB], exported.eval()(_ids()).logits) <= 1e-4


def test_a_model_is_not_exported_as_another_moe_family():
    with pytest.raises(UnsupportedModel, match="mixtral model, not qwen3_moe"):
        hf_config_from_model(model_config_from_hf(_hf("mixtral")), "qwen3_moe")
