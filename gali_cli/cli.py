"""The `gali` command: parse, call the library, print (through gali_cli.display).

stdout carries only the answer (or the --json document); loading, progress, warnings and stats go to stderr.
Exit codes: 0 ok, 1 runtime error, 2 usage, 3 unreadable input, 4 model load or out of memory, 130 interrupted.
"""

import functools
import inspect
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Annotated

import torch
import transformers
import typer

from . import display
from .engine.noisy_attention import kernel_choice
from .config import MethodSettings
from .display import err, fail, print_json, say, warn
from .documents import Document, read_document
from .errors import ConfigError, GaliError, GaliWarning, InputError, ModelLoadError, UnsupportedModelError
from .batch import (
    Collective,
    Outcome,
    Rank,
    ResultsFile,
    batch_summary,
    corpus_perplexities,
    expand_documents,
    run_batch,
)
from .conversation import Conversation, model_spans
from .doc_cache import DocumentCache, default_directory, default_limit
from .generate import Finished, TextPiece, make_sampler, peak_memory_bytes, reset_peak_memory
from .loading import (
    DEFAULT_MODEL,
    LoadedModel,
    environment_facts,
    load_config,
    load_model,
    model_facts,
    resolve_device,
    resolve_dtype,
)
from .methods import METHODS, apply_method, get_method
from .perplexity import perplexities
from .prompts import SUMMARIZE, ask_instruction, text_ids

