"""Hugging Face interop for DeepSeek-V3 and -V2 (multi-latent attention, sigmoid or softmax
routing, shared experts, a dense first layer, multi-token prediction) against transformers
itself: tiny random models built from configs (nothing downloaded), saved in both layouts
transformers 5 writes (per expert, its default; fused, save_original_format=False).

Weights are drawn wider than HF's init (std 0.1, norms 1 +- 0.1, router 0.5, expert bias
0.1) so that a wrong name, split, interleave, scale or router choice moves the logits far
beyond the 1e-4 bound, and near-ties between experts are unlikely; the seeds are fixed.
fp32 logits agree to a few 1e-6 (tessera computes RoPE angles in float64, HF in float32).
"""

import dataclasses
import json
import re

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from tessera.cli import run
from tessera.config import ModelConfig
from tessera.interop.hf import hf_state_from_tessera, load_hf, read_hf_dir
from tessera.interop.hf_config import hf_config_from_model, infer_family, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tessera.models.mtp import shift_left
from tessera.models.presets import preset_values
from tests.interop.conversions import assert_logits_match, round_trip
from tests.interop.test_hf_moe import assert_routes_alike, widened
from tests.interop.test_hf_presets import wide_model

VOCAB, LAYERS = 101, 3
# theta 100 and an original length of 16 (x 4 = max_position_embeddings) put the YaRN ramp across
# the middle of the 4 frequencies; mscale differs from mscale_all_dim, so both factors show
YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
               num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
               qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1,
               max_position_embeddings=64, rope_parameters=YARN, initializer_range=0.1)
CASES = {
    # 16 experts in 4 groups, top-4 from the best 2 (groups scored by their best 2, as V3's 8 of 4 groups)
    "v3-q-lora": lambda: transformers.DeepseekV3Config(
        **_COMMON, q_lora_rank=24, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        n_shared_experts=2, routed_scaling_factor=2.5),
    # V2-Lite's attention (one q_proj), no groups, tied embeddings
    "v3-no-q-lora-tied": lambda: transformers.DeepseekV3Config(
        **_COMMON, q_lora_rank=None, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=1.5, tie_word_embeddings=True),
    # DeepSeek-V2: softmax over all experts, top-k not renormalised, groups scored by their best one
    "v2-group-limited": lambda: transformers.DeepseekV2Config(
        **_COMMON, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=2.0, topk_method="group_limited_greedy"),
}
LAYOUTS = {"per-expert": True, "fused": False}   # save_original_format


@pytest.fixture(scope="module", params=CASES)
def saved(request, tmp_path_factory):
    """(eager HF model, {layout: its saved directory}) of one case."""
    torch.manual_seed(0)
    model = widened(transformers.AutoModelForCausalLM.from_config(CASES[request.param](),
                                                                  experts_implementation="eager").eval())
    with torch.no_grad():  # and an expert bias that changes choices
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    root = tmp_path_factory.mktemp(request.param)
    for layout, original_format in LAYOUTS.items():
        model.save_pretrained(root / layout, save_original_format=original_format)
    return model, {layout: root / layout for layout in LAYOUTS}


def _ids(length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(saved, layout):
    reference, dirs = saved
    _, tensors = read_hf_dir(dirs[layout])
    assert any("gate_up_proj" in name for name in tensors) == (layout == "fused")
    assert_logits_match(reference, dirs[layout], _ids())


def test_the_config_maps_onto_megatrons_flags(saved):
    reference, dirs = saved
    config = load_hf(dirs["per-expert"]).config
    hf = reference.config
    assert (config.multi_latent_attention, config.q_lora_rank, config.kv_lora_rank) == (True, hf.q_lora_rank, 16)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (12, 8, 10)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == ("yarn", 4, 0.9, 0.7)
    assert config.moe_layers() == [False, True, True] and config.moe_layer_freq == "([0]*1+[1]*2)"
    assert config.moe_shared_expert_intermediate_size == 16 * hf.n_shared_experts
    assert config.moe_router_topk_scaling_factor == hf.routed_scaling_factor
    v3 = hf.model_type == "deepseek_v3"
    assert config.moe_router_score_function == ("sigmoid" if v3 else "softmax")
    assert config.moe_router_enable_expert_bias == v3 and config.moe_router_pre_softmax == (not v3)
    assert config.moe_router_num_groups == (None if hf.n_group == 1 else hf.n_group)


def test_the_router_picks_transformers_experts(saved):
    """Same experts (as sets) and weights per token, layer by layer, on the same inputs."""
    reference, dirs = saved
    model = load_hf(dirs["per-expert"])
    hidden = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for i in (1, 2):
            assert_routes_alike(reference.model.layers[i].mlp.gate, model.layers[i].mlp.router, hidden)


def test_greedy_continuation_matches_transformers(saved):
    """HF's generate (its MLA cache) against tessera recomputing the whole sequence per token."""
    reference, dirs = saved
    model = load_hf(dirs["per-expert"])
    prompt = _ids(8)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        tokens = prompt
        for _ in range(12):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, expected)


