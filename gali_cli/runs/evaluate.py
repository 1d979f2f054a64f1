"""gali eval: each task's samples answered greedily by each method, scored, one results line per sample and method
(resumable, sharded under a launcher as batch mode is), then a table of mean scores per task, length and method."""

import hashlib
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from .. import display, plots, tables
from ..conversation import Conversation
from ..display import print_json, say
from ..errors import ConfigError, InputError
from ..estimate import JobClock
from ..evaluation.longbench_paper import is_paper_model, paper_scores
from ..evaluation.sample import Request, Sample
from ..evaluation.tasks import LONGBENCH, build_samples
from ..generate import Finished, TextPiece, make_sampler
from ..loading import LoadedModel
from ..methods.registry import DEFAULT
from ..methods.resolving import kept_window
from ..prompts import ASK_STYLES, ask_instruction, check_prompt_length, conversation_ids, text_ids
from .batches import batch_job, held
from .choices import ModelChoice, Reading
from .common import entry_point, finished_facts, load, prompt_limit, store, with_windows
from .launcher import Rank
from .prechecks import read
from .results_file import ResultsFile, Stopwatch, job_hash, latest_records

TASK_STYLE = "task"  # --prompt-style: each task's own wording (RULER's, LongBench's)
PROMPT_STYLES = (TASK_STYLE, *ASK_STYLES)


@dataclass(frozen=True)
class Evaluation:
    """What `gali eval` runs and how it reports, besides the model and methods."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    seed: int
    haystack: str | None  # --haystack FILE
    out: str | None
    json_output: bool = False
    csv: bool = False
    plot: str | None = None
    cache_dir: str | None = None
    no_cache: bool = False
    longbench_data: str | None = None  # --longbench-data DIR
    truncation: str = "official"
    system: str | None = None  # --system TEXT: a system message before each chat sample (not the raw ones)
    prompt_style: str = TASK_STYLE  # --prompt-style: the task's own wording, or one of gali ask's (ASK_STYLES)


def styled(sample: Sample, style: str) -> Sample:
    """The sample as `gali ask` would ask it in `style` (one of ASK_STYLES): its question alone in that wrapper after
    the document, without the task's answer prefix. TASK_STYLE, and samples with no question of their own (raw
    LongBench prompts, cut questions), keep the task's wording."""
    if style == TASK_STYLE or not sample.query or not sample.chat:
        return sample
    return replace(sample, question=ask_instruction(sample.query, style), answer_prefix="")


def prompt_ids(tokenizer, sample: Sample, system: str | None = None) -> list[int]:
    """The tokens a sample's answer follows, as `gali ask` builds them (conversation.py), with the answer prefix and,
    for a chat sample, the `system` message; without `chat`, the raw text: BOS, the context, the question."""
    prefix = text_ids(tokenizer, sample.answer_prefix) if sample.answer_prefix else []
    return conversation_ids(tokenizer, sample.context, [sample.question], [], _system(sample, system),
                            chat=sample.chat).ids + prefix


def _system(sample: Sample, system: str | None) -> str | None:
    """The system message a sample is asked with: --system's, for samples that take the chat template only."""
    return system if sample.chat else None


def sample_hash(sample: Sample) -> str:
    """What the sample asks: a rerun whose generator built it differently answers it again."""
    fields = [sample.context, sample.question, sample.answer_prefix, sample.references, sample.max_new_tokens,
              sample.chat, sample.stop]
    return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()


def answer_sample(loaded: LoadedModel, method: str, choice: ModelChoice, sample: Sample, cache,
                  system: str | None = None, max_prompt_tokens: int | None = None) -> dict:
    """The sample answered greedily through `gali ask`'s conversation (its document cache too), after the `system`
    message when the sample is a chat one, cut at the first stop string, and scored."""
    talk = Conversation(loaded, method, choice.settings, sample.context, f"<gali eval {sample.task} {sample.id}>",
                        _system(sample, system), cache, chat=sample.chat, max_prompt_tokens=max_prompt_tokens)
    text, finished = "", None
    for event in talk.ask(sample.question, make_sampler(), sample.max_new_tokens, answer_prefix=sample.answer_prefix):
        if isinstance(event, Finished):
            finished = event
            break
        text += event.text if isinstance(event, TextPiece) else ""
        if any(stop in text for stop in sample.stop):
            break  # closing the generator leaves the conversation as it was, which is then dropped
    for stop in sample.stop:
        text = text.split(stop)[0]
    facts = finished_facts(finished) if finished else {"finish_reason": "stop"}
    return {"prediction": text, "score": float(sample.score(text)), "settings": talk.resolved, **facts}


