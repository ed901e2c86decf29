"""What the trainer reads: the run's datasets, this data-parallel rank's micro-batches, and
each micro-batch placed on the device as the model takes it (packed documents' boundaries
read once; under context parallelism, this rank's chunks of every tensor cut once, here)."""

from __future__ import annotations

from typing import Iterator

import torch

from tessera.config import ModelConfig, RunConfig
from tessera.config.fields import require
from tessera.data.mock import MockGPTDataset
from tessera.models.documents import Documents
from tessera.parallel.context import ContextParallel
from tessera.parallel.context_split import SplitDocuments, ZigzagSplit
from tessera.parallel.launch import build_in_turns
from tessera.parallel.mesh import Mesh

Batch = dict[str, torch.Tensor | Documents]   # tensors; with packed samples, "documents" too


def place_batch(batch: Batch, device: torch.device, document_backend: str,
                context_parallel: ContextParallel | None) -> Batch:
    """A loader's micro-batch on `device`, with its Documents (packed samples) and, under
    context parallelism, only this rank's zigzag chunks."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "cu_seqlens"}
    cp = context_parallel
    whole = None   # packed documents: boundaries checked and read on the host, once
    if "cu_seqlens" in batch and (cp is None or "a2a" in cp.comm_types):   # a2a attends over whole samples
        whole = Documents.from_cu_seqlens(batch["cu_seqlens"], *batch["tokens"].shape,
                                          backend=document_backend, device=device)
    if cp is None:
        return moved if whole is None else {**moved, "documents": whole}
    # Context parallelism: this rank's chunks of every tensor along the sequence, cut once, here.
    batch_size, seq_length = batch["tokens"].shape
    split = ZigzagSplit.uniform(cp.size, seq_length) if "cu_seqlens" not in batch else \
        ZigzagSplit.of_cu_seqlens(batch["cu_seqlens"].tolist(), seq_length, cp.size)
    moved.setdefault("position_ids", torch.arange(seq_length, device=device).expand(batch_size, -1))
    # Per-row values ([batch]: a DPO reference's log-probs) stay whole.
    moved = {name: split.split(tensor, cp.rank) if tensor.dim() > 1 else tensor for name, tensor in moved.items()}
    if "cu_seqlens" in batch:
        moved["documents"] = SplitDocuments(split, whole)
    return moved


def check_vocabulary(model: ModelConfig, tokenizer_size: int) -> None:
    """The model's vocabulary comes from the tokenizer (as in Megatron-LM) unless --vocab-size or a
    --model preset set it; then it must hold every token id the tokenizer can produce."""
    if model.vocab_size is None:
        model.vocab_size = tokenizer_size
    require(tokenizer_size <= model.vocab_size,
            f"the tokenizer has {tokenizer_size} tokens but the model's vocabulary (--vocab-size, or the --model "
            f"preset's) has {model.vocab_size}: give --vocab-size {tokenizer_size} or more")


class DataSource:
    """Datasets of the run (mock, .bin/.idx documents, or conversations) and this data-parallel
    rank's micro-batches."""

    def __init__(self, config: RunConfig, mesh: Mesh):
        self.config, self.mesh = config, mesh
        train, data = config.train, config.data
        samples = {
            "train": train.train_iters * train.global_batch_size,
            "valid": (train.train_iters // train.eval_interval + 1) * train.eval_iters * train.global_batch_size
            if train.eval_interval else 0,
        }
        if data.mock_data:
            require(config.model.vocab_size is not None, "--mock-data needs --vocab-size (or a --model preset)")
            self.datasets = {split: MockGPTDataset(count, config.model.seq_length, config.model.vocab_size,
                                                   train.seed + (split == "valid"))
                             for split, count in samples.items()}
        elif config.posttrain.sft:
            self.datasets = self._conversations(samples)
        elif config.posttrain.dpo:
            self.datasets = self._preference_pairs(samples)
        elif config.posttrain.grpo:
            self.datasets = self._prompts()
        else:
            self.datasets = self._documents(samples)

    def _documents(self, samples: dict[str, int]) -> dict:
        """Pretraining: .bin/.idx documents cut into --seq-length samples."""
        from tessera.data.loader import build_train_valid_test_datasets
        from tessera.data.tokenizers import build_tokenizer

        config = self.config
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        check_vocabulary(config.model, tokenizer.vocab_size)
        train_set, valid_set, _ = build_in_turns(lambda: build_train_valid_test_datasets(  # index cache: built once
            config.data, seq_length=config.model.seq_length, seed=config.train.seed, train_samples=samples["train"],
            valid_samples=samples["valid"], test_samples=0, tokenizer_eod=tokenizer.eod))
        return {"train": train_set, "valid": valid_set}

    def _conversations(self, samples: dict[str, int]) -> dict:
        """--sft: conversations packed into --seq-length rows, loss on assistant tokens
        (tessera.posttrain.sft_dataset)."""
        from tessera.posttrain.sft_dataset import build_sft_datasets

        config = self.config
        tokenizer = self._chat_tokenizer()
        train_set, valid_set = build_in_turns(lambda: build_sft_datasets(   # the packing cache: built once
            config.data, config.posttrain, seq_length=config.model.seq_length, seed=config.train.seed,
            train_samples=samples["train"], valid_samples=samples["valid"], vocab_size=config.model.vocab_size,
            tokenizer=tokenizer))
        return {"train": train_set, "valid": valid_set}

    def _preference_pairs(self, samples: dict[str, int]) -> dict:
        """--dpo: each (prompt, chosen, rejected) row as a chosen and a rejected row of --seq-length
        (tessera.posttrain.dpo_data); read by every rank, nothing cached."""
        from tessera.posttrain.dpo_data import build_dpo_datasets

        config = self.config
        tokenizer = self._chat_tokenizer()
        train_set, valid_set = build_dpo_datasets(
            config.data, config.posttrain, seq_length=config.model.seq_length, seed=config.train.seed,
            train_samples=samples["train"], valid_samples=samples["valid"], vocab_size=config.model.vocab_size,
            tokenizer=tokenizer)
        return {"train": train_set, "valid": valid_set}

    def _prompts(self) -> dict:
        """--grpo: the prompts the rollouts answer (tessera.posttrain.grpo_data), and their
        tokenizer (`self.tokenizer`), which reads the answers back for the rewards."""
        from tessera.posttrain.grpo_data import build_prompt_set

        config = self.config
        self.tokenizer = self._chat_tokenizer()
        prompts = build_prompt_set(config.data, self.tokenizer, config.posttrain.sft_tokenizer_prompt_format,
                                   seq_length=config.model.seq_length, seed=config.train.seed)
        return {"train": prompts, "valid": None}

    def _chat_tokenizer(self):
        """The tokenizer of --sft, --dpo and --grpo: --tokenizer-model's, with its chat template (or the
        identity prompt format), its vocabulary checked against the model's."""
        from tessera.posttrain.sft_data import build_chat_tokenizer

        config = self.config
        tokenizer = build_chat_tokenizer(config.data, config.posttrain.sft_tokenizer_prompt_format,
                                         config.model.vocab_size)
        check_vocabulary(config.model, tokenizer.vocab_size)
        return tokenizer

    def micro_batches(self, split: str, consumed_samples: int) -> Iterator[Batch]:
        from tessera.data.loader import build_data_loader

        dataset = self.datasets[split]
        require(dataset is not None, f"no {split} data (check --split / --{split}-data-path)")
        loader = build_data_loader(
            dataset, micro_batch_size=self.config.train.micro_batch_size, dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp_size, consumed_samples=consumed_samples, num_workers=self.config.data.num_workers,
            pin_memory=torch.cuda.is_available(), seed=self.config.train.seed)
        return iter(loader)
