"""--use-precision-aware-optimizer with bf16 Adam moments: the maths of torch's AdamW read from and
rounded into bf16 moments, in the trainer and across a checkpoint, and its flags' errors."""

import pytest
import torch

from tests.conftest import run_config
from tessera.kernels.adamw import MasterAdamW
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


FLAGS = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2", "--bf16"]


def test_training_with_bf16_moments_follows_fp32_moments_and_keeps_less_state():
    fp32 = Trainer(run_config(*FLAGS, "--use-distributed-optimizer"))
    bf16 = Trainer(run_config(*FLAGS, *BF16_MOMENTS))
    expected, history = [r.loss for r in fp32.train()], [r.loss for r in bf16.train()]
    assert history[0] == expected[0]   # the same first forward
    torch.testing.assert_close(history, expected, rtol=1e-3, atol=0)
    assert history != expected         # the moments' rounding shows after the first step
    masters = sum(master.numel() for master, *_ in bf16.optimizer.inner.slices())
    assert fp32.optimizer.state_bytes() - bf16.optimizer.state_bytes() == 2 * 2 * masters
    moments = bf16.optimizer.inner.optimizer.state.values()
    assert {state["exp_avg"].dtype for state in moments} == {torch.bfloat16}


def test_a_checkpoint_of_bf16_moments_resumes_on_the_uninterrupted_losses(tmp_path):
    expected = [r.loss for r in Trainer(run_config(*FLAGS, *BF16_MOMENTS)).train()]
    first = Trainer(run_config(*FLAGS, *BF16_MOMENTS, "--save", str(tmp_path), "--exit-interval", "3"))
    before = [r.loss for r in first.train()]
    resumed = Trainer(run_config(*FLAGS, *BF16_MOMENTS, "--load", str(tmp_path)))
    after = [r.loss for r in resumed.train()]
    assert before + after == expected
    # Loaded into fp32 moments (at construction), the same checkpoint widens the saved bf16 moments exactly.
    widened = Trainer(run_config(*FLAGS, "--use-distributed-optimizer", "--load", str(tmp_path)))
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
     "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
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