@entry_point
def evaluate(choice: ModelChoice, evaluation: Evaluation, reading: Reading) -> None:
    """Build the samples, answer those not already in --out, print the table (or JSON / CSV) and the plot."""
    choice.check()
    rank = Rank.from_environment()
    if rank.distributed and not evaluation.out:
        raise ConfigError("under a launcher gali eval needs --out FILE.jsonl, where the processes' answers meet")
    haystack = read(evaluation.haystack, reading).text if evaluation.haystack else None
    results = ResultsFile(Path(evaluation.out), rank) if evaluation.out else None
    with held(results) if results else nullcontext() as collective:  # a second run on --out refuses before loading
        loaded = load(choice, rank)
        limit = prompt_limit(loaded, reading)
        if evaluation.lengths:  # the lengths asked for, refused before any sample is built
            check_prompt_length(max(evaluation.lengths), limit, "gali eval --lengths")
        paper_model = is_paper_model(loaded.model.config, choice.model)  # before a method changes its config
        with display.status("Building the samples"):
            samples = build_samples(list(evaluation.tasks), Request(
                evaluation.lengths, evaluation.samples, evaluation.seed,
                lambda sample: len(prompt_ids(loaded.tokenizer, sample, evaluation.system)), haystack,
                loaded.tokenizer,
                evaluation.longbench_data, evaluation.truncation))
        samples = [styled(sample, evaluation.prompt_style) for sample in samples]
        longbench = any(task.startswith(f"{LONGBENCH}/") for task in evaluation.tasks)
        jobs = {method: batch_job("eval", replace(choice, methods=(method,)), seed=evaluation.seed,
                                  haystack=haystack and hashlib.sha256(haystack.encode()).hexdigest(),
                                  decoding="greedy", **({"truncation": evaluation.truncation} if longbench else {}),
                                  **({"system": evaluation.system} if evaluation.system else {}),
                                  **({"prompt_style": evaluation.prompt_style}
                                     if evaluation.prompt_style != TASK_STYLE else {}))
                for method in choice.methods}
        records = _answer_all(loaded, choice, samples, jobs, results, rank, evaluation, limit)
        if collective is not None:
            collective.wait()  # every process is done: rank 0 merges their parts
            results.merge()
            collective.wait()
            collective.close()
        if results:
            records = results.records()
    if rank.rank != 0:
        return
    rows = with_windows(score_rows(records, jobs, samples), choice.settings.train_len, loaded.train_len)
    if paper_model:
        rows = with_paper_scores(rows, choice.settings.train_len or loaded.train_len)
    if evaluation.json_output:
        print_json({"results": rows, "model": choice.model, "out": str(results.path) if results else None})
    elif evaluation.csv:
        tables.print_eval_csv(rows)
    elif rows:
        tables.print_eval_table(rows)
    if evaluation.plot and rows:
        window = kept_window(DEFAULT, choice.settings.train_len, loaded.train_len)
        tasks = ", ".join(evaluation.tasks) if len(evaluation.tasks) <= 3 else f"{len(evaluation.tasks)} tasks"
        title = plots.plot_title(f"gali eval: {tasks}", choice.model, choice.settings.train_len, loaded.train_len)
        plots.plot_eval(rows, evaluation.plot, title, window)
        say(f"Saved {evaluation.plot}.")


