"""A missing or garbage tokenizer file is one line naming the flag and the file, exit code 2, from
every command that reads one: never a traceback."""

import pytest
import transformers

from tessera.cli import run

GARBAGE = bytes(range(256)) * 3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _argv(command: str, tmp_path, hf_model) -> list[str]:
    if command == "train":
        return ["train", "--model", "tiny-llama", "--data-path", str(tmp_path / "corpus"), "--lr", "1e-3",
                "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]
    if command == "preprocess":
        (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
        return ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                "--workers", "1"]
    return ["generate", "--hf", str(hf_model), "--prompt", "hello"]


@pytest.mark.parametrize("command", ["train", "preprocess", "generate"])
@pytest.mark.parametrize("kind, name, problem", [
    ("SentencePieceTokenizer", "tok.model", "not a sentencepiece model"),
    ("TikTokenizer", "tok.tiktoken", "not a tiktoken BPE file"),
    ("SentencePieceTokenizer", "missing.model", "no such file or directory"),
])
def test_a_bad_tokenizer_file_is_one_line(command, kind, name, problem, tmp_path, hf_model, capsys):
    path = tmp_path / name
    if not name.startswith("missing"):
        path.write_bytes(GARBAGE)
    with pytest.raises(SystemExit) as exit_code:
        run([*_argv(command, tmp_path, hf_model), "--tokenizer-type", kind, "--tokenizer-model", str(path)])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2
    assert err.startswith(f"tessera {command}: error: --tokenizer-model {path}: {problem}") and err.count("\n") == 1


@pytest.mark.parametrize("command, problem", [("train", "not a Hugging Face tokenizer.json"),
                                              ("generate", "cannot load a Hugging Face tokenizer")])
def test_a_garbage_tokenizer_json_is_one_line(command, problem, tmp_path, hf_model, capsys):
    (tmp_path / "junk.json").write_bytes(GARBAGE)
    with pytest.raises(SystemExit):
        run([*_argv(command, tmp_path, hf_model), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(tmp_path / "junk.json")])
    assert capsys.readouterr().err.splitlines() == [
        f"tessera {command}: error: --tokenizer-model {tmp_path / 'junk.json'}: {problem} "
        "(stream did not contain valid UTF-8)"]
