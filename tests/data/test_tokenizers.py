"""Tokenizers from local files: expected ids derived by hand from each format's rules; a missing,
unreadable or garbage file is one line naming the flag and the file; the files each one reads."""

import base64
import json
import os

import pytest

from tessera.config import ConfigError, DataConfig
from tessera.data.tokenizers import build_tokenizer, tokenizer_files
from tessera.data.train_tokenizer import TrainingText, train_bpe_tokenizer

TEXT = "Naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ASCII.\nSecond line\t tab"


def test_byte_tokenizer_is_utf8_bytes():
    tok = build_tokenizer(DataConfig(tokenizer_type="ByteTokenizer"))
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert list(tok.tokenize("é!")) == [0xC3, 0xA9, 0x21]
    assert tok.detokenize(list(tok.tokenize(TEXT)) + [tok.eod]) == TEXT


def test_null_tokenizer_reads_ids():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), vocab_size=100)
    assert tok.tokenize(" 5 17\n3 ") == [5, 17, 3] and tok.eod == 99
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


def test_gpt2_bpe_from_vocab_and_merges(tmp_path):
    # Byte-level alphabet: ' ' is 'Ġ'. Merges apply in rank order: a+b first, then Ġ+ab.
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "Ġ": 3, "ab": 4, "Ġab": 5}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ ab\n")
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                     merge_file=str(tmp_path / "merges.txt")))
    assert (tok.vocab_size, tok.eod) == (6, 0)
    assert tok.tokenize("ab ab") == [4, 5]
    assert tok.tokenize("ba") == [2, 1]
    assert tok.detokenize([4, 5, 2]) == "ab abb"


def _tiktoken_ranks():
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    return ranks


@pytest.mark.parametrize("fmt", ["tiktoken", "json"])
def test_tiktokenizer_megatron_layout(tmp_path, fmt):
    ranks = _tiktoken_ranks()
    if fmt == "json":
        path = tmp_path / "vocab.json"
        path.write_text(json.dumps([{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": ""}
                                    for t, r in ranks.items()]))
    else:
        path = tmp_path / "bpe.tiktoken"
        path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(path)))
    # 1000 special ids come first (<unk> <s> </s> ...), then the BPE ranks.
    assert tok.eod == 2 and tok.vocab_size == 2**17
    assert tok.tokenize("abc").tolist() == [1256, 1099]
    assert tok.detokenize([1256, 2, 1099]) == "ab</s>c"
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_tiktoken_v1_pattern_works(tmp_path):
    path = tmp_path / "bpe.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in _tiktoken_ranks().items()))
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(path), tiktoken_pattern="v1"))
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def _corpus(tmp_path, n=300):
    path = tmp_path / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "tessera", "mosaic", "token", "café"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(words[(i * j) % len(words)] for j in range(12))}) + "\n")
    return path


def test_trained_bpe_loads_as_huggingface_tokenizer(tmp_path):
    text = TrainingText([str(_corpus(tmp_path))])
    train_bpe_tokenizer(text, str(tmp_path / "tok" / "tokenizer.json"), vocab_size=300, min_frequency=1)
    assert text.documents == 300
    for model in (tmp_path / "tok" / "tokenizer.json", tmp_path / "tok"):
        tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(model)))
        assert tok.eod == 0 and 257 < tok.vocab_size <= 300  # the corpus may run out of merges
        ids = tok.tokenize("tessera mosaic " + TEXT)
        assert len(tok.tokenize(" tessera")) == 1  # a frequent word of the corpus is one token
        assert tok.detokenize(ids) == "tessera mosaic " + TEXT
        assert tok.tokenize_batch(["alpha beta", ""]) == [tok.tokenize("alpha beta"), []]


def test_sentencepiece_model(tmp_path):
    import sentencepiece

    lines = [json.loads(line)["text"] for line in _corpus(tmp_path).read_text().splitlines()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=60, model_type="bpe", minloglevel=2)
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model")))
    assert tok.vocab_size == 60 and tok.eod == 2  # sentencepiece's default </s> id
    assert tok.detokenize(tok.tokenize("alpha beta gamma")) == "alpha beta gamma"
    assert tok.tokenize_batch(["alpha", "beta"]) == [tok.tokenize("alpha"), tok.tokenize("beta")]


