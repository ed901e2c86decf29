"""Tokenizers, all loaded from local files (never from a model hub), with Megatron's type names.

Each has `vocab_size` (unpadded), `eod` (the end-of-document id that --append-eod writes
and the EOD flags look for), `tokenize(text)`, `tokenize_batch(texts)` (the fast path of
preprocessing) and `detokenize(ids)`. The ids of a type match what Megatron-LM's
tokenizer of the same name produces from the same files, so datasets are interchangeable.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from tessera.config import ConfigError, DataConfig

# Megatron-LM's TikTokenizer pre-tokenization patterns (--tiktoken-pattern v1|v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17

# End-of-document tokens looked for, in order, in a Hugging Face tokenizer without a config.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<EOD>")


class Tokenizer:
    """Base class: subclasses set vocab_size and eod and implement tokenize/detokenize."""

    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> Sequence[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[Sequence[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and EOD = 256: needs no file and no training."""

    vocab_size, eod = 257, 256

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """The text is already ids, separated by whitespace; EOD is vocab_size - 1."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        self.vocab_size, self.eod = vocab_size, vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(word) for word in text.split()]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"a token id is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer from a tokenizer.json or a directory holding one."""

    def __init__(self, path: str, tokenizer=None):
        from tokenizers import Tokenizer as HFTokenizer

        directory = Path(path) if Path(path).is_dir() else Path(path).parent
        if tokenizer is None:
            file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
            if not file.is_file():
                raise ConfigError(f"--tokenizer-model {path}: no tokenizer.json there (only local files are read)")
            tokenizer = HFTokenizer.from_file(str(file))
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(directory, path)

    def _find_eod(self, directory: Path, path: str) -> int:
        config = directory / "tokenizer_config.json"
        names = list(EOD_CANDIDATES)
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos:
                names.insert(0, eos)
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ConfigError(f"--tokenizer-model {path}: no end-of-document token (tried {', '.join(names)})")

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def gpt2_bpe_tokenizer(vocab_file: str | None, merge_file: str | None) -> HuggingFaceTokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (EOD = <|endoftext|>)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    for name, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if path is None or not Path(path).is_file():
            raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {name} (a local file), got {path}")
    tokenizer = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return HuggingFaceTokenizer(vocab_file, tokenizer)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (GPT/Llama-2 style: the model's own vocabulary, EOD = </s>)."""

    def __init__(self, model_file: str | None):
        import sentencepiece

        if model_file is None or not Path(model_file).is_file():
            raise ConfigError(f"--tokenizer-model must be a local sentencepiece .model file, got {model_file}")
        self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._model.vocab_size()
        self.eod = self._model.eos_id()
        if self.eod < 0:
            raise ConfigError(f"--tokenizer-model {model_file}: the sentencepiece model has no </s> (eos) piece")

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._model.encode(texts, num_threads=1)  # parallelism comes from the workers

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._model.decode([int(i) for i in ids])


class TikTokenizer(Tokenizer):
    """A tiktoken BPE, laid out as Megatron's: special tokens first, then the BPE ranks.

    The file is Megatron's JSON list of {rank, token_bytes, token_str}, or a
    `.tiktoken` file (one "base64-token rank" per line).
    """

    def __init__(self, path: str | None, pattern: str, num_special_tokens: int, vocab_size: int | None):
        import tiktoken

        if path is None or not Path(path).is_file():
            raise ConfigError(f"--tokenizer-type TikTokenizer needs --tokenizer-model (a local BPE file), got {path}")
        if num_special_tokens < len(TIKTOKEN_SPECIAL_TOKENS):
            raise ConfigError(f"--tiktoken-num-special-tokens must be at least {len(TIKTOKEN_SPECIAL_TOKENS)}")
        self.vocab_size = vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE
        ranks = self._load_ranks(path, self.vocab_size - num_special_tokens)
        self.num_special_tokens = num_special_tokens
        self.special_tokens = TIKTOKEN_SPECIAL_TOKENS + [
            f"<SPECIAL_{i}>" for i in range(len(TIKTOKEN_SPECIAL_TOKENS), num_special_tokens)]
        self.eod = self.special_tokens.index("</s>")
        self._encoding = tiktoken.Encoding(Path(path).stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})

    @staticmethod
    def _load_ranks(path: str, max_ranks: int) -> dict[bytes, int]:
        try:
            if path.endswith(".json"):
                entries = json.loads(Path(path).read_text())
                ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"]) for entry in entries}
            else:  # read directly: tiktoken's own loader caches by path name in a temp directory
                lines = Path(path).read_text().split()
                ranks = {base64.b64decode(token): int(rank) for token, rank in zip(lines[0::2], lines[1::2])}
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--tokenizer-model {path}: not a tiktoken BPE file ({exc})") from None
        return {token: rank for token, rank in ranks.items() if rank < max_ranks}

    def tokenize(self, text: str) -> np.ndarray:
        return np.asarray(self._encoding.encode_ordinary(text), dtype=np.int64) + self.num_special_tokens

    def detokenize(self, ids: Sequence[int]) -> str:
        pieces, ranks = [], []
        for token_id in map(int, ids):
            if token_id < self.num_special_tokens:
                pieces.append(self._encoding.decode(ranks) + self.special_tokens[token_id])
                ranks = []
            else:
                ranks.append(token_id - self.num_special_tokens)
        return "".join(pieces) + self._encoding.decode(ranks)


def build_tokenizer(data: DataConfig, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer that --tokenizer-type and its file flags describe.

    `vocab_size` is --vocab-size: NullTokenizer's size, or a cap on TikTokenizer's.
    """
    kind = data.tokenizer_type
    if kind is None:
        raise ConfigError("--tokenizer-type is required with a dataset")
    if data.tokenizer_model is not None and not os.path.exists(data.tokenizer_model):
        raise ConfigError(f"--tokenizer-model {data.tokenizer_model}: no such file or directory")
    if kind == "HuggingFaceTokenizer":
        if data.tokenizer_model is None:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its directory)")
        return HuggingFaceTokenizer(data.tokenizer_model)
    if kind == "GPT2BPETokenizer":
        return gpt2_bpe_tokenizer(data.vocab_file, data.merge_file)
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return SentencePieceTokenizer(data.tokenizer_model)
    if kind == "TikTokenizer":
        return TikTokenizer(data.tokenizer_model, TIKTOKEN_PATTERNS[data.tiktoken_pattern],
                            data.tiktoken_num_special_tokens, vocab_size)
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {kind}: unknown, expected one of {', '.join(DataConfig.TOKENIZER_TYPES)}")
