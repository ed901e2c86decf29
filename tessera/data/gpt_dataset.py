"""GPT training samples from an indexed dataset: Megatron-Core's GPTDataset semantics.

The sequences of a split are concatenated (in a shuffled order, over as many epochs as
the requested number of samples needs) into one token stream, cut every seq_length
tokens. Sample k holds tokens [k*s, k*s + s] of the stream -- s+1 tokens, the inputs
being the first s and the labels the last s -- so consecutive samples share one token
and every token of an epoch is a label exactly once. Samples run across document
boundaries. Three indices, built once and cached (`index_cache`), make this random
access:

- document_index: the split's sequence ids, tiled once per epoch and shuffled;
- sample_index[k] = (position in document_index, token offset) where sample k starts;
- shuffle_index: the order in which samples are served.

The shuffles use numpy's RandomState(seed) in Megatron's order, and the epoch rules
(a separately shuffled last epoch when little of it is used) are Megatron's, so the
same files, split and seed give the same samples in the same order as Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.data.index_cache import cached_arrays, describe_files
from tessera.data.indexed import IndexedDataset

# Below this fraction of an epoch drawn from the last epoch, that epoch is shuffled on its
# own, so its few samples are not all drawn from a handful of documents (Megatron's rule).
SEPARATE_FINAL_EPOCH_FRACTION = 0.80
_SAMPLE_INDEX_CHUNK = 1 << 24  # documents per step of the sample-index walk (bounds memory)


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens hold num_samples samples of seq_length+1 (sharing one token)."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(sequence_ids: np.ndarray, num_epochs: int, separate_final_epoch: bool,
                         rng: np.random.RandomState) -> np.ndarray:
    if separate_final_epoch:
        first = build_document_index(sequence_ids, num_epochs - 1, False, rng)
        return np.concatenate([first, build_document_index(sequence_ids, 1, False, rng)])
    document_index = np.tile(np.asarray(sequence_ids, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """[num_samples+1, 2] (document_index position, offset) of each sample start k*seq_length.

    A start that falls on a document's end is placed at the last token of that document
    (a sample reads its start token, which is the previous sample's last).
    """
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    done, stream_offset = 0, 0
    for chunk_start in range(0, len(document_index), _SAMPLE_INDEX_CHUNK):
        chunk_lengths = lengths[document_index[chunk_start:chunk_start + _SAMPLE_INDEX_CHUNK]].astype(np.int64)
        ends = stream_offset + np.cumsum(chunk_lengths)
        upto = np.searchsorted(starts, ends[-1], side="left") if len(ends) else done
        here = starts[done:upto]
        position = np.searchsorted(ends, here, side="right")
        sample_index[done:upto, 0] = chunk_start + position
        sample_index[done:upto, 1] = here - (ends[position] - chunk_lengths[position])
        done, stream_offset = upto, int(ends[-1]) if len(ends) else stream_offset
    if done != num_samples + 1:
        raise ValueError(f"the documents hold {stream_offset} tokens, too few for {num_samples} samples")
    fits_int32 = sample_index.max(initial=0) <= np.iinfo(np.int32).max
    return sample_index.astype(np.int32) if fits_int32 else sample_index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of range(total) that keeps [0, num_samples) and the rest apart."""
    dtype = np.uint32 if total < 2**32 - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    rest = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


def build_indices(lengths: np.ndarray, sequence_ids: np.ndarray, seq_length: int, num_samples: int | None,
                  seed: int) -> dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index for one split (Megatron's rules)."""
    tokens_per_epoch = int(lengths[sequence_ids].sum(dtype=np.int64))
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    if samples_per_epoch < 1:
        raise ValueError(f"the split holds {tokens_per_epoch} tokens, too few for one sample of {seq_length + 1}")
    num_epochs = 1 if num_samples is None else num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - samples_before_final
        separate_final_epoch = from_final < int(SEPARATE_FINAL_EPOCH_FRACTION * samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(sequence_ids, num_epochs, separate_final_epoch, rng)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(lengths, document_index, seq_length, total)
    shuffled_apart = samples_before_final if separate_final_epoch else total
    shuffle_index = build_shuffle_index(shuffled_apart, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


@dataclass(frozen=True)
class SampleOptions:
    """How a token window becomes a training sample (--reset-*, --eod-mask-loss)."""

    seq_length: int
    eod: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        if self.eod is None and (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss):
            raise ValueError("--reset-position-ids, --reset-attention-mask and --eod-mask-loss need a tokenizer "
                             "with an end-of-document token (--tokenizer-type)")


def make_sample(window: np.ndarray, options: SampleOptions) -> dict[str, torch.Tensor]:
    """tokens, labels, loss_mask, position_ids from seq_length+1 tokens; with
    --reset-attention-mask also cu_seqlens, the sample's document boundaries (see below)."""
    window = torch.from_numpy(np.asarray(window, dtype=np.int64))
    tokens, labels = window[:-1], window[1:]
    s = options.seq_length
    is_eod = tokens == options.eod if options.eod is not None else torch.zeros(s, dtype=torch.bool)
    loss_mask = torch.ones(s, dtype=torch.float32)
    if options.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(s)
    if options.reset_position_ids:
        first_of_document = torch.zeros(s + 1, dtype=torch.long)
        first_of_document[1:][is_eod] = 1
        starts = torch.cummax(torch.where(first_of_document[:s] > 0, position_ids, 0), 0).values
        position_ids = position_ids - starts
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if options.reset_attention_mask:
        # int32 [documents + 1]: 0, the end of each document, s. An EOD token closes its
        # document, so a document ends after each EOD (one at the last token ends the last).
        ends = torch.nonzero(is_eod[:-1]).flatten() + 1
        sample["cu_seqlens"] = torch.cat([torch.tensor([0]), ends, torch.tensor([s])]).to(torch.int32)
    return sample


class GPTDataset(Dataset):
    """Samples of one split of one indexed dataset; `ds[i]` is a dict of tensors (see make_sample)."""

    def __init__(self, prefix: str, split: str, split_range: tuple[int, int], num_samples: int | None,
                 seed: int, options: SampleOptions, cache_dir: str | None):
        self.prefix, self.split, self.options = prefix, split, options
        self.indexed = IndexedDataset(prefix)
        begin, end = split_range
        description = {
            "class": "GPTDataset", "dataset": describe_files(prefix), "split": split, "sequence_range": [begin, end],
            "num_samples": num_samples, "sequence_length": options.seq_length, "random_seed": seed,
        }
        self.indices = cached_arrays(
            cache_dir, "GPTDataset", description, ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(self.indexed.sequence_lengths, np.arange(begin, end), options.seq_length,
                                  num_samples, seed))
        self.document_index = self.indices["document_index"]
        self.sample_index = self.indices["sample_index"]
        self.shuffle_index = self.indices["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def window(self, index: int) -> np.ndarray:
        """The seq_length+1 tokens of sample `index` (after shuffling)."""
        k = int(self.shuffle_index[index])
        (first, first_offset), (last, last_offset) = self.sample_index[k], self.sample_index[k + 1]
        first, first_offset, last, last_offset = int(first), int(first_offset), int(last), int(last_offset)
        doc = self.document_index
        if first == last:
            return self.indexed.get(int(doc[first]), first_offset, last_offset - first_offset + 1)
        parts = [self.indexed.get(int(doc[first]), first_offset)]
        parts += [self.indexed.get(int(doc[i])) for i in range(first + 1, last)]
        parts.append(self.indexed.get(int(doc[last]), 0, last_offset + 1))
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return make_sample(self.window(index), self.options)
