"""--use-precision-aware-optimizer: bf16 Adam moments (the maths of torch's AdamW read from and
rounded into bf16 moments) and fp32 masters kept as remainders below the bf16 weights, in the
optimizer, the trainer and across a checkpoint, and its flags' errors."""

import pytest
import torch

from tests.conftest import run_config
from tessera.kernels.adamw import MasterAdamW, join_master, split_master
from tessera.training.trainer import Trainer

BF16_MOMENTS = ["--use-distributed-optimizer", "--use-precision-aware-optimizer",
                "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


KWARGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _masters(moment_dtypes, shapes=((33, 17), (5,))):
    generator = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=generator) for s in shapes]
    models = {m: torch.empty(m.shape, dtype=torch.bfloat16) for m in masters}
    ours = MasterAdamW([{"params": masters[:1], "weight_decay": 0.1}, {"params": masters[1:], "weight_decay": 0.0}],
                       models=models, moment_dtypes=moment_dtypes, **KWARGS)
    return masters, models, ours, generator


def _step(optimizer, params, grads, scale=1.0, overflow=False):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.grad_scale = torch.tensor(scale)
    optimizer.found_inf = torch.tensor(float(overflow))
    optimizer.step()


def test_bf16_moments_take_torchs_step_from_the_stored_moments_and_store_it_rounded():
    """Every step equals torch's AdamW started from our weights and our bf16 moments (widened),
    and the moments kept are torch's new ones rounded to bf16 (within one bf16 rounding step:
    torch updates them with lerp)."""
    masters, models, ours, generator = _masters((torch.bfloat16, torch.bfloat16))
    for step in range(1, 5):
        grads = [torch.randn(m.shape, generator=generator) for m in masters]
        reference = [m.clone() for m in masters]
        torch_adamw = torch.optim.AdamW([{"params": reference[:1], "weight_decay": 0.1},
                                         {"params": reference[1:], "weight_decay": 0.0}], fused=True, **KWARGS)
        for mine, theirs in zip(masters, reference):
            if mine in ours.state:
                torch_adamw.state[theirs] = {"step": ours.state[mine]["step"].clone(),
                                             **{kind: ours.state[mine][kind].float() for kind in ("exp_avg", "exp_avg_sq")}}
        _step(ours, masters, grads, scale=2.0)
        _step(torch_adamw, reference, grads, scale=2.0)
        for mine, theirs in zip(masters, reference):
            state, expected = ours.state[mine], torch_adamw.state[theirs]
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
            assert state["step"].item() == step
            for kind in ("exp_avg", "exp_avg_sq"):
                assert state[kind].dtype == torch.bfloat16
                torch.testing.assert_close(state[kind], expected[kind].to(torch.bfloat16), rtol=2**-7, atol=0)
            assert torch.equal(models[mine], mine.to(torch.bfloat16))


def test_an_overflow_skips_the_update_and_the_step_count():
    masters, _, ours, generator = _masters((torch.bfloat16, torch.float32))
    grads = [torch.randn(m.shape, generator=generator) for m in masters]
    _step(ours, masters, grads)
    before = [m.clone() for m in masters]
    _step(ours, masters, grads, overflow=True)
    assert all(torch.equal(a, b) for a, b in zip(masters, before))
    state = ours.state[masters[0]]
    assert state["step"].item() == 1
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.bfloat16, torch.float32)


def test_split_master_rounds_to_nearest_and_joins_back_exactly():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(100_000, generator=generator) * torch.logspace(-30, 30, 100_000)
    bits = torch.randint(-2**31, 2**31 - 1, (1000,), generator=generator, dtype=torch.int64)
    ties = ((bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)   # lower halves exactly 0x8000
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40])
    values = torch.cat([values, ties[torch.isfinite(ties)], special])
    high, low = split_master(values)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_master(high, low).view(torch.int32), values.view(torch.int32))
    cast = values.to(torch.bfloat16)
    differ = high.view(torch.int16) != cast.view(torch.int16)
    is_tie = (values.view(torch.int32) & 0xFFFF) == 0x8000
    assert not (differ & ~is_tie).any()                   # round to nearest, as the cast ...
    assert (high[is_tie].float().abs() > values[is_tie].abs()).all()   # ... but ties away from zero
    assert differ.any()


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_masters_kept_as_remainders_take_the_fp32_masters_steps_exactly(moments):
    """The same maths on the fp32 master joined from the bf16 weight and its int16 remainder: after
    every step (an overflow among them) it is the fp32 master's, bit for bit, and the weight is its
    upper half."""
    masters, _, plain, generator = _masters((moments, moments))
    halves = [split_master(m) for m in masters]
    remainders = [low for _, low in halves]
    groups = [{"params": remainders[:1], "weight_decay": 0.1}, {"params": remainders[1:], "weight_decay": 0.0}]
    split = MasterAdamW(groups, models={low: high for high, low in halves}, moment_dtypes=(moments, moments), **KWARGS)
    for overflow in (False, True, False, False):
        grads = [torch.randn(m.shape, generator=generator).bfloat16() for m in masters]
        for optimizer, params in ((plain, masters), (split, remainders)):
            optimizer.grad_scale, optimizer.found_inf = torch.tensor(2.0), torch.tensor(float(overflow))
            optimizer._reference_step(dict(zip(params, grads)))
        for master, (high, low) in zip(masters, halves):
            assert torch.equal(join_master(high, low).view(torch.int32), master.view(torch.int32))
            assert torch.equal(high, split_master(master)[0])
    assert split.state_of(remainders[0])["exp_avg"].dtype == moments


