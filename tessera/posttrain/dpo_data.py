"""Preference data for DPO: JSONL pairs of answers, tokenized through the chat template, as rows.

A line is `{"prompt": P, "chosen": C, "rejected": R}`, TRL's preference format: P a string
(one user turn) or a list of messages (the conversation so far), C and R a string (one
assistant turn) or a list of messages. Each answer is rendered after the prompt as one
conversation (tessera.posttrain.sft_data.tokenize_conversation, with
--sft-tokenizer-prompt-format), and its loss mask keeps the answer's tokens and its
end-of-turn only: assistant turns inside the prompt are context, never trained.

Each pair becomes two rows of --seq-length, as pretraining samples are
(tessera.data.gpt_dataset: seq_length + 1 token slots, the inputs the first s, the labels
the last s, position ids from 0): sample 2k is the chosen answer of the k-th pair served,
sample 2k + 1 its rejected answer (tessera.posttrain.dpo's layout). The padding after a
sequence is never trained and, the attention being causal, never seen by it.

Truncation: a sequence longer than a row is cut on the right (TRL's truncation_mode
"keep_start"), its answer trained up to the cut (a warning counts them); a prompt so long
that an answer keeps no token is an error naming the file and line, as is a line that is
not a JSON object, lacks "prompt", "chosen" or "rejected", or holds an empty answer.

Splits: --split cuts each --data-path file's pairs into contiguous train/valid ranges (as
pretraining cuts documents); --train-data-path and --valid-data-path give whole files. The
pairs are served in a new permutation each epoch (numpy RandomState(seed)), over as many
epochs as the requested samples need, so sample i depends on the files, the split, the
seed and i alone and the loader resumes it exactly.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.config import ConfigError, DataConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.data.blend import parse_blend
from tessera.data.encode import read_json_object
from tessera.data.indexed import optimal_dtype
from tessera.data.loader import split_ranges
from tessera.data.preprocess import read_blocks
from tessera.posttrain.dpo import REFERENCE_KEY
from tessera.posttrain.sft_data import (
    ChatTokenizer, Conversation, ConversationError, build_chat_tokenizer, check_messages, tokenize_conversation,
)
from tessera.posttrain.sft_packing import pack_row, trained_after_truncation

ANSWERS = ("chosen", "rejected")
SPLITS = ("train", "valid")


def as_messages(value: object, key: str, role: str) -> Conversation:
    """A row's prompt or answer as checked messages: a string is one turn of `role`."""
    if isinstance(value, str):
        value = [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ConversationError(f'"{key}" must be a string or a non-empty list of messages, got {value!r:.40}')
    try:
        check_messages(value)
    except ConversationError as exc:
        raise ConversationError(f'"{key}": {exc}') from None
    return value


class PreferenceEncoder:
    """One JSONL line to the (ids, loss mask) of its chosen and rejected sequences."""

    def __init__(self, tokenizer: ChatTokenizer, prompt_format: str, seq_length: int):
        self.tokenizer, self.prompt_format, self.seq_length = tokenizer, prompt_format, seq_length

    def encode(self, raw: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(ids, mask) of the chosen sequence, (ids, mask) of the rejected one]; ValueError if the line is bad."""
        row = read_json_object(raw)
        for key in ("prompt", *ANSWERS):
            if key not in row:
                raise ConversationError(f'no "{key}": a DPO row is {{"prompt", "chosen", "rejected"}}')
        prompt = as_messages(row["prompt"], "prompt", "user")
        # Assistant turns of the prompt are context: the answer starts after the prompt's tokens,
        # which a conversation's tokens begin with (it tokenizes as its turns one after another).
        context = len(self._tokenize(prompt, "prompt")[0]) \
            if any(message["role"] == "assistant" for message in prompt) else 0
        return [self._answer(prompt, as_messages(row[key], key, "assistant"), context, key) for key in ANSWERS]

    def _answer(self, prompt: Conversation, answer: Conversation, context: int, key: str
                ) -> tuple[np.ndarray, np.ndarray]:
        if not any(message["role"] == "assistant" for message in answer):
            raise ConversationError(f'"{key}" has no assistant turn: nothing to prefer')
        ids, mask = self._tokenize(prompt + answer, key)
        mask[:context] = 0
        if not trained_after_truncation(mask, self.seq_length):
            raise ConversationError(
                f'the prompt leaves no token of the {key} answer within --seq-length {self.seq_length} (its '
                f'answer starts at token {int(np.argmax(mask))}): shorten the prompt or raise --seq-length')
        return ids, mask

    def _tokenize(self, messages: Conversation, key: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            return tokenize_conversation(messages, self.tokenizer, self.prompt_format)
        except ConversationError as exc:
            raise ConversationError(f'"{key}": {exc}') from None


class PreferencePairs:
    """The pairs of one JSONL file, tokenized in memory: row 2p is pair p's chosen sequence, 2p + 1 its rejected one."""

    def __init__(self, path: str, encoder: PreferenceEncoder):
        sequences: list[tuple[np.ndarray, np.ndarray]] = []
        for block in read_blocks([path]):
            for number, raw in enumerate(block.lines, block.first_line):
                if not raw.strip():
                    continue
                try:
                    sequences += encoder.encode(raw)
                except ValueError as exc:   # ConversationError, or read_json_object's reason
                    raise ConversationError(f"{path}:{number}: {exc}") from None
        lengths = np.asarray([len(ids) for ids, _ in sequences], dtype=np.int64)
        self.pointers = np.concatenate([[0], np.cumsum(lengths)])
        dtype = optimal_dtype(encoder.tokenizer.vocab_size)   # in memory on every rank: the smallest that holds ids
        self.ids = np.concatenate([ids for ids, _ in sequences]).astype(dtype) if sequences else np.zeros(0, dtype)
        self.masks = np.concatenate([mask for _, mask in sequences]) if sequences else np.zeros(0, np.uint8)
        self.num_pairs = len(sequences) // 2
        self.cut = int((lengths > encoder.seq_length + 1).sum())

    def get(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.pointers[row], self.pointers[row + 1]
        return self.ids[start:end], self.masks[start:end]


Parts = list[tuple[PreferencePairs, int, int]]   # (file, first pair, end pair)


class PreferenceDataset(Dataset):
    """A split's pairs as samples: sample 2k is the chosen row of the k-th pair served, 2k + 1
    its rejected row. `num_rows` and `row(i)` give each distinct row once (for a precomputed
    reference, tessera.posttrain.dpo); once attached, each sample carries its row's value."""

    def __init__(self, parts: Parts, num_samples: int | None, seed: int,
                 seq_length: int, pad: int):
        self.parts, self.seq_length, self.pad = parts, seq_length, pad
        self.offsets = np.cumsum([0] + [end - first for _, first, end in parts])   # the split's first pair of each
        self.num_pairs = int(self.offsets[-1])
        needed = self.num_pairs if num_samples is None else -(-num_samples // 2)
        rng = np.random.RandomState(seed)
        self.order = np.concatenate([rng.permutation(self.num_pairs)
                                     for _ in range(-(-needed // self.num_pairs))])[:needed]
        self.reference_log_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return 2 * self.num_pairs

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Distinct row `index` (2 x pair + 0 chosen / 1 rejected) as a sample: tokens, labels,
        loss_mask and position_ids [seq_length]."""
        pair, side = divmod(index, 2)
        part = int(np.searchsorted(self.offsets, pair, side="right")) - 1
        source, first, _ = self.parts[part]
        sample = pack_row([source.get(2 * (first + pair - int(self.offsets[part])) + side)], self.seq_length,
                          self.pad)
        del sample["cu_seqlens"]   # one sequence per row: plain causal attention, the padding after it
        return sample

    def attach_reference_log_probs(self, values: torch.Tensor) -> None:
        """The reference's log-prob of each distinct row's answer (precompute_reference_log_probs)."""
        if values.shape != (self.num_rows,):
            raise ValueError(f"{self.num_rows} reference log-probs expected, got shape {tuple(values.shape)}")
        self.reference_log_probs = values

    def __len__(self) -> int:
        return 2 * len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = 2 * int(self.order[index // 2]) + index % 2
        sample = self.row(row)
        if self.reference_log_probs is not None:
            sample[REFERENCE_KEY] = self.reference_log_probs[row]
        return sample


def _check(data: DataConfig, posttrain: PostTrainConfig) -> None:
    if not posttrain.dpo:
        raise ConfigError("build_dpo_datasets needs --dpo")
    if data.mock_data:
        raise ConfigError("--dpo reads preference pairs from --data-path; --mock-data has none")
    for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        if getattr(data, name):
            raise ConfigError(f"--dpo puts one sequence in each row and masks all but the answer: drop "
                              f"--{name.replace('_', '-')}")


def _open(path: str, flag: str, encoder: PreferenceEncoder) -> PreferencePairs:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file (--dpo reads JSONL preference pairs)")
    return PreferencePairs(path, encoder)


def _split_parts(data: DataConfig, encoder: PreferenceEncoder) -> tuple[list[PreferencePairs], dict[str, Parts]]:
    """The files read, and each split's parts of them: --split ranges of each --data-path file, or whole files."""
    if data.data_path is not None:
        paths, weights = parse_blend(data.data_path, "--data-path")
        if weights is not None:
            raise ConfigError("--dpo pools the --data-path files: give paths without blend weights")
        sources = [_open(path, "--data-path", encoder) for path in paths]
        ranges = [split_ranges(data.split_fractions(), source.num_pairs) for source in sources]
        return sources, {split: [(source, *spans[i]) for source, spans in zip(sources, ranges) if spans[i]]
                         for i, split in enumerate(SPLITS)}
    if data.train_data_path is None:
        raise ConfigError("--dpo needs --data-path or --train-data-path (JSONL preference pairs)")
    per_split = {split: [(_open(path, f"--{split}-data-path", encoder), 0) for path in
                         getattr(data, f"{split}_data_path") or []] for split in SPLITS}
    return ([source for parts in per_split.values() for source, _ in parts],
            {split: [(source, 0, source.num_pairs) for source, _ in parts] for split, parts in per_split.items()})


def build_dpo_datasets(data: DataConfig, posttrain: PostTrainConfig, *, seq_length: int, seed: int,
                       train_samples: int, valid_samples: int, vocab_size: int | None = None,
                       tokenizer: ChatTokenizer | None = None
                       ) -> tuple[PreferenceDataset | None, PreferenceDataset | None]:
    """The train and valid datasets of --dpo from --data-path (+ --split) or --train/valid-data-path.

    Samples are rows (two per pair): `train_samples` is --train-iters x --global-batch-size.
    `vocab_size` is --vocab-size (NullTokenizer's size); `tokenizer` the run's ChatTokenizer if
    it was built already (build_chat_tokenizer), else it is built here. A split with no
    requested samples or no pairs is None.
    """
    _check(data, posttrain)
    prompt_format = posttrain.sft_tokenizer_prompt_format
    tokenizer = tokenizer or build_chat_tokenizer(data, prompt_format, vocab_size)
    sources, per_split = _split_parts(data, PreferenceEncoder(tokenizer, prompt_format, seq_length))
    datasets = {}
    for split, count in zip(SPLITS, (train_samples, valid_samples)):
        parts = [part for part in per_split[split] if part[2] > part[1]]
        datasets[split] = PreferenceDataset(parts, count, seed, seq_length, tokenizer.pad) \
            if parts and count > 0 else None
    if datasets["train"] is None and train_samples > 0:
        raise ConfigError(f"--dpo: no training pairs (check --data-path and --split '{data.split}')")
    cut = sum(source.cut for source in sources)
    if cut:
        warnings.warn(f"--seq-length {seq_length}: {cut} of {sum(2 * s.num_pairs for s in sources)} sequences "
                      f"(prompt + answer) are longer than a row ({seq_length + 1} tokens) and were cut on the right")
    return datasets["train"], datasets["valid"]
