"""Megatron's published H100 scaling runs, predicted within 4 MFU points."""

import pytest

from tessera.perf.published import STRONG_SCALING, WEAK_SCALING, reproduce


@pytest.fixture(scope="module")
def weak():
    return reproduce(WEAK_SCALING)


def test_weak_scaling_within_4_points_of_every_row(weak):
    for run, prediction in weak:
        assert prediction.layout.tp == run.tp and prediction.layout.pp == run.pp and prediction.layout.dp == 48
        assert abs(prediction.mfu - run.mfu) <= 0.04, run.label


def test_strong_scaling_falls_like_the_published_runs():
    results = reproduce(STRONG_SCALING)
    published = [(run, p) for run, p in results if run.mfu is not None]
    for run, prediction in published:
        assert abs(prediction.mfu - run.mfu) <= 0.04, run.gpus
    first, last = results[0][1], results[-1][1]
    assert first.mfu - last.mfu > 0.02           # communication and the bubble grow with the GPUs
