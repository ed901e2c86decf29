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