EXIT_CODES = {ConfigError: 2, InputError: 3, ModelLoadError: 4, UnsupportedModelError: 4}
app = typer.Typer(name="gali", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


class Quantize(str, Enum):
    none = "none"
    int8 = "8bit"
    int4 = "4bit"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class DType(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def _option(*flags: str, panel: str, **kwargs) -> typer.Option:
    return typer.Option(*flags, rich_help_panel=panel, **kwargs)


_MODEL, _GALI, _OTHER = "Model and method", "GALI (defaults follow the training window)", "Other methods"
# The options every command takes, declared once: name -> (annotated type, default).
MODEL_OPTIONS = {
    "model": (Annotated[str, _option("--model", "-m", envvar="GALI_MODEL", panel=_MODEL,
                                     help="Hub id, local directory, or 'demo' (the small bundled model).")],
              DEFAULT_MODEL),
    "quantize": (Annotated[Quantize, _option(panel=_MODEL, help="bitsandbytes quantization (4bit: NF4, bf16 "
                                                                 "compute).")], Quantize.none),
    "device": (Annotated[Device, _option(panel=_MODEL, help="auto: CUDA when there is a GPU.")], Device.auto),
    "dtype": (Annotated[DType, _option(panel=_MODEL, help="auto: bfloat16 on GPU, float32 on CPU.")], DType.auto),
    "method": (Annotated[str, _option(panel=_MODEL, help=f"One of {', '.join(METHODS)}; for ppl a comma list, or "
                                                          "all.")], "gali"),
    "train_len": (Annotated[int | None, _option(panel=_GALI, help="The training window to stay within (default: "
                                                                   "the model's).")], None),
    "chunk_size": (Annotated[int | None, _option(panel=_GALI, help="Tokens per chunk beyond it (default: train-len "
                                                                    "/ 4).")], None),
    "local_window": (Annotated[int | None, _option(panel=_GALI, help="Newest tokens kept at exact positions "
                                                                      "(default: train-len / 2; chunk-llama: "
                                                                      "train-len - dca-chunk-size).")], None),
    "noise": (Annotated[bool, _option("--noise/--no-noise", panel=_GALI, help="The paper's Gaussian logit "
                                                                              "noise.")], True),
    "seed": (Annotated[int, _option(panel=_GALI, help="Seed of the noise and of sampling.")], 0),
    "factor": (Annotated[float | None, _option(panel=_OTHER, help="ntk, dynamic-ntk, yarn: the scaling factor "
                                                                  "(default: input tokens / train-len, rounded "
                                                                  "up).")], None),
    "group_size": (Annotated[int | None, _option(panel=_OTHER, help="self-extend: tokens per group (default: the "
                                                                     "smallest that reaches the input).")], None),
    "neighbor_window": (Annotated[int | None, _option(panel=_OTHER, help="self-extend: keys at exact distances "
                                                                          "(default: train-len / 4).")], None),
    "dca_chunk_size": (Annotated[int | None, _option(panel=_OTHER, help="chunk-llama: chunk size (default: 3/4 of "
                                                                         "train-len).")], None),
}


@dataclass(frozen=True)
class ModelChoice:
    """Which model, which methods and their settings: everything needed before a document is read."""

    model: str
    quantize: str
    device: str
    dtype: str
    methods: tuple[str, ...]
    settings: MethodSettings

    @classmethod
    def parse(cls, options: dict) -> "ModelChoice":
        """From the command-line options; bad values raise ConfigError before anything is loaded."""
        names = tuple(dict.fromkeys(part.strip() for part in options["method"].split(",") if part.strip()))
        methods = tuple(METHODS) if names == ("all",) else names
        for name in methods or ("",):
            get_method(name)
        settings = MethodSettings(**{name: options[name] for name in ("train_len", "chunk_size", "local_window",
                                                                       "noise", "seed", "factor", "group_size",
                                                                       "neighbor_window", "dca_chunk_size")})
        return cls(options["model"], options["quantize"].value, options["device"].value, options["dtype"].value,
                   methods, settings)

    @property
    def method(self) -> str:
        """The one method of an answering command."""
        if len(self.methods) != 1:
            raise ConfigError("--method takes one method here; lists and 'all' are for gali ppl")
        return self.methods[0]


def _with_model_options(command: Callable) -> Callable:
    """Give `command` the options in MODEL_OPTIONS; it receives them parsed, as `choice: ModelChoice`, inside
    `_run`, so that a bad value is an error like any other."""
    signature = inspect.signature(command)
    own = [parameter for parameter in signature.parameters.values() if parameter.name != "choice"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
              for name, (annotation, default) in MODEL_OPTIONS.items()]

    @functools.wraps(command)
    def run_command(*args, **kwargs):
        options = {name: kwargs.pop(name) for name in MODEL_OPTIONS}
        _run(lambda: command(*args, choice=ModelChoice.parse(options), **kwargs))

    run_command.__signature__ = signature.replace(parameters=own + shared)
    del run_command.__wrapped__  # Typer must read the new signature, not the wrapped one
    return run_command


File = Annotated[str, typer.Argument(metavar="FILE", help="A text file (any encoding), a PDF, or - for standard "
                                                            "input.")]
Files = Annotated[list[str], typer.Argument(metavar="DOCS", show_default=False,
                                            help="Documents: text files (any encoding), PDFs, or - for standard "
                                                 "input; with --out also directories, globs and @manifests.")]
Out = Annotated[str | None, typer.Option(help="Batch mode: append one JSON line per document here; a rerun skips "
                                              "the documents already done (see docs/batch.md).")]
Password = Annotated[str | None, typer.Option(help="Password of an encrypted PDF.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr: tokens, speed, peak memory.")]
MaxNewTokens = Annotated[int, typer.Option(min=1, help="Longest answer, in tokens.")]
Temperature = Annotated[float, typer.Option(min=0.0, help="0 is greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling.")]
TopK = Annotated[int, typer.Option(min=0, help="0 keeps every token.")]
System = Annotated[str | None, typer.Option(help="A system prompt.")]
NoStream = Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.")]
CacheDir = Annotated[str | None, typer.Option(envvar="GALI_CACHE_DIR", help="Where documents' prefilled states are "
                                                                            "kept (default: the user cache "
                                                                            "directory).")]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Neither reuse nor store the document's prefilled "
                                                          "state.")]


