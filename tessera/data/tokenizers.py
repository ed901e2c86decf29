"""Tokenizers, all loaded from local files (never from a model hub), with Megatron's type names.

Each has `vocab_size` (unpadded), `eod` (the end-of-document id that --append-eod writes
and the EOD flags look for), `tokenize(text)`, `tokenize_batch(texts)` (the fast path of
preprocessing) and `detokenize(ids)`. The ids of a type match what Megatron-LM's
tokenizer of the same name produces from the same files, so datasets are interchangeable.

A file that is missing, unreadable or not of its format is a ConfigError naming the flag and
the file. `tokenizer_files` lists the files a tokenizer reads, so that a checkpoint can carry
copies of them (tessera.training.checkpoint_files).
"""

from __future__ import annotations

import base64
import filecmp
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.files import atomic_write

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
# What a Hugging Face model directory carries beside its weights for tokenizing, chat and generation.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                      "generation_config.json")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _unreadable(flag: str, path, what: str, exc: BaseException) -> ConfigError:
    """The one-line error for a tokenizer file its library could not read."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ConfigError(f"{flag} {path}: not a {what} ({reason})")


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

    def __init__(self, path: str, tokenizer=None, flag: str = "--tokenizer-model"):
        directory = Path(path) if Path(path).is_dir() else Path(path).parent
        if tokenizer is None:
            file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
            if not file.is_file():
                raise ConfigError(f"{flag} {path}: no tokenizer.json there (only local files are read)")
            tokenizer = read_tokenizer_json(file, flag)
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(directory, path, flag)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` that encodes."""
        return self._tokenizer

    def _find_eod(self, directory: Path, path: str, flag: str) -> int:
        names = list(EOD_CANDIDATES)
        eos = special_token(read_tokenizer_config(directory, flag), "eos_token")
        if eos:
            names.insert(0, eos)
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ConfigError(f"{flag} {path}: no end-of-document token (tried {', '.join(names)})")

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def read_tokenizer_json(file: str | os.PathLike, flag: str):
    """The `tokenizers.Tokenizer` of a tokenizer.json; `flag` is the option that named it, for the error."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 -- `tokenizers` raises a bare Exception for any bad file
        raise _unreadable(flag, file, "Hugging Face tokenizer.json", exc) from None


def read_tokenizer_config(directory: Path, flag: str) -> dict:
    """The tokenizer_config.json in `directory` (empty when there is none)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        return dict(json.loads(config.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise _unreadable(flag, config, "tokenizer_config.json", exc) from None


def special_token(config: dict, name: str) -> str | None:
    """A special token of a tokenizer_config.json ("eos_token": a string, or an AddedToken's fields)."""
    token = config.get(name)
    return token.get("content") if isinstance(token, dict) else token


def gpt2_bpe_tokenizer(vocab_file: str | None, merge_file: str | None) -> HuggingFaceTokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (EOD = <|endoftext|>)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    for name, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if path is None or not Path(path).is_file():
            raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {name} (a local file), got {path}")
    try:   # read here first so that a bad file is named: the BPE reader does not say which one it was
        vocab = json.loads(Path(vocab_file).read_text())
        if not isinstance(vocab, dict):
            raise ValueError(f"a JSON {type(vocab).__name__}, not an object of token: id")
    except (OSError, ValueError) as exc:
        raise _unreadable("--vocab-file", vocab_file, "GPT-2 vocab.json", exc) from None
    try:
        tokenizer = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as exc:  # noqa: BLE001 -- `tokenizers` raises a bare Exception for any bad file
        raise _unreadable("--merge-file", merge_file, "GPT-2 merges.txt", exc) from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if "<|endoftext|>" in vocab:   # special, as in GPT-2's own tokenizer.json
        tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return HuggingFaceTokenizer(vocab_file, tokenizer, flag="--vocab-file")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (GPT/Llama-2 style: the model's own vocabulary, EOD = </s>)."""

    def __init__(self, model_file: str | None):
        import sentencepiece

        if model_file is None or not Path(model_file).is_file():
            raise ConfigError(f"--tokenizer-model must be a local sentencepiece .model file, got {model_file}")
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as exc:
            raise _unreadable("--tokenizer-model", model_file, "sentencepiece model", exc) from None
        self.model_file = model_file
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
        self.ranks = self._load_ranks(path, self.vocab_size - num_special_tokens)
        self.pattern = pattern
        self.num_special_tokens = num_special_tokens
        self.special_tokens = TIKTOKEN_SPECIAL_TOKENS + [
            f"<SPECIAL_{i}>" for i in range(len(TIKTOKEN_SPECIAL_TOKENS), num_special_tokens)]
        self.eod = self.special_tokens.index("</s>")
        try:
            self._encoding = tiktoken.Encoding(Path(path).stem, pat_str=pattern, mergeable_ranks=self.ranks,
                                               special_tokens={})
        except ValueError as exc:
            raise _unreadable("--tokenizer-model", path, "tiktoken BPE file", exc) from None

    @staticmethod
    def _load_ranks(path: str, max_ranks: int) -> dict[bytes, int]:
        try:
            if path.endswith(".json"):
                entries = json.loads(Path(path).read_text())
                ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"]) for entry in entries}
            else:  # read directly: tiktoken's own loader caches by path name in a temp directory
                lines = Path(path).read_text().split()
                ranks = {base64.b64decode(token): int(rank) for token, rank in zip(lines[0::2], lines[1::2])}
            if not ranks:
                raise ValueError("no token in it")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _unreadable("--tokenizer-model", path, "tiktoken BPE file", exc) from None
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
    if kind in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(data.tokenizer_model)
    if kind == "TikTokenizer":
        return TikTokenizer(data.tokenizer_model, TIKTOKEN_PATTERNS[data.tiktoken_pattern],
                            data.tiktoken_num_special_tokens, vocab_size)
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {kind}: unknown, expected one of {', '.join(DataConfig.TOKENIZER_TYPES)}")


# -- the files a tokenizer reads, and copies of them --------------------------------------

def tokenizer_files(data: DataConfig) -> dict[str, list[Path]]:
    """The local files the tokenizer of `data` reads, under the DataConfig field that names them:
    a Hugging Face tokenizer's directory files or its tokenizer.json (with the tokenizer_config.json
    beside it, where its end-of-document token is read), GPT-2's two files, a sentencepiece model,
    a tiktoken file; none for the tokenizers that read no file (or no tokenizer)."""
    kind = data.tokenizer_type
    if kind == "GPT2BPETokenizer":
        named = {"vocab_file": data.vocab_file, "merge_file": data.merge_file}
    elif kind in ("HuggingFaceTokenizer", "TikTokenizer", *SENTENCEPIECE_TYPES):
        named = {"tokenizer_model": data.tokenizer_model}
    else:
        return {}
    files = {}
    for field, path in named.items():
        if path is None or not os.path.exists(path):
            raise ConfigError(f"--{field.replace('_', '-')} {path}: no such file or directory")
        path = Path(path)
        config = path.parent / "tokenizer_config.json"   # where a tokenizer.json's end-of-document token is read
        if kind != "HuggingFaceTokenizer":
            files[field] = [path]
        elif path.is_dir():
            files[field] = hf_tokenizer_files(path)
        else:
            files[field] = [path, config] if config.is_file() else [path]
    return files


def hf_tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """The files of HF_TOKENIZER_FILES that `directory` has."""
    return [Path(directory) / name for name in HF_TOKENIZER_FILES if (Path(directory) / name).is_file()]


def copy_tokenizer_files(files: Iterable[Path], destination: str | os.PathLike) -> None:
    """Copy `files` into `destination` under their names, each written under a temporary name and
    then renamed (a reader never sees half a file); a file whose identical copy is there already is
    left alone."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    for source in files:
        target = destination / source.name
        if not (target.is_file() and filecmp.cmp(source, target, shallow=False)):
            with open(source, "rb") as reader:
                atomic_write(target, lambda writer: shutil.copyfileobj(reader, writer))
