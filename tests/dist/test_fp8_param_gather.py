"""--fp8-param-gather: the distributed optimizer, or FSDP2, all-gathers the FP8 linears' weights in E4M3.

Training with it computes what the same layout computes with bf16 gathers (losses, gradient
norms, weights), for the three recipes, with buckets cut through weights and blocks,
overlapped gathers delivered late, TP x DP and PP x DP; the gathered E4M3 weights are bit for bit what
each layer would cast from its whole bf16 weight; those gathers carry one byte an element.
The reference is the layout without the flag, not one process: FP8 training under data
parallelism differs from one process by more than the harness's 1e-5 (a gradient sum in
another order moves a weight by an ulp, which can move its E4M3 value by one of E4M3's ulps).
Under FSDP2 (DP, with uneven shards cutting 128-blocks, and TP x DP) the same holds bit for bit.

torch._scaled_mm runs on the CPU (tests/training/test_fp8.py); the trainer's check for FP8 tensor
cores is switched off (tests.conftest.fp8_on_cpu).
"""

from unittest import mock

import pytest
import torch

from tests.conftest import fp8_on_cpu
from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent, late_parameter_gathers
from tests.dist.launcher import run_distributed
from tessera.kernels.fp8 import E4M3, amax, quantize, scale_for
from tessera.kernels.fp8_blockwise import quantize_blocks

TENSORWISE = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
DELAYED = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "3",
           "--fp8-amax-compute-algo", "max"]
# 128-blocks need 128-divisible weights and tokens per micro-batch.
BLOCKWISE = ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--hidden-size", "128",
             "--ffn-hidden-size", "256", "--seq-length", "128"]
# Buckets of ~30k elements end inside weights (fc1's 45k in tiny-llama; blockwise: inside 128x128 blocks).
DISTRIBUTED = ["--use-distributed-optimizer", "--ddp-bucket-size", "30000"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]

LAYOUTS = {   # recipe: its flags, and (ranks, layout) pairs
    "tensorwise": (TENSORWISE, [(2, DISTRIBUTED), (4, DISTRIBUTED + OVERLAP + [
        "--tensor-model-parallel-size", "2", "--ffn-hidden-size", "192"])]),   # 16-divisible TP shards
    "delayed": (DELAYED, [(4, DISTRIBUTED + OVERLAP + ["--pipeline-model-parallel-size", "2"])]),
    "blockwise": (BLOCKWISE, [(2, DISTRIBUTED)]),
}
FSDP2 = ["--use-torch-fsdp2"]
# FSDP2 gathers each block's weights whole (their E4M3 shards, cast after the step), and computes
# what its bf16 gathers do bit for bit: the reductions are the same with or without the flag.
FSDP2_LAYOUTS = {
    "tensorwise": (TENSORWISE, [(2, FSDP2),
                                (4, FSDP2 + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "192"])]),
    "delayed": (DELAYED, [(2, FSDP2)]),
    # 3 ranks: 256-row weights cut inside a 128-block, and uneven shards (FSDP2 pads the last).
    "blockwise": (BLOCKWISE, [(3, FSDP2 + ["--global-batch-size", "18"])]),
}


def _with_fp8_on_cpu(fn, *args):
    with fp8_on_cpu():
        return fn(*args)


def _train_late(flags):
    with late_parameter_gathers():
        return equivalence.train(flags)


def _train_layouts(layouts):
    return {name: _with_fp8_on_cpu(_train_late if "late" in name else equivalence.train, flags)
            for name, flags in layouts.items()}


@pytest.mark.parametrize("recipe, layouts", [*(pytest.param(recipe, LAYOUTS, id=recipe) for recipe in LAYOUTS),
                                              *(pytest.param(recipe, FSDP2_LAYOUTS, id=f"fsdp2-{recipe}")
                                                for recipe in FSDP2_LAYOUTS)])
def test_fp8_param_gather_trains_as_bf16_gathers_do(recipe, layouts):
    flags, runs = layouts[recipe]
    for world_size, layout in runs:
        name = f"{recipe}, {world_size} ranks {layout}"
        # Overlapped gathers are delivered late (at their wait): a forward reading them early would differ.
        gathered = "fp8 gathers delivered late" if "--overlap-param-gather" in layout else "fp8 gathers"
        results = run_distributed(_train_layouts, world_size, {
            "bf16 gathers": flags + layout, gathered: flags + layout + ["--fp8-param-gather"]})[0]
        # Losses and norms to 1e-5; weights to 1e-4 of their norm: Adam moves an element whose
        # gradient is near zero by ~lr whatever its sign, so one element of a weight can carry a
        # 7th-digit difference in the gradients that far (blockwise on an AVX-512 CPU: 1 of
        # qkv's 32,768 elements, 1.6e-5 of the norm; every other weight within 3e-8).
        assert_equivalent(results["bf16 gathers"], results[gathered], f"{name}, {gathered}", params_rtol=1e-4)
        if layouts is FSDP2_LAYOUTS:
            assert results["bf16 gathers"]["loss"] == results[gathered]["loss"], name
            assert all(torch.equal(weight, results[gathered]["params"][key])
                       for key, weight in results["bf16 gathers"]["params"].items()), name