@dataclass(frozen=True)
class Answering:
    """How an answer is generated and shown."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    system: str | None
    stream: bool
    json_output: bool
    verbose: bool
    cache_dir: str | None = None
    no_cache: bool = False


@app.command()
@_with_model_options
def summarize(
    files: Files, out: Out = None, password: Password = None, max_new_tokens: MaxNewTokens = 512,
    temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0, system: System = None,
    no_stream: NoStream = False, cache_dir: CacheDir = None, no_cache: NoCache = False,
    json_output: JsonOutput = False, verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Summarize a document; the summary streams to stdout. With --out, summarize many into a JSON-lines file.

    Example: gali summarize report.pdf --quantize 4bit > summary.txt
    Example: gali summarize reports/ --out summaries.jsonl
    """
    answering = Answering(max_new_tokens, temperature, top_p, top_k, system, not no_stream, json_output, verbose,
                          cache_dir, no_cache)
    if out or len(files) > 1:
        _answer_batch(files, out, "summarize", SUMMARIZE, None, choice, password, answering)
    else:
        _answer(files[0], SUMMARIZE, choice, password, answering)


@app.command()
@_with_model_options
def ask(
    files: Files,
    question: Annotated[str, typer.Argument(metavar="QUESTION", help="The question about the document(s).")],
    out: Out = None, password: Password = None, max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0,
    top_p: TopP = 1.0, top_k: TopK = 0, system: System = None, no_stream: NoStream = False,
    cache_dir: CacheDir = None, no_cache: NoCache = False, json_output: JsonOutput = False, verbose: Verbose = False,
    choice: ModelChoice = None,
) -> None:
    """Answer QUESTION about a document; the answer streams to stdout. The document's prefilled state is cached,
    so the next question about it starts at once. With --out, ask it of many documents.

    Example: gali ask contract.txt "When does the lease end?"
    Example: gali ask contracts/*.pdf "When does the lease end?" --out leases.jsonl
    """
    if not question.strip():
        raise ConfigError("QUESTION is empty")
    answering = Answering(max_new_tokens, temperature, top_p, top_k, system, not no_stream, json_output, verbose,
                          cache_dir, no_cache)
    if out or len(files) > 1:
        _answer_batch(files, out, "ask", ask_instruction(question), question, choice, password, answering)
    else:
        _answer(files[0], ask_instruction(question), choice, password, answering)


