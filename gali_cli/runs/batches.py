"""summarize, ask and ppl over many documents (--out): the model loads once, each document appends its JSON lines,
and under a launcher each process takes its share and rank 0 merges (batch_inputs.py, launcher.py, results_file.py
and batch_run.py keep the books)."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import display, plots
from ..display import print_json, say
from ..documents import read_document
from ..errors import ConfigError
from ..generate import TextPiece, make_sampler
from ..loading import resolve_device, resolve_dtype
from ..methods.registry import DEFAULT
from ..methods.resolving import kept_window
from ..model.machine import kv_override
from .batch_run import Outcome, Step, run_batch
from .choices import Answering, ModelChoice, Reading
from .common import conversation, entry_point, finished_facts, load, prompt_limit, store, with_windows
from .launcher import Collective, Rank
from .ppl import method_perplexities, ppl_ids, print_rows
from .prechecks import batch_documents
from .results_file import ResultsFile, batch_summary, corpus_perplexities

Within = Callable[[int, int], None]  # how far the document under way is read: (tokens done, tokens)


@entry_point
def answer_batch(specs: list[str], out: str | None, command: str, instruction: str, question: str | None,
                 choice: ModelChoice, reading: Reading, answering: Answering) -> int:
    """Answer `instruction` about each document into `out`; returns how many documents failed (in all processes)."""
    with _setup(specs, out, choice) as batch:
        cache = None if answering.no_cache else store(answering.cache_dir)
        job = batch_job(command, choice, question=question, system=answering.system,
                   generation={"max_new_tokens": answering.max_new_tokens, "temperature": answering.temperature,
                               "top_p": answering.top_p, "top_k": answering.top_k, "seed": answering.seed})
        loaded = load(choice, batch.rank)
        limit = prompt_limit(loaded, reading)

        def work(path: Path, within: Within) -> list[dict]:
            document = read_document(str(path), password=reading.password, max_bytes=reading.max_bytes,
                                     allow_partial=reading.allow_partial)
            talk = conversation(loaded, choice, document, answering.system, cache, limit)
            sampler = make_sampler(answering.temperature, answering.top_p, answering.top_k, answering.seed)
            events = list(talk.ask(instruction, sampler, answering.max_new_tokens, within))
            answer = "".join(event.text for event in events if isinstance(event, TextPiece)).strip()
            return [{"output": answer, "settings": talk.resolved, "tokens": events[-1].prompt_tokens,
                     "warnings": [*document.warnings], **finished_facts(events[-1])}]

        failed = _run(batch, job, work, _answer_line)
        if answering.json_output and batch.rank.rank == 0:
            print_json({"out": str(batch.results.path),
                        **batch_summary(batch.results.records(), job, batch.documents)})
        return failed


@entry_point
def perplexity_batch(specs: list[str], out: str | None, choice: ModelChoice, reading: Reading,
                     max_tokens: int | None, lengths: list[int], json_output: bool, csv: bool, plot: str | None,
                     verbose: bool) -> int:
    """Each document's perplexity into `out`, then the corpus's (token-weighted) on stdout; returns how many
    documents failed (in all processes)."""
    with _setup(specs, out, choice) as batch:
        job = batch_job("ppl", choice, max_tokens=max_tokens, lengths=lengths)
        loaded = load(choice, batch.rank)
        bound = prompt_limit(loaded, reading)

        def work(path: Path, within: Within) -> list[dict]:
            document = read_document(str(path), password=reading.password, max_bytes=reading.max_bytes,
                                     allow_partial=reading.allow_partial)
            ids, _ = ppl_ids(loaded, document, lengths[-1] if lengths else max_tokens, bound)
            reachable = [length for length in lengths if length <= len(ids)] if lengths else [len(ids)]
            records = []
            for method in choice.methods:
                settings, found = (method_perplexities(loaded, ids, method, choice, reachable, verbose,
                                                       show_progress=False,  # the batch has its own bar
                                                       progress=lambda done, total, ppl: within(done, total))
                                   if reachable else ({}, []))
                records.append({"method": method, "settings": settings, "tokens": len(ids),
                                "results": [asdict(result) for result in found], "warnings": [*document.warnings]
                                + ([] if reachable else [f"{len(ids)} tokens: shorter than every --lengths value"])})
            return records

        failed = _run(batch, job, work, _ppl_line)
        if batch.rank.rank == 0:
            records = batch.results.records()
            rows = with_windows(corpus_perplexities(records, job, batch.documents, by_length=bool(lengths)),
                                choice.settings.train_len, loaded.train_len)
            if json_output:
                print_json({"corpus": rows, "out": str(batch.results.path),
                            **batch_summary(records, job, batch.documents)})
            elif rows:
                print_rows(rows, csv, single=len(rows) == 1)
            if plot and lengths and rows:
                window = kept_window(DEFAULT, choice.settings.train_len, loaded.train_len)
                title = plots.plot_title(f"Perplexity of {len(batch.documents)} documents", choice.model,
                                         choice.settings.train_len, loaded.train_len)
                plots.plot_ppl(rows, plot, title, window)
                say(f"Saved {plot}.")
        return failed


@dataclass
class _Batch:
    """A batch ready to run: its documents, results file, this process's rank, and the other processes."""

    documents: list[Path]
    results: ResultsFile
    rank: Rank
    collective: Collective | None