@pytest.mark.parametrize("config, flag", [
    (DataConfig(), "--tokenizer-type"),
    (DataConfig(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
    (DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent/tokenizer.json"), "--tokenizer-model"),
    (DataConfig(tokenizer_type="GPT2BPETokenizer"), "--vocab-file"),
    (DataConfig(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
    (DataConfig(tokenizer_type="TikTokenizer"), "--tokenizer-model"),
])
def test_missing_files_name_the_flag(config, flag):
    with pytest.raises(ConfigError, match=flag):
        build_tokenizer(config)


GARBAGE = bytes(range(256)) * 3   # not UTF-8, not a protobuf


def _files(tmp_path, **contents) -> dict[str, str]:
    paths = {}
    for name, content in contents.items():
        path = tmp_path / name.replace("_", ".")
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("kind, contents, flag, bad", [
    ("HuggingFaceTokenizer", dict(junk_json=GARBAGE), "--tokenizer-model", "junk_json"),
    ("HuggingFaceTokenizer", dict(junk_json='{"version": "1.0"}'), "--tokenizer-model", "junk_json"),
    ("SentencePieceTokenizer", dict(junk_model=GARBAGE), "--tokenizer-model", "junk_model"),
    ("TikTokenizer", dict(junk_tiktoken=GARBAGE), "--tokenizer-model", "junk_tiktoken"),
    ("TikTokenizer", dict(junk_tiktoken="not base64 at all\n"), "--tokenizer-model", "junk_tiktoken"),
    ("TikTokenizer", dict(junk_json='{"rank": 0}'), "--tokenizer-model", "junk_json"),
    ("GPT2BPETokenizer", dict(vocab_json=GARBAGE, merges_txt="a b\n"), "--vocab-file", "vocab_json"),
    ("GPT2BPETokenizer", dict(vocab_json="[1, 2]", merges_txt="a b\n"), "--vocab-file", "vocab_json"),
    ("GPT2BPETokenizer", dict(vocab_json='{"a": 0, "b": 1}', merges_txt=GARBAGE), "--merge-file", "merges_txt"),
])
def test_a_garbage_tokenizer_file_is_one_line_naming_the_flag_and_file(tmp_path, kind, contents, flag, bad):
    paths = _files(tmp_path, **contents)
    if kind == "GPT2BPETokenizer":
        data = DataConfig(tokenizer_type=kind, vocab_file=paths["vocab_json"], merge_file=paths["merges_txt"])
    else:
        data = DataConfig(tokenizer_type=kind, tokenizer_model=paths[bad])
    with pytest.raises(ConfigError) as error:
        build_tokenizer(data)
    message = str(error.value)
    assert message.startswith(f"{flag} {paths[bad]}: not a ") and "\n" not in message, message


def test_a_garbage_tokenizer_config_beside_a_tokenizer_json_is_named(tmp_path):
    train_bpe_tokenizer(TrainingText([str(_corpus(tmp_path))]), str(tmp_path / "tokenizer.json"), vocab_size=300)
    (tmp_path / "tokenizer_config.json").write_bytes(GARBAGE)
    with pytest.raises(ConfigError, match=f"--tokenizer-model {tmp_path / 'tokenizer_config.json'}: not a "):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer"])
def test_an_unreadable_tokenizer_file_is_one_line(tmp_path, kind):
    path = tmp_path / "tokenizer.bin"
    path.write_bytes(GARBAGE)
    path.chmod(0)
    with pytest.raises(ConfigError, match=f"--tokenizer-model {path}: not a "):
        build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=str(path)))


def test_tokenizer_files_are_those_the_tokenizer_reads(tmp_path):
    hf = tmp_path / "hf"
    train_bpe_tokenizer(TrainingText([str(_corpus(tmp_path))]), str(hf / "bpe.json"), vocab_size=300, min_frequency=1)
    (hf / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')   # read for the EOD
    (hf / "notes.txt").write_text("not a tokenizer file")
    hf_file = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf / "bpe.json"))
    assert tokenizer_files(hf_file) == {"tokenizer_model": [hf / "bpe.json", hf / "tokenizer_config.json"]}
    (hf / "bpe.json").rename(hf / "tokenizer.json")
    hf_dir = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf))
    assert tokenizer_files(hf_dir) == {"tokenizer_model": [hf / "tokenizer.json", hf / "tokenizer_config.json"]}
    gpt2 = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(hf / "tokenizer.json"),
                      merge_file=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match=f"--merge-file {tmp_path / 'missing.txt'}: no such file"):
        tokenizer_files(gpt2)
    assert tokenizer_files(DataConfig(tokenizer_type="ByteTokenizer")) == tokenizer_files(DataConfig()) == {}
