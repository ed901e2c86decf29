"""DPO's log-probs, loss and metrics against TRL's DPOTrainer on one tiny Llama and batch; the
loss's normalisation under any micro-batch / data-parallel split; the reference at step 0.

The oracle: a random transformers Llama (the reference) and a perturbed copy (the policy),
saved as HF directories with a chat template. TRL tokenizes and collates the preference rows
and computes its loss (`compute_loss`: sigmoid + SFT terms), metrics and per-sequence
log-probs (`compute_ref_log_probs`); tessera reads the same rows from JSONL
(tessera.posttrain.dpo_data) and runs the same directories imported by tessera.interop.hf.
fp32 on the CPU (TRL's default bf16 autocast off): the two sum the same per-token log-probs
in different orders and agree to ~1e-6 relative.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from torch.utils.data import default_collate

from tessera.config import DataConfig, PostTrainConfig
from tessera.interop.hf import load_hf
from tessera.posttrain.dpo import (
    PAIR_METRICS, DPOObjective, chosen_and_rejected, frozen_reference, sequence_log_probs,
)
from tessera.posttrain.dpo_data import build_dpo_datasets
from tests.inference.tiny_text_model import build_hf_dir

BETA, SFT_WEIGHT = 0.1, 0.5
SEQ_LENGTH = 80   # longer than every pair's sequences: the padding is part of what is checked
ROWS = [  # answers of different lengths, so that the SFT term's per-token mean differs from a per-pair one
    {"prompt": [{"role": "user", "content": "The quick brown fox"}],
     "chosen": [{"role": "assistant", "content": "jumps over the lazy dog."}],
     "rejected": [{"role": "assistant", "content": "naïve café"}]},
    {"prompt": [{"role": "user", "content": "def main():"}],
     "chosen": [{"role": "assistant", "content": "    return 42\n"}],
     "rejected": [{"role": "assistant", "content": "héllo wörld, ünïcode façade"}]},
    {"prompt": [{"role": "user", "content": "tessera trains"}],
     "chosen": [{"role": "assistant", "content": "transformer language models"}],
     "rejected": [{"role": "assistant", "content": "你好，世界。"}]},
    {"prompt": [{"role": "user", "content": "こんにちは"}],
     "chosen": [{"role": "assistant", "content": "héllo"}],
     "rejected": [{"role": "assistant", "content": "The lazy dog jumps over the quick brown fox."}]},
]


def run_model(model, batch):
    return model(batch["tokens"], labels=batch["labels"])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """(reference, policy) HF directories: the policy is the reference with perturbed weights."""
    reference = build_hf_dir(tmp_path_factory.mktemp("dpo") / "reference")
    policy = transformers.AutoModelForCausalLM.from_pretrained(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    policy.save_pretrained(reference.parent / "policy")
    return reference, reference.parent / "policy"


@pytest.fixture(scope="module")
def trl(hf_dirs):
    """TRL's batch (chosen rows, then rejected), loss, metrics and per-sequence log-probs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    reference_dir, policy_dir = hf_dirs
    load = transformers.AutoModelForCausalLM.from_pretrained
    args = DPOConfig(output_dir=str(policy_dir.parent / "trl"), beta=BETA, loss_type=["sigmoid", "sft"],
                     loss_weights=[1.0, SFT_WEIGHT], use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=len(ROWS))
    trainer = DPOTrainer(model=load(policy_dir), ref_model=load(reference_dir), args=args,
                         train_dataset=Dataset.from_list(ROWS),
                         processing_class=transformers.AutoTokenizer.from_pretrained(reference_dir))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    mode = "train" if trainer.model.training else "eval"
    return {"batch": batch, "loss": loss.item(), "metrics": {k: v[-1] for k, v in trainer._metrics[mode].items()},
            "policy": torch.cat(trainer.compute_ref_log_probs(trainer.model, batch)),
            "reference": torch.cat(trainer.compute_ref_log_probs(trainer.ref_model, batch))}


def interleaved(rows: torch.Tensor) -> torch.Tensor:
    """TRL's [chosen rows; rejected rows] as tessera's pairs of consecutive rows."""
    pairs = rows.shape[0] // 2
    return rows[[i for pair in range(pairs) for i in (pair, pairs + pair)]]


@pytest.fixture(scope="module")
def tessera_batch(hf_dirs):
    """The rows' pairs as tessera's DPO dataset serves them, in file order (pair p: rows 2p, 2p + 1)."""
    reference_dir, _ = hf_dirs
    path = reference_dir.parent / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    data = DataConfig(data_path=[str(path)], split="1,0,0", tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=str(reference_dir))
    train, _ = build_dpo_datasets(data, PostTrainConfig(dpo=True), seq_length=SEQ_LENGTH, seed=0,
                                  train_samples=2 * len(ROWS), valid_samples=0)
    return default_collate([train.row(i) for i in range(train.num_rows)])


def test_rows_are_trls_tokens_and_completion_masks(trl, tessera_batch):
    """Each row holds TRL's prompt + answer ids, padded, and trains exactly TRL's completion tokens."""
    ids, completion = interleaved(trl["batch"]["input_ids"]), interleaved(trl["batch"]["completion_mask"])
    length = ids.shape[1]
    tokens = torch.cat([tessera_batch["tokens"][:, :1], tessera_batch["labels"]], dim=1)
    attended = interleaved(trl["batch"]["attention_mask"]).bool()
    assert torch.equal(tokens[:, :length][attended], ids[attended])
    assert torch.equal(tessera_batch["loss_mask"][:, :length - 1], completion[:, 1:].float())
    assert tessera_batch["loss_mask"][:, length - 1:].sum() == 0   # padding: never trained