def _answer_all(loaded: LoadedModel, choice: ModelChoice, samples: list[Sample], jobs: dict[str, dict],
                results: ResultsFile | None, rank: Rank, evaluation: Evaluation, limit: int | None = None
                ) -> list[dict]:
    """This process's share of (sample, method) pairs not already done, each appended as it finishes; returns the
    records written."""
    cache = None if evaluation.no_cache else store(evaluation.cache_dir)
    finished = results.finished() if results else set()
    pairs = rank.shard([(sample, method) for sample in _interleaved(samples) for method in choice.methods])
    keys = {(sample.task, sample.id): sample_hash(sample) for sample in samples}
    job_keys = {method: job_hash(job) for method, job in jobs.items()}
    todo = [(sample, method) for sample, method in pairs
            if (f"{sample.task}/{sample.id}", keys[sample.task, sample.id], job_keys[method]) not in finished]
    label = f"[rank {rank.rank}/{rank.world}] " if rank.distributed else ""
    if len(todo) < len(pairs):
        say(f"{label}{len(pairs) - len(todo)} answers already in {evaluation.out}, skipped", style="dim")
    written = []
    # Each answer's time projected from answers of its length and method, else from the seconds per prompt token
    # (a sample built without a target length: its characters / 4).
    clock = JobClock([((sample.length, method), sample.length or len(sample.context) / 4) for sample, method in todo])
    with display.progress_bar("answers") as bar:
        for done, (sample, method) in enumerate(todo):
            bar(done, len(todo))
            stopwatch = Stopwatch()
            answer = answer_sample(loaded, method, choice, sample, cache, evaluation.system, limit)
            record = {"path": f"{sample.task}/{sample.id}", "sha256": keys[sample.task, sample.id],
                      "job": job_keys[method],
                      "status": "ok", **jobs[method], "task": sample.task, "sample": sample.id,
                      "length": sample.length, "references": list(sample.references), **answer,
                      **stopwatch.elapsed()}
            if results:
                results.append([record])
            written.append(record)
            clock.finish()
            left = clock.seconds_left()
            remaining = f"; {display.time_left(left)}" if left is not None and done + 1 < len(todo) else ""
            bar.describe(f"answers ({display.time_left(left)})" if remaining else "answers")
            say(f"{label}[{done + 1}/{len(todo)}] {sample.task} {sample.id} {method}: score {answer['score']:.2f} "
                f"in {record['seconds']:.1f} s ({record['cpu_seconds']:.0f} s of CPU), "
                f"{answer['prediction'][:60]!r}{remaining}", style="dim")
        bar(len(todo), len(todo))
    if written:
        seconds = sum(record["seconds"] for record in written)
        cpu_seconds = sum(record["cpu_seconds"] for record in written)
        say(f"{label}{len(written)} answers in {seconds:.0f} s ({seconds / len(written):.1f} s each; "
            f"{cpu_seconds:.0f} s of CPU time)")
    return written


def _interleaved(samples: list[Sample]) -> list[Sample]:
    """Shortest length first, and at each length the first sample of every task, then the second of each...: a run
    stopped early has a table for every task, from fewer samples."""
    seen: dict[tuple[str, int | None], int] = {}
    places = []
    for sample in samples:
        places.append(seen.setdefault((sample.task, sample.length), 0))
        seen[sample.task, sample.length] += 1
    order = sorted(range(len(samples)), key=lambda index: (samples[index].length or 0, places[index]))
    return [samples[index] for index in order]


def score_rows(records: list[dict], jobs: dict[str, dict], samples: list[Sample]) -> list[dict]:
    """Mean score (x100, as RULER reports it) per task, length and method, from each sample's latest line of this
    run's jobs; in the order of the tasks, lengths and methods asked."""
    paths = [f"{sample.task}/{sample.id}" for sample in samples]
    wanted = {(f"{sample.task}/{sample.id}", sample_hash(sample)) for sample in samples}
    sums: dict[tuple[str, int | None, str], list[float]] = {}
    for method, job in jobs.items():
        for record in latest_records(records, job, paths, ok_only=True).values():
            if (record["path"], record.get("sha256")) in wanted:
                _check_numbers(record, method)
                entry = sums.setdefault((record["task"], record["length"], method), [0.0, 0, 0.0])
                entry[0] += record["score"]
                entry[1] += 1
                entry[2] += record["seconds"]
    order = {key: index for index, key in enumerate(dict.fromkeys(
        (sample.task, sample.length, method) for sample in samples for method in jobs))}
    return [{"task": task, "length": length, "method": method, "score": round(100 * total / count, 2),
             "samples": count, "seconds_per_sample": round(seconds / count, 3)}
            for (task, length, method), (total, count, seconds) in sorted(sums.items(), key=lambda item:
                                                                         order[item[0]])]


def _check_numbers(record: dict, method: str) -> None:
    """InputError for a results line whose score or time is not a number (edited by hand, or by another tool)."""
    for field in ("score", "seconds"):
        value = record.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InputError(f"the --out line of {record['path']} ({method}) has {field} {value!r}, not a number: "
                             "delete that line and gali eval answers the sample again")


def with_paper_scores(rows: list[dict], train_len: int) -> list[dict]:
    """`rows` with the GALI paper's LongBench score ("paper", x100) where it has one for the task, the method, the
    backbone's window `train_len` and the length: for the paper's own model only (Llama-3-8B-Instruct)."""
    found = []
    for row in rows:
        scores = (paper_scores(train_len, row["length"], row["method"])
                  if row["task"].startswith(f"{LONGBENCH}/") and row["length"] else None)
        dataset = row["task"].removeprefix(f"{LONGBENCH}/")
        found.append({**row, "paper": scores[dataset]} if scores and dataset in scores else row)
    return found