def _add_mtp_layer(directory, reference) -> dict[str, torch.Tensor]:
    """Give the checkpoint at `directory` an MTP layer as DeepSeek-V3's checkpoints hold one
    (model.layers.{num_hidden_layers}: its norms and projection, a MoE block, copies of the
    embedding and output layer); transformers' model skips it on load. Returns its tensors."""
    torch.manual_seed(3)
    hf, tensors = read_hf_dir(directory)
    last, mtp = f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."
    layer = {mtp + name[len(last):]: t + 0.05 * torch.randn_like(t) if t.is_floating_point() else t
             for name, t in tensors.items() if name.startswith(last)}
    h = hf["hidden_size"]
    layer.update({mtp + "enorm.weight": 1 + 0.1 * torch.randn(h), mtp + "hnorm.weight": 1 + 0.1 * torch.randn(h),
                  mtp + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h),
                  mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h),
                  mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  mtp + "shared_head.head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).clone()})
    save_file(layer, directory / "model-mtp.safetensors", metadata={"format": "pt"})
    return layer


def test_round_trip_is_exact_with_deepseek_v3s_mtp_layer_which_transformers_computes_too(saved, tmp_path):
    reference, dirs = saved
    v3 = reference.config.model_type == "deepseek_v3"
    source = tmp_path / "hf"
    source.mkdir()
    for path in dirs["per-expert"].iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    mtp = _add_mtp_layer(source, reference) if v3 else {}   # DeepSeek-V2's checkpoints have none
    # the MTP layer, which transformers' model skips (naming its experts fused), is all it leaves out
    export = round_trip(source, tmp_path, skipped_prefix=f"model.layers.{LAYERS}.", experts_implementation="eager")
    assert bool(export.loading_info["unexpected_keys"]) == v3
    export.original_config["rope_parameters"].setdefault("truncate", True)   # HF's default, written out
    assert not export.changed_fields()
    with torch.no_grad():
        assert torch.equal(export.model(_ids()).logits, reference(_ids()).logits)
    if v3:
        _check_the_mtp_depth_against_transformers_mtp_layer(reference, load_hf(source), mtp)
        copy = f"model.layers.{LAYERS}.embed_tokens.weight"   # tessera has one embedding: copies must agree
        save_file({**mtp, copy: mtp[copy] + 1}, source / "model-mtp.safetensors", metadata={"format": "pt"})
        with pytest.raises(UnsupportedModel, match=f"{copy} differs from model.embed_tokens.weight"):
            load_hf(source)


def _check_the_mtp_depth_against_transformers_mtp_layer(reference, model, mtp):
    """Depth 1's logits against transformers' MtpLayer (speculative decoding's) holding the same
    tensors, fed the main model's normed output and the next tokens' embeddings."""
    assert model.config.mtp_num_layers == 1
    config = reference.config.get_mtp_config()
    config._attn_implementation = "sdpa"   # causal without a mask
    layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layer_idx=0).eval()
    prefix = f"model.layers.{LAYERS}."
    names = {"shared_head.norm.": "post_norm.", "enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj."}
    state = {}
    for name, tensor in mtp.items():
        short = name[len(prefix):]
        if short.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        own = next((names[k] + short[len(k):] for k in names if short.startswith(k)), None)
        state[own or "mtp_block." + short] = tensor
    fused = {}   # the block's experts, fused as transformers holds them in memory
    for key in [k for k in state if ".experts." in k]:
        tensor, parts = state.pop(key), key.split(".")
        fused.setdefault(parts[-2], {})[int(parts[-3])] = tensor
    experts = "mtp_block.mlp.experts."
    state[experts + "gate_up_proj"] = torch.stack([torch.cat([fused["gate_proj"][j], fused["up_proj"][j]])
                                                   for j in sorted(fused["gate_proj"])])
    state[experts + "down_proj"] = torch.stack([fused["down_proj"][j] for j in sorted(fused["down_proj"])])
    layer.load_state_dict(state)
    ids = _ids()
    with torch.no_grad():
        hidden = reference.model(ids).last_hidden_state
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        embedded = reference.model.embed_tokens(shift_left(ids, 1))
        out = layer(embedded, hidden, reference.model.rotary_emb(embedded, positions), None, positions, None)
        expected = reference.lm_head(out)
        h0 = model.final_norm(model.run_layers(model.embed(ids)))
        depth1 = model.mtp.layers[0](model.embed(shift_left(ids, 1)), h0, model.rotary(ids.shape[1], None))
        head = model.embedding.weight if model.output_weight is None else model.output_weight
        assert _max_diff(depth1 @ head.t(), expected) <= 1e-4


# -- tessera models to transformers, and configs without weights ---------------------------

