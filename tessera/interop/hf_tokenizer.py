"""A tessera checkpoint's tokenizer as Hugging Face `transformers` loads it (`tessera convert
tessera-to-hf`), with the generation_config.json that names its special ids.

`AutoTokenizer.from_pretrained(dir)` loads a tokenizer.json (the `tokenizers` library's file) with
a tokenizer_config.json naming the class and the special tokens. Each tokenizer type becomes
one that encodes text to the same ids as tessera's tokenizer of the checkpoint:

- a Hugging Face tokenizer: its files, copied (a tokenizer.json alone, as `tessera
  train-tokenizer` writes it, gets a tokenizer_config.json with its end-of-document token as EOS);
- GPT2BPETokenizer: the byte-level BPE that vocab.json and merges.txt describe;
- the sentencepiece types: the model converted by transformers' SpmConverter, which follows the
  model's own normalizer, dummy prefix and byte fallback as SentencePieceProcessor.encode does;
- TikTokenizer: the BPE ranks turned into merges by transformers' TikTokenConverter, after the
  special tokens at ids 0..N-1, where Megatron-LM's TikTokenizer puts them;
- ByteTokenizer: the 256 bytes at their own ids, then <|endoftext|> (256, the EOD);
- NullTokenizer (text that is already ids) has no equivalent: nothing is written.

One difference stays: transformers matches special tokens written in the text ("</s>"), which
tessera's sentencepiece and tiktoken tokenizers encode as ordinary text, as Megatron-LM's do.
"""

from __future__ import annotations

import json
from pathlib import Path

from tessera.config import ConfigError, DataConfig
from tessera.data.tokenizers import (
    SENTENCEPIECE_TYPES, HuggingFaceTokenizer, build_tokenizer, copy_tokenizer_files, hf_tokenizer_files,
    read_tokenizer_config, read_tokenizer_json, special_token, tokenizer_files,
)

GENERATION_CONFIG = "generation_config.json"
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# AutoTokenizer's class for a plain tokenizer.json, in transformers 4 and 5 alike.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def write_hf_tokenizer(checkpoint_dir: Path, run_config: dict, hf_dir: Path) -> tuple[str, dict[str, int]]:
    """Write the tokenizer of the checkpoint in `checkpoint_dir` into `hf_dir`, and a
    generation_config.json if it has none; (what was written, in words; its special ids, as
    bos_token_id / eos_token_id / pad_token_id)."""
    from tessera.inference.text import saved_tokenizer_config

    # What `tessera convert hf-to-tessera` copied from the HF directory comes first, as for generation.
    imported = hf_tokenizer_files(checkpoint_dir)
    copy_tokenizer_files(imported, hf_dir)
    data = saved_tokenizer_config(run_config)
    if any(path.name != GENERATION_CONFIG for path in imported):
        written = "the imported model's tokenizer"
    elif data is None:
        return "no tokenizer (the checkpoint was trained without one)", {}
    elif data.tokenizer_type == "NullTokenizer":
        return "no tokenizer (NullTokenizer reads ids, and has no Hugging Face equivalent)", {}
    elif data.tokenizer_type == "HuggingFaceTokenizer":
        _copy_hf_tokenizer(data, hf_dir)
        written = f"its tokenizer ({data.tokenizer_type})"
    else:
        backend, specials = _converted(data, run_config["model"].get("vocab_size"))
        backend.save(str(hf_dir / "tokenizer.json"))
        _write_json(hf_dir / "tokenizer_config.json", _tokenizer_config(specials))
        written = f"its tokenizer ({data.tokenizer_type}, as a tokenizer.json)"
    generation = hf_dir / GENERATION_CONFIG
    if generation.is_file():   # the imported model's
        ids = {name: value for name, value in json.loads(generation.read_text()).items() if name in _IDS}
    else:
        ids = _special_token_ids(hf_dir)
        if ids:
            _write_json(generation, ids)
    return written, ids


def _special_token_ids(hf_dir: Path) -> dict[str, int]:
    """bos/eos/pad_token_id of the tokenizer in `hf_dir` (PAD: EOS where it has none, as generate() pads)."""
    if not (hf_dir / "tokenizer.json").is_file():
        return {}
    backend = read_tokenizer_json(hf_dir / "tokenizer.json", "--output")
    config = read_tokenizer_config(hf_dir, "--output")
    ids = {}
    for name in _IDS:
        token = special_token(config, name.removesuffix("_id"))
        token_id = backend.token_to_id(token) if token else None
        if token_id is not None:
            ids[name] = token_id
    if "eos_token_id" in ids:
        ids.setdefault("pad_token_id", ids["eos_token_id"])
    return ids


