"""What the trainer calls: the train/valid/test datasets, the tokenizer, and the loader.

The loader walks the sample stream in order from `consumed_samples` (a count over all
data-parallel ranks): each step takes the next micro_batch_size x dp_size samples, and
rank r gets the r-th slice of micro_batch_size (Megatron's MegatronPretrainingSampler).
Randomness lives in the datasets' shuffle indices, so a run resumed at
consumed_samples=N sees exactly what an uninterrupted run sees from sample N on, for any
number of loader workers.

A micro-batch stacks its samples' tensors; with packed documents (--reset-attention-mask)
it joins their document boundaries into the micro-batch's cu_seqlens (`collate_micro_batch`).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from tessera.config import ConfigError, DataConfig
from tessera.data.blend import BlendedDataset, blend_sizes, normalize, parse_blend
from tessera.data.gpt_dataset import GPTDataset, SampleOptions
from tessera.data.index_cache import default_cache_dir, describe_files
from tessera.data.indexed import IndexedDataset, IndexedDatasetError
from tessera.data.tokenizers import Tokenizer, build_tokenizer

SPLITS = ("train", "valid", "test")

__all__ = ["build_train_valid_test_datasets", "build_data_loader", "build_tokenizer", "Tokenizer",
           "PretrainingSampler"]


def split_ranges(fractions: list[float], num_sequences: int) -> list[tuple[int, int] | None]:
    """Each split's [begin, end) of sequence ids: contiguous slices, rounded as Megatron does."""
    ranges, start = [], 0.0
    for fraction in fractions:
        end = start + fraction
        begin_id, end_id = round(start * num_sequences), round(end * num_sequences)
        ranges.append((begin_id, end_id) if fraction > 0 else None)
        start = end
    return ranges


def _build_split(blend: list[str], flag: str, split: str, fractions: list[float] | None, num_samples: int,
                 seed: int, options: SampleOptions, data: DataConfig) -> Dataset | None:
    prefixes, weights = parse_blend(blend, flag)
    for prefix in prefixes:
        try:
            IndexedDataset(prefix)
        except IndexedDatasetError as exc:
            raise ConfigError(f"{flag}: {exc}") from None

    def dataset(prefix: str, samples: int | None) -> GPTDataset | None:
        num_sequences = len(IndexedDataset(prefix))
        split_range = split_ranges(fractions, num_sequences)[SPLITS.index(split)] if fractions else (0, num_sequences)
        if split_range is None or split_range[0] == split_range[1]:
            return None
        cache_dir = data.data_cache_path or default_cache_dir(prefix)
        return GPTDataset(prefix, split, split_range, samples, seed, options, cache_dir)

    if len(prefixes) == 1:
        return dataset(prefixes[0], num_samples)
    if weights is None:  # weighted by size: the samples one epoch of each split holds
        weights = [len(d) if d is not None else 0 for d in (dataset(p, None) for p in prefixes)]
    per_dataset, size = blend_sizes(weights, num_samples, data.mid_level_dataset_surplus)
    parts = [(dataset(p, n), w) for p, n, w in zip(prefixes, per_dataset, weights) if w > 0]
    if any(d is None for d, _ in parts):
        return None
    description = {"split": split, "datasets": [describe_files(p) for p in prefixes], "sizes": per_dataset,
                   "children": [[d.prefix, len(d)] for d, _ in parts]}
    cache_dir = data.data_cache_path or default_cache_dir(prefixes[0])
    return BlendedDataset([d for d, _ in parts], normalize([w for _, w in parts]), size, description, cache_dir)


def build_train_valid_test_datasets(data: DataConfig, *, seq_length: int, seed: int, train_samples: int,
                                    valid_samples: int, test_samples: int, tokenizer_eod: int | None
                                    ) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """The three splits from --data-path (+ --split) or --train/valid/test-data-path.

    A split with no data or no requested samples is None. Indices are cached, so calling
    this on every rank is safe; calling it on rank 0 first, then the others after a
    barrier, avoids building the same indices on every rank.
    """
    options = SampleOptions(seq_length, tokenizer_eod, data.reset_position_ids, data.reset_attention_mask,
                            data.eod_mask_loss)
    counts = dict(zip(SPLITS, (train_samples, valid_samples, test_samples)))
    per_split = {"train": data.train_data_path, "valid": data.valid_data_path, "test": data.test_data_path}
    if data.data_path is None and all(v is None for v in per_split.values()):
        raise ConfigError("no data: give --data-path, --train-data-path/--valid-data-path/--test-data-path, "
                          "or --mock-data")
    datasets = []
    for split in SPLITS:
        if counts[split] <= 0:
            datasets.append(None)
        elif data.data_path is not None:
            datasets.append(_build_split(data.data_path, "--data-path", split, data.split_fractions(),
                                         counts[split], seed, options, data))
        elif per_split[split] is not None:
            datasets.append(_build_split(per_split[split], f"--{split}-data-path", split, None, counts[split],
                                         seed, options, data))
        else:
            datasets.append(None)
    return tuple(datasets)


class PretrainingSampler(Sampler[list[int]]):
    """Micro-batches of sample indices for one data-parallel rank, from consumed_samples on.

    Endless: after the last full step it wraps to the start of the dataset.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int):
        if total_samples < micro_batch_size * dp_size:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one step of "
                             f"{micro_batch_size} x {dp_size} data-parallel ranks")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed + self.dp_rank * self.micro_batch_size
        while True:
            yield [(start + j) % self.total for j in range(self.micro_batch_size)]
            start += step


def collate_micro_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples stacked into [micro_batch_size, ...] tensors; their cu_seqlens (each of its own
    length) become one over the micro-batch's tokens read row after row (THD, as Megatron
    merges them): sample i's boundaries offset by i x seq_length, joined."""
    if "cu_seqlens" not in samples[0]:
        return default_collate(samples)
    batch = default_collate([{k: v for k, v in sample.items() if k != "cu_seqlens"} for sample in samples])
    seq_length = batch["tokens"].shape[1]
    starts = [sample["cu_seqlens"][:-1] + i * seq_length for i, sample in enumerate(samples)]
    batch["cu_seqlens"] = torch.cat(starts + [torch.tensor([len(samples) * seq_length], dtype=torch.int32)])
    return batch


def build_data_loader(dataset: Dataset, *, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int,
                      num_workers: int, pin_memory: bool, seed: int) -> Iterable[dict[str, torch.Tensor]]:
    """Micro-batches ([micro_batch_size, seq_length] tensors, and cu_seqlens) for this rank, endlessly."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    generator = torch.Generator().manual_seed(seed)  # seeds the workers' own RNGs, if anything uses them
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_micro_batch, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0, generator=generator)
