"""bench/bench.py's pipeline bound: each stage by its threads, and the CPU by its cores."""
from __future__ import annotations

import pytest

from tests.support.pipeline_bound import pipeline_bound


def test_prepare_is_bounded_by_its_pool_not_by_one_thread():
    # prepare 10 ms on 2 workers: 200 frames/s from prepare, not 100; plenty of cores
    stages = {"prepare": 0.010, "encode": 0.002, "decode": 0.001}
    assert pipeline_bound(stages, prepare_workers=2, cores=16) == pytest.approx(200)
    assert pipeline_bound(stages, prepare_workers=1, cores=16) == pytest.approx(100)


def test_the_slowest_single_thread_stage_or_the_cores_bound_it():
    stages = {"prepare": 0.001, "encode": 0.008, "decode": 0.005}
    assert pipeline_bound(stages, prepare_workers=2, cores=16) == pytest.approx(125)  # 1 / encode
    assert pipeline_bound(stages, prepare_workers=2, cores=1) == pytest.approx(1 / 0.014)  # one core: the sum