def _copy_hf_tokenizer(data: DataConfig, hf_dir: Path) -> None:
    """A Hugging Face tokenizer's files; its tokenizer.json under that name; a tokenizer_config.json
    naming the end-of-document token as EOS where there is none."""
    tokenizer = HuggingFaceTokenizer(data.tokenizer_model)   # a bad file is named here, as training named it
    [files] = tokenizer_files(data).values()
    tokenizer_json = Path(data.tokenizer_model)
    if tokenizer_json.is_file():   # a tokenizer.json by another name (and the tokenizer_config.json beside it)
        copy_tokenizer_files(files[1:], hf_dir)
        (hf_dir / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    else:
        copy_tokenizer_files(files, hf_dir)
    if not (hf_dir / "tokenizer_config.json").is_file():
        eos = tokenizer.backend.id_to_token(tokenizer.eod)
        _write_json(hf_dir / "tokenizer_config.json", _tokenizer_config({"eos_token": eos}))


def _converted(data: DataConfig, vocab_size: int | None):
    """(tokenizers.Tokenizer, {special token kind: token}) encoding as tessera's tokenizer of `data`
    does, for a model of `vocab_size` (TikTokenizer's cap, as in training)."""
    from tokenizers import AddedToken

    tokenizer = build_tokenizer(data, vocab_size)
    if data.tokenizer_type == "GPT2BPETokenizer":
        backend = tokenizer.backend
        specials = {"bos_token": backend.id_to_token(tokenizer.eod), "eos_token": backend.id_to_token(tokenizer.eod)}
    elif data.tokenizer_type in SENTENCEPIECE_TYPES:
        backend, specials = _sentencepiece(tokenizer.model_file)
    elif data.tokenizer_type == "TikTokenizer":
        backend = _tiktoken(tokenizer)
        specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    else:   # ByteTokenizer
        backend, specials = _bytes(), {"eos_token": "<|endoftext|>"}
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials.values()])
    return backend, specials


def _sentencepiece(model_file: str):
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise ConfigError("converting a sentencepiece tokenizer needs a newer transformers "
                          "(SpmConverter.build_tokenizer_from_spm_proto: pip install -U transformers)")
    proto = SentencePieceExtractor(model_file).proto
    kind = proto.trainer_spec.model_type   # sentencepiece_model.proto: 1 unigram, 2 BPE, 3 word, 4 char
    if kind == 1:
        vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    elif kind == 2:
        vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    else:
        raise ConfigError(f"--tokenizer-model {model_file}: a sentencepiece {'word' if kind == 3 else 'char'} model "
                          "has no Hugging Face tokenizer.json equivalent (unigram and BPE models have)")
    spec = proto.trainer_spec
    specials = {f"{name}_token": getattr(spec, f"{name}_piece") for name in ("bos", "eos", "unk", "pad")
                if getattr(spec, f"{name}_id") >= 0}
    return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab), specials


def _tiktoken(tokenizer):
    """Megatron's TikTokenizer layout: the special tokens, then each BPE rank shifted past them."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class MegatronTikToken(TikTokenConverter):
        def load_tiktoken_bpe(self, _url):   # the ranks tessera read (Megatron's JSON or a .tiktoken file)
            return tokenizer.ranks

        def tokenizer(self):
            ranks, merges = self.extract_vocab_merges_from_model(None)
            shift = tokenizer.num_special_tokens
            vocab = {**{token: i for i, token in enumerate(tokenizer.special_tokens)},
                     **{token: rank + shift for token, rank in ranks.items()}}
            # ignore_merges: a pre-token that is a whole vocabulary entry is that token, as in tiktoken
            return Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))

    return MegatronTikToken(pattern=tokenizer.pattern, extra_special_tokens=tokenizer.special_tokens).converted()


def _bytes():
    """UTF-8 bytes as ids 0..255: byte-level pre-tokenization without GPT-2's word split, no merges."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = Tokenizer(BPE({char: byte for byte, char in bytes_to_unicode().items()}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _tokenizer_config(specials: dict[str, str]) -> dict:
    # Decoding gives back the text as tessera's tokenizer does: no spaces removed before punctuation.
    return {"tokenizer_class": TOKENIZER_CLASS, **specials, "clean_up_tokenization_spaces": False}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