@app.command()
@_with_model_options
def ppl(
    files: Files, out: Out = None, password: Password = None,
    max_tokens: Annotated[int | None, typer.Option(min=2, help="Evaluate the first N tokens only.")] = None,
    lengths: Annotated[str | None, typer.Option(help="PPL over the first l tokens for each l, e.g. 1k,2k,4k "
                                                     "(k = 1024).")] = None,
    csv: Annotated[bool, typer.Option("--csv", help="Print method,length,ppl rows as CSV.")] = False,
    plot: Annotated[str | None, typer.Option(help="Also save PPL against length as an image, e.g. ppl.png "
                                                  "(needs gali-cli[plot]).")] = None,
    json_output: JsonOutput = False, verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Perplexity of a document: exp(mean NLL of tokens 2..N), each predicted from its whole prefix, in one pass
    per method. With --out, of many documents, with the corpus's token-weighted perplexity at the end.

    Example: gali ppl book.txt --method gali,yarn,original --lengths 2k,4k,8k,16k
    Example: gali ppl corpus/ --out ppl.jsonl --method gali,yarn --max-tokens 16384
    """
    wanted = _parse_lengths(lengths)
    if wanted and max_tokens and wanted[-1] > max_tokens:
        raise ConfigError(f"--lengths goes to {wanted[-1]} tokens, past --max-tokens {max_tokens}")
    if json_output and csv:
        raise ConfigError("--json and --csv both print on stdout: choose one")
    if plot:
        display.check_plotting()
    if out or len(files) > 1:
        _perplexity_batch(files, out, choice, password, max_tokens, wanted, json_output, csv, plot, verbose)
    else:
        _perplexity(files[0], choice, password, max_tokens, wanted, json_output, csv, plot, verbose)


@app.command()
@_with_model_options
def chat(
    file: File, password: Password = None, max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0,
    top_p: TopP = 1.0, top_k: TopK = 0, system: System = None, no_stream: NoStream = False,
    cache_dir: CacheDir = None, no_cache: NoCache = False,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per answer, a line each.")] = False,
    verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Read FILE once, then answer questions typed at the prompt, keeping the conversation (Ctrl-C stops an
    answer, Ctrl-D leaves).

    Answers stream to stdout, the prompt goes to stderr; questions may also be piped in, one a line.

    Example: gali chat report.pdf -m demo
    """
    if file == "-":
        raise ConfigError("gali chat reads its questions from standard input: give FILE as a path")
    answering = Answering(max_new_tokens, temperature, top_p, top_k, system, not no_stream, json_output, verbose,
                          cache_dir, no_cache)
    sampler = make_sampler(temperature, top_p, top_k, choice.settings.seed)
    _check(choice)
    store = None if no_cache else _store(cache_dir)
    document = _read(file, password)
    loaded = _load(choice)
    conversation = _conversation(loaded, choice, document, system, store)
    _say_input(loaded, choice.method, document, conversation.prompt(ask_instruction("?")).document_end)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # a stray byte in a piped question is not worth a crash
    while True:
        question = _read_question(interactive)
        if question is None:
            return
        if not question:
            continue
        instruction = question if conversation.questions else ask_instruction(question)
        try:
            text, finished = _stream_answer(conversation, instruction, sampler, answering)
        except KeyboardInterrupt:  # stops this answer; Ctrl-C at the prompt leaves
            say("(answer stopped; the question is forgotten)", style="dim")
            continue
        if json_output:
            print_json({"question": question, "answer": text.strip(), "turn": len(conversation.questions),
                        **_finished_facts(finished)})
        if verbose:
            _say_stats(finished)


def _read_question(interactive: bool) -> str | None:
    """The next question from stdin (the prompt on stderr when a person types, with line editing and history
    where the readline module exists), stripped; None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line.strip() if line else None
    try:
        import readline  # noqa: F401 - importing it gives input() line editing
    except ImportError:
        pass
    err.print("[bold]>[/bold] ", end="")
    try:
        return input().strip()
    except EOFError:
        err.print()
        return None


cache_app = typer.Typer(name="cache", no_args_is_help=True, help="The document cache: prefilled states of documents "
                                                                  "asked about (GALI_CACHE_DIR, GALI_CACHE_LIMIT).")
app.add_typer(cache_app)


@cache_app.command("list")
def cache_list(cache_dir: CacheDir = None, json_output: JsonOutput = False) -> None:
    """List cached documents, most recently used first.

    Example: gali cache list
    """
    def action() -> None:
        store = _store(cache_dir)
        entries = store.entries()
        if json_output:
            print_json({"directory": str(store.directory), "limit_bytes": store.limit,
                        "entries": [{"document": entry.document, "model": entry.model, "method": entry.method,
                                     "tokens": entry.tokens, "bytes": entry.size, "last_used": entry.last_used,
                                     "path": str(entry.path)} for entry in entries]})
        else:
            display.print_cache_entries(entries, store.directory, store.limit)

    _run(action)


@cache_app.command("clear")
def cache_clear(cache_dir: CacheDir = None) -> None:
    """Delete every cached document state.

    Example: gali cache clear
    """
    def action() -> None:
        store = _store(cache_dir)
        count, size = store.clear()
        say(f"Removed {count} cached document state{'s' if count != 1 else ''} ({size / 2**20:.1f} MiB) from "
            f"{store.directory}.")

    _run(action)


@app.command()
@_with_model_options
def info(json_output: JsonOutput = False, choice: ModelChoice = None) -> None:
    """Describe the model, device, CUDA, bitsandbytes and GALI settings, without loading weights.

    Example: gali info -m demo
    """
    _print_info(choice, json_output)


def _answer(file: str, instruction: str, choice: ModelChoice, password: str | None, answering: Answering) -> None:
    sampler = make_sampler(answering.temperature, answering.top_p, answering.top_k, choice.settings.seed)
    _check(choice)
    store = None if answering.no_cache else _store(answering.cache_dir)
    document = _read(file, password)
    loaded = _load(choice)
    conversation = _conversation(loaded, choice, document, answering.system, store)
    _say_input(loaded, choice.method, document, len(conversation.prompt(instruction).ids))
    text, finished = _stream_answer(conversation, instruction, sampler, answering)
    if answering.json_output:
        print_json({"answer": text.strip(), **_facts(choice.model, choice.method, conversation.resolved, document),
                    **_finished_facts(finished)})
    if answering.verbose:
        _say_stats(finished)


def _conversation(loaded: LoadedModel, choice: ModelChoice, document: Document, system: str | None,
                  store: DocumentCache | None) -> Conversation:
    return Conversation(loaded, choice.method, choice.settings, document.text, document.name, system, store,
                        notice=lambda message: say(message, style="dim"))


def _store(directory: str | None) -> DocumentCache:
    path = Path(directory).expanduser() if directory else default_directory()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--cache-dir {path}: not a directory")
    return DocumentCache(path, default_limit(), warn)


def _stream_answer(conversation: Conversation, instruction: str, sampler, answering: Answering
                   ) -> tuple[str, Finished]:
    """One answer, streamed to stdout unless --json or --no-stream; returns its text and what it cost."""
    stream = answering.stream and not answering.json_output
    answer, finished = [], None
    with display.progress_bar("Reading") as bar:
        try:
            for event in conversation.ask(instruction, sampler, answering.max_new_tokens, bar):
                bar.hide()
                if isinstance(event, TextPiece):
                    answer.append(event.text)
                    if stream:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                else:
                    finished = event
        except KeyboardInterrupt:
            if stream and answer:
                sys.stdout.write("\n")
            raise
    text = "".join(answer)
    if not answering.json_output:
        sys.stdout.write(("" if text.endswith("\n") else "\n") if stream else text.strip() + "\n")
        sys.stdout.flush()
    if conversation.from_store and len(conversation.questions) == 1:
        say(f"(document state from the cache: {conversation.document_tokens} tokens not read again)", style="dim")
    if finished.reason == "length":
        say(f"(stopped at --max-new-tokens {answering.max_new_tokens})", style="dim")
    return text, finished


def _perplexity(file: str, choice: ModelChoice, password: str | None, max_tokens: int | None, lengths: list[int],
                json_output: bool, csv: bool, plot: str | None, verbose: bool) -> None:
    _check(choice)
    document = _read(file, password)
    loaded = _load(choice)
    limit = lengths[-1] if lengths else max_tokens
    ids, total = _ppl_ids(loaded, document, limit)
    if total > len(ids):
        say(f"Evaluating the first {limit} of {total} tokens ({'--lengths' if lengths else '--max-tokens'}).")
    rows, settings = [], {}
    for method in choice.methods:
        _say_input(loaded, method, document, len(ids))
        settings[method], results = _method_perplexities(loaded, ids, method, choice, lengths or [len(ids)], verbose)
        rows += [{"method": method, "length": result.length, "ppl": result.ppl} for result in results]
    single = len(rows) == 1 and not lengths
    if json_output:
        facts = _facts(choice.model, ",".join(choice.methods), settings, document)
        print_json({"ppl": rows[0]["ppl"], "tokens": len(ids), **facts} if single else
                   {"results": rows, "tokens": len(ids), **facts})
    else:
        _print_ppl_rows(rows, csv, single)
    if plot:
        display.plot_ppl(rows, plot, f"{os.path.basename(document.name)}, {choice.model}")
        say(f"Saved {plot}.")


def _ppl_ids(loaded: LoadedModel, document: Document, limit: int | None) -> tuple[list[int], int]:
    """The document's first `limit` tokens (the tokenizer's default special tokens), and how many it has."""
    ids = text_ids(loaded.tokenizer, document.text, add_special_tokens=True)
    if len(ids) < 2:
        raise InputError(f"{document.name} has {len(ids)} token(s); perplexity needs at least 2")
    return ids[:limit] if limit else ids, len(ids)


def _method_perplexities(loaded: LoadedModel, ids: list[int], method: str, choice: ModelChoice, lengths: list[int],
                         verbose: bool, show_progress: bool = True) -> tuple[dict, list]:
    """Apply `method` for these tokens and measure PPL at `lengths` in one pass; returns its settings and results."""
    device = loaded.model.get_input_embeddings().weight.device
    settings = apply_method(loaded.model, method, choice.settings, len(ids))
    spans = model_spans(loaded, method, settings, 0, len(ids))
    boundaries = METHODS[method].boundaries(loaded.model, 0, len(ids)) if METHODS[method].boundaries else None
    reset_peak_memory(device)
    started = time.perf_counter()
    with display.progress_bar(method) as bar:
        results = perplexities(loaded.model, torch.tensor([ids], device=device), lengths, spans,
                               bar.with_figure("ppl") if show_progress else None, boundaries)
    if verbose:
        seconds = time.perf_counter() - started
        say(f"{method}: {len(ids)} tokens in {seconds:.2f} s ({len(ids) / seconds:.0f} tokens/s); "
            f"peak memory {peak_memory_bytes(device) / 2**30:.2f} GiB")
    return settings, results


def _print_ppl_rows(rows: list[dict], csv: bool, single: bool) -> None:
    if csv:
        display.print_ppl_csv(rows)
    elif single:
        sys.stdout.write(f"{rows[0]['ppl']:.4f}\n")
    else:
        display.print_ppl_table(rows)


@dataclass
class Batch:
    """A batch ready to run: its documents, results file, this process's rank, and the other processes."""

    documents: list
    results: ResultsFile
    rank: Rank
    collective: Collective | None


