"""One process's pass over its share of a batch: each document that the results file does not show as finished
with the same settings is worked on and its lines appended; a document that fails gets an error line and the batch
goes on.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import GaliError
from .launcher import Rank
from .results_file import ResultsFile, Stopwatch, content_hash, job_hash


@dataclass
class Outcome:
    """What one process did with its share of a batch."""

    documents: int = 0  # its share
    done: int = 0
    skipped: int = 0  # finished by an earlier run with the same settings
    failed: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Step:
    """One document of a batch as `run_batch` reports it: "started", then "ok" (with its records), "skipped"
    (finished by an earlier run with the same settings) or "error" (with why)."""

    path: Path
    status: str
    records: tuple[dict, ...] = ()
    error: str = ""
    seconds: float = 0.0


def run_batch(
    documents: list[Path],
    results: ResultsFile,
    job: dict,
    work: Callable[[Path], list[dict]],
    rank: Rank,
    progress: Callable[[Outcome, Step], None] = lambda outcome, step: None,
) -> Outcome:
    """Run `work` on this process's share of `documents` not already finished, appending its records (one or
    more per document, each with its "tokens") to `results`; a document that fails gets an error record and the
    batch goes on. `progress` hears about each document as it starts and once it is finished."""
    key = job_hash(job)
    finished = results.finished()
    share = rank.shard(documents)
    outcome = Outcome(documents=len(share))
    for path in share:
        progress(outcome, Step(path, "started"))
        base = {"path": str(path), "job": key}
        try:
            base["sha256"] = content_hash(path)
            if (base["path"], base["sha256"], key) in finished:
                outcome.skipped += 1
                progress(outcome, Step(path, "skipped"))
                continue
            stopwatch = Stopwatch()
            records = work(path)
            cost = stopwatch.elapsed()
        except KeyboardInterrupt:
            raise
        except Exception as error:  # one document's failure must not stop the batch
            message = str(error) if isinstance(error, GaliError) else f"{type(error).__name__}: {error}"
            results.append([{**base, "status": "error", "error": message, **job}])
            outcome.failed += 1
            progress(outcome, Step(path, "error", error=message))
            continue
        results.append([{**base, "status": "ok", **job, **record, **cost, "line": [index, len(records)]}
                        for index, record in enumerate(records)])
        outcome.done += 1
        outcome.tokens += sum(record.get("tokens", 0) for record in records)
        progress(outcome, Step(path, "ok", tuple(records), seconds=cost["seconds"]))
    return outcome
