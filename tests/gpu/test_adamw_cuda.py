"""The Triton AdamW over fp32 masters against torch.optim.AdamW(fused=True), on CUDA.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.kernels.adamw import MasterAdamW, join_master, split_master, triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")


def test_master_adamw_steps_like_torch_and_writes_the_bf16_copy():
    generator = torch.Generator("cuda").manual_seed(0)
    shapes = [(1000, 33), (7,), (4097,)]
    masters = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    reference = [m.clone() for m in masters]
    models = {m: torch.empty(m.shape, dtype=torch.bfloat16, device="cuda") for m in masters}
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours = MasterAdamW([{"params": masters[:2], "weight_decay": 0.1}, {"params": masters[2:], "weight_decay": 0.0}],
                       models=models, **kwargs)
    torch_adamw = torch.optim.AdamW([{"params": reference[:2], "weight_decay": 0.1},
                                     {"params": reference[2:], "weight_decay": 0.0}], fused=True, **kwargs)
    for step, overflow in enumerate([False, True, False, False]):
        grads = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
        for optimizer, params in ((ours, masters), (torch_adamw, reference)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.grad_scale = torch.tensor(2.0 + step, device="cuda")
            optimizer.found_inf = torch.tensor(float(overflow), device="cuda")
            optimizer.step()
    for mine, theirs in zip(masters, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.state[mine]["exp_avg_sq"], torch_adamw.state[theirs]["exp_avg_sq"],
                                   rtol=1e-6, atol=0)
        assert ours.state[mine]["step"].item() == torch_adamw.state[theirs]["step"].item() == 3   # one skipped
        assert torch.equal(models[mine], mine.to(torch.bfloat16))



def test_bf16_moments_in_the_kernel_are_the_reference_steps():
    """--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: each step of the Triton kernel against MasterAdamW's
    torch path (the CPU one; tests/training/test_precision_aware_optimizer.py checks it against torch's
    AdamW) from the same state. Step by step, because a moment whose fp32 value lies within an fp32 ulp
    or two of a bf16 rounding midpoint may round either way (FMA, the kernel's exp2 bias corrections),
    and such a one-ulp difference would then grow over steps."""
    generator = torch.Generator("cuda").manual_seed(0)
    shapes = [(1000, 33), (4097,)]
    bf16 = (torch.bfloat16, torch.bfloat16)
    lr = 1e-2
    optimizers = []
    for _ in range(2):
        masters = [torch.randn(s, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) for s in shapes]
        models = {m: torch.empty(m.shape, dtype=torch.bfloat16, device="cuda") for m in masters}
        optimizers.append(MasterAdamW([{"params": masters, "weight_decay": 0.1}], models=models, moment_dtypes=bf16,
                                      lr=lr, betas=(0.9, 0.95), eps=1e-8))
    ours, reference = optimizers
    pairs = list(zip(ours.param_groups[0]["params"], reference.param_groups[0]["params"]))
    for step, overflow in enumerate([False, True, False, False]):
        grads = [torch.randn(s, device="cuda", generator=generator).to(torch.bfloat16) for s in shapes]
        for mine, theirs in pairs:   # the reference starts from the kernel's state
            theirs.copy_(mine)
            for key, value in ours.state_of(mine).items():
                reference.state_of(theirs)[key].copy_(value)
        for optimizer in optimizers:
            optimizer.grads = dict(zip(optimizer.param_groups[0]["params"], grads))   # bf16, as autograd's
            optimizer.grad_scale = torch.tensor(2.0 + step, device="cuda")
            optimizer.found_inf = torch.tensor(float(overflow), device="cuda")
        ours.step()
        reference._reference_step(reference.grads)
        for mine, theirs in pairs:
            # The update (~lr) uses the fp32 moments in both: fp32 rounding apart, equal.
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=lr * 1e-4)
            for kind in ("exp_avg", "exp_avg_sq"):
                assert ours.state[mine][kind].dtype == torch.bfloat16
                # One bf16 ulp at most; atol for a moment that cancels to near 0 (0.9 m + 0.1 g), where an
                # fp32 ulp of the terms is a large part of the result.
                torch.testing.assert_close(ours.state[mine][kind], reference.state[theirs][kind], rtol=2**-7, atol=1e-7)
            assert torch.equal(ours.models[mine], mine.to(torch.bfloat16))
    assert ours.state_of(pairs[0][0])["step"].item() == 3   # the overflow step did not count


def test_masters_kept_as_remainders_take_the_fp32_masters_steps_in_the_kernel():
    """--use-precision-aware-optimizer's masters (the bf16 weight and an int16 remainder, joined in the
    kernel): after every step the fp32 master the kernel gives a plain fp32 master, bit for bit, and the
    weight its upper half."""
    generator = torch.Generator("cuda").manual_seed(0)
    shapes = [(1000, 33), (4097,)]
    masters = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    halves = [split_master(m) for m in masters]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    plain = MasterAdamW([{"params": masters, "weight_decay": 0.1}],
                        models={m: torch.empty(m.shape, dtype=torch.bfloat16, device="cuda") for m in masters}, **kwargs)
    split = MasterAdamW([{"params": [low for _, low in halves], "weight_decay": 0.1}],
                        models={low: high for high, low in halves}, **kwargs)
    for step, overflow in enumerate([False, True, False, False]):
        grads = [torch.randn(s, device="cuda", generator=generator).to(torch.bfloat16) for s in shapes]
        for optimizer in (plain, split):
            optimizer.grads = dict(zip(optimizer.param_groups[0]["params"], grads))
            optimizer.grad_scale = torch.tensor(2.0 + step, device="cuda")
            optimizer.found_inf = torch.tensor(float(overflow), device="cuda")
            optimizer.step()
        for master, (high, low) in zip(masters, halves):
            assert torch.equal(join_master(high, low).view(torch.int32), master.view(torch.int32))
            assert torch.equal(high, split_master(master)[0])