def test_a_tiny_deepseek_trained_in_tessera_exports_to_what_transformers_computes(tmp_path):
    """No imported config: the written config.json alone describes the model (MTP layer included)."""
    from tessera.training.checkpoint_files import save_model_checkpoint

    config = ModelConfig(**{**preset_values("tiny-deepseek"), "make_vocab_size_divisible_by": 1})
    model = wide_model(config)
    save_model_checkpoint(tmp_path / "ckpt", config, model.state_dict())
    assert run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf_config["model_type"], hf_config["first_k_dense_replace"], hf_config["num_nextn_predict_layers"]) == \
        ("deepseek_v3", 1, 1)
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "mismatched_keys")), info
    assert all(key.startswith("model.layers.3.") for key in info["unexpected_keys"])   # the MTP layer
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert _max_diff(model(ids), exported.eval()(ids).logits) <= 1e-4
    # In bf16 too the expert bias stays fp32, as transformers keeps it.
    bf16 = hf_state_from_tessera(model.state_dict(), config, "deepseek_v3", torch.bfloat16)
    gate = "model.layers.1.mlp.gate."
    assert (bf16[gate + "e_score_correction_bias"].dtype, bf16[gate + "weight"].dtype) == (torch.float32, torch.bfloat16)


# The published config.json values (the fields the mapping reads) of each preset's model.
_V3 = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
           num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
           n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
           v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
           num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
           scoring_func="sigmoid", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
           rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=4096, type="yarn"),
           tie_word_embeddings=False, vocab_size=129280, num_nextn_predict_layers=1)
_PUBLISHED = {
    "deepseek-v3": (_V3, 1),   # (config.json, MTP layers in the checkpoint)
    "deepseek-v2-lite": (dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6, moe_layer_freq=1,
        first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax", max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000, vocab_size=102400, tie_word_embeddings=False,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                          original_max_position_embeddings=4096, type="yarn")), 0),
    "moonlight-16b-a3b": (dict(
        _V3, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=2.446, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=50000.0,
        rope_scaling=None, vocab_size=163840), 0),
    "kimi-k2": (dict(
        _V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=131072,
        rope_theta=50000.0, vocab_size=163840, num_nextn_predict_layers=0,
        rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=32.0, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn")), 0),
}


@pytest.mark.parametrize("preset", _PUBLISHED)
def test_an_import_loads_into_a_run_of_its_preset(preset):
    """--model PRESET --load IMPORT --finetune finds no differing architecture flag."""
    from tessera.training.checkpoint import model_config_differences

    hf, mtp_layers = _PUBLISHED[preset]
    imported = dataclasses.replace(model_config_from_hf(hf), mtp_num_layers=mtp_layers or None)
    assert model_config_differences(dataclasses.asdict(imported), ModelConfig(**preset_values(preset))) == []
    family = "deepseek_v3" if hf["model_type"] == "kimi_k2" else hf["model_type"]
    assert infer_family(imported) == family
    assert model_config_from_hf(hf_config_from_model(imported, hf["model_type"], hf)) == \
        dataclasses.replace(imported, mtp_num_layers=None)


def _v3(**changes) -> dict:
    return {**CASES["v3-q-lora"]().to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(rope_interleave=False), "rope_interleave false is not supported"),
    (dict(attention_bias=True), "attention_bias true is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 is not supported"),
    (dict(qk_head_dim=12), "qk_head_dim 12 does not add up: qk_nope_head_dim + qk_rope_head_dim = 12 + 8 = 20"),
    (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 4 is not supported"),
    (dict(num_experts_per_tok=6), "HF scores a group by its best 2, Megatron's router by its best"),
    (dict(n_shared_experts=0), "n_shared_experts 0 is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported"),
])
def test_hf_features_tessera_does_not_compute_are_refused(changes, message):
    with pytest.raises(UnsupportedModel, match=re.escape(message)) as error:
        model_config_from_hf(_v3(**changes))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("changes, message", [
    (dict(latent_norm_epsilon=1e-5), "--latent-norm-epsilon 1e-05 has no Hugging Face equivalent"),
    (dict(moe_layer_freq="([0]*1+[1]*1+[0]*1)"), "its dense layers must all come first"),
    (dict(moe_router_topk=2), "--moe-router-topk 2 with --moe-router-group-topk 2 has no deepseek_v3 equivalent"),
    (dict(moe_shared_expert_intermediate_size=24), "must be a positive multiple of --moe-ffn-hidden-size (16)"),
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False, moe_router_num_groups=None,
          moe_router_group_topk=None), "this MoE model has no DeepSeek equivalent"),
])
def test_tessera_models_no_deepseek_computes_are_refused(changes, message):
    config = ModelConfig(**{**preset_values("tiny-deepseek"), **changes})
    with pytest.raises(UnsupportedModel, match=re.escape(message)):
        hf_config_from_model(config, infer_family(config))


def test_a_dense_mla_model_with_mtp_is_refused():
    dense = {k: v for k, v in preset_values("tiny-deepseek").items() if not k.startswith(("moe_", "num_experts"))}
    config = ModelConfig(**dense)
    assert infer_family(config) == "deepseek_v3"
    with pytest.raises(UnsupportedModel, match="DeepSeek's MTP layers are MoE layers"):
        hf_config_from_model(config, "deepseek_v3")
    hf_config_from_model(dataclasses.replace(config, mtp_num_layers=None), "deepseek_v3")   # without MTP it maps
