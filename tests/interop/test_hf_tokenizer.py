"""`tessera convert tessera-to-hf` writes the checkpoint's tokenizer as transformers loads it.

Oracle: transformers itself. `AutoTokenizer.from_pretrained` on the export encodes every text to
the ids tessera's tokenizer of that type gives and decodes them back to the same text;
`GenerationConfig` and `AutoModelForCausalLM` load the export with the tokenizer's special ids.
The export runs from another working directory, after the original tokenizer files are gone.
"""

import dataclasses
import json
import shutil

import pytest
import transformers

from tessera.cli import run
from tessera.config import DataConfig, ModelConfig
from tessera.data.tokenizers import build_tokenizer
from tessera.models.gpt import GPTModel
from tessera.training.checkpoint_files import copy_tokenizer, iteration_dir, write_checkpoint
from tessera.training.checkpoint_state import whole
from tests.interop.tokenizer_files import KINDS, TEXTS, make_tokenizer

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, seq_length=32,
                    vocab_size=500, make_vocab_size_divisible_by=8, position_embedding_type="rope",
                    normalization="RMSNorm", swiglu=True, disable_bias_linear=True)


def save_checkpoint(root, data: DataConfig, model: ModelConfig = MODEL) -> None:
    """What a training run's save leaves: weights, config.yaml naming the tokenizer's copies."""
    config = {"model": dataclasses.asdict(model), "data": dataclasses.asdict(data)}
    config["data"].update(copy_tokenizer(data, root))
    state = {f"model.{name}": whole(t) for name, t in GPTModel(model).state_dict().items()}
    write_checkpoint(iteration_dir(root, 5), state, config)


@pytest.mark.parametrize("kind", KINDS)
def test_autotokenizer_on_the_export_encodes_as_tessera(kind, tmp_path, monkeypatch, capsys):
    data = make_tokenizer(kind, tmp_path / "tokenizer")
    tokenizer = build_tokenizer(data, MODEL.vocab_size)
    save_checkpoint(tmp_path / "ckpt", data)
    shutil.rmtree(tmp_path / "tokenizer")   # the checkpoint carries its own copy
    monkeypatch.chdir(tmp_path / "ckpt")
    assert run(["convert", "tessera-to-hf", "--input", ".", "--output", str(tmp_path / "hf")]) == 0
    assert f"with its tokenizer ({data.tokenizer_type}" in capsys.readouterr().out

    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        ids = [int(i) for i in tokenizer.tokenize(text)]
        assert exported(text)["input_ids"] == ids, text
        assert exported.decode(ids) == tokenizer.detokenize(ids), text
    assert exported.eos_token_id == tokenizer.eod
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.eos_token_id == tokenizer.eod and generation.pad_token_id is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.generation_config.eos_token_id == model.config.eos_token_id == tokenizer.eod


@pytest.mark.parametrize("data, said", [
    (DataConfig(), "no tokenizer (the checkpoint was trained without one)"),
    (DataConfig(tokenizer_type="NullTokenizer"), "no tokenizer (NullTokenizer reads ids"),
])
def test_without_a_tokenizer_the_export_says_so(data, said, tmp_path, capsys):
    save_checkpoint(tmp_path / "ckpt", data)
    assert run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    assert said in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_an_imported_tokenizer_comes_back_as_it_was(tmp_path):
    """hf-to-tessera copies the HF directory's tokenizer beside the checkpoint; a run that saves into
    the same directory keeps it, and the export gives back those files byte for byte."""
    data = make_tokenizer("hf-dir", tmp_path / "tokenizer")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        eos_token_id=0)).save_pretrained(data.tokenizer_model)
    assert run(["convert", "hf-to-tessera", "--input", data.tokenizer_model, "--output", str(tmp_path / "ckpt")]) == 0
    assert run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "tokenizer" / "hf" / name).read_bytes(), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0


def test_a_garbage_tokenizer_in_the_checkpoint_is_one_line(tmp_path, capsys):
    data = make_tokenizer("sentencepiece-bpe", tmp_path / "tokenizer")
    save_checkpoint(tmp_path / "ckpt", data)
    (tmp_path / "ckpt" / "tokenizer" / "sp.model").write_bytes(b"\x00garbage")
    with pytest.raises(SystemExit) as exit_code:
        run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and err.count("\n") == 1
    assert f"--tokenizer-model {tmp_path / 'ckpt' / 'tokenizer' / 'sp.model'}: not a sentencepiece model" in err
