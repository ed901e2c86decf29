"""GRPO's prompts: JSONL rows `{"prompt": ..., "answer": ...}`, tokenized for generation.

`prompt` is a string (one user turn) or a list of messages (the conversation so far), as in
DPO's rows (tessera.posttrain.dpo_data); `answer` is what the rewards check it against (any
JSON value; optional for a reward that needs none). With --sft-tokenizer-prompt-format
default the prompt is rendered by the chat template with the assistant's turn opened
(`add_generation_prompt=True`), so the model writes the answer and the template's
end-of-turn; with `identity`, the turns' texts one after another (tessera.posttrain.sft_data).

--split keeps each --data-path file's first (train) fraction of rows, as pretraining cuts
documents; --train-data-path gives whole files. Every prompt must leave room for an answer
within --seq-length; a line that does not, or is not a JSON object with a "prompt", stops the
run with one line naming the file and line. Prompts are served in a new permutation each
epoch, from --seed: prompt k of the run depends on the files, the split, the seed and k alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from tessera.config import ConfigError, DataConfig
from tessera.data.blend import parse_blend
from tessera.data.encode import read_json_object
from tessera.data.loader import split_ranges
from tessera.data.preprocess import read_blocks
from tessera.posttrain.dpo_data import as_messages
from tessera.posttrain.sft_data import ChatTokenizer, ConversationError, tokenize_conversation


@dataclass(frozen=True)
class Prompt:
    prompt: object           # the row's "prompt": a string or a list of messages
    answer: object           # the row's "answer", None if it has none
    token_ids: list[int]     # what the model continues
    where: str               # file:line


def prompt_ids(prompt: object, tokenizer: ChatTokenizer, prompt_format: str) -> list[int]:
    """The ids a model continues to answer `prompt`; ConversationError if it cannot be rendered."""
    messages = as_messages(prompt, "prompt", "user")
    if prompt_format == "identity":
        return tokenize_conversation(messages, tokenizer, prompt_format)[0].tolist()
    try:
        return tokenizer.render(messages, generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 -- a template's raise_exception, a tokenizer rejecting a text
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConversationError(f"the tokenizer or its chat template rejects it ({reason})") from None


def read_prompts(path: str, tokenizer: ChatTokenizer, prompt_format: str, seq_length: int) -> list[Prompt]:
    """Every prompt of one JSONL file; ConfigError naming the file and line of a bad one."""
    prompts = []
    for block in read_blocks([path]):
        for number, raw in enumerate(block.lines, block.first_line):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = read_json_object(raw)
                if "prompt" not in row:
                    raise ConversationError('no "prompt": a GRPO row is {"prompt", "answer"}')
                ids = prompt_ids(row["prompt"], tokenizer, prompt_format)
            except ValueError as exc:   # ConversationError, or read_json_object's reason
                raise ConfigError(f"{where}: {exc}") from None
            if len(ids) >= seq_length:
                raise ConfigError(f"{where}: the prompt is {len(ids)} tokens and leaves no room for an answer in "
                                  f"--seq-length {seq_length}: shorten it or raise --seq-length")
            prompts.append(Prompt(row["prompt"], row.get("answer"), ids, where))
    return prompts


class PromptSet:
    """The training prompts, served in a new permutation of them each epoch."""

    def __init__(self, prompts: list[Prompt], seed: int):
        if not prompts:
            raise ConfigError("--grpo: no training prompts (check --data-path and --split)")
        self.prompts, self.seed = prompts, seed
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        """The run's index-th prompt (over epochs)."""
        epoch, position = divmod(index, len(self.prompts))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.RandomState([self.seed, epoch]).permutation(len(self.prompts))
        return self.prompts[int(self._order[position])]


def build_prompt_set(data: DataConfig, tokenizer: ChatTokenizer, prompt_format: str, *, seq_length: int,
                     seed: int) -> PromptSet:
    """The prompts of --data-path (their --split train fraction) or --train-data-path."""
    if data.data_path is not None:
        paths, weights = parse_blend(data.data_path, "--data-path")
        if weights is not None:
            raise ConfigError("--grpo pools the --data-path files: give paths without blend weights")
        flag = "--data-path"
    elif data.train_data_path is not None:
        paths, flag = data.train_data_path, "--train-data-path"
    else:
        raise ConfigError("--grpo needs --data-path or --train-data-path (JSONL prompts)")
    prompts = []
    for path in paths:
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file (--grpo reads JSONL prompts)")
        rows = read_prompts(path, tokenizer, prompt_format, seq_length)
        train = split_ranges(data.split_fractions(), len(rows))[0] if flag == "--data-path" else (0, len(rows))
        prompts += rows[train[0]:train[1]] if train else []
    return PromptSet(prompts, seed)
