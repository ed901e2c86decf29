"""GPTDataset: samples against a naive concatenation, label coverage, epochs, masks, split, cache."""

import numpy as np
import pytest
import torch

from tessera.data import gpt_dataset
from tessera.data.gpt_dataset import GPTDataset, SampleOptions, build_indices, make_sample
from tessera.data.indexed import IndexedDatasetWriter
from tessera.data.loader import split_ranges
from tessera.models.documents import Documents


def unique_token_dataset(path, lengths):
    """Every token is unique (its global position), so a token says where it came from."""
    with IndexedDatasetWriter(path, np.int32) as writer:
        start = 0
        for n in lengths:
            writer.add_document(np.arange(start, start + n))
            start += n
    return str(path)


LENGTHS = [5, 1, 9, 3, 12, 2, 7, 4, 6, 8]  # 57 tokens


def stream(document_index):
    """The split's token stream in document_index order, built the obvious way."""
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    return np.concatenate([np.arange(starts[d], starts[d + 1]) for d in document_index])


def test_samples_are_consecutive_windows_of_the_shuffled_stream(tmp_path):
    prefix = unique_token_dataset(tmp_path / "d", LENGTHS)
    ds = GPTDataset(prefix, "train", (0, 10), 30, 7, SampleOptions(4), cache_dir=None)
    tokens = stream(ds.document_index)
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(ds.window(i), tokens[k * 4:k * 4 + 5])
        sample = ds[i]
        assert torch.equal(sample["tokens"], torch.from_numpy(tokens[k * 4:k * 4 + 4]).long())
        assert torch.equal(sample["labels"], torch.from_numpy(tokens[k * 4 + 1:k * 4 + 5]).long())


def test_every_token_is_a_label_exactly_once_per_epoch(tmp_path):
    prefix = unique_token_dataset(tmp_path / "d", LENGTHS)  # 57 tokens; (57 - 1) % 8 == 0
    ds = GPTDataset(prefix, "train", (0, 10), 7, 3, SampleOptions(8), cache_dir=None)
    assert len(ds) == 7 and sorted(ds.document_index.tolist()) == list(range(10))
    labels = np.concatenate([ds[i]["labels"].numpy() for i in range(len(ds))])
    first = stream(ds.document_index)[0]
    assert sorted(labels.tolist()) == sorted(set(range(57)) - {first})


def test_more_samples_than_an_epoch_tile_the_documents(tmp_path):
    prefix = unique_token_dataset(tmp_path / "d", LENGTHS)
    ds = GPTDataset(prefix, "train", (2, 8), 40, 3, SampleOptions(4), cache_dir=None)
    tokens_per_epoch = sum(LENGTHS[2:8])  # 37: 40 samples need 161 tokens, 5 epochs
    assert len(ds.document_index) == 6 * 5 and np.bincount(ds.document_index).tolist() == [0, 0] + [5] * 6
    assert len(ds) == (5 * tokens_per_epoch - 1) // 4 >= 40
    labels = np.concatenate([ds[i]["labels"].numpy() for i in range(len(ds))])
    counts = np.bincount(labels, minlength=57)
    in_split = np.arange(sum(LENGTHS[:2]), sum(LENGTHS[:8]))
    assert set(counts[in_split].tolist()) <= {4, 5} and counts.sum() == len(ds) * 4
    assert counts[:in_split[0]].sum() == 0 and counts[in_split[-1] + 1:].sum() == 0


def test_shuffle_depends_on_seed_only(tmp_path):
    prefix = unique_token_dataset(tmp_path / "d", LENGTHS)
    a, b, c = (GPTDataset(prefix, "train", (0, 10), 12, seed, SampleOptions(4), None) for seed in (1, 1, 2))
    assert [a.window(i).tolist() for i in range(len(a))] == [b.window(i).tolist() for i in range(len(b))]
    assert sorted(a.shuffle_index.tolist()) == list(range(len(a)))
    assert a.shuffle_index.tolist() != c.shuffle_index.tolist()