@contextmanager
def _setup(specs: list[str], out: str | None, choice: ModelChoice) -> Iterator[_Batch]:
    """Everything checked before the model loads: the documents, the results file (held by this run until it is
    done: a second run on it refuses), the launcher's processes."""
    documents, results = batch_documents(specs, out, choice)  # as the command line checked them before torch loaded
    with held(results) as collective:
        yield _Batch(documents, results, results.rank, collective)


@contextmanager
def held(results: ResultsFile) -> Iterator[Collective | None]:
    """The results file checked, held by this run until the block ends (a second run on it refuses) and merged
    from what an interrupted distributed run left; yields the launcher's other processes (None when alone)."""
    rank = results.rank
    results.prepare()
    collective = Collective(rank) if rank.distributed else None
    holder = results.lock() if rank.rank == 0 else None  # rank 0 holds it for all the processes of its run
    try:
        if (collective.total(int(holder is not None)) if collective else holder is not None):
            raise ConfigError(f"--out {results.path} is being written by {holder or 'another gali run'}: wait for "
                              "it to finish, or choose another --out")
        if not rank.distributed:
            results.merge()  # part files an interrupted distributed run left behind
        yield collective
    finally:
        results.unlock()


def batch_job(command: str, choice: ModelChoice, **details) -> dict:
    """What decides a document's output besides its content: a rerun with another job does every document again.
    A 16-bit KV cache (--kv-dtype) is part of it; the default adds nothing, so files written before it resume."""
    device = resolve_device(choice.device)
    stored = {} if kv_override(choice.kv_dtype) is None else {"kv_dtype": choice.kv_dtype}
    return {"command": command, "model": choice.model, "quantize": choice.quantize, "device": device.type,
            "dtype": str(resolve_dtype(choice.dtype, device)).removeprefix("torch."), **stored,
            "method": ",".join(choice.methods), "settings": asdict(choice.settings), **details}


def _run(batch: _Batch, job: dict, work: Callable[[Path, Within], list[dict]],
         describe: Callable[[tuple[dict, ...]], str]) -> int:
    """Run this process's share under a bar (`work` tells it how far a document's reading has come), a line on
    stderr per finished document (`describe` says what its records hold); then merge on rank 0. Returns how many
    documents failed in all processes. Ctrl-C ends it saying how many documents are safe in the file."""
    rank, started = batch.rank, time.perf_counter()
    with display.progress_bar("documents") as bar:
        watch = _Watch(bar, batch, describe)
        try:
            outcome = run_batch(batch.documents, batch.results, job, lambda path: work(path, watch.reading), rank,
                                watch.step)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(watch.interrupted()) from None
        watch.say_skipped()
    say(f"{watch.label}{summary(outcome, time.perf_counter() - started)} -> {batch.results.part}")
    if batch.collective is None:
        return outcome.failed
    failed = batch.collective.total(outcome.failed)  # every process is done
    batch.results.merge()
    batch.collective.wait()  # no process exits (and so no launcher stops the others) before the merge is done
    batch.collective.close()
    if rank.rank == 0:
        say(f"merged the {rank.world} parts into {batch.results.path}")
    return failed


