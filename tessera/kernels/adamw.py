"""AdamW over fp32 master weights that also writes the model's bf16 copy: one pass over memory.

The distributed optimizer keeps fp32 masters apart from bf16 model weights, and on one rank
with one micro-batch its gradients are autograd's bf16 ones. torch's fused AdamW wants
gradients in the masters' dtype and leaves the copy into the model to another pass; one
Triton kernel per tensor reads the bf16 gradient and writes the bf16 weight in the same pass
(28 bytes per parameter; ~4.1 TB/s in config M's step on an H200; alone on fp32 gradients it
is no faster than torch's kernel plus a copy: docs/performance-notes.md). The maths is
torch.optim.AdamW(fused=True)'s:

    p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps),   g = grad / grad_scale

and the same `grad_scale` / `found_inf` interface (an overflow skips the update and the step
count). Elsewhere (CPU, no Triton) torch's AdamW and a copy compute the same.

The moments may be kept in bf16 (--use-precision-aware-optimizer --exp-avg-dtype bf16
--exp-avg-sq-dtype bf16, Megatron's flags; DeepSeek-V3 trained so): each step reads them into
fp32, updates the weight from the fp32 values and stores them rounded, 4 bytes a parameter less
memory and 8 less traffic a step. torch's AdamW keeps moments in the weights' dtype only, so
without Triton `_reference_step` does the same maths in torch.

With the precision-aware optimizer and bf16 weights, each fp32 master is kept as its two halves
(Transformer Engine's FusedAdam does the same for Megatron: `store_param_remainders`): the bf16
model weight is its upper 16 bits rounded to nearest, and an int16 holds the remainder, so that
`join_master(weight, remainder)` is the fp32 master exactly. That is 2 bytes a parameter less
memory and 2 less traffic a step (26 bytes a parameter). The rounding differs from the plain
cast's in one case: an exact tie (1 in 65,536 values) rounds away from zero, not to even. A master
stored as int16 in a param group is such a remainder; its weight is `models[master]`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

BLOCK, NUM_WARPS = 2048, 4   # elements per program; the fastest of bench/optimizer_step.py --sweep on an H200


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor as (its bf16 rounding, ties away from zero; the int16 remainder)."""
    bits = master.float().view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)   # the lower half; negative when it rounds the upper one up
    high = ((bits >> 16) + (low < 0)).to(torch.int16)
    return high.view(torch.bfloat16), low