FLAGS = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2", "--bf16"]


def test_training_with_bf16_moments_follows_fp32_moments_and_keeps_less_state():
    fp32 = Trainer(run_config(*FLAGS, "--use-distributed-optimizer"))
    bf16 = Trainer(run_config(*FLAGS, *BF16_MOMENTS))
    expected, history = [r.loss for r in fp32.train()], [r.loss for r in bf16.train()]
    assert history[0] == expected[0]   # the same first forward
    torch.testing.assert_close(history, expected, rtol=1e-3, atol=0)
    assert history != expected         # the moments' rounding shows after the first step
    masters = sum(master.numel() for master, *_ in bf16.optimizer.inner.slices())
    # 2 bytes less for each moment, and for each master (its remainder below the bf16 weight)
    assert fp32.optimizer.state_bytes() - bf16.optimizer.state_bytes() == 3 * 2 * masters
    moments = bf16.optimizer.inner.optimizer.state.values()
    assert {state["exp_avg"].dtype for state in moments} == {torch.bfloat16}


def test_master_remainders_change_only_how_ties_round_and_keep_less_state():
    """Twelve steps (two micro-batches each) with the masters kept as remainders below the bf16
    weights give, bit for bit, the losses and masters of the plain distributed optimizer's fp32
    masters once its bf16 weights round ties away from zero as the remainders' do; the state is 2
    bytes a parameter smaller."""
    flags = [*FLAGS, "--use-distributed-optimizer", "--train-iters", "12"]
    split = Trainer(run_config(*flags, "--use-precision-aware-optimizer"))
    plain = Trainer(run_config(*flags))
    slices, plain_slices = split.optimizer.inner.slices(), plain.optimizer.inner.slices()
    assert {master.dtype for master, *_ in slices} == {torch.int16}
    assert plain.optimizer.state_bytes() - split.optimizer.state_bytes() == 2 * sum(m.numel() for m, *_ in slices)
    adamw = plain.optimizer.inner.optimizer

    @torch.no_grad()
    def round_ties_away():
        for master, weight, _, _ in plain_slices:
            weight.copy_(split_master(master)[0])

    def step():   # the kernel's maths in torch, as the remainders take them on the CPU
        adamw._reference_step(adamw.grads)
        round_ties_away()

    round_ties_away()
    adamw.step = step
    assert [r.loss for r in split.train()] == [r.loss for r in plain.train()]
    for (value, *_), (want, *_) in zip(split.optimizer.inner.master_weights(), plain.optimizer.inner.master_weights()):
        assert torch.equal(value, want)


def test_a_checkpoint_of_bf16_moments_resumes_on_the_uninterrupted_losses(tmp_path):
    expected = [r.loss for r in Trainer(run_config(*FLAGS, *BF16_MOMENTS)).train()]
    first = Trainer(run_config(*FLAGS, *BF16_MOMENTS, "--save", str(tmp_path), "--exit-interval", "3"))
    before = [r.loss for r in first.train()]
    resumed = Trainer(run_config(*FLAGS, *BF16_MOMENTS, "--load", str(tmp_path)))
    after = [r.loss for r in resumed.train()]
    assert before + after == expected
    # Loaded into fp32 moments (at construction), the same checkpoint widens the saved bf16 moments exactly.
    widened = Trainer(run_config(*FLAGS, "--use-distributed-optimizer", "--load", str(tmp_path)))
    # ... and its masters, kept as remainders, into fp32 masters.
    masters = zip(first.optimizer.inner.master_weights(), widened.optimizer.inner.master_weights())
    for (saved, *_), (loaded, *_) in masters:
        assert loaded.dtype == torch.float32 and torch.equal(saved, loaded)
    for (saved, *_), (loaded, *_) in zip(first.optimizer.inner.slices(), widened.optimizer.inner.slices()):
        for kind in ("exp_avg", "exp_avg_sq"):
            before, after = first.optimizer.inner.optimizer.state[saved][kind], \
                widened.optimizer.inner.optimizer.state[loaded][kind]
            assert before.dtype == torch.bfloat16 and after.dtype == torch.float32
            assert torch.equal(after, before.float())


@pytest.mark.parametrize("flags, message", [
    (["--exp-avg-dtype", "bf16", "--use-distributed-optimizer"],
     "--exp-avg-dtype and --exp-avg-sq-dtype need --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "bf16"],
     "--use-precision-aware-optimizer needs the distributed optimizer (--use-distributed-optimizer, "
     "--data-parallel-sharding-strategy optim); this run's strategy is no_shard"),
])
def test_flags_that_cannot_combine_are_named(flags, message, capsys):
    with pytest.raises(SystemExit):
        run_config(*FLAGS, *flags)
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def test_a_step_with_no_gradient_is_a_no_op():
    empty = torch.zeros(0)   # the distributed optimizer's stand-in on a rank that owns no slice
    optimizer = MasterAdamW([{"params": [empty]}], models={}, moment_dtypes=(torch.bfloat16, torch.bfloat16), **KWARGS)
    optimizer.step()
    assert not optimizer.state
