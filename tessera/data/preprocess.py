"""JSONL to Megatron `.bin/.idx`: the job of Megatron-LM's tools/preprocess_data.py.

One streaming pass. The main process reads the input in blocks of whole lines (about
1 MiB each, `.gz` decompressed on the fly) and hands them to a pool of worker processes
that parse and tokenize (an encoder: `TextEncoder` for documents, tessera.data.encode;
conversations and their loss masks for `--sft`, tessera.posttrain.sft_preprocess); it
then writes the results in input order. At most two blocks per worker are in flight, so
memory stays flat however large the input, and the writer keeps its index on disk
(`IndexedDatasetWriter`). The outputs appear under their final names only when the whole
input went through.

Megatron's --partitions (separate per-partition outputs, merged at the end) is not
needed: the reader only moves bytes, never parses or tokenizes, so one reader keeps many
workers busy, and partial files plus a merge would only add I/O.
"""

from __future__ import annotations

import glob
import gzip
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import numpy as np

from tessera.config import DataConfig
from tessera.data.encode import EncodedBlock, EncodeOptions, encode_block
from tessera.data.indexed import IndexedDatasetWriter, optimal_dtype
from tessera.data.tokenizers import Tokenizer, build_tokenizer

BLOCK_BYTES = 1 << 20
BLOCKS_IN_FLIGHT_PER_WORKER = 2


class PreprocessError(ValueError):
    """Bad input that stops the run; the message names the file (and line)."""


@dataclass
class Block:
    path: str
    first_line: int
    lines: list[bytes]
    raw_bytes: int  # bytes of the file on disk this block accounts for (compressed for .gz)


@dataclass
class KeyStats:
    output_prefix: str
    sequences: int = 0
    tokens: int = 0
    empty_documents: int = 0


@dataclass
class Summary:
    documents: int = 0
    skipped_lines: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    keys: dict[str, KeyStats] = field(default_factory=dict)

    def lines(self) -> list[str]:
        rate = max(self.seconds, 1e-9)
        out = [f"documents: {self.documents:,}   skipped bad lines: {self.skipped_lines:,}",
               f"input: {self.input_bytes / 1e6:,.1f} MB   output: {self.output_bytes / 1e6:,.1f} MB   "
               f"time: {self.seconds:,.1f} s   {self.documents / rate:,.0f} docs/s   "
               f"{self.input_bytes / 1e6 / rate:,.1f} MB/s"]
        for key, stats in self.keys.items():
            out.append(f"{key}: {stats.tokens:,} tokens in {stats.sequences:,} sequences, "
                       f"{stats.empty_documents:,} empty documents -> {stats.output_prefix}.bin/.idx")
        return out


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by --input: paths or globs, each glob sorted; a name that matches nothing fails."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise PreprocessError(f"--input {pattern}: no such file")
        files.extend(matches)
    return files