def join_master(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor whose halves split_master gave, exactly."""
    return ((high.view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)).view(torch.float32)


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over fp32 masters; after each step `models[master]` (a view of the
    model's weights, any dtype) holds the updated master, cast. A master's gradient is
    `grads[master]` if set (it may be bf16), else its .grad. `moment_dtypes`: those of
    exp_avg and exp_avg_sq (fp32, or bf16 rounded from fp32 maths). An int16 master is the
    remainder of an fp32 master whose bf16 upper half is its model weight (join_master)."""

    def __init__(self, param_groups, *, models: dict[torch.Tensor, torch.Tensor],
                 moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32), **adamw):
        super().__init__(param_groups, fused=True, **adamw)
        self.models = models
        self.moment_dtypes = moment_dtypes
        self.grads: dict[torch.Tensor, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        grads = {p: self.grads.get(p, p.grad) for group in self.param_groups for p in group["params"]}
        grads = {p: g for p, g in grads.items() if g is not None}
        on_gpu = triton is not None and grads and all(p.is_cuda for p in grads)
        remainders = any(p.dtype == torch.int16 for p in grads)
        if not on_gpu and (self.moment_dtypes != (torch.float32, torch.float32) or remainders):
            self._reference_step(grads)
            return
        if not on_gpu:
            lent = [p for p, g in grads.items() if g is not p.grad]
            for master in lent:   # torch's AdamW reads .grad, in the master's dtype
                master.grad = grads[master].to(master.dtype)
            super().step(closure)
            for master in lent:
                master.grad = None
            for master, model in self.models.items():
                model.copy_(master.view_as(model))
            return
        params = list(grads)
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        device = params[0].device
        found_inf = torch.zeros((), device=device) if found_inf is None else found_inf.float()
        grad_scale = torch.ones((), device=device) if grad_scale is None else grad_scale.float()
        steps = [self.state_of(p)["step"] for p in params]
        torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))   # a skipped step does not count
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for master in group["params"]:
                if master not in grads:
                    continue
                state = self.state[master]
                model = self.models.get(master, master)
                n = master.numel()
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    master, grads[master], state["exp_avg"], state["exp_avg_sq"], model, state["step"],
                    grad_scale, found_inf, n, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                    WRITE_MODEL=model is not master, REMAINDER=master.dtype == torch.int16, BLOCK=BLOCK,
                    num_warps=NUM_WARPS)

    def state_of(self, master: torch.Tensor) -> dict:
        """AdamW's state of `master` as torch's fused AdamW creates it, the moments in their dtypes."""
        if master not in self.state or not self.state[master]:
            exp_avg, exp_avg_sq = (torch.zeros_like(master, dtype=dtype) for dtype in self.moment_dtypes)
            self.state[master] = {"step": torch.zeros((), dtype=torch.float32, device=master.device),
                                  "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return self.state[master]

    def _reference_step(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """The kernel's maths in torch, one tensor at a time (moments read into fp32, stored rounded)."""
        if not grads:   # a rank that owns no slice
            return
        device = next(iter(grads)).device
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        skip = found_inf is not None and bool(found_inf.item())
        scale = 1.0 if grad_scale is None else grad_scale.float().to(device)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for master in group["params"]:
                if master not in grads:
                    continue
                state = self.state_of(master)
                if skip:   # an overflow: no update, and the step does not count
                    continue
                state["step"] += 1
                step = state["step"].item()
                g = grads[master].float() / scale
                m = state["exp_avg"].float().mul_(beta1).add_(g, alpha=1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                model = self.models.get(master)
                value = join_master(model, master) if master.dtype == torch.int16 else master
                value.mul_(1 - lr * weight_decay)
                denominator = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
                value.addcdiv_(m, denominator, value=-lr / (1 - beta1**step))
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                if value is not master:   # a remainder: both halves anew
                    high, low = split_master(value)
                    model.copy_(high)
                    master.copy_(low)
                elif model is not None:
                    model.copy_(master.view_as(model))


if triton is not None:
    @triton.jit
    def _adamw_kernel(master, grad, exp_avg, exp_avg_sq, model, step_ptr, scale_ptr, found_inf_ptr, n,
                      lr, beta1, beta2, eps, weight_decay, WRITE_MODEL: tl.constexpr, REMAINDER: tl.constexpr,
                      BLOCK: tl.constexpr):
        if tl.load(found_inf_ptr) != 0:
            return
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(grad + offsets, mask=mask).to(tl.float32) / tl.load(scale_ptr)
        if REMAINDER:   # the fp32 master from the bf16 weight (upper half) and the int16 remainder
            high = tl.load(model + offsets, mask=mask).to(tl.int16, bitcast=True).to(tl.int32)
            p = ((high << 16) + tl.load(master + offsets, mask=mask).to(tl.int32)).to(tl.float32, bitcast=True)
        else:
            p = tl.load(master + offsets, mask=mask)
        m = tl.load(exp_avg + offsets, mask=mask).to(tl.float32)   # fp32, or bf16 moments
        v = tl.load(exp_avg_sq + offsets, mask=mask).to(tl.float32)
        step = tl.load(step_ptr)
        p = p * (1.0 - lr * weight_decay)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(exp_avg + offsets, m.to(exp_avg.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq + offsets, v.to(exp_avg_sq.dtype.element_ty), mask=mask)
        if REMAINDER:   # split_master's halves
            bits = p.to(tl.int32, bitcast=True)
            low = (bits & 0xFFFF).to(tl.int16)
            high = ((bits >> 16) + (low < 0).to(tl.int32)).to(tl.int16)
            tl.store(master + offsets, low, mask=mask)
            tl.store(model + offsets, high.to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(master + offsets, p, mask=mask)
            if WRITE_MODEL:
                tl.store(model + offsets, p.to(model.dtype.element_ty), mask=mask)
