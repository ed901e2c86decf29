"""DPO's preference data (rows, masks, order, splits, bad lines) and its reference log-probs
(a frozen copy and a precomputed pass give the same values).

Byte-level tokens and the `identity` prompt format (each turn's bytes; an assistant turn
ends with EOD, 256), so what a row holds can be read back as text.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from tessera.config import ConfigError, DataConfig, ModelConfig, PostTrainConfig
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values
from tessera.posttrain.dpo import (
    REFERENCE_KEY, ModelReference, PrecomputedReference, adapters_off_reference, frozen_reference,
    precompute_reference_log_probs,
)
from tessera.posttrain.dpo_data import build_dpo_datasets
from tessera.posttrain.lora import apply_lora

EOD = 256
PAIRS = [{"prompt": "2+2=", "chosen": "4", "rejected": "five"},
         {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon, I think"},
         {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
          "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": "Greetings, dear user"}]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def datasets(path: str, *, seq_length: int = 48, train_samples: int = 6, valid_samples: int = 0, split: str = "1,0,0"):
    data = DataConfig(data_path=[path], split=split, tokenizer_type="ByteTokenizer")
    posttrain = PostTrainConfig(dpo=True, sft_tokenizer_prompt_format="identity")
    return build_dpo_datasets(data, posttrain, seq_length=seq_length, seed=3, train_samples=train_samples,
                              valid_samples=valid_samples)


def as_text(ids: torch.Tensor) -> bytes:
    """Byte tokens as bytes, EOD shown as '|'."""
    return bytes(ord("|") if token == EOD else token for token in ids.tolist())


def trained_text(sample: dict) -> bytes:
    """The labels the loss mask keeps."""
    return as_text(sample["labels"][sample["loss_mask"].bool()])


def answer_text(answer) -> bytes:
    return (answer if isinstance(answer, str) else answer[-1]["content"]).encode() + b"|"


def test_pairs_are_consecutive_rows_over_shuffled_epochs(tmp_path):
    train, valid = datasets(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), train_samples=14)
    assert valid is None and len(train) == 14   # 7 pairs: two epochs of 3 and one pair of a third
    served = []
    for k in range(7):
        chosen, rejected = train[2 * k], train[2 * k + 1]
        pair = next(p for p in PAIRS if trained_text(chosen) == answer_text(p["chosen"]))
        assert trained_text(rejected) == answer_text(pair["rejected"])
        # Both rows continue the same prompt, from position 0.
        prompt = int(chosen["loss_mask"].nonzero()[0]) + 1
        assert torch.equal(chosen["tokens"][:prompt], rejected["tokens"][:prompt])
        assert torch.equal(chosen["position_ids"][:prompt], torch.arange(prompt))
        served.append(PAIRS.index(pair))
    assert sorted(served[:3]) == sorted(served[3:6]) == [0, 1, 2]   # each epoch a permutation


def test_assistant_turns_of_the_prompt_are_context(tmp_path):
    row = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"},
                      {"role": "user", "content": "Name?"}], "chosen": "Tess", "rejected": "Bob"}
    train, _ = datasets(write_jsonl(tmp_path / "pairs.jsonl", [row]), train_samples=2)
    assert trained_text(train.row(0)) == b"Tess|" and trained_text(train.row(1)) == b"Bob|"
    # The prompt's assistant turn (and its end of turn) is in the row, untrained.
    assert as_text(train.row(0)["tokens"][:15]) == b"HiHey|Name?Tess"


def test_split_and_truncation(tmp_path):
    rows = PAIRS + [{"prompt": "Long?", "chosen": "x" * 60, "rejected": "short"}]
    with pytest.warns(UserWarning, match="1 of 8 sequences .* cut on the right"):
        train, valid = datasets(write_jsonl(tmp_path / "pairs.jsonl", rows), split="3,1", train_samples=6,
                                valid_samples=2)
    assert train.num_pairs == 3 and valid.num_pairs == 1   # contiguous ranges: the last pair is valid's
    cut = valid.row(0)
    assert cut["loss_mask"].sum() == 48 - 5 + 1   # the answer trained up to the row's end: no end of turn
    assert trained_text(cut) == b"x" * 44 and trained_text(valid.row(1)) == b"short|"


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": "hi", "chosen": "yes"}', 'no "rejected"'),
    ('{"prompt": "hi", "chosen": "", "rejected": "no"}', '"chosen": message 1: empty assistant turn'),
    ('{"prompt": "hi", "chosen": "yes", "rejected": []}', '"rejected" must be a string or a non-empty list'),
    ('{"prompt": "hi", "chosen": [{"role": "user", "content": "yes"}], "rejected": "no"}',
     '"chosen" has no assistant turn'),
    ('{"prompt": 7, "chosen": "yes", "rejected": "no"}', '"prompt" must be a string or a non-empty list'),
    ('{"prompt": "hi", "chosen": "yes", "rejected": [{"role": "bot", "content": "no"}]}',
     '"rejected": message 1: unknown role \'bot\''),
    ('{"prompt": "' + "p" * 60 + '", "chosen": "yes", "rejected": "no"}',
     "the prompt leaves no token of the chosen answer within --seq-length 48"),
    ('{"prompt": "hi", "chosen": "yes", ', "malformed JSON"),
])
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], "", line])
    with pytest.raises(ConfigError) as error:
        datasets(path)
    message = str(error.value)
    assert message.startswith(f"{path}:3: ") and reason in message and "\n" not in message


def test_flags_that_do_not_apply(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    with pytest.raises(ConfigError, match="drop --reset-attention-mask"):
        build_dpo_datasets(DataConfig(data_path=[path], tokenizer_type="ByteTokenizer", reset_attention_mask=True),
                           PostTrainConfig(dpo=True, sft_tokenizer_prompt_format="identity"), seq_length=48,
                           seed=0, train_samples=2, valid_samples=0)
    with pytest.raises(ConfigError, match="without blend weights"):
        build_dpo_datasets(DataConfig(data_path=["1", path], tokenizer_type="ByteTokenizer"),
                           PostTrainConfig(dpo=True, sft_tokenizer_prompt_format="identity"), seq_length=48,
                           seed=0, train_samples=2, valid_samples=0)


def tiny_model() -> GPTModel:
    values = {key: value for key, value in preset_values("tiny-llama").items() if key != "mtp_num_layers"}
    values.update(vocab_size=EOD + 1, hidden_dropout=0.0, attention_dropout=0.0, seq_length=48)
    model = GPTModel(ModelConfig(**values))
    initialize_parameters(model, seed=1)
    return model


def run_model(model, batch):
    return model(batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"])


def test_frozen_copy_and_precomputed_pass_give_the_same_reference(tmp_path):
    train, _ = datasets(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), train_samples=8)
    policy = tiny_model()
    frozen = frozen_reference(policy, run_model)
    # The initial model itself, before it trains: two data-parallel ranks' blocks in micro-batches
    # of 4 (the last padded), added as the all-reduce adds them.
    values = sum(precompute_reference_log_probs(train, ModelReference(policy, run_model), micro_batch_size=4,
                                                device="cpu", dp_rank=rank, dp_size=2) for rank in range(2))
    train.attach_reference_log_probs(values)
    with torch.no_grad():   # the policy moves on; the references do not
        for parameter in policy.parameters():
            parameter.mul_(1.5)
    for batch in DataLoader(train, batch_size=4, collate_fn=default_collate):
        assert batch[REFERENCE_KEY].shape == (4,)
        torch.testing.assert_close(PrecomputedReference.log_probs(batch), frozen.log_probs(batch), rtol=1e-6,
                                   atol=1e-5)
        assert not torch.allclose(ModelReference(policy, run_model).log_probs(batch), frozen.log_probs(batch))
    with pytest.raises(ValueError, match="6 reference log-probs expected"):
        train.attach_reference_log_probs(values[:4])


def test_lora_reference_is_the_base_model(tmp_path):
    train, _ = datasets(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), train_samples=6)
    batch = default_collate([train.row(i) for i in range(train.num_rows)])
    policy = tiny_model()
    base = frozen_reference(policy, run_model).log_probs(batch)
    apply_lora(policy, PostTrainConfig(lora_rank=4, lora_dropout=0.5), seed=0)
    with torch.no_grad():   # B starts at zero: make the adapters change the model
        for name, parameter in policy.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(std=0.5)
    policy.train()
    torch.testing.assert_close(adapters_off_reference(policy, run_model).log_probs(batch), base, rtol=1e-6,
                               atol=1e-5)
    assert policy.training   # back in training mode, adapters on again
    assert not torch.allclose(ModelReference(policy, run_model).log_probs(batch), base)
