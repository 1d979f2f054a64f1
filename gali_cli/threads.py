"""How many CPU threads torch runs on, and how its OpenMP threads wait, so that a busy machine does not collapse.

torch's CPU wheel runs on GNU OpenMP (libgomp), whose threads by default spin at each barrier before they sleep.
When other processes want the same cores, a spinning thread burns the time slice its partner needs: on a loaded
machine `gali summarize` decoded many times slower with torch's defaults than with OMP_WAIT_POLICY=PASSIVE
(docs/usage.md, "CPU threads"; benchmarks/bench_threads.py). libgomp reads that variable once, when torch loads
it, so `prepare_openmp` runs before torch is imported (gali_cli.entry). KMP_BLOCKTIME is Intel OpenMP's and does
nothing to libgomp.

The thread count: --threads (GALI_THREADS), else torch's own (OMP_NUM_THREADS, else the physical cores). Nothing
here imports torch at module level.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from .errors import ConfigError

WAIT_POLICY = "OMP_WAIT_POLICY"
# Past the CPUs, more threads only take turns on them; far past, each is an OS thread OpenMP starts at once:
# --threads 100000 started ~100,000 of them (a fork storm outside a cgroup), then torch failed and segfaulted.
THREADS_PER_CPU = 4


def prepare_openmp() -> None:
    """Make OpenMP's threads sleep rather than spin while they wait, unless the user chose otherwise; call before
    torch is imported (later, libgomp has read its environment)."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def most_threads() -> int:
    """The most threads a run may ask for: THREADS_PER_CPU per logical CPU of this machine."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def check_threads(count: int | None) -> None:
    """A ConfigError for a thread count past `most_threads()`, before torch starts any thread (None: torch's own)."""
    if count is not None and count > most_threads():
        raise ConfigError(f"{count} threads is more than {THREADS_PER_CPU} per CPU ({most_threads()} on this "
                          f"machine's {os.cpu_count() or 1} CPUs); leave it out for torch's default")


@dataclass(frozen=True)
class CpuThreads:
    """The thread count a run uses and why: `source` is what -v shows after the count."""

    count: int
    source: str

    def describe(self) -> str:
        """-v's line, e.g. "threads: 2 (torch's default, the physical cores; load 5.2); OpenMP waits PASSIVE"."""
        return f"threads: {self.count} ({self.source}); OpenMP waits {os.environ.get(WAIT_POLICY, 'by its default')}"


def choose_threads(requested: int | None, torch_default: int) -> CpuThreads:
    """The count for `requested` (--threads; None: torch's own default, which follows OMP_NUM_THREADS and is
    otherwise the physical cores). Under load, fewer threads did not help once OpenMP waits passively
    (docs/performance.md, "Threads on a loaded machine")."""
    if requested:
        return CpuThreads(requested, "--threads")
    load = f"; load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    source = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "torch's default, the physical cores"
    return CpuThreads(torch_default, f"{source}{load}")


_in_use: ContextVar[CpuThreads | None] = ContextVar("gali_cpu_threads", default=None)


def in_use() -> CpuThreads | None:
    """The threads the current run chose (inside `cpu_threads`), for -v to show; None outside a run."""
    return _in_use.get()


@contextmanager
def cpu_threads(requested: int | None) -> Iterator[CpuThreads]:
    """torch's intra-op threads set for the block (as `choose_threads` decides), and restored afterwards."""
    import torch

    before = torch.get_num_threads()
    chosen = choose_threads(requested, before)
    torch.set_num_threads(chosen.count)
    token = _in_use.set(chosen)
    try:
        yield chosen
    finally:
        _in_use.reset(token)
        torch.set_num_threads(before)
