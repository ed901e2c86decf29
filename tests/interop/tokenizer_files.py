"""Small real tokenizers of every --tokenizer-type, trained here on a few lines (offline, fast), and
the texts to compare them on: words of the corpus, words it lacks, other scripts, whitespace runs."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tessera.config import DataConfig
from tessera.data.train_tokenizer import EOD_TOKEN, TrainingText, train_bpe_tokenizer

WORDS = ["alpha", "beta", "gamma", "tessera", "mosaic", "token", "café", "naïve", "don't", "I'll", "1234", "—",
         "你好", "Ünïcödé"]
CORPUS = [" ".join(WORDS[(i * j + i) % len(WORDS)] for j in range(10)) for i in range(60)]
TEXTS = ["tessera mosaic alpha", " leading space and  two   runs", "Naïve café — ünïcode, 你好世界!",
         "line one\nline two\t\ttabs\n\n", "numbers 1234567 and don't, I'll, they're", "zebra quokka"]
KINDS = ("hf-file", "hf-dir", "gpt2", "sentencepiece-bpe", "sentencepiece-unigram", "tiktoken", "tiktoken-json",
         "bytes")


def _bpe_json(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json (`tessera train-tokenizer`'s), named bpe.json."""
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS))
    train_bpe_tokenizer(TrainingText([str(corpus)]), str(directory / "bpe.json"), vocab_size=400, min_frequency=1)
    return directory / "bpe.json"


def _tiktoken_ranks(bpe_json: Path) -> dict[bytes, int]:
    """The BPE's tokens as bytes, ranked in vocabulary order (merges come after their parts)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab = json.loads(bpe_json.read_text())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1]) if token != EOD_TOKEN]
    return {bytes(to_byte[char] for char in token): rank for rank, token in enumerate(tokens)}


def make_tokenizer(kind: str, directory: Path) -> DataConfig:
    """Tokenizer files of `kind` (one of KINDS) in `directory`, and the flags that name them."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "bytes":
        return DataConfig(tokenizer_type="ByteTokenizer")
    if kind.startswith("sentencepiece"):
        import sentencepiece

        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS), model_prefix=str(directory / "sp"), vocab_size=330,
            model_type=kind.removeprefix("sentencepiece-"), byte_fallback=True, hard_vocab_limit=False,
            minloglevel=2)
        return DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(directory / "sp.model"))
    bpe = _bpe_json(directory)
    if kind == "hf-file":
        return DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(bpe))
    if kind == "hf-dir":
        import transformers

        transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe), eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                             pad_token=EOD_TOKEN).save_pretrained(directory / "hf")
        return DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory / "hf"))
    if kind == "gpt2":
        model = json.loads(bpe.read_text())["model"]
        (directory / "gpt2-vocab.json").write_text(json.dumps(model["vocab"]))
        merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]]
        (directory / "gpt2-merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        return DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(directory / "gpt2-vocab.json"),
                          merge_file=str(directory / "gpt2-merges.txt"))
    ranks = _tiktoken_ranks(bpe)
    if kind == "tiktoken":
        path = directory / "bpe.tiktoken"
        path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
        return DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(path), tiktoken_num_special_tokens=10)
    path = directory / "tiktoken.json"   # Megatron's format, with its v1 pattern
    path.write_text(json.dumps([{"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": ""}
                                for token, rank in ranks.items()]))
    return DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(path), tiktoken_pattern="v1",
                      tiktoken_num_special_tokens=10)
