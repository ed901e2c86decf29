"""`tessera preprocess --sft`: JSONL conversations to token and loss-mask `.bin/.idx` pairs.

The streaming pass of pretraining's preprocessing (tessera.data.preprocess: blocks of
lines, worker processes, outputs renamed into place only at the end, bad lines named by
file and line or skipped with --skip-bad-lines), with the encoder that training uses on
a JSONL file (tessera.posttrain.sft_data.ConversationEncoder), so reading the outputs
gives the same samples as reading the JSONL. Two pairs are written:

- OUTPUT_conversations.bin/.idx: the token ids in Megatron-Core's IndexedDataset
  format, one sequence per conversation and one document per JSONL row;
- OUTPUT_conversations_loss_mask.bin/.idx: the loss masks, one uint8 (0/1) per token,
  with the same sequences and documents.

Training reads them with --sft --data-path OUTPUT_conversations.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from tessera.config import DataConfig
from tessera.data.preprocess import BLOCK_BYTES, Summary, encode_files
from tessera.posttrain.sft_data import ConversationEncoder, build_chat_tokenizer, conversation_encoder
from tessera.posttrain.sft_dataset import MASK_SUFFIX


def sft_prefix(output_prefix: str) -> str:
    """The --data-path of what `preprocess_sft` writes for --output-prefix."""
    return f"{output_prefix}_conversations"


def preprocess_sft(inputs: list[str], output_prefix: str, data: DataConfig, prompt_format: str, *,
                   workers: int = 1, skip_bad_lines: bool = False, log_interval: int = 1000,
                   vocab_size: int | None = None, block_bytes: int = BLOCK_BYTES) -> Summary:
    """Tokenize JSONL conversations with their loss masks; returns the run's summary."""
    # A bad tokenizer or template fails here, once, not in every worker.
    encoder = ConversationEncoder(build_chat_tokenizer(data, prompt_format, vocab_size), prompt_format)
    prefix = sft_prefix(output_prefix)
    outputs = {"tokens": (prefix, encoder.dtype), "loss_mask": (prefix + MASK_SUFFIX, np.dtype(np.uint8))}
    return encode_files(inputs, outputs, partial(conversation_encoder, data, prompt_format, vocab_size),
                        workers=workers, skip_bad_lines=skip_bad_lines, log_interval=log_interval,
                        block_bytes=block_bytes)


def summary_lines(summary: Summary) -> list[str]:
    """What a run of preprocess_sft did, for the terminal."""
    tokens, masks = summary.keys["tokens"], summary.keys["loss_mask"]
    # The masks are uint8, one byte per token: their .bin is the masks themselves.
    trained = int(np.count_nonzero(np.memmap(masks.output_prefix + ".bin", np.uint8, "r"))) if masks.tokens else 0
    return [f"rows: {summary.documents:,}   skipped bad lines: {summary.skipped_lines:,}   "
            f"time: {summary.seconds:,.1f} s",
            f"conversations: {tokens.sequences:,}   tokens: {tokens.tokens:,}   trained (loss mask 1): {trained:,}",
            f"--data-path {tokens.output_prefix}  ({tokens.output_prefix}.bin/.idx and "
            f"{masks.output_prefix}.bin/.idx)"]