def read_blocks(paths: list[str], block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """Whole lines of each file in blocks of about block_bytes, with their line numbers."""
    for path in paths:
        with open(path, "rb") as raw:
            stream = gzip.open(raw) if path.endswith(".gz") else raw
            line_number, position = 1, 0
            while True:
                data = stream.read(block_bytes)
                if not data:
                    break
                if not data.endswith(b"\n"):
                    data += stream.readline()
                lines = data.split(b"\n")
                if lines[-1] == b"":
                    lines.pop()
                consumed = raw.tell() - position
                position += consumed
                yield Block(path, line_number, lines, consumed)
                line_number += len(lines)


# An encoder turns one block of lines (and the 1-based number of its first line) into arrays
# per output key; each worker builds its own (tokenizers are not sent between processes).
Encoder = Callable[[list[bytes], int], EncodedBlock]


class TextEncoder:
    """Pretraining's encoder: the --json-keys texts of each line, tokenized (tessera.data.encode)."""

    def __init__(self, data: DataConfig, vocab_size: int | None, options: EncodeOptions, dtype: np.dtype):
        self.tokenizer: Tokenizer = build_tokenizer(data, vocab_size)
        self.options, self.dtype = options, dtype

    def __call__(self, lines: list[bytes], first_line: int) -> EncodedBlock:
        return encode_block(lines, first_line, self.tokenizer, self.options, self.dtype)


# Worker-process state, set once by the pool's initializer.
_worker: dict = {}


def _init_worker(make_encoder: Callable[[], Encoder]) -> None:
    # A forked worker inherits the parent's signal handlers; one that only notes SIGTERM (a Trainer's
    # --exit-signal-handler, a user's script) would keep it alive when the job is stopped.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Each worker is one core's worth of tokenizing: no thread pools inside the tokenizers.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker["encode"] = make_encoder()


def _encode(block: Block) -> tuple[Block, EncodedBlock]:
    encoded = _worker["encode"](block.lines, block.first_line)
    block.lines = []  # no need to send the text back
    return block, encoded


class _Progress:
    """A tqdm bar of input bytes with docs/s on a terminal; plain log lines otherwise."""

    def __init__(self, total_bytes: int, log_interval: int):
        from tqdm import tqdm

        self.log_interval, self.next_log, self.start = log_interval, log_interval, time.perf_counter()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000,
                        desc="preprocess", disable=not sys.stderr.isatty(), smoothing=0.1)

    def update(self, raw_bytes: int, summary: Summary) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(raw_bytes)
        self.bar.set_postfix_str(f"{summary.documents / elapsed:,.0f} docs/s", refresh=False)
        if self.bar.disable and summary.documents >= self.next_log:
            print(f"processed {summary.documents:,} documents ({summary.documents / elapsed:,.0f} docs/s, "
                  f"{summary.input_bytes / 1e6 / elapsed:,.1f} MB/s)", file=sys.stderr, flush=True)
            self.next_log = (summary.documents // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


def output_prefix(prefix: str, key: str, split_sentences: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def preprocess(inputs: list[str], output: str, data: DataConfig, *, json_keys: list[str] = ("text",),
               append_eod: bool = False, split_sentences: bool = False, keep_newlines: bool = False,
               workers: int = 1, skip_bad_lines: bool = False, log_interval: int = 1000,
               vocab_size: int | None = None, block_bytes: int = BLOCK_BYTES) -> Summary:
    """Tokenize JSONL files into one `.bin/.idx` pair per key; returns the run's summary."""
    dtype = optimal_dtype(build_tokenizer(data, vocab_size).vocab_size)  # a bad tokenizer fails here, not in a worker
    options = EncodeOptions(list(json_keys), append_eod, split_sentences, keep_newlines)
    outputs = {key: (output_prefix(output, key, split_sentences), dtype) for key in json_keys}
    return encode_files(inputs, outputs, partial(TextEncoder, data, vocab_size, options, dtype), workers=workers,
                        skip_bad_lines=skip_bad_lines, log_interval=log_interval, block_bytes=block_bytes)


def encode_files(inputs: list[str], outputs: dict[str, tuple[str, np.dtype]], make_encoder: Callable[[], Encoder], *,
                 workers: int = 1, skip_bad_lines: bool = False, log_interval: int = 1000,
                 block_bytes: int = BLOCK_BYTES) -> Summary:
    """Encode JSONL files with `make_encoder()`'s encoders in `workers` processes, writing each output
    key to its (prefix, token dtype) `.bin/.idx` pair; returns the run's summary."""
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    paths = expand_inputs(list(inputs))
    summary = Summary(keys={key: KeyStats(prefix) for key, (prefix, _) in outputs.items()})
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, (prefix, dtype) in outputs.items()}
    progress = _Progress(sum(os.path.getsize(p) for p in paths), log_interval)
    start = time.perf_counter()
    try:
        # Leaving the executor, also on an error, waits for the blocks in flight (a few) and lets
        # the workers exit. multiprocessing.Pool's terminate() could hang there instead: its
        # workers blocked writing large results that nothing read any more.
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(make_encoder,)) as pool:
            pending: deque = deque()
            for block in read_blocks(paths, block_bytes):
                pending.append(pool.submit(_encode, block))
                if len(pending) >= BLOCKS_IN_FLIGHT_PER_WORKER * workers:
                    _write(*pending.popleft().result(), writers, summary, skip_bad_lines, progress)
            while pending:
                _write(*pending.popleft().result(), writers, summary, skip_bad_lines, progress)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        progress.close()
    for writer in writers.values():
        writer.finalize()
        summary.output_bytes += writer.bin_path.stat().st_size + writer.idx_path.stat().st_size
    summary.seconds = time.perf_counter() - start
    return summary


def _write(block: Block, encoded: EncodedBlock, writers: dict[str, IndexedDatasetWriter], summary: Summary,
           skip_bad_lines: bool, progress: _Progress) -> None:
    if encoded.bad_lines and not skip_bad_lines:
        number, reason = encoded.bad_lines[0]
        raise PreprocessError(f"{block.path}:{number}: {reason} (--skip-bad-lines skips such lines)")
    for key, part in encoded.keys.items():
        writers[key].add_documents(part.tokens, part.sequence_lengths, part.sequences_per_document)
        stats = summary.keys[key]
        stats.sequences += len(part.sequence_lengths)
        stats.tokens += len(part.tokens)
        stats.empty_documents += int((part.sequences_per_document == 0).sum())
    summary.documents += encoded.documents
    summary.skipped_lines += len(encoded.bad_lines)
    summary.input_bytes += block.raw_bytes
    progress.update(block.raw_bytes, summary)
