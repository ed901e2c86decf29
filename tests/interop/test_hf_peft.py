"""LoRA adapters <-> PEFT adapter directories, against PEFT itself: `PeftModel.from_pretrained` on
the HF export of the base (tessera convert tessera-to-hf) computes what the tessera LoRA model
computes, and a PEFT adapter of PEFT's own making imports into tessera's fused layout exactly.

tiny-llama: GQA (4 heads, 2 KV groups) and SwiGLU, so q/k/v and gate/up are split on export.
Logits agree to rounding in fp32 (max |difference| <= 1e-5 on logits of order 1; the fused GEMMs
add in another order); tessera -> PEFT -> tessera is bit for bit.
"""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from tessera.config import ConfigError, ModelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.interop.hf_checkpoint import tessera_to_hf
from tessera.interop.hf_peft import export_peft, import_peft
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.posttrain.lora import adapter_state, adapters, apply_lora
from tessera.training.checkpoint_files import save_model_checkpoint
from tests.posttrain.test_lora import randomize_adapters

CONFIG = ModelConfig(**PRESETS["tiny-llama"])
HEADS, GROUPS, HEAD_DIM, FFN = 4, 2, 16, 176
LORA = PostTrainConfig(lora_rank=4, lora_alpha=12, lora_dropout=0.05)
TOKENS = torch.randint(0, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


def _base() -> GPTModel:
    model = GPTModel(CONFIG).eval()
    initialize_parameters(model, seed=1)
    return model


def _lora_model(posttrain: PostTrainConfig = LORA) -> GPTModel:
    model = _base()
    apply_lora(model, posttrain, seed=1)
    randomize_adapters(model, seed=2)
    return model


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """The HF export of the base, as `tessera convert tessera-to-hf` writes it."""
    root = tmp_path_factory.mktemp("base")
    save_model_checkpoint(root / "ckpt", CONFIG, {name: p.detach() for name, p in _base().named_parameters()})
    tessera_to_hf(root / "ckpt", root / "hf")
    return root / "hf"


def _peft_logits(hf_base, adapter_dir) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _logits(model: GPTModel) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)[..., :CONFIG.vocab_size]


def test_export_names_shapes_splits_and_config(hf_base, tmp_path):
    model = _lora_model(PostTrainConfig(lora_rank=4, lora_alpha=12, lora_dropout=0.05,
                                        lora_target_modules=["linear_qkv", "linear_fc1", "*.layers.1.*.linear_fc2"]))
    export_peft(model, tmp_path, base_model_name_or_path=str(hf_base))
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    q, kv, hidden = HEADS * HEAD_DIM, GROUPS * HEAD_DIM, CONFIG.hidden_size
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "mlp.gate_proj": (hidden, FFN), "mlp.up_proj": (hidden, FFN)}
    expected = {f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight":
                (4, fan_in) if ab == "A" else (fan_out, 4)
                for i in range(2) for module, (fan_in, fan_out) in shapes.items() for ab in "AB"}
    expected.update({f"base_model.model.model.layers.1.mlp.down_proj.lora_{ab}.weight": shape
                     for ab, shape in (("A", (4, FFN)), ("B", (hidden, 4)))})
    assert {key: tuple(t.shape) for key, t in tensors.items()} == expected
    state = adapter_state(model)
    for i in range(2):   # A repeated on every piece, B cut into q | k | v and gate | up rows
        prefix = f"base_model.model.model.layers.{i}."
        for fused, pieces in (("attention.qkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                              ("mlp.fc1", ["mlp.gate_proj", "mlp.up_proj"])):
            a, b = state[f"layers.{i}.{fused}.adapter.lora_A"], state[f"layers.{i}.{fused}.adapter.lora_B"]
            assert all(torch.equal(tensors[f"{prefix}{p}.lora_A.weight"], a) for p in pieces)
            assert torch.equal(torch.cat([tensors[f"{prefix}{p}.lora_B.weight"] for p in pieces]), b)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
                                   "fan_in_fan_out", "use_rslora", "use_dora", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 12, "lora_dropout": 0.05,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "base_model_name_or_path": str(hf_base)}
    # every q/k/v/gate/up has an adapter, down_proj only layer 1's
    assert config["target_modules"] == ["model.layers.1.mlp.down_proj", "gate_proj", "k_proj", "q_proj", "up_proj",
                                        "v_proj"]


def test_peft_on_the_hf_base_computes_the_tessera_lora_model(hf_base, tmp_path):
    model = _lora_model()
    export_peft(model, tmp_path, base_model_name_or_path=str(hf_base))
    expected = _logits(model)
    actual = _peft_logits(hf_base, tmp_path)
    assert (actual - expected).abs().max().item() <= 1e-5
    assert (actual - _logits(_base())).abs().max().item() > 1e-2   # the adapters change the logits


def test_export_import_round_trip_is_lossless(tmp_path):
    model = _lora_model()
    export_peft(model, tmp_path / "first")
    imported = _base()
    assert import_peft(imported, tmp_path / "first") == list(adapters(model))
    expected, actual = adapter_state(model), adapter_state(imported)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    assert {a.scale for a in adapters(imported).values()} == {3.0}
    export_peft(imported, tmp_path / "second")
    first, second = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("first", "second"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert (tmp_path / "first" / "adapter_config.json").read_text() == \
        (tmp_path / "second" / "adapter_config.json").read_text()


def test_a_peft_adapter_of_peft_own_making_imports_exactly(hf_base, tmp_path):
    """PEFT's adapters are separate per module: q_proj and v_proj with A's of their own (v at another
    rank and alpha, by rank_pattern / alpha_pattern) become one block-diagonal qkv adapter, down_proj
    a plain one; then exported back for PEFT again (rank_pattern for the adapters of a rank of their own)."""
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 6}, init_lora_weights=False)
        peft.get_peft_model(hf, lora).save_pretrained(tmp_path / "peft")
    expected = _peft_logits(hf_base, tmp_path / "peft")
    model = _base()
    assert import_peft(model, tmp_path / "peft") == [f"layers.{i}.{m}" for i in range(2)
                                                     for m in ("attention.qkv", "mlp.fc2")]
    assert adapters(model)["layers.0.attention.qkv"].lora_A.shape == (4 + 2, CONFIG.hidden_size)
    assert (_logits(model) - expected).abs().max().item() <= 1e-5
    export_peft(model, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (6, 12)   # the most common rank, and the scale 8 / 4
    down = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert (config["rank_pattern"], config["alpha_pattern"]) == (dict.fromkeys(down, 4), dict.fromkeys(down, 8))
    assert (_peft_logits(hf_base, tmp_path / "back") - expected).abs().max().item() <= 1e-5


def test_what_peft_cannot_say_is_one_line(tmp_path):
    moe = GPTModel(ModelConfig(**{**PRESETS["tiny-moe"], "moe_shared_expert_gate": True}))
    apply_lora(moe, PostTrainConfig(lora_rank=2, lora_target_modules=["*.experts.linear_fc1"]), seed=0)
    with pytest.raises(ConfigError, match="layers.1.mlp.experts.fc1: PEFT adapters cover"):
        export_peft(moe, tmp_path / "moe")
    model = _lora_model()
    export_peft(model, tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "ok" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora True is not a plain LoRA adapter"):
        import_peft(_base(), tmp_path / "ok")
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        import_peft(_base(), tmp_path)
