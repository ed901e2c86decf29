"""Data, tensor and sequence parallelism, the four --data-parallel-sharding-strategy values
(DDP, the distributed optimizer, FSDP2 without and with resharding after forward), HSDP
(--num-distributed-optimizer-instances), alone and combined, against single-process training."""

import pytest
import torch

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist.equivalence import assert_equivalent, late_parameter_gathers, train
from tests.dist.launcher import run_distributed
from tests.dist import equivalence

PARAM_GATHER = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--ddp-bucket-size", "20000"]
STRATEGY = "--data-parallel-sharding-strategy"
HSDP = ["--num-distributed-optimizer-instances", "2"]   # 2 replicas x DP / 2 shards
# (--use-distributed-optimizer and --use-torch-fsdp2 set the same switches as optim and
# optim_grads_params: tests/parallel/test_sharding_strategy_flags.py)
LAYOUTS = {
    2: {
        "DP=2 no_shard": [STRATEGY, "no_shard"],
        "DP=2 overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
        "DP=2 optim": [STRATEGY, "optim"],
        "DP=2 distributed optimizer, overlap, param gather": PARAM_GATHER,
        "DP=2 optim_grads": [STRATEGY, "optim_grads"],
        "DP=2 optim_grads_params": [STRATEGY, "optim_grads_params"],
        "TP=2": ["--tensor-model-parallel-size", "2"],
        "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    },
    4: {
        "DP=4": [],
        "DP=4 overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", "30000"],
        "DP=4 distributed optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
        "TP=4 (2 KV groups replicated)": ["--tensor-model-parallel-size", "4"],
        "TP=2 x DP=2": ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"],
        "TP=2 + SP x DP=2 distributed optimizer": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                   "--use-distributed-optimizer", "--overlap-grad-reduce"],
        "TP=2 x FSDP2 DP=2": ["--tensor-model-parallel-size", "2", "--use-torch-fsdp2"],
        "HSDP 2x2 optim": HSDP + [STRATEGY, "optim", "--overlap-grad-reduce", "--ddp-bucket-size", "30000"],
        "HSDP 2x2 optim_grads_params (Megatron-FSDP's default)": HSDP + ["--use-megatron-fsdp"],
        "HSDP 2 replicas x CP=2 optim_grads": HSDP + ["--context-parallel-size", "2", STRATEGY, "optim_grads"],
        "HSDP 2 replicas x CP=2 optim": HSDP + ["--context-parallel-size", "2", STRATEGY, "optim"],
    },
}


@pytest.fixture(scope="module")
def reference():
    return train([])


@pytest.fixture(scope="module")
def results():
    out = {}
    for world_size, layouts in LAYOUTS.items():
        out.update(run_distributed(equivalence.train_layouts, world_size, layouts)[0])
    return out


@pytest.mark.parametrize("layout", [name for layouts in LAYOUTS.values() for name in layouts])
def test_layout_matches_single_process(reference, results, layout):
    assert_equivalent(reference, results[layout], layout)


def _train_with_late_gathers(flags: list[str]) -> dict:
    with late_parameter_gathers():
        return train(flags)


def test_training_returns_the_gathered_parameters(reference):
    # The last step's gathers are still in flight when the loop ends; train() must wait.
    result = run_distributed(_train_with_late_gathers, 2, PARAM_GATHER)[0]
    assert_equivalent(reference, result, "DP=2 distributed optimizer, param gathers delivered late")


def _launch_pattern():
    """Which buckets have started reducing when backward ends, per micro-batch kind."""
    import torch

    from tessera.config import ParallelConfig
    from tessera.parallel.ddp import GradBuffer
    from tessera.parallel.mesh import Mesh

    mesh = Mesh.build(ParallelConfig(), "cpu")
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    grads = GradBuffer(list(model.parameters()), mesh.group("dp_cp"), bucket_size=200, overlap=True,
                       reduce_scatter=False)
    started = {}
    for last in (False, True):
        grads.zero()
        grads.set_last_micro_batch(last)
        model(torch.randn(3, 16)).sum().backward()
        started[last] = [bucket.work is not None for bucket in grads.buckets]
        grads.finish()
    return len(grads.buckets), started


def test_overlap_starts_every_bucket_during_the_last_backward_only():
    num_buckets, started = run_distributed(_launch_pattern, 2)[0]
    assert num_buckets >= 3
    assert started[False] == [False] * num_buckets   # accumulation micro-batches: no communication
    assert started[True] == [True] * num_buckets     # all launched before finish() is called


