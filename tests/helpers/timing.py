"""How slow this machine is right now, so that the tests' waits grow with it instead of being constants.

A wait in a test is either a guard against a hang (a generous bound on something that normally takes a fraction of
it) or the behaviour under test (the server closes a slow client within a few seconds). Both were written on a
quiet machine; on a shared one, with other jobs holding the cores, the same work takes several times longer and a
constant fails a test that would pass alone. `scaled(seconds)` is `seconds` times the machine's slowness: how much
longer than on a quiet machine a fixed piece of work takes now, or the load average per core, whichever is larger.
It is measured once per test session.
"""

import os
import statistics
import time
from collections.abc import Callable
from functools import cache

# The workload's time on a quiet machine, measured on the project's two-core CPU on 2026-11-28 at load 5-6 from other
# jobs: the fastest of 200 runs of its first 20,000 steps took 1.2 ms (a run that short fits in one scheduler slice,
# so it runs as on a quiet machine), times 15; the whole workload's median was then 45 ms, 2.5 times it.
QUIET_SECONDS = 0.018
RUNS = 5  # the workload's runs per measurement; their median is taken
MOST = 20.0  # slowness is capped here: past it a run is broken rather than slow, and a bound must still end it


def workload() -> int:
    """A fixed piece of pure-Python work of about 20 ms on a quiet machine, on one core as most of a test's waiting
    is; long enough to span several scheduler slices, so that other jobs' share of the core shows in its time."""
    return sum(index * index % 7 for index in range(300_000))


def slowness(clock: Callable[[], float] = time.perf_counter, load: Callable[[], float] | None = None,
             cores: int | None = None) -> float:
    """How many times slower than a quiet machine this one is now, at least 1 and at most MOST: the median time of
    RUNS workloads against QUIET_SECONDS, or the 1-minute load average per core, whichever is larger."""
    times = []
    for _ in range(RUNS):
        started = clock()
        workload()
        times.append(clock() - started)
    per_core = (load or (lambda: os.getloadavg()[0]))() / (cores or os.cpu_count() or 1)
    return min(MOST, max(1.0, statistics.median(times) / QUIET_SECONDS, per_core))


@cache
def session_slowness() -> float:
    """slowness(), measured once per test session (the first test that waits measures it)."""
    return slowness()


def scaled(seconds: float) -> float:
    """`seconds`, a wait written for a quiet machine, for this machine as loaded as it is now."""
    return seconds * session_slowness()