def _batch_setup(specs: list[str], out: str | None, choice: ModelChoice) -> Batch:
    """Everything checked before the model loads: the documents, the results file, the launcher's processes."""
    if not out:
        raise ConfigError("several documents need --out FILE.jsonl for their results")
    _check(choice)
    rank = Rank.from_environment()
    results = ResultsFile(Path(out), rank)
    documents = [document for document in expand_documents(specs) if not results.is_output(document)]
    if not documents:
        raise InputError(f"no documents in {' '.join(specs)} besides --out")
    results.prepare()
    collective = Collective(rank) if rank.distributed else None
    if not rank.distributed:
        results.merge()  # part files an interrupted distributed run left behind
    return Batch(documents, results, rank, collective)


def _batch_job(command: str, choice: ModelChoice, **details) -> dict:
    """What decides a document's output besides its content: a rerun with another job does every document again."""
    device = resolve_device(choice.device)
    return {"command": command, "model": choice.model, "quantize": choice.quantize, "device": device.type,
            "dtype": str(resolve_dtype(choice.dtype, device)).removeprefix("torch."),
            "method": ",".join(choice.methods), "settings": asdict(choice.settings), **details}


def _run_batch(batch: Batch, job: dict, work) -> int:
    """Run this process's share (a bar with tokens/s alone, a line per document when distributed), then merge on
    rank 0; returns how many documents failed in all processes."""
    rank, label = batch.rank, f"[rank {batch.rank.rank}/{batch.rank.world}] " if batch.rank.distributed else ""
    started = time.perf_counter()
    with display.progress_bar("documents") as bar:
        def progress(outcome: Outcome, path: Path | None) -> None:
            finished = outcome.done + outcome.skipped + outcome.failed
            if rank.distributed:
                if path is not None:
                    say(f"{label}{finished + 1}/{outcome.documents} {path}", style="dim")
                return
            bar(finished, outcome.documents)
            bar.describe(f"documents ({outcome.tokens / (time.perf_counter() - started):.0f} tokens/s)")

        outcome = run_batch(batch.documents, batch.results, job, work, rank, progress)
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


