"""The results file of a batch: what makes a run resumable, and what is read back from it.

A results file is JSON lines, one per finished document (and method, for ppl). Each line carries the document's
path and content hash and the hash of the job's settings; a rerun skips the documents whose line says they were done
with the same settings, so an interrupted run resumes where it stopped. Lines are written whole and flushed to disk;
a line cut by a kill or a full disk is skipped when read and removed before the next line is written.

Under a launcher (launcher.py) each process writes its own part file next to the results file, and rank 0 merges
the parts once all processes are done.

One run at a time per results file: a run holds a lock on a hidden file beside it (`.NAME.lock`, with its process id)
from before it merges or appends anything until it is done, and a second run refuses to start. The lock is the
operating system's (flock; POSIX systems only), so a run that is killed leaves it free.
"""

import glob
import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, GaliError
from ..file_locks import is_held_elsewhere, lock_exclusive
from ..printable import json_text
from .launcher import Rank

_LONGEST_LINE = 64 * 2**20  # bytes: no line gali writes in a results file comes near (an answer is a few KB)


@dataclass(frozen=True)
class Stopwatch:
    """What one line of a results file cost in time: `seconds` of wall time, and `cpu_seconds` of this process's
    CPU time (all its threads), which a machine shared with other work does not inflate as it does the wall time."""

    wall: float = field(default_factory=time.perf_counter)
    cpu: float = field(default_factory=time.process_time)

    def elapsed(self) -> dict[str, float]:
        """The line's `seconds` and `cpu_seconds` since this stopwatch started."""
        return {"seconds": round(time.perf_counter() - self.wall, 3),
                "cpu_seconds": round(time.process_time() - self.cpu, 3)}


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

