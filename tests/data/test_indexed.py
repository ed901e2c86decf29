"""The .bin/.idx format against a fixture hand-built from the spec (struct.pack), not from our writer."""

import struct

import numpy as np
import pytest

from tessera.data.indexed import (DTYPES, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter,
                                  merge_datasets, optimal_dtype)

# Three documents: [[3 tokens], [1 token, 2 tokens] (two sentences)], an empty one; uint16.
SEQUENCES = [[7, 8, 9], [65535, 0], [300]]
LENGTHS = [3, 2, 1]
DOC_INDICES = [0, 1, 3, 3]  # document 0 = sequence 0; document 1 = sequences 1-2; document 2 empty


def spec_idx(lengths, doc_indices, dtype_code, itemsize, version=1, magic=b"MMIDIDX\x00\x00"):
    """An .idx laid out by hand from the reference table (little-endian, 34-byte header)."""
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    header = magic + struct.pack("<Q", version) + struct.pack("<B", dtype_code)
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    body = struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
    return header + body + struct.pack(f"<{len(doc_indices)}q", *doc_indices)


def write_fixture(tmp_path, name="spec", **kwargs):
    prefix = tmp_path / name
    (prefix.parent / f"{name}.idx").write_bytes(spec_idx(LENGTHS, DOC_INDICES, 8, 2, **kwargs))
    (prefix.parent / f"{name}.bin").write_bytes(b"".join(struct.pack("<H", t) for s in SEQUENCES for t in s))
    return str(prefix)


def test_reads_hand_built_megatron_layout(tmp_path):
    ds = IndexedDataset(write_fixture(tmp_path))
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(3)] == SEQUENCES
    assert ds.sequence_lengths.tolist() == LENGTHS
    assert ds.document_indices.tolist() == DOC_INDICES
    assert ds.get(0, 1, 2).tolist() == [8, 9]
    assert ds.get(1, 1).tolist() == [0]
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)


def test_writer_is_byte_identical_to_the_spec(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        writer.add_document(np.array(SEQUENCES[0]))
        writer.add_document(np.array(SEQUENCES[1] + SEQUENCES[2]), lengths=[2, 1])
        writer.add_documents(np.zeros(0, np.uint16), np.zeros(0, np.int32), np.array([0]))
    write_fixture(tmp_path)
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype_code(tmp_path, code):
    dtype = DTYPES[code]
    rng = np.random.default_rng(code)
    info = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
    documents = [rng.uniform(-100, 100, n).astype(dtype) if dtype.kind == "f"
                 else rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True) for n in (5, 0, 1, 17)]
    with IndexedDatasetWriter(tmp_path / "d", dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    assert (tmp_path / "d.idx").read_bytes()[17] == code
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == dtype and len(ds) == 4
    for i, doc in enumerate(documents):
        np.testing.assert_array_equal(ds[i], doc)


def test_optimal_dtype_follows_megatron_threshold():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32


@pytest.mark.parametrize("damage, message", [
    (lambda idx, bin_: (b"XXIDIDX\x00\x00" + idx[9:], bin_), "bad magic"),
    (lambda idx, bin_: (idx[:9] + struct.pack("<Q", 2) + idx[17:], bin_), "version 2"),
    (lambda idx, bin_: (idx[:17] + b"\x09" + idx[18:], bin_), "dtype code 9"),
    (lambda idx, bin_: (idx[:-5], bin_), "truncated"),
    (lambda idx, bin_: (idx[:20], bin_), "truncated"),
    (lambda idx, bin_: (idx, bin_[:-2]), "tokens.bin"),
    (lambda idx, bin_: (idx, bin_ + b"\x00\x00"), "different datasets"),
])
def test_damaged_pair_fails_on_open_naming_the_file(tmp_path, damage, message):
    prefix = write_fixture(tmp_path, "tokens")
    idx, bin_ = damage((tmp_path / "tokens.idx").read_bytes(), (tmp_path / "tokens.bin").read_bytes())
    (tmp_path / "tokens.idx").write_bytes(idx)
    (tmp_path / "tokens.bin").write_bytes(bin_)
    with pytest.raises(IndexedDatasetError, match="tokens") as info:
        IndexedDataset(prefix)
    assert message in str(info.value)


def test_missing_file_is_named(tmp_path):
    write_fixture(tmp_path, "half")
    (tmp_path / "half.bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"half\.bin: no such file"):
        IndexedDataset(tmp_path / "half")


def test_multimodal_modes_array_is_tolerated(tmp_path):
    prefix = write_fixture(tmp_path)
    with open(prefix + ".idx", "ab") as f:
        f.write(bytes(len(LENGTHS)))
    assert [s.tolist() for s in IndexedDataset(prefix)] == SEQUENCES


def test_merge_concatenates_and_shifts_document_indices(tmp_path):
    first = write_fixture(tmp_path, "a")
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as writer:
        writer.add_document(np.array([1, 2]))
    merged = merge_datasets([first, str(tmp_path / "b")], str(tmp_path / "m"))
    assert [s.tolist() for s in merged] == SEQUENCES + [[1, 2]]
    assert merged.document_indices.tolist() == DOC_INDICES + [4]
    assert merged.sequence_pointers.tolist() == [0, 6, 10, 12]


def test_merge_refuses_mixed_dtypes(tmp_path):
    first = write_fixture(tmp_path, "a")
    with IndexedDatasetWriter(tmp_path / "b", np.int32) as writer:
        writer.add_document(np.array([1]))
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge_datasets([first, str(tmp_path / "b")], str(tmp_path / "m"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_interrupted_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
            writer.add_document(np.arange(10))
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