def _answer_batch(specs: list[str], out: str | None, command: str, instruction: str, question: str | None,
                  choice: ModelChoice, password: str | None, answering: Answering) -> None:
    batch = _batch_setup(specs, out, choice)
    store = None if answering.no_cache else _store(answering.cache_dir)
    job = _batch_job(command, choice, question=question, system=answering.system,
                     generation={"max_new_tokens": answering.max_new_tokens, "temperature": answering.temperature,
                                 "top_p": answering.top_p, "top_k": answering.top_k})
    loaded = _load(choice, batch.rank)

    def work(path: Path) -> list[dict]:
        document = read_document(str(path), password=password)
        conversation = _conversation(loaded, choice, document, answering.system, store)
        sampler = make_sampler(answering.temperature, answering.top_p, answering.top_k, choice.settings.seed)
        events = list(conversation.ask(instruction, sampler, answering.max_new_tokens))
        answer = "".join(event.text for event in events if isinstance(event, TextPiece)).strip()
        return [{"output": answer, "settings": conversation.resolved, "tokens": events[-1].prompt_tokens,
                 "warnings": [*document.warnings], **_finished_facts(events[-1])}]

    failed = _run_batch(batch, job, work)
    if answering.json_output and batch.rank.rank == 0:
        print_json({"out": str(batch.results.path), **batch_summary(batch.results.records(), job, batch.documents)})
    if failed:
        raise typer.Exit(1)


