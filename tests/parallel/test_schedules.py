"""Pipeline schedules checked as data, without a model (tessera.parallel.pipeline_schedules)."""

import dataclasses
from collections import Counter

import pytest

from tessera.config import ConfigError
from tessera.parallel.pipeline_actions import BACKWARD, FORWARD, RECV_ACTIVATION, SEND_ACTIVATION, Action, Schedule
from tessera.parallel.pipeline_schedules import build_schedule
from tessera.parallel.pipeline_simulation import ScheduleError, simulate

# (schedule, pp_size, vp_size, num_micro_batches); interleaving needs m to be a multiple of p.
CASES = sorted({(name, p, 1, m) for name in ("1f1b", "gpipe") for p in (2, 3, 4, 8)
                for m in (1, 2, p - 1, p, p + 1, 3 * p)}
               | {("1f1b", p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)})


def _ids(case):
    name, p, v, m = case
    return f"{name}-p{p}-v{v}-m{m}"


@pytest.mark.parametrize("case", CASES, ids=map(_ids, CASES))
@pytest.mark.parametrize("forward_only", [False, True])
def test_every_micro_batch_runs_forward_then_backward_once_per_chunk(case, forward_only):
    name, p, v, m = case
    schedule = build_schedule(name, p, m, v, forward_only=forward_only)
    expected = {(mb, chunk) for mb in range(m) for chunk in range(v)}
    for rank in range(p):
        compute = [a for a in schedule.ranks[rank] if a.is_compute]
        forwards = [(a.micro_batch, a.chunk) for a in compute if a.kind == FORWARD]
        backwards = [(a.micro_batch, a.chunk) for a in compute if a.kind == BACKWARD]
        assert sorted(forwards) == sorted(expected) and len(set(forwards)) == len(forwards)
        if forward_only:
            assert backwards == []
            continue
        assert sorted(backwards) == sorted(expected)
        position = {(a.kind, a.micro_batch, a.chunk): i for i, a in enumerate(compute)}
        for mb, chunk in expected:
            assert position[FORWARD, mb, chunk] < position[BACKWARD, mb, chunk]


@pytest.mark.parametrize("case", CASES, ids=map(_ids, CASES))
def test_transfers_match_across_ranks_and_bubble_is_the_theoretical_one(case):
    name, p, v, m = case
    schedule = build_schedule(name, p, m, v)
    simulation = simulate(schedule)  # raises if a receive gets the wrong tensor or a rank waits forever
    sends = Counter((rank, a.peer, a.kind.split("_")[1]) for rank in range(p) for a in schedule.ranks[rank]
                    if a.kind.startswith("send"))
    receives = Counter((a.peer, rank, a.kind.split("_")[1]) for rank in range(p) for a in schedule.ranks[rank]
                       if a.kind.startswith("recv"))
    assert sends == receives
    # Forward 1, backward 2 per stage, free transfers: every rank idles (p-1)/(v*m+p-1) of the step.
    for rank in range(p):
        assert simulation.bubble(rank) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 16), (8, 3)])
def test_peak_live_activations(p, m):
    one_f_one_b = simulate(build_schedule("1f1b", p, m)).peak_live_activations
    gpipe = simulate(build_schedule("gpipe", p, m)).peak_live_activations
    assert one_f_one_b == tuple(min(p - rank, m) for rank in range(p))   # rank 0 holds p, never more
    assert gpipe == (m,) * p


@pytest.mark.parametrize("p, v, m", [(2, 2, 8), (4, 2, 16), (4, 3, 8)])
def test_interleaved_peak_is_its_warmup_plus_one(p, v, m):
    peaks = simulate(build_schedule("1f1b", p, m, v)).peak_live_activations
    for rank in range(p):
        assert peaks[rank] == 2 * (p - rank - 1) + (v - 1) * p + 1   # in chunk activations, 1/v of a stage's
    assert peaks[0] < v * m   # fewer than all-forward-all-backward over the same chunks


def test_interleaved_needs_a_multiple_of_pipeline_size():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        build_schedule("1f1b", 4, 6, 2)
    with pytest.raises(ConfigError, match="--pipeline-schedule"):
        build_schedule("gpipe", 4, 8, 2)
    with pytest.raises(ConfigError, match="choose one of"):
        build_schedule("zigzag", 2, 4)


def _replace_rank(schedule, rank, actions):
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_simulator_catches_mismatched_and_deadlocking_transfers(overlap_p2p):
    schedule = build_schedule("gpipe", 2, 2, overlap_p2p=overlap_p2p)
    receiver = list(schedule.ranks[1])
    receives = [i for i, a in enumerate(receiver) if a.kind == RECV_ACTIVATION]
    receiver[receives[0]], receiver[receives[1]] = (dataclasses.replace(receiver[receives[0]], micro_batch=1),
                                                    dataclasses.replace(receiver[receives[1]], micro_batch=0))
    with pytest.raises(ScheduleError, match="carries"):
        simulate(_replace_rank(schedule, 1, receiver))
    sender = [a for a in schedule.ranks[0] if not (a.kind == SEND_ACTIVATION and a.micro_batch == 1)]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(_replace_rank(schedule, 0, sender))