def _gathered_against_cast(flags):
    """After training: each FP8 layer's gathered E4M3 weight and its scale, beside what the layer
    casts from its whole bf16 weight; and the dtype and size of every weight all-gather."""
    from tessera.cli.args import parse_run_config
    from tessera.parallel import zero
    from tessera.training.trainer import Trainer
    import torch.distributed as dist

    gathers = []

    def recording(output, input, *, group, async_op=False):
        gathers.append((input.dtype, output.numel()))
        return equivalence.all_gather_flat(output, input, group=group, async_op=async_op)

    config, _ = parse_run_config(equivalence.BASE + flags + ["--train-iters", "3"], "test",
                                 world_size=dist.get_world_size())
    with fp8_on_cpu(), mock.patch.object(zero, "all_gather_flat", recording):
        trainer = Trainer(config)
        for _ in range(3):   # the last step's gathers are kept
            gathers.clear()
            trainer.train_step()
        trainer.optimizer.wait_for_parameters()
        step_gathers = list(gathers)
        trainer.optimizer.gather_model_weights()
    pairs = []
    for module in trainer.model.modules():
        layer = getattr(module, "fp8", None)
        if layer is None:
            continue
        weight = module.weight.detach()
        if layer.weight_block is None:
            expected = quantize(weight, scale_for(amax(weight), E4M3), E4M3), scale_for(amax(weight), E4M3)
        else:
            expected = quantize_blocks(weight)
        pairs.append(((layer.weight_fp8.view(torch.uint8).clone(), layer.weight_fp8_scale.clone()),
                      (expected[0].view(torch.uint8), expected[1])))
    fp8_elements = sum(module.weight.numel() for module in trainer.model.modules()
                       if getattr(module, "fp8", None) is not None)
    return pairs, step_gathers, fp8_elements


@pytest.mark.parametrize("flags", [TENSORWISE, BLOCKWISE], ids=["tensorwise", "blockwise"])
def test_gathered_weights_are_what_each_layer_would_cast(flags):
    pairs, gathers, fp8_elements = run_distributed(_gathered_against_cast, 2,
                                                   flags + DISTRIBUTED + ["--fp8-param-gather"])[1]
    assert pairs
    for (gathered, scale), (cast, cast_scale) in pairs:
        assert torch.equal(gathered, cast)
        assert torch.equal(scale.reshape(cast_scale.shape), cast_scale)
    one_byte = sum(size for dtype, size in gathers if dtype == torch.uint8)
    assert one_byte == pytest.approx(fp8_elements, rel=0.01)   # bucket padding aside
    assert {dtype for dtype, _ in gathers} == {torch.uint8, torch.bfloat16}   # the other weights: bf16


def _fsdp2_gathered_against_cast(flags):
    """After training under FSDP2: each FP8 layer's weight as FSDP2 gathers it (its E4M3 values, their
    scales and the bytes of the gathered storage) beside what the layer casts from its whole weight."""
    import torch.distributed as dist
    from tessera.cli.args import parse_run_config
    from tessera.parallel.fsdp_fp8 import GatheredFp8Weight
    from tessera.training.trainer import Trainer

    config, _ = parse_run_config(equivalence.BASE + flags + ["--train-iters", "3"], "test",
                                 world_size=dist.get_world_size())
    with fp8_on_cpu():
        trainer = Trainer(config)
        for _ in range(3):
            trainer.train_step()
    found = []
    for block in trainer.model.layers:
        linears = [module for module in block.modules() if getattr(module, "fp8", None) is not None]
        # The fp32 shards whole, in bf16 as FSDP2 gathers the other weights (--bf16) and the layer would cast them.
        whole = [module.weight.full_tensor().detach().bfloat16() for module in linears]
        block.unshard()
        for module, weight in zip(linears, whole):
            gathered = module.weight
            assert isinstance(gathered, GatheredFp8Weight)
            if module.fp8.weight_block is None:
                expected = quantize(weight, scale_for(amax(weight), E4M3), E4M3), scale_for(amax(weight), E4M3)
            else:
                expected = quantize_blocks(weight)
            rows = -(-weight.shape[0] // dist.get_world_size())   # FSDP2's padded shard
            found.append(((gathered.e4m3.view(torch.uint8).clone(), gathered.e4m3_scale.clone()),
                          (expected[0].view(torch.uint8), expected[1]),
                          gathered.e4m3.untyped_storage().nbytes() == rows * weight.shape[1] * dist.get_world_size()))
        block.reshard()
    return found


@pytest.mark.parametrize("flags, ranks", [(TENSORWISE, 2), (BLOCKWISE + ["--global-batch-size", "18"], 3)],
                         ids=["tensorwise", "blockwise"])
def test_fsdp2_gathers_what_each_layer_would_cast_in_one_byte_an_element(flags, ranks):
    found = run_distributed(_fsdp2_gathered_against_cast, ranks, flags + FSDP2 + ["--fp8-param-gather"])[ranks - 1]
    assert found
    for (gathered, scale), (cast, cast_scale), one_byte in found:
        assert torch.equal(gathered, cast)
        assert torch.equal(scale.reshape(cast_scale.shape), cast_scale)
        assert one_byte


def _interrupted_and_uninterrupted(flags, directory):
    from tests.dist.test_checkpoint import interrupted_and_uninterrupted
    return _with_fp8_on_cpu(interrupted_and_uninterrupted, flags, directory)


def test_fsdp2_resumes_exactly(tmp_path):
    # The loaded weights are cast for FSDP2's gathers with the loaded amax history's scales.
    expected, resumed = run_distributed(_interrupted_and_uninterrupted, 2, DELAYED + FSDP2 + ["--fp8-param-gather"],
                                        str(tmp_path))[0]
    assert resumed == expected
