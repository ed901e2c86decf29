"""tessera train --grpo end to end in one process: the engine's log-probs are the trainer's, pi_old's
are the training forward's bit for bit, one answer per group without clip or KL trains as
REINFORCE, truncation at --seq-length, and bad input stops in one line."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError
from tessera.posttrain.grpo import ADVANTAGES, ENGINE_LOG_PROBS, OLD_LOG_PROBS
from tessera.training.trainer import Trainer

GRPO = ["--model", "tiny-llama", "--grpo", "--sft-tokenizer-prompt-format", "identity", "--tokenizer-type",
        "ByteTokenizer", "--vocab-size", "272", "--seq-length", "24", "--grpo-max-new-tokens", "6",
        "--grpo-group-size", "4", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2",
        "--lr", "1e-3", "--log-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--seed", "5", "--grpo-reward", "exact_match", "format"]


def write_prompts(path, count: int = 16, extra: dict | None = None) -> str:
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "answer": a + b, **(extra or {})})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def prompts(tmp_path) -> list[str]:
    return ["--data-path", write_prompts(tmp_path / "prompts.jsonl")]


def trainer(flags: list[str]) -> Trainer:
    return Trainer(parse_run_config(GRPO + flags, "test", world_size=1)[0])


def step_batches(run: Trainer) -> list[dict]:
    return [next(run.train_data) for _ in range(run.config.num_micro_batches)]


@pytest.mark.parametrize("model", [[], ["--model", "tiny-hybrid", "--vocab-size", "272", "--seq-length", "24"],
                                   ["--model", "tiny-qwen3-next", "--vocab-size", "272", "--seq-length", "24"]],
                         ids=["llama", "mamba2-hybrid", "gated-deltanet-moe"])
def test_rollout_log_probs_are_the_trainers(prompts, model):
    """pi_old (--grpo-iterations 2) is the training forward's exactly; the engine's within 1e-6
    (fp32), also for the recurrent layers of hybrids, whose state the engine keeps per request."""
    run = trainer(prompts + ["--grpo-iterations", "2"] + model)
    batches = step_batches(run)
    run.model.train()
    for batch in batches:
        log_probs = -run._token_losses(run.model, batch)    # the training step's own forward, with grad
        mask = batch["loss_mask"].bool()
        assert mask.any()
        assert torch.equal(log_probs.detach()[mask], batch[OLD_LOG_PROBS][mask])
        assert (log_probs.detach() - batch[ENGINE_LOG_PROBS])[mask].abs().max() <= 1e-6
    history = run.train()   # its first step: ratio 1 everywhere
    assert history[0].terms["clip_ratio"] == 0 and history[0].terms["logprob_gap"] <= 1e-6


def test_the_step_after_a_rollout_trains_in_training_mode(prompts):
    """The engine puts the model it reads in evaluation mode; the rollout gives it back as it was, so
    that the step's dropout and MoE load statistics run as in training."""
    run = trainer(prompts)
    run.model.train()
    step_batches(run)
    assert all(module.training for module in run.model.modules())


def test_a_released_kv_cache_trains_the_same(prompts):
    """--rl-kv-cache-management-mode recompute frees the engine after each rollout and builds it
    again for the next: the same answers and updates as the engine kept (two rollouts)."""
    kept, released = trainer(prompts + ["--train-iters", "2"]), trainer(
        prompts + ["--train-iters", "2", "--rl-kv-cache-management-mode", "recompute"])
    expected, history = kept.train(), released.train()
    assert [step.loss for step in history] == [step.loss for step in expected]
    assert kept.train_data.engine is not None and released.train_data.engine is None
    for a, b in zip(kept.model.parameters(), released.model.parameters()):
        assert torch.equal(a, b)


def vowels(prompt, completion: str, answer) -> float:
    """A reward a random model earns something of: its answer's vowels and digits, less one."""
    return sum(c in "aeiou0123456789" for c in completion) - 1.0


