"""DataConfig: where training samples come from."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tessera.config.fields import flag, option, require

@dataclass
class DataConfig:
    """Where training samples come from."""

    TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "ByteTokenizer",
                       "NullTokenizer")

    mock_data: bool = option(False, "train on deterministic synthetic tokens instead of a dataset")
    num_workers: int = option(2, "DataLoader worker processes")
    data_path: list[str] | None = option(None, "dataset prefixes (.bin/.idx without extension): "
                                         "PREFIX, or P1 P2 ... (weighted by size), or W1 P1 W2 P2 ...")
    split: str = option("969, 30, 1", "train, valid, test proportions of each --data-path dataset")
    train_data_path: list[str] | None = option(None, "training dataset(s), whole (instead of --data-path and --split)")
    valid_data_path: list[str] | None = option(None, "validation dataset(s), whole")
    test_data_path: list[str] | None = option(None, "test dataset(s), whole")
    data_cache_path: str | None = option(None, "directory for the sample index cache (default: next to each dataset)",
                                      per_node=True)
    mid_level_dataset_surplus: float = option(0.005, "extra fraction of samples each blended dataset builds")
    reset_position_ids: bool = option(False, "restart position ids after each end-of-document token")
    reset_attention_mask: bool = option(False, "no attention across end-of-document tokens")
    eod_mask_loss: bool = option(False, "no loss on the token that follows an end-of-document token")
    tokenizer_type: str | None = option(None, "tokenizer (loaded from local files)", TOKENIZER_TYPES)
    tokenizer_model: str | None = option(None, "tokenizer file: tokenizer.json (or its directory), .model, BPE file")
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer)")
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer)")
    tiktoken_pattern: str = option("v2", "TikTokenizer pre-tokenization pattern", ("v1", "v2"))
    tiktoken_num_special_tokens: int = option(1000, "TikTokenizer ids reserved for special tokens")

    def __post_init__(self) -> None:
        require(self.num_workers >= 0, "--num-workers must be >= 0")
        self.split_fractions()
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)
        require(self.data_path is None or all(p is None for p in per_split),
                 "give --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
        require(self.mid_level_dataset_surplus >= 0, "--mid-level-dataset-surplus must be >= 0")
        if self.mock_data:
            for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
                require(getattr(self, name) is None,
                        f"--mock-data and {flag(name)} are exclusive: train on synthetic tokens or on a dataset")

    def split_fractions(self) -> list[float]:
        """--split as three fractions summing to 1 (missing entries are 0), Megatron's parsing."""
        numbers = [float(x) for x in re.findall(r"[-+]?(?:\d*\.\d+|\d+\.?)", self.split)]
        require(0 < len(numbers) <= 3 and all(x >= 0 for x in numbers) and sum(numbers) > 0,
                 f"--split must be up to three non-negative numbers with a positive sum, got '{self.split}'")
        numbers += [0.0] * (3 - len(numbers))
        return [x / sum(numbers) for x in numbers]
