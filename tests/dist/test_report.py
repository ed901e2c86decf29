"""An error several ranks find is printed by one of them; distinct errors by each rank that finds one."""

from tessera.parallel.report import first_to_report
from tests.dist.launcher import run_distributed


def report(messages: list[str]) -> list[bool]:
    import torch.distributed as dist

    return [first_to_report(message.format(rank=dist.get_rank())) for message in messages]


def test_the_same_error_is_reported_by_one_rank_and_distinct_errors_by_each():
    results = run_distributed(report, 3, ["--num-query-groups (3) cannot be split", "rank {rank}: no such file"])
    same, own = zip(*results)
    assert sum(same) == 1
    assert all(own)


def test_without_a_job_the_error_is_reported():
    assert first_to_report("anything")