def test_one_answer_per_group_without_clip_or_kl_is_reinforce(prompts):
    """SGD step = -lr x grad of -(1 / (answers x max new tokens)) sum_i R_i log pi(o_i), with R_i the
    reward of the answer's text, computed here from its tokens."""
    flags = prompts + ["--grpo-group-size", "1", "--grpo-clip-eps", "1e9", "--grpo-loss-type", "dr_grpo",
                       "--grpo-reward", f"{__name__}:vowels", "--optimizer", "sgd", "--sgd-momentum", "0",
                       "--weight-decay", "0", "--clip-grad", "0", "--lr", "0.5", "--lr-warmup-iters", "0",
                       "--lr-decay-style", "constant", "--train-iters", "1", "--grpo-temperature", "3"]
    run = trainer(flags)
    batches = step_batches(run)
    rows = [(batch["tokens"][i], batch["loss_mask"][i], batch["labels"][i]) for batch in batches
            for i in range(batch["tokens"].shape[0])]
    rewards = []
    for (_, mask, labels), prompt in zip(rows, [run.data.datasets["train"][i] for i in range(len(rows))]):
        answer = [t for t in labels[mask.bool()].tolist() if t < 256]
        rewards.append(vowels(None, bytes(answer).decode("utf-8", "replace"), prompt.answer))
    assert len(set(rewards)) > 1   # the answers differ in reward: the gradient has something to say
    assert [a for b in batches for a in b[ADVANTAGES].tolist()] == rewards
    before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    run.model.zero_grad()
    for batch, start in zip(batches, range(0, len(rows), 4)):
        log_probs = -(run.model(batch["tokens"], labels=batch["labels"]) * batch["loss_mask"]).sum(dim=1)
        reward = torch.tensor(rewards[start:start + 4])
        (-(reward * log_probs).sum() / (len(rows) * 6)).backward()
    expected = {name: before[name] - 0.5 * p.grad for name, p in run.model.named_parameters()}
    run.train_data._queue.extend(batches)   # the step trains on the answers read above
    run.train()
    for name, parameter in run.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), expected[name], rtol=1e-5, atol=1e-7)


def test_answers_stop_at_the_sequence_length(tmp_path):
    """A prompt of 20 bytes leaves 4 tokens of --seq-length 24: answers of 6 are cut there and trained as they are."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1+1? Say: ##", "answer": 2}) + "\n")
    run = trainer(["--data-path", str(path), "--grpo-reward", "exact_match", "--lr", "0"])
    batches = step_batches(run)
    assert all(batch["loss_mask"].sum(dim=1).eq(4).all() for batch in batches)
    assert run.train_data.metrics()["completions/clipped_ratio"].item() == 1.0


def _bad_reward_module(tmp_path, monkeypatch, body: str) -> str:
    module = "bad_reward_" + re.sub(r"\W", "_", tmp_path.name)   # one per test: imports are cached
    (tmp_path / f"{module}.py").write_text(f"def reward(prompt, completion, answer):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:reward"


@pytest.mark.parametrize("body, says", [("raise KeyError('oops')", "raised KeyError ('oops')"),
                                        ("return float('nan')", "returned nan"),
                                        ("return 'yes'", "returned 'yes'")])
def test_a_bad_reward_names_the_prompt(prompts, tmp_path, monkeypatch, body, says):
    reward = _bad_reward_module(tmp_path, monkeypatch, body)
    with pytest.raises(ConfigError) as error:
        trainer(prompts + ["--grpo-reward", reward]).train()
    message = str(error.value)
    assert "\n" not in message and says in message and f"--grpo-reward {reward}" in message
    assert "prompts.jsonl:" in message


@pytest.mark.parametrize("flags, says", [
    (["--pipeline-model-parallel-size", "2", "--moe-enable-routing-replay", "--num-experts", "4"],
     "--grpo does not combine with --pipeline-model-parallel-size > 1 and --moe-enable-routing-replay"),
    (["--sft"], "--grpo does not combine with --sft or --dpo"),
    (["--grpo-group-size", "3"], "must hold whole groups of --grpo-group-size 3"),
])
def test_flags_grpo_cannot_combine_with_are_one_line(prompts, flags, says, capsys):
    with pytest.raises(SystemExit):
        parse_run_config(GRPO + prompts + flags, "test", world_size=2 if "--pipeline" in flags[0] else 1)
    error = capsys.readouterr().err
    assert says in error and error.count("\n") == 1


def test_bad_prompt_rows_name_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"question": "2+2="}\n')
    with pytest.raises(ConfigError, match=r"rows.jsonl:3: no \"prompt\""):
        trainer(["--data-path", str(path)])
    path.write_text(json.dumps({"prompt": "x" * 30, "answer": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: the prompt is 30 tokens and leaves no room"):
        trainer(["--data-path", str(path)])
