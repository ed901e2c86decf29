"""Train a byte-level BPE tokenizer on JSONL text with Hugging Face `tokenizers`, offline.

The result is a tokenizer.json that `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model PATH` loads, with <|endoftext|> as its end-of-document token (id 0).
Byte-level, like GPT-2: any text encodes, with no unknown token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from tessera.data.encode import parse_line
from tessera.data.preprocess import PreprocessError, expand_inputs, read_blocks

EOD_TOKEN = "<|endoftext|>"


@dataclass
class TrainingText:
    """The texts a tokenizer is trained on, read lazily; counts what it read and skipped."""

    inputs: list[str]
    json_key: str = "text"
    max_bytes: int | None = None
    skip_bad_lines: bool = False
    documents: int = 0
    bytes: int = 0
    skipped_lines: int = 0

    def __iter__(self) -> Iterator[str]:
        for block in read_blocks(expand_inputs(self.inputs)):
            for number, raw in enumerate(block.lines, block.first_line):
                if not raw.strip():
                    continue
                if self.max_bytes is not None and self.bytes >= self.max_bytes:
                    return
                try:
                    text = parse_line(raw, [self.json_key])[self.json_key]
                except ValueError as exc:
                    if not self.skip_bad_lines:
                        raise PreprocessError(f"{block.path}:{number}: {exc} (--skip-bad-lines skips such lines)")
                    self.skipped_lines += 1
                    continue
                self.documents += 1
                self.bytes += len(raw)
                yield text


def train_bpe_tokenizer(text: TrainingText, output: str, vocab_size: int, min_frequency: int = 2) -> "object":
    """Train on `text` and write `output` (a tokenizer.json) atomically; returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 257:
        raise ValueError(f"--vocab-size must exceed the 256 byte tokens plus {EOD_TOKEN}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    temporary = f"{output}.tmp{os.getpid()}"
    tokenizer.save(temporary)
    os.replace(temporary, output)
    return tokenizer
