"""tests/helpers/timing.py: the machine's slowness the tests' waits are scaled by, on a fake clock and a fake load."""

import pytest
from helpers import timing


def clock(*runs: float):
    """A fake clock read twice per workload run (before and after), on which the runs take `runs` seconds."""
    readings = [0.0]
    for run in runs:
        readings += [readings[-1] + run, readings[-1] + run]
    return iter(readings).__next__


QUIET = timing.QUIET_SECONDS


@pytest.mark.parametrize("run, load, cores, expected", [
    (QUIET / 2, 0.0, 2, 1.0),  # faster than the reference: never below 1
    (QUIET, 1.0, 2, 1.0),  # a quiet machine
    (3 * QUIET, 1.0, 2, 3.0),  # the workload takes three times as long
    (QUIET, 9.0, 2, 4.5),  # other jobs wait for the cores: the load per core says more
    (1000 * QUIET, 0.0, 2, timing.MOST),  # broken rather than slow: capped
])
def test_slowness_is_the_larger_of_the_workload_ratio_and_the_load_per_core(run, load, cores, expected):
    assert timing.slowness(clock(*[run] * timing.RUNS), lambda: load, cores) == pytest.approx(expected)


def test_one_slow_run_does_not_count():
    runs = [QUIET] * (timing.RUNS - 1) + [50 * QUIET]
    assert timing.slowness(clock(*runs), lambda: 0.0, 2) == pytest.approx(1.0)


def test_waits_grow_with_the_sessions_slowness(monkeypatch):
    monkeypatch.setattr(timing, "session_slowness", lambda: 2.5)
    assert timing.scaled(20) == 50.0
