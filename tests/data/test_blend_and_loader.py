"""Blending by weight on every prefix, the split/blend builder, and the resumable DP sampler."""

import itertools
import math

import numpy as np
import pytest
import torch

from tessera.config import ConfigError, DataConfig
from tessera.data.blend import build_blending_indices, parse_blend
from tessera.data.indexed import IndexedDatasetWriter
from tessera.data.loader import PretrainingSampler, build_data_loader, build_train_valid_test_datasets

EOD = 999


def token_range_dataset(path, low, num_docs, seed):
    """Documents of tokens in [low, low+100) ending with EOD: a token tells its dataset."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as writer:
        for _ in range(num_docs):
            writer.add_document(np.append(rng.integers(low, low + 100, rng.integers(1, 30)), EOD))
    return str(path)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.05, 0.15, 0.8], [2, 3, 5, 7, 11]])
def test_blend_follows_weights_on_every_prefix(weights):
    dataset_index, sample_index = build_blending_indices(weights, 5000)
    share = np.asarray(weights) / sum(weights)
    drawn = np.cumsum(np.eye(len(weights))[dataset_index], axis=0)
    prefix = np.arange(1, 5001)[:, None]
    assert np.abs(drawn - share * prefix).max() < 1.0
    for d in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample_index[dataset_index == d].tolist() == list(range(int(drawn[-1, d])))


def test_parse_blend_forms():
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b", "c"]) == (["a", "b", "c"], None)
    with pytest.raises(ConfigError, match="--data-path"):
        parse_blend(["-1", "a", "2", "b"])


def test_weighted_data_path_end_to_end(tmp_path):
    a = token_range_dataset(tmp_path / "a", 0, 300, 1)
    b = token_range_dataset(tmp_path / "b", 500, 300, 2)
    data = DataConfig(data_path=["0.3", a, "0.7", b], split="90,10,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(data, seq_length=8, seed=3, train_samples=400,
                                                         valid_samples=30, test_samples=10, tokenizer_eod=EOD)
    assert test is None  # a zero-width split
    assert len(train) == math.ceil(400 * 0.3) + math.ceil(400 * 0.7) and len(valid) == 9 + 21
    from_a = []
    for i in range(len(train)):
        tokens = train[i]["tokens"]
        real = tokens[tokens != EOD]
        assert bool((real < 100).all()) or bool((real >= 500).all())
        from_a.append(bool((real < 100).all()) and len(real) > 0)
    drawn_a = np.cumsum(from_a)
    assert np.abs(drawn_a - 0.3 * np.arange(1, len(train) + 1)).max() < 1.0


def test_prefixes_without_weights_are_weighted_by_size(tmp_path):
    small = token_range_dataset(tmp_path / "small", 0, 100, 1)
    large = token_range_dataset(tmp_path / "large", 500, 300, 2)
    data = DataConfig(data_path=[small, large], split="1,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_train_valid_test_datasets(data, seq_length=8, seed=3, train_samples=1000,
                                                  valid_samples=0, test_samples=0, tokenizer_eod=EOD)
    share_small = train.weights[0]
    tokens_small, tokens_large = (sum(len(train.datasets[d].indexed[i]) for i in range(len(train.datasets[d].indexed)))
                                  for d in (0, 1))
    assert share_small == pytest.approx(tokens_small / (tokens_small + tokens_large), abs=0.01)


def test_per_split_paths_use_whole_datasets(tmp_path):
    a = token_range_dataset(tmp_path / "a", 0, 50, 1)
    b = token_range_dataset(tmp_path / "b", 500, 50, 2)
    data = DataConfig(train_data_path=[a], valid_data_path=[b], data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(data, seq_length=8, seed=3, train_samples=20,
                                                         valid_samples=20, test_samples=20, tokenizer_eod=EOD)
    assert test is None and len(train.document_index) % 50 == 0 and len(valid.document_index) % 50 == 0
    assert int(valid[0]["tokens"][valid[0]["tokens"] != EOD].min()) >= 500


def test_missing_data_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--data-path"):
        build_train_valid_test_datasets(DataConfig(), seq_length=8, seed=1, train_samples=1, valid_samples=0,
                                        test_samples=0, tokenizer_eod=None)
    with pytest.raises(ConfigError, match=r"--data-path: .*nothing\.idx: no such file"):
        build_train_valid_test_datasets(DataConfig(data_path=[str(tmp_path / "nothing")]), seq_length=8, seed=1,
                                        train_samples=1, valid_samples=0, test_samples=0, tokenizer_eod=None)


def global_steps(sampler_for_rank, dp_size, steps):
    iterators = [iter(sampler_for_rank(rank)) for rank in range(dp_size)]
    return [[next(it) for it in iterators] for _ in range(steps)]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_sampler_resumes_exactly_where_it_stopped(dp_size):
    micro, total = 3, 1000
    full = global_steps(lambda r: PretrainingSampler(total, 0, micro, r, dp_size), dp_size, 12)
    for step in full:  # one step covers consecutive samples, rank r holding the r-th slice
        assert list(itertools.chain(*step)) == list(range(step[0][0], step[0][0] + micro * dp_size))
    for done in (1, 5):
        consumed = done * micro * dp_size
        resumed = global_steps(lambda r: PretrainingSampler(total, consumed, micro, r, dp_size), dp_size, 12 - done)
        assert resumed == full[done:]


def test_sampler_wraps_after_the_last_sample():
    batches = iter(PretrainingSampler(10, 8, 2, 0, 1))
    assert [next(batches) for _ in range(3)] == [[8, 9], [0, 1], [2, 3]]


def test_loader_resume_and_worker_count_give_the_same_batches(tmp_path):
    prefix = token_range_dataset(tmp_path / "a", 0, 200, 1)
    data = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=str(tmp_path / "cache"),
                      reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    train, _, _ = build_train_valid_test_datasets(data, seq_length=16, seed=3, train_samples=64, valid_samples=0,
                                                  test_samples=0, tokenizer_eod=EOD)

    def batches(rank, consumed, workers, n):
        loader = build_data_loader(train, micro_batch_size=2, dp_rank=rank, dp_size=2, consumed_samples=consumed,
                                   num_workers=workers, pin_memory=False, seed=3)
        return list(itertools.islice(iter(loader), n))

    full = batches(1, 0, 0, 6)
    assert full[0]["tokens"].shape == (2, 16) and full[0]["loss_mask"].dtype == torch.float32
    for resumed, expected in zip(batches(1, 8, 2, 4), full[2:]):
        for key in expected:
            assert torch.equal(resumed[key], expected[key])
    assert torch.equal(full[0]["tokens"][0], train[2]["tokens"])  # rank 1's first sample is global sample 2


def test_micro_batch_document_boundaries_follow_the_eod_tokens(tmp_path):
    """--reset-attention-mask: cu_seqlens over the micro-batch's tokens read row after row, a
    boundary after every EOD and at every sample's end (checked against the tokens themselves)."""
    prefix = token_range_dataset(tmp_path / "a", 0, 200, 2)
    data = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=str(tmp_path / "cache"),
                      reset_attention_mask=True)
    train, _, _ = build_train_valid_test_datasets(data, seq_length=16, seed=3, train_samples=32, valid_samples=0,
                                                  test_samples=0, tokenizer_eod=EOD)
    loader = build_data_loader(train, micro_batch_size=3, dp_rank=0, dp_size=1, consumed_samples=0,
                               num_workers=0, pin_memory=False, seed=3)
    for batch in itertools.islice(iter(loader), 4):
        flat = batch["tokens"].flatten()
        expected = {0, flat.numel()} | {i + 1 for i in range(flat.numel()) if flat[i] == EOD}
        expected |= set(range(0, flat.numel(), 16))
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == sorted(expected)
