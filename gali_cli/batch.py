"""Many documents in one run: which documents, which are already done, which are this process's, and the results
file that makes a run resumable.

A results file is JSON lines, one per finished document (and method, for ppl). Each line carries the document's
path and content hash and the hash of the job's settings; a rerun skips the documents whose line says they were done
with the same settings, so an interrupted run resumes where it stopped. Lines are written whole (one write call) and
flushed to disk; a line cut by a kill is dropped when the file is next opened.

Under torchrun or `accelerate launch` (RANK / WORLD_SIZE in the environment) each process takes every WORLD_SIZE-th
document of the sorted list, writes its own part file next to the results file, and rank 0 merges the parts once all
processes are done.
"""

import glob
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .errors import ConfigError, GaliError, InputError

# Files a directory contributes; anything else in it (images, binaries, code) is left alone.
DOCUMENT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".html", ".htm", ".pdf")
_GLOB_CHARACTERS = set("*?[")


def expand_documents(specs: list[str]) -> list[Path]:
    """The documents named by `specs`, in order, each once: files, directories (searched recursively for
    DOCUMENT_SUFFIXES, hidden entries skipped), glob patterns (`**` recurses), and `@list.txt` manifests with one
    path, directory or pattern per line (relative to the manifest's folder; blank lines and # comments skipped)."""
    found: dict[Path, None] = {}
    for spec in specs:
        for path in _expand(spec, Path.cwd(), manifests_seen=set()):
            found.setdefault(path, None)
    if not found:
        raise InputError(f"no documents in {' '.join(specs)}")
    return list(found)


def _expand(spec: str, base: Path, manifests_seen: set[Path]) -> Iterator[Path]:
    if spec == "-":
        raise ConfigError("several documents are read from files, not from standard input ('-')")
    if spec.startswith("@"):
        manifest = (base / Path(spec[1:]).expanduser()).resolve()
        if manifest in manifests_seen:
            raise InputError(f"manifest {manifest} includes itself")
        try:
            lines = manifest.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"cannot read manifest {spec[1:]}: {error}") from error
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                try:
                    yield from _expand(line, manifest.parent, manifests_seen | {manifest})
                except InputError as error:
                    raise InputError(f"{spec[1:]}, line {number}: {error}") from None
        return
    path = base / Path(spec).expanduser()
    if path.is_file():
        yield path.resolve()
    elif path.is_dir():
        files = [found for found in path.rglob("*") if found.is_file() and found.suffix.lower() in DOCUMENT_SUFFIXES
                 and not any(part.startswith(".") for part in found.relative_to(path).parts)]
        if not files:
            raise InputError(f"{spec}: no documents ({', '.join(DOCUMENT_SUFFIXES)}) in this directory")
        yield from sorted(found.resolve() for found in files)
    elif _GLOB_CHARACTERS & set(spec):
        matches = sorted(Path(match).resolve() for match in glob.glob(str(path), recursive=True)
                         if Path(match).is_file())
        if not matches:
            raise InputError(f"{spec}: no file matches")
        yield from matches
    else:
        raise InputError(f"{spec}: no such file or directory")


def content_hash(path: Path) -> str:
    """SHA-256 of the file's bytes: a document edited since its line was written is done again."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def job_hash(job: dict) -> str:
    """A short name for everything that decides a document's output besides its content."""
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Rank:
    """This process's place among the launcher's processes (0 of 1 when run alone)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_environment(cls) -> "Rank":
        """From RANK / WORLD_SIZE / LOCAL_RANK, which torchrun and `accelerate launch` set."""
        try:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except ValueError as error:
            raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be whole numbers: {error}") from None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK {rank} is not within WORLD_SIZE {world}")
        return cls(rank, world, local_rank)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def shard(self, documents: list[Path]) -> list[Path]:
        """This process's documents: every world-th of the list, starting at its rank (the same split on every
        process, as each expands the same arguments)."""
        return documents[self.rank :: self.world]


class ResultsFile:
    """The results file `path` (JSON lines) and, when distributed, this process's part file next to it."""

    def __init__(self, path: Path, rank: Rank) -> None:
        self.path = path
        self.rank = rank
        self.part = path.with_name(f"{path.name}.rank{rank.rank}-of-{rank.world}.part") if rank.distributed else path
        if path.exists() and not path.is_file():
            raise ConfigError(f"--out {path}: not a file")

    def finished(self) -> set[tuple[str, str, str]]:
        """(path, content hash, job) of every document some earlier run (or process) finished without error."""
        done = set()
        for file in [self.path, *self._parts()]:
            for record in _records(file):
                if record.get("status") == "ok":
                    done.add((record.get("path"), record.get("sha256"), record.get("job")))
        return done

    def records(self) -> list[dict]:
        """Every whole line of the results file."""
        return list(_records(self.path))

    def append(self, record: dict) -> None:
        """Add one line, whole: a single write, then flushed to disk."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        self.part.parent.mkdir(parents=True, exist_ok=True)
        _drop_cut_line(self.part)
        descriptor = os.open(self.part, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def merge(self) -> None:
        """Rank 0, once every process is done: move the part files' lines into the results file."""
        seen = {json.dumps(record, sort_keys=True) for record in _records(self.path)}
        for part in self._parts():
            for record in _records(part):
                if json.dumps(record, sort_keys=True) not in seen:
                    ResultsFile(self.path, Rank()).append(record)
                    seen.add(json.dumps(record, sort_keys=True))
            part.unlink()

    def _parts(self) -> list[Path]:
        return sorted(self.path.parent.glob(f"{glob.escape(self.path.name)}.rank*-of-*.part"))


