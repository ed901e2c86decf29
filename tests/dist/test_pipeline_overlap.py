"""--overlap-p2p-communication in the runner, on a toy two-rank pipeline (gloo).

The trainer's runs under the flag are compared with one process and with the same layout
without it in tests/dist/test_pipeline.py. This checks what equal results cannot show:
where the runner waits. With the flag some compute runs while a posted transfer is still
unwaited; without it none does. Every stage multiplies by its weight, so the gradients
are known by hand.
"""

from math import factorial
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.dist.launcher import run_distributed

SHAPE, MICRO_BATCHES = (1, 2, 3), 4


class _LoggedWork:
    def __init__(self, work, batch: int, events: list):
        self.work, self.batch, self.events = work, batch, events

    def wait(self):
        self.events.append(("wait", self.batch))
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _run_toy_pipelines(cases: list[tuple[int, bool]]) -> dict:
    """Per (vp_size, overlap_p2p): the event log of this rank's run and its weights' gradients by stage."""
    from tessera.parallel.pipeline import PipelineGroups, PipelineRunner
    from tessera.parallel.pipeline_schedules import build_schedule

    rank, post = dist.get_rank(), dist.batch_isend_irecv
    groups = PipelineGroups(ranks=(0, 1), activations=dist.new_group([0, 1]), gradients=dist.new_group([0, 1]),
                            embedding=None, embedding_dp=None)
    out = {}
    for vp_size, overlap_p2p in cases:
        schedule = build_schedule("1f1b", 2, MICRO_BATCHES, vp_size, overlap_p2p=overlap_p2p)
        runner = PipelineRunner(schedule, rank, groups, activation_shape=SHAPE, dtype=torch.float32,
                                device=torch.device("cpu"))
        weights = [torch.tensor(runner.stage(chunk) + 1.0, requires_grad=True) for chunk in range(vp_size)]
        events = []

        def forward_step(chunk, micro_batch, hidden, runner=runner, weights=weights, events=events):
            events.append(("compute",))
            output = (torch.full(SHAPE, micro_batch + 1.0) if hidden is None else hidden) * weights[chunk]
            return output.sum() if runner.stage(chunk) == runner.last_stage else output

        def logged_post(ops, events=events):
            batch = sum(event[0] == "post" for event in events)
            events.append(("post", batch))
            return [_LoggedWork(work, batch, events) for work in post(ops)]

        with mock.patch.object(dist, "batch_isend_irecv", logged_post):
            runner.run(forward_step, before_backward=lambda micro_batch, chunk, events=events: events.append(
                ("compute",)))
        out[vp_size, overlap_p2p] = {"events": events,
                                     "grads": {runner.stage(c): w.grad.item() for c, w in enumerate(weights)}}
    return out


def _computes_before_first_wait(events: list) -> dict[int, int]:
    """Per posted batch: how many computes ran between posting it and the first wait on it."""
    counts, open_batches = {}, {}
    for event in events:
        if event[0] == "post":
            open_batches[event[1]] = 0
        elif event[0] == "compute":
            for batch in open_batches:
                open_batches[batch] += 1
        elif event[1] in open_batches:
            counts[event[1]] = open_batches.pop(event[1])
    assert not open_batches, f"batches never waited on: {sorted(open_batches)}"
    return counts


CASES = [(1, False), (1, True), (2, False), (2, True)]


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run_toy_pipelines, 2, CASES)


@pytest.mark.parametrize("vp_size, overlap_p2p", CASES)
def test_runner_waits_where_the_schedule_says_and_gradients_stay_exact(runs, vp_size, overlap_p2p):
    stages = 2 * vp_size
    grads = {stage: grad for rank in runs for stage, grad in rank[vp_size, overlap_p2p]["grads"].items()}
    # loss = numel x sum(mb + 1) x prod(w_s), w_s = s + 1: d loss / d w_s = numel x 10 x stages! / (s + 1)
    numel, inputs = SHAPE[0] * SHAPE[1] * SHAPE[2], sum(mb + 1 for mb in range(MICRO_BATCHES))
    assert grads == {s: numel * inputs * factorial(stages) / (s + 1) for s in range(stages)}
    for rank, run in enumerate(runs):
        counts = _computes_before_first_wait(run[vp_size, overlap_p2p]["events"])
        if overlap_p2p:
            assert max(counts.values()) >= 1, f"rank {rank}: every transfer was waited on before the next compute"
        else:
            assert set(counts.values()) == {0}, f"rank {rank}: a compute ran before a batch was waited on"


def test_overlap_p2p_needs_pipeline_parallelism():
    from tessera.config import ConfigError
    from tessera.config.parallel import ParallelConfig

    with pytest.raises(ConfigError, match="--overlap-p2p-communication needs --pipeline-model-parallel-size > 1"):
        ParallelConfig(overlap_p2p_communication=True)
    ParallelConfig(overlap_p2p_communication=True, pipeline_model_parallel_size=2)
