"""--tp-comm-overlap (tessera.parallel.tp_overlap) against the same layouts without it and
against one process (gloo).

Layers: a sequence-parallel ColumnParallelLinear and RowParallelLinear with `comm_overlap`
against the same layer without it, at TP=2 (the ring's next and previous rank are one rank)
and TP=4 (the ring's order matters): output and every gradient, by ||a - b|| / ||b|| <= 1e-6
in fp32 (the chunked sums add the same products in another order: a few ulps), and under
bf16 autocast <= 2e-2 (a few bf16 roundings of 2^-8), where backward must cast as forward did.

Training: the harness of tests/dist/equivalence.py (losses and grad norms every step at
rtol 1e-5, every parameter by relative norm 1e-5; it says why). A LLaMA-style model trains
with TP=2 + SP + --tp-comm-overlap and must match the single-process run and TP=2 + SP
without the overlap; so must TP=2 x DP=2, TP=4 with full recompute, TP=2 x PP=2 and a MoE model
(tiny-moe) at TP=2 + SP x EP=2. A GPT-style model with biases must match
TP=2 + SP without the overlap; against one process it runs without linear biases, as in
tests/dist/test_pipeline.py: the key bias has a zero gradient in exact arithmetic, so any
two layouts (TP=2 + SP alone included) round it to different noise that Adam scales up
(tests/dist/test_tensor_parallel.py checks TP + SP's gradients with biases after one step).
Equality alone would also hold if the flag did nothing, so each run also counts the chunks
passed round the ring: TP - 1 per sequence-parallel GEMM in forward (recomputed ones twice)
and as many in backward, for every block's four GEMMs and the output layer.
"""

from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.parallel import tp_overlap
from tessera.parallel.mesh import Mesh
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tests.dist.equivalence import assert_equivalent, train
from tests.dist.launcher import run_distributed
from tests.dist.test_moe import MOE

STEPS, MICRO_BATCHES = 3, 2
SHORT = ["--train-iters", str(STEPS), "--global-batch-size", str(2 * MICRO_BATCHES)]   # micro-batches of 2
LLAMA = SHORT                                   # tiny-llama: no biases, RMSNorm, SwiGLU, GQA 4/2, RoPE, untied
GPT = SHORT + ["--model", "tiny-gpt"]           # biases, LayerNorm, GeLU, learned positions, tied embedding
GPT_NO_BIASES = GPT + ["--disable-bias-linear"]
MOE_MODEL = SHORT + MOE   # tiny-moe: a dense layer, then 4 experts (top-2) and a shared one
REFERENCES = {"llama": LLAMA, "gpt no biases": GPT_NO_BIASES, "moe": MOE_MODEL}
BLOCK_GEMMS = 2 * 4                             # 2 blocks x (QKV, attention projection, fc1, fc2)
GEMMS = BLOCK_GEMMS + 1                         # and the output layer
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


class Layout(NamedTuple):
    model: list[str]
    flags: list[str]
    tp: int
    dp: int
    reference: str | None   # the single-process run it must match


def _sp(tp: int, *extra: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--sequence-parallel", *extra]


OVERLAP = "--tp-comm-overlap"
LAYOUTS = {
    2: {"llama TP=2 SP": Layout(LLAMA, _sp(2), 2, 1, "llama"),
        "llama TP=2 SP overlap": Layout(LLAMA, _sp(2, OVERLAP), 2, 1, "llama"),
        "gpt TP=2 SP": Layout(GPT, _sp(2), 2, 1, None),
        "gpt TP=2 SP overlap": Layout(GPT, _sp(2, OVERLAP), 2, 1, None),
        "gpt no biases TP=2 SP overlap": Layout(GPT_NO_BIASES, _sp(2, OVERLAP), 2, 1, "gpt no biases")},
    4: {"llama TP=2 SP overlap x DP=2": Layout(LLAMA, _sp(2, OVERLAP, "--use-distributed-optimizer"), 2, 2, "llama"),
        "llama TP=4 SP overlap (2 KV groups replicated), full recompute": Layout(
            LLAMA, _sp(4, OVERLAP, *RECOMPUTE), 4, 1, "llama")},
}
ALL = {name: layout for layouts in LAYOUTS.values() for name, layout in layouts.items()}
# With the other parallelisms (4 ranks), against one process only: their rings are counted above.
COMBINED = {"llama TP=2 SP overlap x PP=2": Layout(LLAMA, _sp(2, OVERLAP, "--pipeline-model-parallel-size", "2"),
                                                   2, 1, "llama"),
            "moe TP=2 SP overlap x EP=2": Layout(MOE_MODEL, _sp(2, OVERLAP, "--expert-model-parallel-size", "2"),
                                                 2, 1, "moe")}


# -- layers ----------------------------------------------------------------------------

def _layer_grads(kind: str, group, overlap: bool, autocast: bool, **options) -> list[torch.Tensor]:
    """Output and gradients of a seeded SP layer, whose full input and output gradient are the same on every rank."""
    torch.manual_seed(0)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if kind == "column":
        layer = ColumnParallelLinear(16, 24, bias=True, init_std=0.02, tp_group=group, sequence_parallel=True,
                                     comm_overlap=overlap, **options)
        x = torch.randn(3, 8, 16).chunk(size, dim=1)[rank]
    else:
        layer = RowParallelLinear(16, 24, bias=True, init_std=0.02, tp_group=group, sequence_parallel=True,
                                  comm_overlap=overlap)
        x = torch.randn(3, 8, 16).chunk(size, dim=2)[rank]
    with torch.no_grad():   # a different shard on every rank
        torch.manual_seed(1 + rank)
        layer.weight.normal_()
        layer.bias.normal_()
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(2 + rank))).sum().backward()
    return [y, x.grad, layer.weight.grad, layer.bias.grad]


