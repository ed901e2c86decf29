"""The training loop: it learns, it is deterministic, and batching does not change the maths."""

import json
import math

import pytest
import torch

from tests.conftest import TINY, run_config
from tessera.training.trainer import Trainer


def losses(*flags):
    return [r.loss for r in Trainer(run_config(*flags)).train()]


def test_loss_falls_on_the_learnable_mock_pattern():
    history = losses("--train-iters", "40", "--lr", "1e-2", "--lr-decay-style", "constant")
    assert history[0] > math.log(256) - 0.5              # starts near chance
    assert sum(history[-5:]) / 5 < 0.6 * history[0]     # and learns the pattern


def test_same_seed_same_losses_other_seed_differs():
    first = losses("--seed", "5")
    assert first == losses("--seed", "5")
    assert first != losses("--seed", "6")


def test_micro_batching_does_not_change_the_step():
    """One micro-batch of 4 and four micro-batches of 1 give the same loss and parameters."""
    results = {}
    for micro in ("4", "1"):
        trainer = Trainer(run_config("--micro-batch-size", micro, "--global-batch-size", "4",
                                     "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3"))
        history = trainer.train()
        results[micro] = ([(r.loss, r.grad_norm) for r in history],
                          [p.detach().clone() for p in trainer.model.parameters()])
    # Loss and gradient norm are sums over tokens in another order: fp32 rounding only.
    torch.testing.assert_close(results["4"][0], results["1"][0], rtol=1e-5, atol=0)
    # Adam divides by sqrt(v), which magnifies rounding in near-zero gradients: compare the
    # parameters to a small fraction of one update (lr = 3e-3).
    for a, b in zip(results["4"][1], results["1"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_bf16_trains():
    history = losses("--bf16", "--train-iters", "20", "--lr", "1e-2")
    assert history[-1] < history[0]


def test_gradient_clipping_bounds_the_update():
    trainer = Trainer(run_config("--clip-grad", "1e-3", "--lr", "1.0", "--train-iters", "1",
                                 "--lr-decay-style", "constant", "--weight-decay", "0"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train_step().resolve()
    assert result.grad_norm > 1e-3          # the reported norm is the unclipped one
    # Adam's first step moves each element by lr * g/|g| ~ lr whatever the scale, so check the
    # clipped gradient through the first moment instead: m = (1 - beta1) * g_clipped.
    state = trainer.optimizer.inner.state
    moments = [state[p]["exp_avg"] for p in trainer.model.parameters()]
    clipped_norm = torch.linalg.vector_norm(torch.stack([m.norm() for m in moments])) / (1 - 0.9)
    assert clipped_norm.item() == pytest.approx(1e-3, rel=1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_evaluation_and_json_log(tmp_path):
    log = tmp_path / "log.jsonl"
    Trainer(run_config("--train-iters", "6", "--log-interval", "2", "--eval-interval", "3", "--eval-iters", "2",
                       "--log-json", str(log))).train()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval_loss" in r]
    assert [r["iteration"] for r in train_records] == [2, 4, 6]
    assert [r["iteration"] for r in eval_records] == [3, 6]
    assert all(r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) for r in eval_records)
    assert train_records[-1]["consumed_samples"] == 24


def test_exit_interval_stops_early():
    trainer = Trainer(run_config("--train-iters", "10", "--exit-interval", "4"))
    assert len(trainer.train()) == 4 and trainer.iteration == 4


def test_trains_and_evaluates_on_preprocessed_text(tmp_path):
    """--data-path: JSONL -> .bin/.idx (byte tokenizer) -> training with a validation split."""
    from tessera.config import DataConfig
    from tessera.data.preprocess import preprocess

    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 8})
             for i in range(60)]
    corpus.write_text("\n".join(lines) + "\n")
    preprocess([str(corpus)], str(tmp_path / "corpus"), DataConfig(tokenizer_type="ByteTokenizer"),
               append_eod=True)
    log = tmp_path / "log.jsonl"
    trainer = Trainer(run_config(
        "--data-path", str(tmp_path / "corpus_text_document"), "--split", "90,10,0",
        "--tokenizer-type", "ByteTokenizer", "--data-cache-path", str(tmp_path / "cache"),
        "--vocab-size", "257", "--train-iters", "30", "--lr", "1e-2", "--lr-decay-style", "constant",
        "--eval-interval", "15", "--eval-iters", "2", "--log-interval", "15", "--log-json", str(log),
        base=[flag for flag in TINY if flag != "--mock-data"]))   # --mock-data would win over --data-path
    history = trainer.train()
    assert any((tmp_path / "cache").iterdir())           # the indexed dataset was read (its index cached)
    assert history[-1].loss < 0.7 * history[0].loss     # the repeated sentence is learnable
    evals = [json.loads(line) for line in log.read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 2 and evals[1]["eval_loss"] < evals[0]["eval_loss"]


def test_compiled_blocks_train_like_eager():
    """--compile (the default on GPUs) compiles each block and the head; same maths as eager."""
    flags = ("--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0")
    eager = losses(*flags, "--no-compile")
    compiled = losses(*flags, "--compile")
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=0)


def test_distributed_optimizer_on_one_process_reads_autograds_gradients():
    """With one micro-batch and nothing to reduce the distributed optimizer keeps no gradient
    buffer; it must still take the plain optimizer's steps (fp32: the same AdamW maths)."""
    flags = ("--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "2")
    plain = Trainer(run_config(*flags))
    sharded = Trainer(run_config(*flags, "--use-distributed-optimizer"))
    expected, history = plain.train(), sharded.train()
    assert not sharded.optimizer.buffers[0].stored
    torch.testing.assert_close([(r.loss, r.grad_norm) for r in history], [(r.loss, r.grad_norm) for r in expected],
                               rtol=1e-6, atol=0)
    for a, b in zip(plain.model.parameters(), sharded.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_both():
    from tessera.config import ConfigError
    from tessera.training.batches import check_vocabulary

    model = run_config().model                       # tiny-llama: 256 entries
    with pytest.raises(ConfigError, match="the tokenizer has 512 tokens but the model's vocabulary "
                                          r"\(--vocab-size, or the --model preset's\) has 256: give --vocab-size 512"):
        check_vocabulary(model, 512)
    check_vocabulary(model, 200)                     # a smaller tokenizer fits
    assert model.vocab_size == 256
    model.vocab_size = None
    check_vocabulary(model, 300)                     # without one, the tokenizer's is the model's (Megatron-LM)
    assert model.vocab_size == 300


def test_a_cuda_attention_backend_on_the_cpu_gets_one_note(capsys):
    Trainer(run_config("--attention-backend", "flash", "--train-iters", "1")).train()
    out = capsys.readouterr().out
    assert out.count("note: --attention-backend flash chooses among CUDA kernels; on cpu") == 1


@pytest.mark.parametrize("sharding", [[], ["--use-distributed-optimizer"]])
def test_decoupled_lr_trains_the_embedding_and_output_layer_at_their_own_rate(sharding):
    """--decoupled-lr 0 freezes exactly the word embedding and the output layer; at --lr it is the
    plain run, step for step."""
    flags = ("--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0", *sharding)
    plain = Trainer(run_config(*flags))
    same = Trainer(run_config(*flags, "--decoupled-lr", "3e-3"))
    frozen = Trainer(run_config(*flags, "--decoupled-lr", "0", "--decoupled-min-lr", "0"))
    before = {name: p.detach().clone() for name, p in frozen.model.named_parameters()}
    assert [r.loss for r in same.train()] == [r.loss for r in plain.train()]
    frozen.train()
    for name, param in frozen.model.named_parameters():
        unchanged = torch.equal(param, before[name])
        assert unchanged == (name in ("embedding.weight", "output_weight")), name


def test_fsdp2_on_one_process_trains_as_the_plain_run():
    """A sharding strategy on one process (a config tried on one GPU before scaling out): FSDP2's
    DeviceMesh gets a one-rank group, and the run is the plain one."""
    import torch.distributed as dist

    flags = ("--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0")
    expected = losses(*flags)
    try:
        sharded = losses(*flags, "--data-parallel-sharding-strategy", "optim_grads_params")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.testing.assert_close(sharded, expected, rtol=1e-6, atol=0)
