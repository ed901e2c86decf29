"""Megatron-Core's IndexedDataset format: a `.bin` of token arrays and its `.idx` index.

The layout (see docs/data.md) is read and written byte for byte as Megatron-Core does,
so datasets move between the two projects unchanged. The reader memory-maps both
files and checks, on open, every size the header implies, so that a truncated,
corrupt or mismatched pair fails at once with the file named, not later in training.

The writer streams: token bytes go straight to the `.bin`, and the per-sequence
lengths and document boundaries go to side files, so memory stays flat however many
documents are written. Everything is written under temporary names and renamed only
by `finalize`, so an interrupted run never leaves a half-written pair behind.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
assert HEADER.size == 34

# Megatron-Core's DType enum: code -> numpy dtype of the `.bin` tokens.
DTYPES = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}

_COPY_CHUNK = 1 << 22  # elements per chunk when streaming side files into the .idx


class IndexedDatasetError(ValueError):
    """A `.bin/.idx` pair that cannot be read; the message names the file and the problem."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks for a vocabulary (uint16 below 65,500)."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def exists(prefix: str | os.PathLike) -> bool:
    return all(path.is_file() for path in _paths(prefix))


class IndexedDataset:
    """A memory-mapped `.bin/.idx` pair: `ds[i]` is sequence i as a zero-copy numpy view."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexedDatasetError(f"{path}: no such file")
        self._read_index()
        self._check_bin()
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if self._bin_size else np.zeros(0, np.uint8)

    def _read_index(self) -> None:
        path, size = self.idx_path, self.idx_path.stat().st_size
        if size < HEADER.size:
            raise IndexedDatasetError(f"{path}: {size} bytes is shorter than the {HEADER.size}-byte header (truncated?)")
        with open(path, "rb") as f:
            magic, version, code, num_sequences, num_doc_entries = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise IndexedDatasetError(f"{path}: bad magic {magic!r}, expected {MAGIC!r} (not a Megatron .idx file)")
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPES)}")
        self.dtype = DTYPES[code]
        # A trailing int8 array of sequence modes (multimodal datasets) is allowed and ignored.
        expected = HEADER.size + 12 * num_sequences + 8 * num_doc_entries
        if size not in (expected, expected + num_sequences):
            raise IndexedDatasetError(
                f"{path}: {size} bytes, but a header of {num_sequences} sequences and "
                f"{num_doc_entries} document indices needs {expected} (truncated or corrupt)")
        index = np.memmap(path, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sequence_lengths = index[offset:offset + 4 * num_sequences].view(np.int32)
        offset += 4 * num_sequences
        self.sequence_pointers = index[offset:offset + 8 * num_sequences].view(np.int64)
        offset += 8 * num_sequences
        self.document_indices = index[offset:offset + 8 * num_doc_entries].view(np.int64)
        if num_doc_entries == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != num_sequences:
            raise IndexedDatasetError(
                f"{path}: document indices must run from 0 to the sequence count {num_sequences} (corrupt)")

    def _check_bin(self) -> None:
        self._bin_size = self.bin_path.stat().st_size
        if len(self.sequence_lengths) == 0:
            needed = 0
        else:
            needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if self._bin_size != needed:
            raise IndexedDatasetError(
                f"{self.bin_path}: {self._bin_size} bytes, but {self.idx_path.name} describes {needed} "
                "(truncated, or a .bin and .idx from different datasets)")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `index` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if not (0 <= offset and 0 <= length and offset + length <= size):
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) outside sequence {index} of {size}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return self._bin[start:start + length * self.dtype.itemsize].view(self.dtype)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetWriter:
    """Writes a `.bin/.idx` pair; nothing appears under the final names before `finalize`.

    `add_document(tokens, lengths)` writes one document made of sequences of the given
    lengths (one sequence by default); `add_dataset(prefix)` appends a whole dataset.
    Use as a context manager: leaving the block by an exception removes the partial files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"token dtype {self.dtype} has no Megatron dtype code")
        self.bin_path, self.idx_path = _paths(prefix)
        tag = f".tmp{os.getpid()}"
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + tag)
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + tag)
        self._tmp_lengths = self.idx_path.with_name(self.idx_path.name + tag + ".lengths")
        self._tmp_docs = self.idx_path.with_name(self.idx_path.name + tag + ".docs")
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = open(self._tmp_lengths, "wb")
        self._docs = open(self._tmp_docs, "wb")
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray, lengths: np.ndarray | list[int] | None = None) -> None:
        tokens = np.asarray(tokens)
        lengths = np.asarray([len(tokens)] if lengths is None else lengths, dtype=np.int32)
        self.add_documents(tokens, lengths, np.array([len(lengths)]))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append many documents at once: the batched path of the preprocessing workers.

        A document may have zero sequences (an empty document); like Megatron's writer it
        still closes a document, so the document indices repeat a value.
        """
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int32)
        if int(sequence_lengths.sum(dtype=np.int64)) != len(tokens):
            raise ValueError(f"sequence lengths add up to {sequence_lengths.sum()}, but {len(tokens)} tokens were given")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.write(sequence_lengths.tobytes())
        ends = self.num_sequences + np.cumsum(sequences_per_document, dtype=np.int64)
        self._docs.write(ends.tobytes())
        self.num_sequences += len(sequence_lengths)
        self.num_documents += len(sequences_per_document)
        self.num_tokens += len(tokens)

    def add_dataset(self, prefix: str | os.PathLike) -> None:
        """Append every document of another dataset of the same dtype (Megatron's add_index)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{other.idx_path}: dtype {other.dtype} differs from the output's {self.dtype}")
        self._lengths.write(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._docs.write((np.asarray(other.document_indices[1:]) + self.num_sequences).tobytes())
        with open(other.bin_path, "rb") as source:
            shutil.copyfileobj(source, self._bin, 1 << 24)
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the `.idx` from the side files, then move both files to their final names."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        with open(self._tmp_idx, "wb") as idx:
            idx.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], self.num_sequences, self.num_documents + 1))
            self._stream_lengths_and_pointers(idx)
            idx.write(np.zeros(1, np.int64).tobytes())
            with open(self._tmp_docs, "rb") as docs:
                shutil.copyfileobj(docs, idx, 1 << 24)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
        self._remove(self._tmp_lengths, self._tmp_docs)

    def _stream_lengths_and_pointers(self, idx) -> None:
        """Lengths, then byte pointers (a running sum), in chunks so memory stays bounded."""
        lengths = np.memmap(self._tmp_lengths, np.int32, "r") if self.num_sequences else np.zeros(0, np.int32)
        for start in range(0, len(lengths), _COPY_CHUNK):
            idx.write(np.asarray(lengths[start:start + _COPY_CHUNK]).tobytes())
        offset = 0
        for start in range(0, len(lengths), _COPY_CHUNK):
            sizes = np.asarray(lengths[start:start + _COPY_CHUNK], dtype=np.int64) * self.dtype.itemsize
            ends = offset + np.cumsum(sizes)
            idx.write((ends - sizes).tobytes())
            offset = int(ends[-1])
        del lengths

    def abort(self) -> None:
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        self._remove(self._tmp_bin, self._tmp_idx, self._tmp_lengths, self._tmp_docs)

    @staticmethod
    def _remove(*paths: Path) -> None:
        for path in paths:
            path.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets (all of one dtype) into a new pair, in the order given."""
    if not prefixes:
        raise ValueError("no datasets to merge")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_dataset(prefix)
    return IndexedDataset(output_prefix)