def _perplexity_batch(specs: list[str], out: str | None, choice: ModelChoice, password: str | None,
                      max_tokens: int | None, lengths: list[int], json_output: bool, csv: bool, plot: str | None,
                      verbose: bool) -> None:
    batch = _batch_setup(specs, out, choice)
    job = _batch_job("ppl", choice, max_tokens=max_tokens, lengths=lengths)
    loaded = _load(choice, batch.rank)

    def work(path: Path) -> list[dict]:
        document = read_document(str(path), password=password)
        ids, _ = _ppl_ids(loaded, document, lengths[-1] if lengths else max_tokens)
        reachable = [length for length in lengths if length <= len(ids)] if lengths else [len(ids)]
        records = []
        for method in choice.methods:
            settings, found = (_method_perplexities(loaded, ids, method, choice, reachable, verbose,
                                                    show_progress=False)  # the batch has its own bar
                               if reachable else ({}, []))
            records.append({"method": method, "settings": settings, "tokens": len(ids),
                            "results": [asdict(result) for result in found], "warnings": [*document.warnings]
                            + ([] if reachable else [f"{len(ids)} tokens: shorter than every --lengths value"])})
        return records

    failed = _run_batch(batch, job, work)
    if batch.rank.rank == 0:
        records = batch.results.records()
        rows = corpus_perplexities(records, job, batch.documents, by_length=bool(lengths))
        if json_output:
            print_json({"corpus": rows, "out": str(batch.results.path),
                        **batch_summary(records, job, batch.documents)})
        elif rows:
            _print_ppl_rows(rows, csv, single=len(rows) == 1)
        if plot and lengths and rows:
            display.plot_ppl(rows, plot, f"{len(batch.documents)} documents, {choice.model}")
            say(f"Saved {plot}.")
    if failed:
        raise typer.Exit(1)


def _print_info(choice: ModelChoice, json_output: bool) -> None:
    facts = {"model": choice.model, **environment_facts(choice.device, choice.dtype),
             "quantization": choice.quantize, "method": ",".join(choice.methods)}
    try:
        config = load_config(choice.model)
    except GaliError:
        display.print_facts(facts, json_output)  # what is known without the model, then the error
        raise
    gali = asdict(choice.settings.gali().resolved(config.max_position_embeddings))
    display.print_facts({**facts, **model_facts(config), "gali": gali}, json_output)


def _check(choice: ModelChoice) -> None:
    """Settings that depend on the model (its window) are checked from its config, before any file is read."""
    window = load_config(choice.model).max_position_embeddings
    if "gali" in choice.methods:
        choice.settings.gali().resolved(window)
    elif choice.settings.train_len is not None and choice.settings.train_len > window:
        raise ConfigError(f"--train-len ({choice.settings.train_len}) exceeds the model's training window ({window})")


def _read(file: str, password: str | None) -> Document:
    with display.progress_bar("Pages") as bar:
        document = read_document(file, password=password, progress=bar)
    for warning in document.warnings:
        warn(warning)
    return document


def _load(choice: ModelChoice, rank: Rank | None = None) -> LoadedModel:
    """The model; under a launcher, on this process's own GPU (local rank, modulo the GPUs it can see)."""
    gpu = rank.local_rank % max(1, torch.cuda.device_count()) if rank and rank.distributed else None
    kernel_choice()  # a mistyped GALI_KERNEL fails now, not after the model has loaded
    with err.status(f"Loading {choice.model}"):
        return load_model(choice.model, choice.quantize, choice.device, choice.dtype, gpu=gpu)


