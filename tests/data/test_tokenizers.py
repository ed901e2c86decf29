"""Tokenizers from local files: expected ids derived by hand from each format's rules."""

import base64
import json

import pytest

from tessera.config import ConfigError, DataConfig
from tessera.data.tokenizers import build_tokenizer
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