@pytest.fixture(scope="module")
def models(hf_dirs):
    reference_dir, policy_dir = hf_dirs
    return load_hf(policy_dir), load_hf(reference_dir)


def test_sequence_log_probs_equal_trl(trl, tessera_batch, models):
    """The same answers' log-probs, each side from its own tokenization, model and code."""
    for model, name in zip(models, ("policy", "reference")):
        with torch.no_grad():
            log_probs = sequence_log_probs(run_model(model, tessera_batch), tessera_batch["loss_mask"])
        torch.testing.assert_close(log_probs, interleaved(trl[name]), rtol=1e-5, atol=1e-5)


def test_loss_and_metrics_equal_trl(trl, tessera_batch, models):
    policy, reference = models
    objective = DPOObjective(BETA, SFT_WEIGHT)
    objective.begin()
    objective.set_global_batch([tessera_batch["loss_mask"]])
    with torch.no_grad():
        share = objective.micro_batch(run_model(policy, tessera_batch), tessera_batch["loss_mask"],
                                      frozen_reference(reference, run_model).log_probs(tessera_batch))
    loss, metrics = objective.finish()
    assert 0 < metrics["rewards/accuracies"] < 1   # the pairs disagree: the accuracy is a real mean
    assert share.item() == pytest.approx(trl["loss"], rel=1e-5)
    assert loss.item() == pytest.approx(trl["loss"], rel=1e-5)
    for name in PAIR_METRICS:
        assert metrics[name].item() == pytest.approx(trl["metrics"][name], rel=1e-5, abs=1e-6), name
    # TRL's loss is its sigmoid term + SFT_WEIGHT x its SFT term; ours logs them apart.
    assert (metrics["preference_loss"] + SFT_WEIGHT * metrics["sft_loss"]).item() == pytest.approx(trl["loss"],
                                                                                                    rel=1e-5)


def _gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_split_over_micro_batches_and_ranks_adds_up(tessera_batch, models):
    """Two micro-batches of one pair and a half-batch on each of two "ranks" (one process, the
    ranks' global counts given): the shares, their gradients and the metrics add up to the whole
    batch's. The answers differ in length, so a per-micro-batch token mean would not."""
    policy, reference = models
    references = frozen_reference(reference, run_model).log_probs(tessera_batch)
    part = {name: [t[:2], t[2:4], t[4:]] for name, t in tessera_batch.items()}   # 1, 1 and 2 pairs
    part_references = [references[:2], references[2:4], references[4:]]

    def run(splits: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """splits: for each rank, the indices of its micro-batches (`part`). The sum of the
        shares, the gradients, and finish()'s loss and metrics."""
        policy.zero_grad()
        shares, ranks = 0.0, []
        for rank_parts in splits:
            objective = DPOObjective(BETA, SFT_WEIGHT)
            objective.begin()
            objective.set_global_batch(part["loss_mask"])   # what the all-reduce over ranks gives
            for i in rank_parts:
                share = objective.micro_batch(run_model(policy, {k: v[i] for k, v in part.items()}),
                                              part["loss_mask"][i], part_references[i])
                share.backward()
                shares += share.detach()
            ranks.append(objective)
        merged = DPOObjective(BETA, SFT_WEIGHT)   # finish()'s all-reduce over the ranks, by hand
        merged.sums, merged.pairs = sum(o.sums for o in ranks), sum(o.pairs for o in ranks)
        return (shares, _gradients(policy), *merged.finish())

    whole_shares, whole_grad, whole_loss, whole_metrics = run([[0, 1, 2]])
    assert whole_shares.item() == pytest.approx(whole_loss.item(), rel=1e-6)
    for splits in ([[0], [1, 2]], [[0, 1], [2]], [[2], [0], [1]]):
        shares, grad, loss, metrics = run(splits)
        assert shares.item() == pytest.approx(whole_shares.item(), rel=1e-6)
        assert loss.item() == pytest.approx(whole_loss.item(), rel=1e-6)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
        for name, value in whole_metrics.items():
            assert metrics[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
    policy.zero_grad(set_to_none=True)


def test_equal_policy_and_reference_give_log_2(tessera_batch, models):
    policy, _ = models
    reference = frozen_reference(policy, run_model)
    objective = DPOObjective(BETA, 0.0)
    objective.begin()
    objective.set_global_batch([tessera_batch["loss_mask"]])
    share = objective.micro_batch(run_model(policy, tessera_batch), tessera_batch["loss_mask"],
                                  reference.log_probs(tessera_batch))
    loss, metrics = objective.finish()
    assert share.item() == pytest.approx(math.log(2), rel=1e-6)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["rewards/margins"].item() == 0 and metrics["rewards/accuracies"].item() == 0
    share.backward()   # the frozen copy stays out of the graph: only the policy gets gradients
    assert all(p.grad is None for p in reference.model.parameters())
    assert any(p.grad is not None for p in policy.parameters())
    policy.zero_grad(set_to_none=True)


def test_odd_rows_are_not_pairs():
    with pytest.raises(ValueError, match="pairs of rows, got 3 rows"):
        chosen_and_rejected(torch.zeros(3, 4))
