"""--fp8-param-gather on an FP8 GPU, one process: the Triton cast of many slices is bit for bit
quantize()'s (slices starting and ending inside rows and 128x128 blocks); the optimizer's E4M3
weights are bit for bit what the layers cast eagerly from the bf16 weights, and training with them
is the training without them,
exactly in eager mode (no gradient clipping: tests/training/test_fp8_param_gather.py says why) and
compiled within rounding (Inductor casts the weights inside the blocks without the flag).
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.kernels.fp8 import E4M3, amax, quantize, scale_for
from tessera.kernels.fp8_blockwise import quantize_blocks
from tessera.kernels.fp8_cast import Slice, WeightSlices, grid, quantize_slice, slice_amax
from tessera.training.trainer import Trainer
from tests.conftest import run_config

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not FP8_GPU, reason="needs an FP8 GPU")
HOPPER = FP8_GPU and torch.cuda.get_device_capability()[0] == 9
RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "2"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
STEPS = 5


@pytest.mark.parametrize("block", [None, 128], ids=["one-scale", "blocks"])
def test_one_launch_finds_the_amaxes_and_casts_every_slice_as_torch_does(block):
    generator = torch.Generator("cuda").manual_seed(2)
    shapes = [torch.Size((256, 384)), torch.Size((384, 128))]
    weights = [torch.randn(shape, device="cuda", generator=generator).to(torch.bfloat16) for shape in shapes]
    cuts = [(0, 0, 1000), (0, 1000, 50_001), (0, 50_001, 98_304), (1, 129, 40_000)]   # inside rows and blocks
    # Each slice with scales of its own (a rank holds one slice of a weight): its weight's whole grid.
    sizes = [grid(shapes[which], block)[0] * grid(shapes[which], block)[1] for which, _, _ in cuts]
    first_scales = [sum(sizes[:i]) for i in range(len(cuts))]
    scales = torch.rand(sum(sizes), device="cuda", generator=generator) * 50
    targets = torch.zeros(sum(end - start for _, start, end in cuts), dtype=torch.uint8, device="cuda")
    slices, at = [], 0
    for (which, start, end), first_scale in zip(cuts, first_scales):
        slices.append(Slice(weights[which].flatten()[start:end], targets[at:at + end - start].view(E4M3), start,
                            shapes[which], block, first_scale))
        at += end - start
    weight_slices = WeightSlices(slices)
    weight_slices.cast(scales)
    amaxes = torch.zeros_like(scales)
    weight_slices.amax(amaxes)
    for s in slices:
        rows, cols = grid(s.shape, s.block)
        assert torch.equal(amaxes[s.first_scale:s.first_scale + rows * cols],
                           slice_amax(s.source, s.offset, s.shape, s.block).flatten())
        expected = quantize_slice(s.source, s.offset, s.shape, s.block,
                                  scales[s.first_scale:s.first_scale + rows * cols].view(rows, cols))
        assert torch.equal(s.target.view(torch.uint8), expected.view(torch.uint8))


def _train(flags):
    trainer = Trainer(run_config("--model", "tiny-llama", "--hidden-size", "256", "--ffn-hidden-size", "512",
                                 "--seq-length", "128", "--global-batch-size", "4", "--bf16", "--device", "cuda",
                                 "--use-distributed-optimizer", "--clip-grad", "0", "--train-iters", str(STEPS),
                                 *flags))
    losses = [trainer.train_step().resolve().loss for _ in range(STEPS)]
    return losses, trainer


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gathered_weights_train_as_the_layers_own_casts(recipe, compiled):
    if recipe == "blockwise" and not HOPPER:
        pytest.skip("cuBLAS's block-scaled GEMMs are Hopper-only")
    flags = RECIPES[recipe] + ([] if compiled else ["--no-compile"])
    losses, _ = _train(flags)
    gathered, trainer = _train(flags + ["--fp8-param-gather"])
    if compiled:
        torch.testing.assert_close(gathered, losses, rtol=2e-3, atol=0)
    else:
        assert gathered == losses
    for module in trainer.model.modules():
        layer = getattr(module, "fp8", None)
        if layer is None or recipe == "delayed":   # delayed: its scale is the history's, not this weight's
            continue
        weight = module.weight.detach()
        cast = quantize(weight, scale_for(amax(weight), E4M3), E4M3) if layer.weight_block is None \
            else quantize_blocks(weight)[0]
        assert torch.equal(layer.weight_fp8.view(torch.uint8), cast.view(torch.uint8))
