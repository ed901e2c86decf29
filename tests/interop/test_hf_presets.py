"""Every preset of tessera/models/presets.py exports to the transformers family that computes it, or
`tessera convert` refuses it in one line naming the feature no family has.

Each preset is built tiny (widths, layers, experts and vocabulary shrunk; what decides the family
kept: attention kind, norms, biases, RoPE and its scaling, routers, shared experts, dense layers
first, MTP), saved as a checkpoint, exported with `tessera convert tessera-to-hf` and loaded by
transformers' AutoModelForCausalLM, the oracle: its logits must be tessera's to 1e-4 (fp32; they
agree to ~1e-6). Presets that shrink to the same model are checked once. Routers are drawn wide
(std 0.5) so that near-ties between experts, which rounding could break either way, are unlikely.
"""

import dataclasses

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.config import ModelConfig
from tessera.config.hybrid import layer_symbols
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import PRESETS, preset_values
from tessera.training.checkpoint_files import save_model_checkpoint

VOCAB = 101
# Presets no transformers family computes, and the flag their refusal names.
REFUSED = {"tiny-moe": "--moe-shared-expert-gate", "tiny-hybrid": "--squared-relu",   # Nemotron-H's MLPs, not GeLU
           "mamba2-hybrid-8b": "--squared-relu"}


def tiny(preset: str) -> ModelConfig:
    values = preset_values(preset)
    full = ModelConfig(**values)
    values.update(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=VOCAB, seq_length=32,
                  max_position_embeddings=32, make_vocab_size_divisible_by=8, init_method_std=0.1, num_layers=2)
    if full.group_query_attention:
        values["num_query_groups"] = 2
    if full.hybrid_layer_pattern:   # each kind of layer once; Mamba-2 heads of 16 channels in 2 groups
        symbols = layer_symbols(full.hybrid_layer_pattern)
        if "G" in symbols:   # Qwen3-Next's layers come in (mixer, MLP) pairs: each kind of pair once
            symbols = ["".join(pair) for pair in zip(symbols[0::2], symbols[1::2])]
        pattern = "".join(dict.fromkeys(symbols))
        values.update(hybrid_layer_pattern=pattern, num_layers=len(pattern), mamba_head_dim=16, mamba_num_groups=2,
                      mamba_state_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16)
    if "kv_channels" in values:
        values["kv_channels"] = 24   # not hidden / heads, as in the presets that set it
    if full.multi_latent_attention:
        values.update(q_lora_rank=full.q_lora_rank and 32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
                      v_head_dim=16)
    if full.num_experts:
        dense = full.moe_layers().index(True)   # the dense layers before the first MoE one
        values.update(num_layers=dense + 2, moe_ffn_hidden_size=32, num_experts=4, moe_router_topk=2)
        if full.moe_layer_freq != "1":
            values["moe_layer_freq"] = f"([0]*{dense}+[1]*2)"
        if full.moe_shared_expert_intermediate_size:
            values["moe_shared_expert_intermediate_size"] = 64
        if full.moe_router_num_groups:   # HF's grouped router picks 2 experts per group
            values.update(num_experts=16, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2)
    return ModelConfig(**values)


def _by_model() -> dict[str, ModelConfig]:
    """{"preset, preset, ...": their tiny model} for the presets that export."""
    groups: dict[str, list[str]] = {}
    configs = {}
    for name in PRESETS:
        if name not in REFUSED:
            config = tiny(name)
            key = repr(dataclasses.asdict(config))
            groups.setdefault(key, []).append(name)
            configs[key] = config
    return {", ".join(names): configs[key] for key, names in groups.items()}


EXPORTED = _by_model()


def wide_model(config: ModelConfig) -> GPTModel:
    """A tessera model (eval mode) drawn so that mix-ups show: norms away from 1, biases (the
    routers' expert bias too) away from 0, and decisive routers."""
    model = GPTModel(config).eval()
    initialize_parameters(model, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("router.weight"):
                tensor.normal_(0.0, 0.5, generator=generator)
            elif "norm" in name or name.endswith(("bias", "expert_bias")):
                tensor.normal_(1.0 if "norm" in name else 0.0, 0.1, generator=generator)
    return model


@pytest.mark.parametrize("presets", EXPORTED)
def test_presets_export_to_what_transformers_computes(presets, tmp_path):
    config = EXPORTED[presets]
    model = wide_model(config)
    save_model_checkpoint(tmp_path / "ckpt", config, model.state_dict())
    assert run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = exported.eval()(ids).logits
        assert (model(ids)[..., :VOCAB] - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("preset", REFUSED)
def test_presets_no_family_computes_are_refused_in_one_line(preset, tmp_path, capsys):
    config = tiny(preset)
    save_model_checkpoint(tmp_path / "ckpt", config, wide_model(config).state_dict())
    with pytest.raises(SystemExit) as exit_code:
        run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and err.count("\n") == 1 and REFUSED[preset] in err, err
    assert not (tmp_path / "hf").exists()   # refused before anything is written
