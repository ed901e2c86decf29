"""Loading models to generate with: tessera checkpoints (full weights, padding rows fitted to the
TP size), Hugging Face directories (EOS ids), and the errors."""

import json

import pytest
import torch

from tessera.inference.loading import load_model
from tessera.training.checkpoint_files import save_model_checkpoint
from tests.inference.test_engine import tiny_model


def test_a_tessera_checkpoint_loads_with_its_weights(tmp_path):
    original = tiny_model("tiny-deepseek")   # MLA, MoE, and persistent buffers (the routers' expert bias)
    with torch.no_grad():
        original.layers[1].mlp.router.expert_bias.normal_()
    state = dict(original.state_dict())
    # saved from a layout with more vocabulary padding (say TP=4): the extra rows are dropped
    state["embedding.weight"] = torch.cat([state["embedding.weight"], torch.zeros(16, 64)])
    save_model_checkpoint(tmp_path, original.config, state)
    model, info = load_model(load=str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), original(ids))
    assert not model.training and info.config == original.config and info.hf_config is None
    assert info.checkpoint_config["model"]["num_layers"] == 3 and info.eos_token_ids == ()


def test_weights_that_do_not_fit_are_refused(tmp_path):
    model = tiny_model()
    state = dict(model.state_dict())
    del state["final_norm.weight"]
    save_model_checkpoint(tmp_path / "missing", model.config, state)
    with pytest.raises(ValueError, match=r"missing \['final_norm.weight'\]"):
        load_model(load=str(tmp_path / "missing"))
    state = dict(model.state_dict(), **{"embedding.weight": torch.zeros(100, 64)})   # fewer rows than the vocabulary
    save_model_checkpoint(tmp_path / "short", model.config, state)
    with pytest.raises(ValueError, match="embedding.weight: the weights hold"):
        load_model(load=str(tmp_path / "short"))
    with pytest.raises(ValueError, match="give one of load"):
        load_model(load=str(tmp_path), hf=str(tmp_path))


def test_eos_ids_come_from_the_generation_config_first(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32, eos_token_id=5)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    _, info = load_model(hf=str(tmp_path), dtype=torch.float32)
    assert info.eos_token_ids == (5,) and info.tokenizer_dir == tmp_path and info.hf_config["vocab_size"] == 64
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=[7, 8])))
    assert load_model(hf=str(tmp_path))[1].eos_token_ids == (7, 8)


def test_the_tokenizer_a_checkpoint_carries_is_found_from_any_directory(tmp_path, monkeypatch):
    """config.yaml names the tokenizer's copy relative to the checkpoint directory; loading makes it
    absolute. A path that names no copy (an older checkpoint's original) is left as it was."""
    import dataclasses

    from tessera.config import DataConfig
    from tessera.training.checkpoint_files import copy_tokenizer, iteration_dir, write_checkpoint
    from tessera.training.checkpoint_state import whole

    model = tiny_model()
    (tmp_path / "sp.model").write_bytes(b"a sentencepiece model")
    for root, data in (("ckpt", DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model="sp.model")),
                       ("old", DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model="gone/sp.model"))):
        monkeypatch.chdir(tmp_path)
        config = {"model": dataclasses.asdict(model.config), "data": dataclasses.asdict(data)}
        if root == "ckpt":
            config["data"].update(copy_tokenizer(data, tmp_path / root))
        state = {f"model.{name}": whole(t) for name, t in model.state_dict().items()}
        write_checkpoint(iteration_dir(tmp_path / root, 1), state, config)
    monkeypatch.chdir("/")
    saved = load_model(load=str(tmp_path / "ckpt"))[1].checkpoint_config["data"]
    assert saved["tokenizer_model"] == str(tmp_path / "ckpt" / "tokenizer" / "sp.model")
    assert load_model(load=str(tmp_path / "old"))[1].checkpoint_config["data"]["tokenizer_model"] == "gone/sp.model"