def _records(path: Path) -> Iterator[dict]:
    """The whole JSON lines of `path` (none if it does not exist); a line cut short by a kill is skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as error:
        raise InputError(f"cannot read results file {path}: {error}") from error
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def _drop_cut_line(path: Path) -> None:
    """Cut a last line that a killed run left without its newline, so the next line starts on its own."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as file:
        file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        file.seek(0)
        content = file.read()
        file.truncate(content.rfind(b"\n") + 1)


def wait_for_all(rank: Rank, hours: float = 72.0) -> None:
    """Block until every process has reached this point (torch.distributed over gloo, on CPU or GPU machines)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank.rank, world_size=rank.world, timeout=timedelta(hours=hours))
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Outcome:
    """What one process did with its share of a batch."""

    documents: int = 0  # its share
    done: int = 0
    skipped: int = 0  # finished by an earlier run with the same settings
    failed: int = 0
    tokens: int = 0


def run_batch(
    documents: list[Path],
    results: ResultsFile,
    job: dict,
    work: Callable[[Path], list[dict]],
    rank: Rank,
    progress: Callable[[Outcome, Path | None], None] = lambda outcome, path: None,
) -> Outcome:
    """Run `work` on this process's share of `documents` not already finished, appending its records (one or
    more per document, each with its "tokens") to `results`; a document that fails gets an error record and the
    batch goes on. `progress` hears about each document before and after it."""
    key = job_hash(job)
    finished = results.finished()
    share = rank.shard(documents)
    outcome = Outcome(documents=len(share))
    for path in share:
        progress(outcome, path)
        base = {"path": str(path), "job": key}
        try:
            base["sha256"] = content_hash(path)
            if (base["path"], base["sha256"], key) in finished:
                outcome.skipped += 1
                continue
            started = time.perf_counter()
            records = work(path)
            seconds = round(time.perf_counter() - started, 3)
        except KeyboardInterrupt:
            raise
        except Exception as error:  # noqa: BLE001 - one document's failure must not stop the batch
            message = str(error) if isinstance(error, GaliError) else f"{type(error).__name__}: {error}"
            results.append({**base, "status": "error", "error": message, **job})
            outcome.failed += 1
            continue
        for record in records:
            results.append({**base, "status": "ok", **job, **record, "seconds": seconds})
        outcome.done += 1
        outcome.tokens += sum(record.get("tokens", 0) for record in records)
    progress(outcome, None)
    return outcome


def corpus_perplexities(records: list[dict], job: dict, documents: list[Path], by_length: bool) -> list[dict]:
    """Token-weighted perplexity over the documents, per method (and length with `by_length`): exp of the summed
    NLL over the summed predicted tokens, from each document's latest finished record of this job."""
    key, wanted = job_hash(job), {str(path) for path in documents}
    latest = {}
    for record in records:
        if record.get("job") == key and record.get("status") == "ok" and record.get("path") in wanted:
            latest[(record["path"], record.get("method"))] = record
    sums: dict[tuple[str, int | str], list[float]] = {}
    for record in latest.values():
        for result in record.get("results", []):
            group = (record["method"], result["length"] if by_length else "document")
            predicted = result["length"] - 1
            entry = sums.setdefault(group, [0.0, 0, 0])
            entry[0] += result["mean_nll"] * predicted
            entry[1] += predicted
            entry[2] += 1
    return [{"method": method, "length": length, "ppl": math.exp(nll / predicted), "documents": count,
             "tokens": predicted + count}
            for (method, length), (nll, predicted, count) in sums.items() if predicted]


def batch_summary(records: list[dict], job: dict, documents: list[Path]) -> dict:
    """Where every document stands after a run (its latest line of this job): done, failed, or not reached."""
    key, latest = job_hash(job), {}
    for record in records:
        if record.get("job") == key:
            latest[record.get("path")] = record.get("status")
    statuses = [latest.get(str(path)) for path in documents]
    return {"documents": len(documents), "ok": statuses.count("ok"), "failed": statuses.count("error"),
            "missing": statuses.count(None)}
