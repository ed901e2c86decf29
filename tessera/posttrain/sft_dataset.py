"""SFT datasets: conversations from JSONL or a preprocessed prefix, split, packed, served by index.

`build_sft_datasets` is what the trainer calls with --sft. Each --data-path entry is a
JSONL file (`.jsonl`, `.json`, optionally `.gz`), tokenized when the dataset is built
(every conversation, in this process: for large files run `tessera preprocess --sft`
once), or the PREFIX that preprocessing wrote: PREFIX.bin/.idx holds the tokens (one
sequence per conversation, one document per JSONL row) and PREFIX_loss_mask.bin/.idx the
loss masks, uint8, sequence for sequence. --split cuts each entry's conversations into
contiguous train/valid ranges as pretraining cuts documents; --train-data-path and
--valid-data-path give whole splits instead. Several entries are pooled and packed
together (blend weights are not taken).

A split's conversations are packed into rows once (tessera.posttrain.sft_packing); the
rows are served in a shuffled order, a new permutation per epoch from numpy's
RandomState(seed), over as many epochs as the requested samples need. Sample i is a
function of the files, the split, --seq-length, CP, the seed and i alone, so the loader
(tessera.data.loader) resumes it exactly and its data-parallel ranks share one packing.
With preprocessed data the packing and order are cached like pretraining's indices.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.config import ConfigError, DataConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.data.blend import parse_blend
from tessera.data.index_cache import cached_arrays, default_cache_dir, describe_files
from tessera.data.indexed import IndexedDataset, IndexedDatasetError
from tessera.data.loader import split_ranges
from tessera.data.preprocess import read_blocks
from tessera.posttrain.sft_data import ChatTokenizer, ConversationEncoder, ConversationError, build_chat_tokenizer
from tessera.posttrain.sft_packing import (first_fit_decreasing, pack_row, row_sizes,
                                          trained_after_truncation)

MASK_SUFFIX = "_loss_mask"
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SPLITS = ("train", "valid")


class IndexedConversations:
    """Preprocessed conversations: PREFIX.bin/.idx (tokens) and PREFIX_loss_mask.bin/.idx."""

    def __init__(self, prefix: str, flag: str):
        try:
            self.tokens, self.masks = IndexedDataset(prefix), IndexedDataset(prefix + MASK_SUFFIX)
        except IndexedDatasetError as exc:
            raise ConfigError(f"{flag} {prefix}: {exc} (--sft reads a JSONL file or `tessera preprocess --sft` "
                              "output)") from None
        if not np.array_equal(self.tokens.sequence_lengths, self.masks.sequence_lengths):
            raise ConfigError(f"{flag} {prefix}: {self.masks.idx_path.name} does not describe the sequences of "
                              f"{self.tokens.idx_path.name} (written by different runs?)")
        self.prefix, self.sequence_lengths = prefix, self.tokens.sequence_lengths
        self.description = {"tokens": describe_files(prefix), "masks": describe_files(prefix + MASK_SUFFIX)}

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens.get(index), self.masks.get(index)


class JsonlConversations:
    """Conversations of a JSONL file, tokenized in memory (the encoder of preprocessing)."""

    def __init__(self, path: str, encoder: ConversationEncoder):
        ids, masks, lengths = [], [], []
        for block in read_blocks([path]):
            encoded = encoder(block.lines, block.first_line)
            if encoded.bad_lines:
                number, reason = encoded.bad_lines[0]
                raise ConversationError(f"{path}:{number}: {reason}")
            ids.append(encoded.keys["tokens"].tokens)
            masks.append(encoded.keys["loss_mask"].tokens)
            lengths.append(encoded.keys["tokens"].sequence_lengths)
        self.sequence_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        self.pointers = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        self.ids = np.concatenate(ids) if ids else np.zeros(0, encoder.dtype)
        self.masks = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        self.description = None   # the tokens depend on the tokenizer too: not cached

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.pointers[index], self.pointers[index + 1]
        return self.ids[start:end], self.masks[start:end]


Conversations = IndexedConversations | JsonlConversations


@dataclass
class Part:
    """Conversations [begin, end) of one source that belong to a split."""

    source: Conversations
    begin: int
    end: int


class SFTDataset(Dataset):
    """Packed rows of a split's conversations; `ds[i]` is a sample dict (see pack_row)."""

    def __init__(self, parts: list[Part], num_samples: int | None, seed: int, seq_length: int, pad: int,
                 split: str, cache_dir: str | None):
        self.parts, self.seq_length, self.pad = parts, seq_length, pad
        self.offsets = np.cumsum([0] + [part.end - part.begin for part in parts])
        description = {"class": "SFTDataset", "split": split, "parts": [
            [part.source.description, part.begin, part.end] for part in parts],
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed}
        self.index = cached_arrays(cache_dir, "SFTDataset", description, ("row_starts", "row_items", "order"),
                                   lambda: self._build_index(num_samples, seed, split))

    @property
    def num_rows(self) -> int:
        return len(self.index["row_starts"]) - 1

    def conversation(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of the split's conversation `index` (numbered across its parts)."""
        p = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.parts[p].source.get(self.parts[p].begin + index - int(self.offsets[p]))

    def _build_index(self, num_samples: int | None, seed: int, split: str) -> dict[str, np.ndarray]:
        lengths = np.concatenate([part.source.sequence_lengths[part.begin:part.end] for part in self.parts])
        capacity = self.seq_length + 1
        cut = np.flatnonzero(lengths > capacity)
        dropped = [i for i in cut.tolist() if not trained_after_truncation(self.conversation(i)[1], self.seq_length)]
        kept = np.setdiff1d(np.arange(len(lengths)), dropped)
        if len(cut):
            warnings.warn(f"--seq-length {self.seq_length}: {len(cut)} of {len(lengths)} {split} conversations are "
                          f"longer than a row ({capacity} tokens) and were cut on the right; {len(dropped)} of them "
                          "kept no assistant token and were dropped")
        if not len(kept):
            raise ConfigError(f"--seq-length {self.seq_length}: no {split} conversation has an assistant token "
                              "within a row")
        row_starts, items = first_fit_decreasing(row_sizes(lengths[kept], self.seq_length), capacity)
        rows = len(row_starts) - 1
        num_samples = rows if num_samples is None else num_samples
        rng = np.random.RandomState(seed)
        order = np.concatenate([rng.permutation(rows) for _ in range(-(-num_samples // rows))])[:num_samples]
        return {"row_starts": row_starts, "row_items": kept[items], "order": order}

    def __len__(self) -> int:
        return len(self.index["order"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = int(self.index["order"][index])
        starts, items = self.index["row_starts"], self.index["row_items"]
        conversations = [self.conversation(int(i)) for i in items[starts[row]:starts[row + 1]]]
        return pack_row(conversations, self.seq_length, self.pad)


def _open(path: str, flag: str, encoder: ConversationEncoder) -> Conversations:
    if path.endswith(JSONL_SUFFIXES):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
        return JsonlConversations(path, encoder)
    return IndexedConversations(path, flag)


def check_data_flags(data: DataConfig, feature: str, reads: str, layout: str) -> None:
    """What fine-tuning data refuses: --mock-data, and the pretraining flags its own row `layout`
    replaces (--reset-position-ids, --reset-attention-mask, --eod-mask-loss)."""
    if data.mock_data:
        raise ConfigError(f"{feature} reads {reads} from --data-path; --mock-data has none")
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(data, name):
            raise ConfigError(f"{feature} {layout}: drop --{name.replace('_', '-')}")


def _check(data: DataConfig, posttrain: PostTrainConfig) -> None:
    if not posttrain.sft:
        raise ConfigError("build_sft_datasets needs --sft")
    check_data_flags(data, "--sft", "conversations", "packs each conversation as a document of its own and masks "
                     "by role")


def _split_parts(data: DataConfig, encoder: ConversationEncoder) -> dict[str, list[Part]]:
    """Each split's conversations: --split ranges of every --data-path entry, or whole per-split paths."""
    if data.data_path is not None:
        paths, weights = parse_blend(data.data_path, "--data-path")
        if weights is not None:
            raise ConfigError("--sft pools the --data-path entries and packs them together: give paths without "
                              "blend weights")
        sources = [_open(path, "--data-path", encoder) for path in paths]
        ranges = [split_ranges(data.split_fractions(), len(source.sequence_lengths)) for source in sources]
        return {split: [Part(source, *spans[i]) for source, spans in zip(sources, ranges) if spans[i]]
                for i, split in enumerate(SPLITS)}
    if data.train_data_path is None:
        raise ConfigError("--sft needs --data-path (JSONL conversations or a `tessera preprocess --sft` prefix) "
                          "or --train-data-path")
    parts = {}
    for split in SPLITS:
        flag = f"--{split}-data-path"
        sources = [_open(path, flag, encoder) for path in getattr(data, f"{split}_data_path") or []]
        parts[split] = [Part(source, 0, len(source.sequence_lengths)) for source in sources]
    return parts


def build_sft_datasets(data: DataConfig, posttrain: PostTrainConfig, *, seq_length: int, seed: int,
                       train_samples: int, valid_samples: int, vocab_size: int | None = None,
                       tokenizer: ChatTokenizer | None = None) -> tuple[SFTDataset | None, SFTDataset | None]:
    """The train and valid datasets of --sft from --data-path (+ --split) or --train/valid-data-path.

    `vocab_size` is --vocab-size (NullTokenizer's size); `tokenizer`, the run's ChatTokenizer if it
    was built already (build_chat_tokenizer), else it is built here. A split with no requested
    samples or no conversations is None; requested training samples need training conversations.
    """
    _check(data, posttrain)
    prompt_format = posttrain.sft_tokenizer_prompt_format
    encoder = ConversationEncoder(tokenizer or build_chat_tokenizer(data, prompt_format, vocab_size), prompt_format)
    per_split = _split_parts(data, encoder)
    sources = [part.source for parts in per_split.values() for part in parts]
    cached = bool(sources) and all(isinstance(source, IndexedConversations) for source in sources)
    cache_dir = (data.data_cache_path or default_cache_dir(sources[0].prefix)) if cached else None
    datasets = {}
    for split, count in zip(SPLITS, (train_samples, valid_samples)):
        parts = [part for part in per_split[split] if part.end > part.begin]
        datasets[split] = SFTDataset(parts, count, seed, seq_length, encoder.tokenizer.pad, split,
                                     cache_dir) if parts and count > 0 else None
    if datasets["train"] is None and train_samples > 0:
        raise ConfigError(f"--sft: no training conversations (check --data-path and --split '{data.split}')")
    return datasets["train"], datasets["valid"]