def test_schedule_prints_one_line_per_rank_and_knows_each_chunks_last_backward():
    schedule = build_schedule("1f1b", 2, 4, 2)
    text = schedule.format()
    assert "interleaved-1f1b" in text and "rank 0: F0 [send_act0.0->1]" in text
    assert "rank 1: [recv_act0.0<-0] F0" in text
    assert schedule.last_backwards(0) == {(3, 1), (3, 0)}
    assert str(Action(BACKWARD, 2, 1)) == "B2.1"


# --overlap-p2p-communication: every schedule kind, p in 2..4, v in 1..3 where allowed, m in p..3p.
OVERLAP_CASES = sorted({(name, p, 1, m) for name in ("1f1b", "gpipe") for p in (2, 3, 4) for m in range(p, 3 * p + 1)}
                       | {("1f1b", p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)})


def _computes(schedule, rank):
    return [a for a in schedule.ranks[rank] if a.is_compute]


def _consumer(receive):
    return (FORWARD if receive.kind == RECV_ACTIVATION else BACKWARD, receive.micro_batch, receive.chunk)


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=map(_ids, OVERLAP_CASES))
@pytest.mark.parametrize("forward_only", [False, True])
def test_overlapped_schedules_cannot_deadlock_and_keep_the_compute_order(case, forward_only):
    name, p, v, m = case
    plain = build_schedule(name, p, m, v, forward_only=forward_only)
    overlapped = build_schedule(name, p, m, v, forward_only=forward_only, overlap_p2p=True)
    simulation = simulate(overlapped)   # raises on a deadlock or a receive of the wrong tensor
    for rank in range(p):
        assert _computes(overlapped, rank) == _computes(plain, rank)
        assert Counter(overlapped.ranks[rank]) == Counter(plain.ranks[rank])   # the same transfers, moved
    if not forward_only:   # free transfers: the same bubble and peak memory as without overlap
        assert simulation.peak_live_activations == simulate(plain).peak_live_activations
        for rank in range(p):
            assert simulation.bubble(rank) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("case", [("1f1b", 4, 1, 8), ("1f1b", 2, 2, 4), ("gpipe", 3, 1, 5)], ids=_ids)
def test_overlapped_receives_arrive_during_the_compute_of_the_other_kind(case):
    """A receive is posted before the compute that precedes its consumer when that compute is
    of the other kind (it runs while the transfer is in flight), else right before its consumer;
    sends right after the compute that produced them."""
    name, p, v, m = case
    schedule = build_schedule(name, p, m, v, overlap_p2p=True)
    for rank in range(p):
        actions = list(schedule.ranks[rank])
        position = {(a.kind, a.micro_batch, a.chunk): i for i, a in enumerate(actions) if a.is_compute}
        for index, action in enumerate(actions):
            if action.is_compute:
                continue
            if action.kind.startswith("send"):
                producer = (FORWARD if action.kind == SEND_ACTIVATION else BACKWARD, action.micro_batch, action.chunk)
                assert all(not a.is_compute for a in actions[position[producer] + 1:index])
                continue
            consumer = position[_consumer(action)]
            between = [a for a in actions[index:consumer] if a.is_compute]
            before = [a for a in actions[:consumer] if a.is_compute][-1:]
            expected = before if before and before[0].kind != actions[consumer].kind else []
            assert between == expected, f"rank {rank}: {action} is posted before {between}"


def test_overlapped_model_waits_for_whole_groups_in_stream_order():
    """Rank 1 receives both of rank 0's activations in one batch up front. Either NCCL rule
    of the model deadlocks it, where gloo's per-transfer matching would not: F0 waits for
    its receive's whole group, so for rank 0's second send, which follows F0.1, which needs
    rank 1's send after F0; and in stream order that send queues behind the receive of rank
    0's second send. Receiving them in separate batches is fine."""
    send, recv = SEND_ACTIVATION, RECV_ACTIVATION
    rank0 = (Action(FORWARD, 0, 0), Action(send, 0, 0, 1), Action(recv, 0, 1, 1), Action(FORWARD, 0, 1),
             Action(send, 0, 1, 1))
    grouped = (Action(recv, 0, 0, 0), Action(recv, 0, 1, 0), Action(FORWARD, 0, 0), Action(send, 0, 0, 0),
               Action(FORWARD, 0, 1))
    separate = (Action(recv, 0, 0, 0), Action(FORWARD, 0, 0), Action(send, 0, 0, 0), Action(recv, 0, 1, 0),
                Action(FORWARD, 0, 1))
    schedule = Schedule("hand-made", 2, 2, 1, True, (rank0, grouped), overlap_p2p=True)
    with pytest.raises(ScheduleError, match="overlapped\\) deadlocks"):
        simulate(schedule)
    simulate(dataclasses.replace(schedule, ranks=(rank0, separate)))
