"""The Triton AdamW over fp32 masters against torch.optim.AdamW(fused=True), on CUDA.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.kernels.adamw import MasterAdamW, triton

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



def test_bf16_moments_in_the_kernel_are_the_cpu_reference_steps():
    """--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: the Triton kernel against MasterAdamW's torch path
    on the CPU (tests/training/test_precision_aware_optimizer.py checks that one against torch's AdamW)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(1000, 33), (4097,)]
    cpu = [torch.randn(s, generator=generator) for s in shapes]
    gpu = [m.cuda() for m in cpu]
    bf16 = (torch.bfloat16, torch.bfloat16)
    optimizers = []
    for masters in (cpu, gpu):
        models = {m: torch.empty(m.shape, dtype=torch.bfloat16, device=m.device) for m in masters}
        optimizers.append((MasterAdamW([{"params": masters, "weight_decay": 0.1}], models=models, moment_dtypes=bf16,
                                       lr=1e-2, betas=(0.9, 0.95), eps=1e-8), masters, models))
    for step, overflow in enumerate([False, True, False, False]):
        grads = [torch.randn(s, generator=generator).to(torch.bfloat16) for s in shapes]
        for optimizer, masters, _ in optimizers:
            device = masters[0].device
            optimizer.grads = {p: g.to(device) for p, g in zip(masters, grads)}   # bf16, as autograd's
            optimizer.grad_scale = torch.tensor(2.0 + step, device=device)
            optimizer.found_inf = torch.tensor(float(overflow), device=device)
            optimizer.step()
    (reference, cpu, _), (ours, gpu, gpu_models) = optimizers
    for mine, theirs in zip(gpu, cpu):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-6, atol=1e-7)
        for kind in ("exp_avg", "exp_avg_sq"):
            assert ours.state[mine][kind].dtype == torch.bfloat16
            torch.testing.assert_close(ours.state[mine][kind].cpu(), reference.state[theirs][kind], rtol=2**-7, atol=0)
        assert ours.state[mine]["step"].item() == reference.state[theirs]["step"].item() == 3
        assert torch.equal(gpu_models[mine], mine.to(torch.bfloat16))
