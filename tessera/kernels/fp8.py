"""FP8 linear layers over torch._scaled_mm, with per-tensor scales (current or delayed).

A linear layer's three GEMMs run in FP8: forward y = x W^T with x and W in E4M3, dgrad
dx = dy W and wgrad dW = dy^T x with dy in E5M2 ("hybrid") or E4M3. Each operand has one
fp32 scale; FP8 = saturate(value x scale) and _scaled_mm takes the inverse scales. The
backward keeps the bf16 x and W (see _Fp8Matmul); FP8's memory saving on a compiled block
comes from inductor recomputing the norms' outputs and fc2's input in the backward instead
of keeping them (counted with saved-tensor hooks: 2 s b (2 h + f) bytes a layer less).

Scales: `tensorwise` (current scaling) takes each tensor's scale from its own amax, now;
`delayed` takes it from the amax history of earlier steps (TE's DelayedScaling), and records
this step's amax for the next. Written here rather than taken from torchao because tessera's
linears are its own tensor-parallel modules (torchao swaps nn.Linear), and delayed scaling
needs its amaxes reduced over the model-parallel ranks once per step, which torchao no longer
offers. torch.compile fuses each amax and cast into the neighbouring elementwise kernels.
Scales per 1x128 tile and 128x128 block (`blockwise`) live in tessera.kernels.fp8_blockwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}   # 448, 57344
_TINY_AMAX = 1e-12   # an all-zero tensor gets a finite scale
INPUT, WEIGHT, GRAD = 0, 1, 2   # rows of a delayed-scaling history
ROLES = ("input", "weight", "grad")


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x x scale, saturated to the format's range, rounded to nearest even in `dtype`."""
    limit = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def scale_for(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale that maps amax to the format's largest value, less 2^margin of headroom."""
    return FP8_MAX[dtype] / amax.float().clamp(min=_TINY_AMAX) / 2.0**margin


def amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


@dataclass(frozen=True)
class Fp8Recipe:
    """What --fp8-format / --fp8-recipe and their knobs ask of every FP8 linear layer."""

    format: str = "hybrid"            # e4m3 everywhere, or hybrid (E5M2 gradients)
    recipe: str = "tensorwise"        # tensorwise (current scaling), delayed or blockwise (fp8_blockwise.py)
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"   # or "max" over the history
    fp8_wgrad: bool = True            # False: the weight gradient GEMM in high precision
    experts: bool = False             # the MoE experts' grouped GEMMs too (tessera.kernels.fp8_grouped)

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3


def linear_by(matmul: type[torch.autograd.Function], layer: nn.Module, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through an FP8 GEMM function of (2-D input, weight, layer, output dtype): the output is
    in autocast's dtype where autocast is on, as F.linear's would be."""
    shape = x.shape
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    y = matmul.apply(x.reshape(-1, shape[-1]), weight, layer, out_dtype)
    y = y.reshape(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Gemm(nn.Module):
    """What the FP8 GEMM modules share: with --fp8-param-gather, the weight's E4M3 copy that the
    distributed optimizer (tessera.parallel.fp8_gather) or FSDP2 (tessera.parallel.fsdp_fp8)
    gathers, read instead of casting the weight.

    A subclass says how its weights are scaled: `weight_block` (None: one scale for the whole
    tensor, else square blocks of that size) and `weight_scales`, the scales of many weights
    from their whole amaxes, and the form its GEMMs take them in (`weight_fp8_scale`).
    """

    weight_block: int | None = None

    def __init__(self):
        super().__init__()
        # Views of the optimizer's buffers, refreshed in place every step (no state_dict entry).
        self.register_buffer("weight_fp8", None, persistent=False)
        self.register_buffer("weight_fp8_scale", None, persistent=False)

    def attach_fp8_weight(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Read the weight from `data` (E4M3, the weight's shape) and its scales from `scale`."""
        self.weight_fp8, self.weight_fp8_scale = data, scale

    def gathered(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's E4M3 copy and its scales as gathered: by the distributed optimizer (attached
        here), or by FSDP2 (the weight is one: tessera.parallel.fsdp_fp8.GatheredFp8Weight); None
        where the layer casts the weight itself."""
        if self.weight_fp8 is not None:
            return self.weight_fp8, self.weight_fp8_scale
        if hasattr(weight, "e4m3"):
            return weight.e4m3, weight.e4m3_scale
        return None


class Fp8Linear(Fp8Gemm):
    """The FP8 GEMM of one linear layer: `fp8(x, weight, bias)` in place of F.linear.

    Holds the delayed-scaling state (amax history and scales of input, weight and output
    gradient) when the recipe is `delayed`; nothing otherwise.
    """

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str | None = None):
        super().__init__()
        self.recipe = recipe
        # Not in state_dict, so that FP8 and bf16 checkpoints stay interchangeable: a training
        # checkpoint saves them apart (tessera.training.checkpoint_state).
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len, device=device),
                                 persistent=False)
            self.register_buffer("scales", torch.ones(3, device=device), persistent=False)
            # This step's amax of each operand, the max over micro-batches: one 0-d buffer each
            # (an in-place update of a slice of one [3] buffer hit "invalid argument" in an
            # Inductor kernel on the H200).
            for role in ROLES:
                self.register_buffer(f"{role}_amax", torch.zeros((), device=device), persistent=False)
        self.calibrated = False   # delayed: the first step, with no history yet, scales by its own amax

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_by(_Fp8Matmul, self, x, weight, bias)

    def scale(self, role: int, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This operand's scale; with delayed scaling also records its amax for the next step."""
        if self.recipe.recipe != "delayed":
            return scale_for(amax(tensor), dtype)
        current = amax(tensor)
        recorded = getattr(self, f"{ROLES[role]}_amax")
        recorded.copy_(torch.maximum(recorded, current))
        return self.scales[role] if self.calibrated else scale_for(current, dtype, self.recipe.margin)

    @staticmethod
    def weight_scales(layers: list["Fp8Linear"], amaxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales of the layers' gathered weights from their whole amaxes (one each), as cast
        with and as stored. Delayed scaling takes the history's scale, once it has one, and counts
        the amax as the step's weight amax: the weight cast last is the one the layer reads."""
        recipe = layers[0].recipe
        if recipe.recipe != "delayed":
            scales = scale_for(amaxes, E4M3)
            return scales, scales
        torch._foreach_copy_([layer.weight_amax for layer in layers], list(amaxes.unbind()))
        scales = torch.stack([layer.scales[WEIGHT] if layer.calibrated else scale_for(amax, E4M3, recipe.margin)
                              for layer, amax in zip(layers, amaxes.unbind())])
        return scales, scales

    def quantized_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight in E4M3 and its scale: the gathered copy with --fp8-param-gather, else cast now
        (in the backward with the forward's scale, giving the forward's bits)."""
        gathered = self.gathered(weight)
        if gathered is not None:
            return gathered[0], gathered[1].reshape(())
        if scale is None:
            scale = self.scale(WEIGHT, weight, E4M3)
        return quantize(weight, scale, E4M3), scale

    @property
    def step_amax(self) -> torch.Tensor:
        """This step's amax of input, weight and output gradient (so far)."""
        return torch.stack([getattr(self, f"{role}_amax") for role in ROLES])

    @step_amax.setter
    def step_amax(self, values: torch.Tensor) -> None:   # after the reduction over ranks
        for role, value in zip(ROLES, values):
            getattr(self, f"{role}_amax").copy_(value)

    @torch.no_grad()
    def end_step(self) -> None:
        """Delayed scaling, after the optimizer step (and the amax reduction over ranks):
        push this step's amaxes into the history and derive the next step's scales."""
        history = torch.roll(self.amax_history, 1, dims=1)
        history[:, 0] = self.step_amax
        self.amax_history.copy_(history)
        for role in ROLES:
            getattr(self, f"{role}_amax").zero_()
        window = history[:, 0] if self.recipe.amax_compute_algo == "most_recent" else history.amax(dim=1)
        margin = self.recipe.margin   # input and weight in E4M3, the gradient in its own format
        self.scales.copy_(torch.cat([scale_for(window[:GRAD], E4M3, margin),
                                     scale_for(window[GRAD:], self.recipe.grad_dtype, margin)]))
        self.calibrated = True

    @torch.no_grad()
    def resume_scaling(self, history: torch.Tensor, scales: torch.Tensor) -> None:
        """Delayed scaling, on resume: a checkpoint's amax history (newest first; under another
        history length, the newest steps that fit) and the scales it gave."""
        kept = min(history.shape[1], self.amax_history.shape[1])
        self.amax_history.zero_()
        self.amax_history[:, :kept] = history[:, :kept]
        self.scales.copy_(scales)
        self.calibrated = True


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as _scaled_mm wants its second operand."""
    return t.t().contiguous().t()


class _Fp8Matmul(torch.autograd.Function):
    """The three FP8 GEMMs. The backward saves the high-precision input and the weight, not
    their FP8 copies: the weight is held anyway, and under torch.compile the input is either
    held by its neighbour (attention's output) or recomputed from what is (a norm's input), so
    FP8 adds no activation memory. Their transposed FP8 copies, which the backward GEMMs need
    in any case, are cast again with the forward's scales: the same bits as the forward's
    (with --fp8-param-gather the weight's is the gathered copy, transposed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype):
        x_scale = layer.scale(INPUT, x, E4M3)
        x8, (w8, w_scale) = quantize(x, x_scale, E4M3), layer.quantized_weight(weight)
        y = torch._scaled_mm(x8, w8.t(), 1 / x_scale, 1 / w_scale, out_dtype=out_dtype, use_fast_accum=True)
        ctx.save_for_backward(x, weight, x_scale, w_scale)
        ctx.layer, ctx.out_dtype = layer, out_dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, x_scale, w_scale = ctx.saved_tensors
        layer, out_dtype = ctx.layer, ctx.out_dtype
        grad_dtype = layer.recipe.grad_dtype
        g_scale = layer.scale(GRAD, grad, grad_dtype)
        g8 = quantize(grad, g_scale, grad_dtype)
        # dgrad and wgrad accumulate in full precision (no fast accumulation), as TE does.
        w8 = _column_major(layer.quantized_weight(weight, w_scale)[0])
        grad_x = torch._scaled_mm(g8, w8, 1 / g_scale, 1 / w_scale, out_dtype=out_dtype)
        if layer.recipe.fp8_wgrad:
            # Straight into the weight's dtype (the GEMM accumulates in fp32 and rounds once): an fp32
            # output cast afterwards would cost an extra pass of 10 bytes a weight.
            x8 = _column_major(quantize(x, x_scale, E4M3))
            grad_w = torch._scaled_mm(g8.t().contiguous(), x8, 1 / g_scale, 1 / x_scale, out_dtype=weight.dtype)
        else:
            grad_w = (grad.to(out_dtype).t() @ x.to(out_dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None