def _state_bytes(flags):
    from tessera.cli.args import parse_run_config
    from tessera.training.trainer import Trainer
    import torch.distributed as dist

    config, _ = parse_run_config(equivalence.BASE + flags, "test", world_size=dist.get_world_size())
    return Trainer(config).optimizer.state_bytes()


def test_distributed_optimizer_shards_the_state():
    replicated = run_distributed(_state_bytes, 2, [])[0]
    sharded = run_distributed(_state_bytes, 2, ["--use-distributed-optimizer"])
    assert all(abs(s - replicated / 2) < 0.01 * replicated for s in sharded)


FP16 = ["--fp16", "--initial-loss-scale", str(2.0**30), "--hysteresis", "1"]


def test_fp16_overflow_skips_agree_across_ranks():
    """fp16 with a scale that overflows at first: every rank skips the same iterations, and
    the run matches the single-process one (loss, norm, parameters)."""
    reference = train(FP16)
    assert any(norm != norm or norm == float("inf") for norm in reference["grad_norm"])  # overflowed
    results = run_distributed(equivalence.train_layouts, 2,
                              {"dist-opt": FP16 + ["--use-distributed-optimizer", "--overlap-grad-reduce"]})
    assert_equivalent(reference, results[0]["dist-opt"], "DP=2 fp16 distributed optimizer")


def test_bf16_moments_shard_like_fp32_ones():
    """--use-precision-aware-optimizer with bf16 moments: DP=2 steps each slice as one process does."""
    flags = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
             "--exp-avg-sq-dtype", "bf16", "--overlap-grad-reduce"]
    results = run_distributed(equivalence.train_layouts, 2, {"bf16 moments": flags})
    # Moments keep 8 bits: a last-bit difference in a gradient sum (DP adds the halves in another
    # order) can flip an element's rounding and move its update by 2^-8 of itself. Such flips reach
    # ~1e-5 of a weight's norm in 5 steps (1.06e-5 on one x86 CPU, below 1e-5 on earlier ones); a slice
    # stepped wrongly would be off by far more.
    assert_equivalent(train(flags), results[0]["bf16 moments"], "DP=2 distributed optimizer, bf16 moments",
                      params_rtol=1e-4)


def _bf16_gathers(flags: list[str]) -> tuple[dict, set, set]:
    """A run's results, the dtypes of the weights a block computes with (its forward's), and of its shards."""
    config, _ = parse_run_config(equivalence.BASE + flags, "test", world_size=2)
    trainer = Trainer(config)
    block = trainer.model.layers[0]
    computed = set()
    block.register_forward_pre_hook(lambda module, args: computed.update(p.dtype for p in module.parameters()))
    results = equivalence.result(trainer, trainer.train())
    return results, computed, {p.dtype for p in block.parameters()}


def test_fsdp2_computes_with_bf16_gathers_as_the_distributed_optimizer_with_bf16_weights():
    """--bf16 under FSDP2: the fp32 shards are gathered in bf16 and the gradients reduced in fp32, as the
    distributed optimizer's bf16 weights and fp32 gradient sums (--accumulate-allreduce-grads-in-fp32) do."""
    fsdp2, computed, sharded = run_distributed(_bf16_gathers, 2, ["--bf16", "--use-torch-fsdp2"])[0]
    assert computed == {torch.bfloat16} and sharded == {torch.float32}
    distributed = run_distributed(equivalence.train_layouts, 2, {"dist-opt": [
        "--bf16", "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32"]})[0]["dist-opt"]
    # The distributed optimizer's model holds its fp32 masters rounded to bf16, FSDP2's the masters
    # themselves: compared rounded, where a master a few ulps off may round one bf16 ulp the other way.
    fsdp2["params"] = {name: weight.bfloat16().float() for name, weight in fsdp2["params"].items()}
    assert_equivalent(distributed, fsdp2, "DP=2 FSDP2 bf16 against the distributed optimizer's bf16 weights",
                      params_rtol=1e-4)


def test_decoupled_lr_shards_like_the_single_process_run(reference):
    """--decoupled-lr's groups hold the embedding and output layer whatever holds the weights: the
    distributed optimizer's slices or FSDP2's DTensor shards."""
    decoupled = ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3"]
    expected = train(decoupled)
    layouts = {"DP=2 optim": decoupled + [STRATEGY, "optim"],
               "DP=2 optim_grads_params": decoupled + [STRATEGY, "optim_grads_params"]}
    for name, result in run_distributed(equivalence.train_layouts, 2, layouts)[0].items():
        assert_equivalent(expected, result, name)
    assert expected["loss"] != reference["loss"]    # the decoupled rate changed the run
