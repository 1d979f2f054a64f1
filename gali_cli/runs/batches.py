"""summarize, ask and ppl over many documents (--out): the model loads once, each document appends its JSON lines,
and under a launcher each process takes its share and rank 0 merges (gali_cli.runs.batch_files keeps the books)."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import display
from ..display import print_json, say
from ..documents import read_document
from ..errors import ConfigError, InputError
from ..generate import TextPiece, make_sampler
from ..methods import kept_window
from ..model.loading import resolve_device, resolve_dtype
from . import Answering, ModelChoice, Reading
from .batch_files import (
    Collective,
    Outcome,
    Rank,
    ResultsFile,
    Step,
    batch_summary,
    corpus_perplexities,
    expand_documents,
    run_batch,
)
from .common import conversation, entry_point, finished_facts, load, prompt_limit, store, with_windows
from .ppl import method_perplexities, ppl_ids, print_rows


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

        def work(path: Path) -> list[dict]:
            document = read_document(str(path), password=reading.password, max_bytes=reading.max_bytes,
                                     allow_partial=reading.allow_partial)
            talk = conversation(loaded, choice, document, answering.system, cache, limit)
            sampler = make_sampler(answering.temperature, answering.top_p, answering.top_k, answering.seed)
            events = list(talk.ask(instruction, sampler, answering.max_new_tokens))
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

        def work(path: Path) -> list[dict]:
            document = read_document(str(path), password=reading.password, max_bytes=reading.max_bytes,
                                     allow_partial=reading.allow_partial)
            ids, _ = ppl_ids(loaded, document, lengths[-1] if lengths else max_tokens, bound)
            reachable = [length for length in lengths if length <= len(ids)] if lengths else [len(ids)]
            records = []
            for method in choice.methods:
                settings, found = (method_perplexities(loaded, ids, method, choice, reachable, verbose,
                                                       show_progress=False)  # the batch has its own bar
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
                window = kept_window("gali", choice.settings.train_len, loaded.train_len)
                title = display.plot_title(f"Perplexity of {len(batch.documents)} documents", choice.model,
                                           choice.settings.train_len, loaded.train_len)
                display.plot_ppl(rows, plot, title, window)
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
    if not out:
        raise ConfigError("several documents need --out FILE.jsonl for their results")
    choice.check()
    rank = Rank.from_environment()
    results = ResultsFile(Path(out), rank)
    documents = [document for document in expand_documents(specs) if not results.is_output(document)]
    if not documents:
        raise InputError(f"no documents in {' '.join(specs)} besides --out")
    with held(results) as collective:
        yield _Batch(documents, results, rank, collective)


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
    """What decides a document's output besides its content: a rerun with another job does every document again."""
    device = resolve_device(choice.device)
    return {"command": command, "model": choice.model, "quantize": choice.quantize, "device": device.type,
            "dtype": str(resolve_dtype(choice.dtype, device)).removeprefix("torch."),
            "method": ",".join(choice.methods), "settings": asdict(choice.settings), **details}


def _run(batch: _Batch, job: dict, work: Callable[[Path], list[dict]], describe: Callable[[tuple[dict, ...]], str]
         ) -> int:
    """Run this process's share, a line on stderr per finished document (`describe` says what its records hold),
    under a bar with tokens/s; then merge on rank 0. Returns how many documents failed in all processes."""
    rank, label = batch.rank, f"[rank {batch.rank.rank}/{batch.rank.world}] " if batch.rank.distributed else ""
    started, skipped = time.perf_counter(), []
    with display.progress_bar("documents") as bar:
        def progress(outcome: Outcome, step: Step) -> None:
            finished = outcome.done + outcome.skipped + outcome.failed
            if step.status == "skipped":
                skipped.append(step.path)
                return
            if step.status == "started":
                bar(finished, outcome.documents)
                bar.describe(f"documents ({outcome.tokens / (time.perf_counter() - started):.0f} tokens/s)")
                return
            if skipped:
                _say_skipped(label, skipped, batch.results.path)
            where = f"{label}[{finished}/{outcome.documents}] {display.short_path(str(step.path))}"
            if step.status == "error":
                say(f"{where}: failed: {step.error}", style="red")
            else:
                say(f"{where}: {describe(step.records)}, {step.seconds:.1f} s")

        outcome = run_batch(batch.documents, batch.results, job, work, rank, progress)
        if skipped:
            _say_skipped(label, skipped, batch.results.path)
    seconds = time.perf_counter() - started
    say(f"{label}{outcome.documents} documents: {outcome.done} done ({outcome.tokens / seconds:.0f} tokens/s), "
        f"{outcome.skipped} already done, {outcome.failed} failed -> {batch.results.part}")
    if batch.collective is None:
        return outcome.failed
    failed = batch.collective.total(outcome.failed)  # every process is done
    batch.results.merge()
    batch.collective.wait()  # no process exits (and so no launcher stops the others) before the merge is done
    batch.collective.close()
    if rank.rank == 0:
        say(f"merged the {rank.world} parts into {batch.results.path}")
    return failed


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