class ResultsFile:
    """The results file `path` (JSON lines) and, when distributed, this process's part file next to it."""

    def __init__(self, path: Path, rank: Rank) -> None:
        self.path = path.expanduser().resolve()  # the same file for every process, whatever its folder
        self.rank = rank
        self.part = (self.path.with_name(f"{self.path.name}.rank{rank.rank}-of-{rank.world}.part")
                     if rank.distributed else self.path)
        self.lock_path = self.path.with_name(f".{self.path.name}.lock")
        self._lock: int | None = None  # the locked file's descriptor while this run holds it

    def lock(self) -> str | None:
        """Take the results file for this run; returns None, or (leaving it alone) who holds it: another run.
        Where the file system cannot lock at all, the run goes on unlocked, as it would have without the lock; a
        lock file that cannot be written (a full disk, a read-only folder) is a ConfigError."""
        while self._lock is None:
            try:
                descriptor = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise self._lock_error(error) from None
            try:
                lock_exclusive(descriptor)
            except OSError as error:
                try:
                    holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
                except OSError:
                    holder = ""
                os.close(descriptor)
                if is_held_elsewhere(error):
                    return holder or "another gali run"
                return None
            try:
                if os.stat(self.lock_path).st_ino != os.fstat(descriptor).st_ino:
                    raise FileNotFoundError  # its holder removed it between our open and our lock: take the new one
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, f"gali run {os.getpid()} on {socket.gethostname()}".encode(), 0)
            except FileNotFoundError:
                os.close(descriptor)
                continue
            except OSError as error:
                self._lock = descriptor
                self.unlock()  # ours, so ours to remove
                raise self._lock_error(error) from None
            self._lock = descriptor
        return None

    def _lock_error(self, error: OSError) -> ConfigError:
        return ConfigError(f"--out {self.path}: cannot take its lock ({self.lock_path.name}): "
                           f"{error.strerror or error}")

    def unlock(self) -> None:
        """Let the next run have the results file (removing the lock file first, then releasing it)."""
        if self._lock is not None:
            try:
                self.lock_path.unlink()
            except OSError:
                pass
            os.close(self._lock)
            self._lock = None

    def prepare(self) -> None:
        """Before any work: refuse a file that is not ours (it is never touched), and make sure ours can be
        written, so that a bad --out fails at once rather than after the first document."""
        for file in [self.path, *self._parts()]:
            _check_ours(file)
        try:
            self.part.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.part, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as error:
            raise ConfigError(f"--out {self.path}: cannot write there ({error.strerror})") from None

    def is_output(self, document: Path) -> bool:
        """Whether `document` is the results file, a part of it or its lock (never a document of the batch)."""
        return document in (self.path, self.lock_path) or (document.parent == self.path.parent and document.name
                                                           .startswith(f"{self.path.name}.rank")
                                                           and document.suffix == ".part")

    def finished(self) -> set[tuple[str, str, str]]:
        """(path, content hash, job) of every document some earlier run (or process) finished without error: all
        of its lines are there (each says which of how many it is; a power cut may keep the first of a document's
        lines and lose the rest, and then the document is done again). Lines without that mark (older gali) are
        whole documents."""
        seen: dict[tuple, set[int]] = {}
        done = set()
        for record in self.records(parts=True):
            if record.get("status") != "ok":
                continue
            key = (record.get("path"), record.get("sha256"), record.get("job"))
            mark = record.get("line")
            if not (isinstance(mark, list) and len(mark) == 2 and all(isinstance(value, int) for value in mark)):
                done.add(key)
                continue
            indices = seen.setdefault((*key, mark[1]), set())
            indices.add(mark[0])
            if len(indices) >= mark[1]:
                done.add(key)
        return done

    def records(self, parts: bool = False) -> list[dict]:
        """Every whole line of the results file (and with `parts`, of the part files beside it)."""
        return [record for file in [self.path, *(self._parts() if parts else [])] for record in _records(file)]

    def append(self, records: list[dict]) -> None:
        """Add a document's lines, whole: written together, then flushed to disk. A line that a killed run or a full
        disk left cut short is removed first (it holds no whole record; one that lost only its newline is closed),
        so that no cut line is ever followed by another; and if this write fails, what it wrote is taken back: the
        file keeps whole lines only."""
        data = "".join(json_text(record) + "\n" for record in records).encode()
        try:
            descriptor = os.open(self.part, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                whole, size = _whole_lines(descriptor), os.fstat(descriptor).st_size
                if whole != size and _is_record(os.pread(descriptor, size - whole, whole)):
                    data, whole = b"\n" + data, size  # a whole record that lost only its newline: kept
                elif whole != size:
                    os.ftruncate(descriptor, whole)
                try:
                    _write_all(descriptor, data)
                    os.fsync(descriptor)
                except OSError:
                    os.ftruncate(descriptor, whole)  # frees what was written: it works on a full disk
                    raise
            finally:
                os.close(descriptor)
        except OSError as error:
            raise GaliError(f"cannot write results to {self.part}: {error.strerror or error}") from None

    def merge(self) -> None:
        """Move the part files' lines (this run's, or those an interrupted run left) into the results file."""
        if not self.rank.distributed or self.rank.rank == 0:
            seen = {json.dumps(record, sort_keys=True) for record in _records(self.path)}
            main = ResultsFile(self.path, Rank())
            for part in self._parts():
                new = [record for record in _records(part) if json.dumps(record, sort_keys=True) not in seen]
                if new:
                    main.append(new)
                    seen.update(json.dumps(record, sort_keys=True) for record in new)
                try:
                    part.unlink()
                except FileNotFoundError:
                    pass
                except OSError as error:  # its lines are in OUT now; a later merge finds them there and skips them
                    raise GaliError(f"cannot remove {part} after merging it: {error.strerror or error}") from None

    def _parts(self) -> list[Path]:
        return sorted(self.path.parent.glob(f"{glob.escape(self.path.name)}.rank*-of-*.part"))


def _write_all(descriptor: int, data: bytes) -> None:
    """All of `data`, or OSError: a write to a filling disk may take only part of it and say so, not fail."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view):]


def _whole_lines(descriptor: int) -> int:
    """The size of the file up to the end of its last whole line (its newline included): all of it unless its
    last line was cut short."""
    end = os.fstat(descriptor).st_size
    while end > 0:
        start = max(0, end - (1 << 16))
        block = os.pread(descriptor, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


_OUR_START = b'{"path": '  # every line gali writes starts so


def _check_ours(path: Path) -> None:
    """ConfigError unless `path` is absent, empty, or JSON lines of gali records. Lines may be cut short, and not
    only the last: earlier releases of gali closed a cut line with a newline before appending (and a crash can
    leave zeros where data had not reached the disk)."""
    try:
        if not path.exists():
            return
        if not path.is_file():
            raise ConfigError(f"--out {path}: not a file")
        for number, line in enumerate(_lines(path), 1):
            _check_our_line(path, number, line)
    except OSError as error:
        raise ConfigError(f"--out {path}: cannot read it ({error.strerror or error})") from None


def _check_our_line(path: Path, number: int, line: bytes | None) -> None:
    """ConfigError unless `line` is blank or one of ours, whole or cut short (None: a line too long to be ours)."""
    if line is not None and not line.strip(b"\0 \t\r"):
        return
    try:
        record = json.loads(line) if line is not None else None
        ours = isinstance(record, dict) and "job" in record and "path" in record
    except (json.JSONDecodeError, UnicodeDecodeError):
        ours = line.startswith(_OUR_START) or _OUR_START.startswith(line)  # our line, cut short
    if not ours:
        longer = f", longer than {_LONGEST_LINE // 2**20}M" if line is None else ""
        raise ConfigError(f"--out {path} exists and is not a gali results file (line {number}{longer}); it was "
                          "left untouched: choose another name")


def _lines(path: Path) -> Iterator[bytes | None]:
    """The lines of `path` (without their newline), read one at a time; None for a line longer than _LONGEST_LINE, which
    is skipped unread: a results file of one 2.5 GB line must not take 3.4 times that in memory."""
    with open(path, "rb") as file:
        while line := file.readline(_LONGEST_LINE + 1):
            if len(line) > _LONGEST_LINE and not line.endswith(b"\n"):
                while (rest := file.readline(2**20)) and not rest.endswith(b"\n"):
                    pass
                yield None
            else:
                yield line.removesuffix(b"\n")


def _records(path: Path) -> Iterator[dict]:
    """The whole JSON lines of `path` (none if it does not exist); a line cut short by a kill is skipped."""
    try:
        for line in _lines(path):
            try:
                record = json.loads(line.decode("utf-8", errors="replace")) if line else None
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record
    except FileNotFoundError:
        return
    except OSError as error:
        raise GaliError(f"cannot read results file {path}: {error.strerror}") from None

def latest_records(records: list[dict], job: dict, documents: list[Path], ok_only: bool = False) -> dict:
    """Each document's (and method's) last line of this job, by (path, method), for the documents given; in the
    order they were written, the most recent last."""
    key, wanted, latest = job_hash(job), {str(path) for path in documents}, {}
    for record in records:
        if record.get("job") == key and record.get("path") in wanted and (record.get("status") == "ok" or not ok_only):
            latest.pop((record["path"], record.get("method")), None)
            latest[(record["path"], record.get("method"))] = record
    return latest


def corpus_perplexities(records: list[dict], job: dict, documents: list[Path], by_length: bool) -> list[dict]:
    """Token-weighted perplexity over the documents, per method (and length with `by_length`): exp of the summed
    NLL over the summed predicted tokens, from each document's latest finished record of this job."""
    sums: dict[tuple[str, int | str], list[float]] = {}
    for record in latest_records(records, job, documents, ok_only=True).values():
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
    status = {path: record.get("status")  # the most recent line of a path wins
              for (path, _), record in latest_records(records, job, documents).items()}
    statuses = [status.get(str(path)) for path in documents]
    return {"documents": len(documents), "ok": statuses.count("ok"), "failed": statuses.count("error"),
            "missing": statuses.count(None)}