def test_small_last_epoch_is_shuffled_apart():
    lengths = np.full(100, 10, dtype=np.int32)
    # 1000 tokens per epoch, 111 samples/epoch of 9; 120 samples take 2 epochs, 9 from the last.
    indices = build_indices(lengths, np.arange(100), 9, 120, seed=5)
    document_index, shuffle_index = indices["document_index"], indices["shuffle_index"]
    assert sorted(document_index[:100].tolist()) == sorted(document_index[100:].tolist()) == list(range(100))
    before_final = (1000 - 1) // 9
    assert sorted(shuffle_index[:before_final].tolist()) == list(range(before_final))
    # A last epoch used for more than 80% is shuffled together with the others.
    together = build_indices(lengths, np.arange(100), 9, 200, seed=5)["document_index"]
    assert sorted(together[:100].tolist()) != list(range(100))


def test_masks_and_positions_reset_at_end_of_document():
    E = 99
    window = np.array([5, E, 7, 8, E, 9, 4])
    sample = make_sample(window, SampleOptions(6, E, reset_position_ids=True, reset_attention_mask=True,
                                                eod_mask_loss=True))
    assert sample["tokens"].tolist() == [5, E, 7, 8, E, 9]
    assert sample["labels"].tolist() == [E, 7, 8, E, 9, 4]
    assert sample["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]
    assert sample["loss_mask"].tolist() == [1, 0, 1, 1, 0, 1]
    assert sample["cu_seqlens"].tolist() == [0, 2, 5, 6] and sample["cu_seqlens"].dtype == torch.int32
    expected = torch.tensor([  # row attends to column; a document ends with its EOD
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    documents = Documents.from_cu_seqlens(sample["cu_seqlens"], 1, 6, backend="dense", device=torch.device("cpu"))
    assert torch.equal(documents.dense_mask[0, 0], expected)
    # An EOD as the last token ends the last document: no empty one after it.
    ends_on_eod = make_sample(np.array([5, 7, E, 8, 9, E, 4]), SampleOptions(6, E, reset_attention_mask=True))
    assert ends_on_eod["cu_seqlens"].tolist() == [0, 3, 6]
    plain = make_sample(window, SampleOptions(6, E))
    assert plain["position_ids"].tolist() == list(range(6)) and plain["loss_mask"].tolist() == [1] * 6
    assert "cu_seqlens" not in plain
    assert plain["tokens"].dtype == torch.int64 and plain["loss_mask"].dtype == torch.float32


def test_eod_flags_need_a_tokenizer():
    with pytest.raises(ValueError, match="--eod-mask-loss"):
        SampleOptions(8, None, eod_mask_loss=True)


def test_split_ranges_follow_megatron_rounding():
    assert split_ranges([0.969, 0.03, 0.001], 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges([0.5, 0.5, 0.0], 7) == [(0, 4), (4, 7), None]
    assert split_ranges([1 / 3, 1 / 3, 1 / 3], 10) == [(0, 3), (3, 7), (7, 10)]


def test_cache_is_reused_and_keyed_by_inputs(tmp_path, monkeypatch):
    prefix = unique_token_dataset(tmp_path / "d", LENGTHS)
    cache = tmp_path / "cache"
    first = GPTDataset(prefix, "train", (0, 10), 20, 1, SampleOptions(4), str(cache))
    assert len(list(cache.iterdir())) == 4

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices rebuilt despite a cache hit")

    monkeypatch.setattr(gpt_dataset, "build_indices", no_rebuild)
    again = GPTDataset(prefix, "train", (0, 10), 20, 1, SampleOptions(4), str(cache))
    assert isinstance(again.shuffle_index, np.memmap)
    assert [again.window(i).tolist() for i in range(len(again))] == [first.window(i).tolist() for i in range(len(first))]
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(prefix, "train", (0, 10), 20, 2, SampleOptions(4), str(cache))  # another seed: another entry