def _layer_errors(group) -> dict[str, float]:
    tp = dist.get_world_size(group)
    cases = {"column": ("column", {}), "row": ("row", {}),
             # q 8, k 8, v 8 rows; the KV blocks are cut in 2 however many ranks: replicated at TP=4.
             "column fused q/k/v, 2 KV groups": ("column", dict(segments=(8, 8, 8), splits=(tp, 2, 2)))}
    errors = {}
    for name, (kind, options) in cases.items():
        for autocast in (False, True):
            expected = _layer_grads(kind, group, False, autocast, **options)
            actual = _layer_grads(kind, group, True, autocast, **options)
            for quantity, a, b in zip(("output", "input grad", "weight grad", "bias grad"), actual, expected):
                key = f"{name} TP={tp}{' bf16' if autocast else ''}: {quantity}"
                same_dtype = a.dtype == b.dtype
                errors[key] = ((a.float() - b.float()).norm() / b.float().norm()).item() if same_dtype else 1.0
    return errors


def _all_layer_errors() -> dict[str, float]:
    errors = {}
    for tp in (2, 4):
        errors.update(_layer_errors(Mesh.build(ParallelConfig(tensor_model_parallel_size=tp), "cpu").tp_group))
    return errors


def test_overlapped_layers_match_the_unchunked_ones():
    for rank, errors in enumerate(run_distributed(_all_layer_errors, 4)):
        for key, error in errors.items():
            limit = 2e-2 if "bf16" in key else 1e-6
            assert error <= limit, f"rank {rank}: {key} differs by {error:.2e}"


# -- training --------------------------------------------------------------------------

def _train_counting_passes(layouts: dict) -> dict:
    """Each layout's run, with how many tensors this rank passed round the TP ring."""
    results = {}
    for name, layout in layouts.items():
        with mock.patch.object(tp_overlap.Ring, "send_on", autospec=True,
                               side_effect=tp_overlap.Ring.send_on) as send_on:
            results[name] = {**train(layout.model + layout.flags), "passes": send_on.call_count}
    return results


@pytest.fixture(scope="module")
def references():
    return {name: train(flags) for name, flags in REFERENCES.items()}


@pytest.fixture(scope="module")
def results():
    out = {}
    for world_size, layouts in LAYOUTS.items():
        layouts = {**layouts, **COMBINED} if world_size == 4 else layouts
        out.update(run_distributed(_train_counting_passes, world_size, layouts)[0])
    return out


@pytest.mark.parametrize("layout", [name for name, layout in {**ALL, **COMBINED}.items() if layout.reference])
def test_layout_matches_single_process(references, results, layout):
    assert_equivalent(references[{**ALL, **COMBINED}[layout].reference], results[layout], layout)


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_overlap_matches_the_same_layout_without_it(results, model):
    assert_equivalent(results[f"{model} TP=2 SP"], results[f"{model} TP=2 SP overlap"], f"{model} overlap vs none")


@pytest.mark.parametrize("layout", list(ALL))
def test_every_sequence_parallel_gemm_runs_round_the_ring(results, layout):
    flags, tp, dp = ALL[layout].flags, ALL[layout].tp, ALL[layout].dp
    forward = GEMMS + (BLOCK_GEMMS if "--recompute-granularity" in flags else 0)   # recompute: blocks again
    expected = STEPS * (MICRO_BATCHES // dp) * (forward + GEMMS) * (tp - 1) if OVERLAP in flags else 0
    assert results[layout]["passes"] == expected, layout