def _say_input(loaded: LoadedModel, method: str, document: Document, tokens: int) -> None:
    pages = f"{document.pages} page{'s' if document.pages != 1 else ''}, " if document.pages else ""
    say(f"{document.name}: {pages}{tokens} tokens, {tokens / loaded.train_len:.1f}x the model's {loaded.train_len}"
        f"-token window ({method})", style="dim")


def _say_stats(finished: Finished) -> None:
    cached = finished.prompt_tokens - finished.prefilled_tokens
    say(f"prompt {finished.prompt_tokens} tokens ({cached} from the cache), prefill {finished.prefill_seconds:.2f} s "
        f"({finished.prefill_tokens_per_second:.0f} tokens/s); generated {finished.generated_tokens} tokens "
        f"({finished.decode_tokens_per_second:.1f} tokens/s, {finished.reason}); "
        f"peak memory {finished.peak_memory_bytes / 2**30:.2f} GiB")


def _facts(model: str, method: str, settings: dict, document: Document) -> dict:
    return {"model": model, "method": method, "settings": settings,
            "document": {"name": document.name, "kind": document.kind, "pages": document.pages}}


def _finished_facts(finished: Finished) -> dict:
    return {"finish_reason": finished.reason, "prompt_tokens": finished.prompt_tokens,
            "cached_tokens": finished.prompt_tokens - finished.prefilled_tokens,
            "generated_tokens": finished.generated_tokens,
            "prefill_tokens_per_second": round(finished.prefill_tokens_per_second, 2),
            "decode_tokens_per_second": round(finished.decode_tokens_per_second, 2),
            "peak_memory_mib": round(finished.peak_memory_bytes / 2**20, 1)}


def _parse_lengths(text: str | None) -> list[int]:
    """"1k,2k,4k" -> [1024, 2048, 4096] (k = 1024, as in the paper); sorted, unique."""
    lengths = set()
    for part in (text or "").split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(part.removesuffix("k")) * (1024 if part.endswith("k") else 1)
        except ValueError:
            raise ConfigError(f"--lengths: {part!r} is not a length such as 4096 or 4k") from None
        if value < 2:
            raise ConfigError(f"--lengths: {part!r} is too short, perplexity needs at least 2 tokens")
        lengths.add(value)
    return sorted(lengths)


def _run(action: Callable[[], None]) -> None:
    """Run a command: library errors become one line on stderr and an exit code (GALI_DEBUG=1: tracebacks)."""
    _quiet_libraries()
    try:
        action()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        say("interrupted")
        raise typer.Exit(130)
    except BrokenPipeError:  # the reader of stdout went away (e.g. | head): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1)
    except GaliError as error:
        fail(str(error))
        raise typer.Exit(next((code for kind, code in EXIT_CODES.items() if isinstance(error, kind)), 1))
    except torch.cuda.OutOfMemoryError:
        fail("CUDA ran out of memory: try --quantize 4bit or a smaller --chunk-size")
        raise typer.Exit(4)
    except Exception as error:
        if os.environ.get("GALI_DEBUG"):
            raise
        fail(f"unexpected {type(error).__name__}: {error} (GALI_DEBUG=1 shows the traceback)")
        raise typer.Exit(1)


def _quiet_libraries() -> None:
    """Keep library chatter (retries, repaired PDFs, per-call quantization notes) off the user's stderr."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("huggingface_hub", "pypdf", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="bitsandbytes")
    warnings.showwarning = _show_warning


_show_library_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """gali's own warnings (GaliWarning) as one "warning:" line on stderr; other libraries' as Python shows them."""
    if issubclass(category, GaliWarning):
        warn(str(message))
    else:
        _show_library_warning(message, category, filename, lineno, file, line)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        sys.stdout.write(f"gali {__version__}\n")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")]
    = False,
) -> None:
    """Read documents longer than a Llama's training window, with Greedy Attention Logit Interpolation (GALI)."""


def main(args: list[str] | None = None) -> int:
    """The `gali` executable: like `app()`, but usage errors too are one line on stderr."""
    try:
        code = app(args=args, standalone_mode=False)
    except typer.TyperException as error:  # a usage error: unknown option, bad value, missing argument
        fail(f"{error.format_message()} (see gali --help)")
        return error.exit_code
    except typer.Abort:
        return 1
    return code if isinstance(code, int) else 0
