"""--sft (and LoRA) under parallel layouts: packed conversations, the loss on assistant tokens only, the same
losses every step and the same weights after as one process (data, tensor + sequence, pipeline and
context parallelism; tolerances of tests/dist/equivalence.py)."""

import pytest

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent
from tests.dist.launcher import run_distributed
from tests.posttrain.test_sft_dataset import chat_rows, write_jsonl

# Byte-level tokens and the identity prompt format: no tokenizer files; 256 bytes and the EOD, in a
# vocabulary that pads alike for TP=1 and TP=2 (the padded logits take part in the softmax).
SFT = ["--model", "tiny-llama", "--sft", "--sft-tokenizer-prompt-format", "identity", "--tokenizer-type",
       "ByteTokenizer", "--vocab-size", "272", "--split", "1", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1000", "--num-workers", "0",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "11"]
LAYOUTS = {
    "DP=2": [],
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2": ["--pipeline-model-parallel-size", "2"],
    "CP=2": ["--context-parallel-size", "2"],
}


def train(flags: list[str]) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(parse_run_config(SFT + flags, "test", world_size=world)[0])
    return equivalence.result(trainer, trainer.train())


def train_layouts(data: list[str], layouts: dict[str, list[str]]) -> dict[str, dict]:
    return {name: train(data + flags) for name, flags in layouts.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return ["--data-path", write_jsonl(tmp_path_factory.mktemp("sft") / "chats.jsonl", chat_rows(64))]


def test_sft_layouts_match_one_process(data):
    reference = train(data)
    results = run_distributed(train_layouts, 2, data, LAYOUTS)[0]
    for name, result in results.items():
        assert_equivalent(reference, result, name)


LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
LORA_LAYOUTS = {
    "LoRA DP=2 distributed optimizer": LORA + ["--use-distributed-optimizer"],
    "LoRA DP=2 FSDP2": LORA + ["--use-torch-fsdp2"],
    "LoRA TP=2 + SP": LORA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "LoRA PP=2": LORA + ["--pipeline-model-parallel-size", "2"],
}


def test_lora_sft_layouts_match_one_process(data):
    """Adapters on a frozen base: the same under data (its optimizers and FSDP2), tensor + sequence
    and pipeline parallelism."""
    reference = train(data + LORA)
    results = run_distributed(train_layouts, 2, data, LORA_LAYOUTS)[0]
    for name, result in results.items():
        assert_equivalent(reference, result, name)


def test_lora_on_routed_experts_under_expert_parallelism(data):
    """The experts' adapters (in the default targets) split with their experts over EP ranks."""
    moe_lora = ["--model", "tiny-moe", *LORA]
    reference = train(data + moe_lora)
    results = run_distributed(train_layouts, 2, data, {"LoRA EP=2": moe_lora + ["--expert-model-parallel-size", "2"]})
    assert_equivalent(reference, results[0]["LoRA EP=2"], "LoRA EP=2")