class _Watch:
    """What a batch shows as it goes: on the bar, the document under way (its place, its name, how many of its tokens
    are read: a long document moves the bar's line too, issue 50) and the pace; a line per finished document, one for
    a run of skipped ones; and, for Ctrl-C, how many documents are safe in the results file."""

    def __init__(self, bar: display.Bar, batch: _Batch, describe: Callable[[tuple[dict, ...]], str]) -> None:
        self.bar, self.batch, self.describe = bar, batch, describe
        self.label = f"[rank {batch.rank.rank}/{batch.rank.world}] " if batch.rank.distributed else ""
        self.outcome = Outcome(documents=len(batch.rank.shard(batch.documents)))
        self.skipped: list[Path] = []
        self.started, self.current = time.perf_counter(), "documents"

    def step(self, outcome: Outcome, step: Step) -> None:
        """run_batch's report on a document: started, skipped, done or failed."""
        self.outcome = outcome
        finished = outcome.done + outcome.skipped + outcome.failed
        if step.status == "skipped":
            self.skipped.append(step.path)
            return
        if step.status == "started":
            seconds = time.perf_counter() - self.started
            pace = f" ({outcome.tokens / seconds:.0f} tokens/s)" if outcome.tokens and seconds > 0 else ""
            self.current = f"documents{pace}: [{finished + 1}/{outcome.documents}] {display.short_path(str(step.path))}"
            self.bar(finished, outcome.documents)
            self.bar.describe(self.current)
            return
        self.say_skipped()
        where = f"{self.label}[{finished}/{outcome.documents}] {display.short_path(str(step.path))}"
        if step.status == "error":
            say(f"{where}: failed: {step.error}", style="red")
        else:
            say(f"{where}: {self.describe(step.records)}, {step.seconds:.1f} s")

    def reading(self, done: int, total: int, *_: float) -> None:
        """How far the document under way is read (a prefill's, or a perplexity pass's, (done, total))."""
        self.bar.describe(f"{self.current}, {done:,}/{total:,} tokens read")

    def say_skipped(self) -> None:
        if self.skipped:
            _say_skipped(self.label, self.skipped, self.batch.results.path)

    def interrupted(self) -> str:
        """Ctrl-C's line: how many documents are done in the results file (this run's and earlier runs'), and that
        the same command goes on with the others; a document stopped midway left nothing there."""
        outcome, part = self.outcome, display.short_path(str(self.batch.results.part))
        safe = outcome.done + outcome.skipped
        return (f"{self.label}{safe} of {outcome.documents} documents done and kept in {part}; the same command "
                f"resumes with the other {outcome.documents - safe}")


def summary(outcome: Outcome, seconds: float) -> str:
    """A batch's last line, before its file: "3 documents: 2 done (512 tokens/s), 1 already done, 0 failed"; the
    rate only where something was read (a rerun that skips everything read nothing, at no rate)."""
    rate = f" ({outcome.tokens / seconds:.0f} tokens/s)" if outcome.done and outcome.tokens and seconds > 0 else ""
    return (f"{outcome.documents} document{'s' if outcome.documents != 1 else ''}: {outcome.done} done{rate}, "
            f"{outcome.skipped} already done, {outcome.failed} failed")


def _say_skipped(label: str, skipped: list[Path], results: Path) -> None:
    """One line for a run of documents an earlier run finished (a resumed batch may skip thousands)."""
    what = display.short_path(str(skipped[0])) if len(skipped) == 1 else f"{len(skipped)} documents"
    say(f"{label}{what}: already done in {display.short_path(str(results))}, skipped", style="dim")
    skipped.clear()


def _answer_line(records: tuple[dict, ...]) -> str:
    """What a batch answer cost, for its line on stderr."""
    record = records[0]
    return f"{record['tokens']} tokens read, {record['generated_tokens']} written ({record['finish_reason']})"


def _ppl_line(records: tuple[dict, ...]) -> str:
    """A batch document's perplexity per method (at its longest length), for its line on stderr."""
    figures = [f"{record['method']} {record['results'][-1]['ppl']:.3f}" for record in records if record["results"]]
    return f"{records[0]['tokens']} tokens, ppl " + (", ".join(figures) or "none (shorter than every --lengths)")
