"""The `gali` command: parse, call the library, print.

stdout carries only the answer (or the --json document); loading, progress, warnings and stats go to stderr.
Exit codes: 0 ok, 1 runtime error, 2 usage, 3 unreadable input, 4 model load or out of memory, 130 interrupted.
"""

import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Annotated

import torch
import transformers
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import GaliConfig
from .documents import Document, read_document
from .errors import ConfigError, GaliError, InputError, ModelLoadError, UnsupportedModelError
from .generate import Finished, TextPiece, forward_spans, make_sampler, stop_token_ids, stream_generate
from .loading import DEFAULT_MODEL, LoadedModel, load_config, load_model, resolve_device, resolve_dtype
from .methods import METHODS, get_method
from .perplexity import perplexities
from .prompts import SUMMARIZE, ask_instruction, prompt_ids

EXIT_CODES = {ConfigError: 2, InputError: 3, ModelLoadError: 4, UnsupportedModelError: 4}
err = Console(stderr=True, highlight=False, soft_wrap=True)  # never hard-wrap: one error, one line
app = typer.Typer(
    name="gali",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


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


MethodName = Enum("MethodName", {name: name for name in METHODS}, type=str)

_MODEL, _GALI, _GEN, _OUT = "Model", "GALI (defaults follow the model's training window)", "Generation", "Output"
File = Annotated[str, typer.Argument(help="A text file (any encoding), a PDF, or - for standard input.")]
Model = Annotated[str, typer.Option("--model", "-m", envvar="GALI_MODEL", rich_help_panel=_MODEL,
                                    help="Hub id, local directory, or 'demo' (the small bundled model).")]
QuantizeOpt = Annotated[Quantize, typer.Option(help="bitsandbytes quantization (4bit: NF4, bf16 compute).",
                                               rich_help_panel=_MODEL)]
DeviceOpt = Annotated[Device, typer.Option(help="auto: CUDA when there is a GPU.", rich_help_panel=_MODEL)]
DTypeOpt = Annotated[DType, typer.Option(help="auto: bfloat16 on GPU, float32 on CPU.", rich_help_panel=_MODEL)]
MethodOpt = Annotated[MethodName, typer.Option(help="gali, or original (the unpatched model).",
                                               rich_help_panel=_MODEL)]
TrainLen = Annotated[int | None, typer.Option(help="The training window to stay within [model's].",
                                              rich_help_panel=_GALI)]
ChunkSize = Annotated[int | None, typer.Option(help="Tokens per chunk beyond it [train-len / 8].",
                                               rich_help_panel=_GALI)]
LocalWindow = Annotated[int | None, typer.Option(help="Newest tokens kept at exact positions [train-len / 64].",
                                                 rich_help_panel=_GALI)]
Noise = Annotated[bool, typer.Option("--noise/--no-noise", help="The paper's Gaussian logit noise.",
                                     rich_help_panel=_GALI)]
Seed = Annotated[int, typer.Option(help="Seed of the noise and of sampling.", rich_help_panel=_GALI)]
Password = Annotated[str | None, typer.Option(help="Password of an encrypted PDF.", rich_help_panel=_MODEL)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.", rich_help_panel=_OUT)]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr: tokens, speed, peak memory.",
                                       rich_help_panel=_OUT)]
MaxNewTokens = Annotated[int, typer.Option(min=1, help="Longest answer, in tokens.", rich_help_panel=_GEN)]
Temperature = Annotated[float, typer.Option(min=0.0, help="0 is greedy.", rich_help_panel=_GEN)]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling.", rich_help_panel=_GEN)]
TopK = Annotated[int, typer.Option(min=0, help="0 keeps every token.", rich_help_panel=_GEN)]
System = Annotated[str | None, typer.Option(help="A system prompt.", rich_help_panel=_GEN)]
NoStream = Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.", rich_help_panel=_OUT)]


@dataclass(frozen=True)
class ModelChoice:
    """Which model, and how to run it: everything needed before a document is read."""

    name: str
    quantize: str
    device: str
    dtype: str
    method: str
    gali: GaliConfig

    @classmethod
    def parse(cls, name, quantize, device, dtype, method, train_len, chunk_size, local_window, noise, seed):
        gali = GaliConfig(train_len=train_len, chunk_size=chunk_size, local_window=local_window, noise=noise,
                          seed=seed)  # validates the flags before anything is loaded
        return cls(name, quantize.value, device.value, dtype.value, method.value, gali)


@app.command()
def summarize(
    file: File, model: Model = DEFAULT_MODEL, quantize: QuantizeOpt = Quantize.none, device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto, method: MethodOpt = MethodName.gali, train_len: TrainLen = None,
    chunk_size: ChunkSize = None, local_window: LocalWindow = None, noise: Noise = True, seed: Seed = 0,
    password: Password = None, max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0,
    top_p: TopP = 1.0, top_k: TopK = 0, system: System = None, no_stream: NoStream = False,
    json_output: JsonOpt = False, verbose: Verbose = False,
) -> None:
    """Summarize FILE; the summary streams to stdout.

    Example: gali summarize report.pdf --quantize 4bit > summary.txt
    """
    _run(lambda: _answer(
        file, SUMMARIZE,
        ModelChoice.parse(model, quantize, device, dtype, method, train_len, chunk_size, local_window, noise, seed),
        password, make_sampler(temperature, top_p, top_k, seed), max_new_tokens, system, not no_stream, json_output,
        verbose,
    ))


@app.command()
def ask(
    file: File, question: Annotated[str, typer.Argument(help="The question about the document.")],
    model: Model = DEFAULT_MODEL, quantize: QuantizeOpt = Quantize.none, device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto, method: MethodOpt = MethodName.gali, train_len: TrainLen = None,
    chunk_size: ChunkSize = None, local_window: LocalWindow = None, noise: Noise = True, seed: Seed = 0,
    password: Password = None, max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0,
    top_p: TopP = 1.0, top_k: TopK = 0, system: System = None, no_stream: NoStream = False,
    json_output: JsonOpt = False, verbose: Verbose = False,
) -> None:
    """Answer QUESTION about FILE; the answer streams to stdout.

    Example: gali ask contract.txt "When does the lease end?"
    """
    if not question.strip():
        raise typer.BadParameter("the question is empty", param_hint="QUESTION")
    _run(lambda: _answer(
        file, ask_instruction(question),
        ModelChoice.parse(model, quantize, device, dtype, method, train_len, chunk_size, local_window, noise, seed),
        password, make_sampler(temperature, top_p, top_k, seed), max_new_tokens, system, not no_stream, json_output,
        verbose,
    ))


@app.command()
def ppl(
    file: File, model: Model = DEFAULT_MODEL, quantize: QuantizeOpt = Quantize.none, device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto, method: MethodOpt = MethodName.gali, train_len: TrainLen = None,
    chunk_size: ChunkSize = None, local_window: LocalWindow = None, noise: Noise = True, seed: Seed = 0,
    password: Password = None,
    max_tokens: Annotated[int | None, typer.Option(min=2, help="Evaluate the first N tokens only.")] = None,
    lengths: Annotated[str | None, typer.Option(help="PPL over the first l tokens for each l, e.g. 1k,2k,4k.")] = None,
    json_output: JsonOpt = False, verbose: Verbose = False,
) -> None:
    """Perplexity of FILE: exp(mean NLL of tokens 2..N), each predicted from its whole prefix, in one pass.

    Example: gali ppl book.txt --lengths 2k,4k,8k,16k
    """
    wanted = _parse_lengths(lengths)
    _run(lambda: _perplexity(
        file,
        ModelChoice.parse(model, quantize, device, dtype, method, train_len, chunk_size, local_window, noise, seed),
        password, max_tokens, wanted, json_output, verbose,
    ))


@app.command()
def info(
    model: Model = DEFAULT_MODEL, quantize: QuantizeOpt = Quantize.none, device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto, method: MethodOpt = MethodName.gali, train_len: TrainLen = None,
    chunk_size: ChunkSize = None, local_window: LocalWindow = None, noise: Noise = True, seed: Seed = 0,
    json_output: JsonOpt = False,
) -> None:
    """Describe the model, device, CUDA, bitsandbytes and GALI settings, without loading weights.

    Example: gali info -m demo
    """
    _run(lambda: _print_info(
        ModelChoice.parse(model, quantize, device, dtype, method, train_len, chunk_size, local_window, noise, seed),
        json_output,
    ))


def _answer(file, instruction, choice, password, sampler, max_new_tokens, system, stream, json_output, verbose):
    _check(choice)
    document = _read(file, password)
    loaded = _load(choice)
    ids = prompt_ids(loaded.tokenizer, document.text, instruction, system)
    _say_input(loaded, choice, document, len(ids))
    spans = _spans(loaded, choice, 0, len(ids))
    stream = stream and not json_output
    answer, finished = [], None
    with _progress("Reading", len(ids)) as progress:
        events = stream_generate(loaded.model, loaded.tokenizer, ids, sampler, max_new_tokens,
                                 stop_token_ids(loaded.model, loaded.tokenizer), spans, progress)
        try:
            for event in events:
                progress.done()
                if isinstance(event, TextPiece):
                    answer.append(event.text)
                    if stream:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                elif isinstance(event, Finished):
                    finished = event
        except KeyboardInterrupt:
            if stream and answer:
                sys.stdout.write("\n")
            raise
    text = "".join(answer)
    if json_output:
        _print_json({"answer": text.strip(), **_run_facts(loaded, choice, document), **_finished_facts(finished)})
    elif stream:
        sys.stdout.write("" if text.endswith("\n") else "\n")
    else:
        sys.stdout.write(text.strip() + "\n")
    if verbose:
        _say_stats(finished)


def _perplexity(file, choice, password, max_tokens, lengths, json_output, verbose) -> None:
    _check(choice)
    document = _read(file, password)
    loaded = _load(choice)
    ids = loaded.tokenizer(document.text)["input_ids"]
    if max_tokens and len(ids) > max_tokens:
        err.print(f"Evaluating the first {max_tokens} of {len(ids)} tokens (--max-tokens).")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InputError(f"{document.name} has {len(ids)} token(s); perplexity needs at least 2")
    _say_input(loaded, choice, document, len(ids))
    tensor = torch.tensor([ids], device=loaded.model.get_input_embeddings().weight.device)
    with _progress("Perplexity", len(ids)) as progress:
        results = perplexities(loaded.model, tensor, lengths or [len(ids)], _spans(loaded, choice, 0, len(ids)),
                               progress.with_figure("ppl"))
    rows = [{"method": choice.method, "length": r.length, "ppl": r.ppl} for r in results]
    if json_output:
        facts = _run_facts(loaded, choice, document)
        _print_json({"results": rows, "tokens": len(ids), **facts} if lengths else
                    {"ppl": results[0].ppl, "tokens": len(ids), **facts})
    elif lengths:
        table = Table("method", "length", "ppl")
        for row in rows:
            table.add_row(row["method"], str(row["length"]), f"{row['ppl']:.3f}")
        Console().print(table)
    else:
        sys.stdout.write(f"{results[0].ppl:.4f}\n")
    if verbose:
        err.print(f"{len(ids)} tokens, method {choice.method}, ppl {results[-1].ppl:.4f}")


def _print_info(choice: ModelChoice, json_output: bool) -> None:
    config = load_config(choice.name)
    device = resolve_device(choice.device)
    gali = choice.gali.resolved(config.max_position_embeddings)
    cuda = [{"name": torch.cuda.get_device_name(i), "memory_gib": round(torch.cuda.get_device_properties(i)
             .total_memory / 2**30, 1)} for i in range(torch.cuda.device_count())]
    facts = {
        "model": choice.name,
        "architecture": (config.architectures or ["LlamaForCausalLM"])[0],
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "train_len": config.max_position_embeddings,
        "rope": dict(config.rope_parameters or {}),
        "device": str(device),
        "dtype": str(resolve_dtype(choice.dtype, device)).removeprefix("torch."),
        "quantization": choice.quantize,
        "method": choice.method,
        "gali": asdict(gali),
        "cuda": cuda,
        "bitsandbytes": _bitsandbytes_status(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if json_output:
        _print_json(facts)
        return
    table = Table(show_header=False, box=None)
    for key, value in facts.items():
        shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
        if key == "cuda":
            shown = "; ".join(f"{gpu['name']} ({gpu['memory_gib']} GiB)" for gpu in value) or "no GPU"
        table.add_row(key, str(shown))
    Console().print(table)


def _bitsandbytes_status() -> str:
    try:
        import bitsandbytes
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable", and we say why
        return f"unavailable ({type(error).__name__}: {error})"
    return f"bitsandbytes {bitsandbytes.__version__}"


def _read(file: str, password: str | None) -> Document:
    with _progress("Pages", None) as progress:
        document = read_document(file, password=password, progress=progress)
    for warning in document.warnings:
        err.print(f"[yellow]warning:[/] {warning}")
    return document


def _check(choice: ModelChoice) -> None:
    """Settings that depend on the model (its window) are checked from its config, before any file is read."""
    get_method(choice.method)
    choice.gali.resolved(load_config(choice.name).max_position_embeddings)


def _load(choice: ModelChoice) -> LoadedModel:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with err.status(f"Loading {choice.name}"):
        loaded = load_model(choice.name, choice.quantize, choice.device, choice.dtype)
        get_method(choice.method).apply(loaded.model, choice.gali)
    return loaded


def _spans(loaded: LoadedModel, choice: ModelChoice, start: int, stop: int) -> list[tuple[int, int]]:
    """Forwards of about 8 chunks (bounded memory), cut only where the method allows."""
    method = get_method(choice.method)
    step = max(256, 8 * choice.gali.resolved(loaded.train_len).chunk_size)
    boundaries = method.boundaries(loaded.model, start, stop) if method.boundaries else None
    return forward_spans(start, stop, step, boundaries)


def _say_input(loaded: LoadedModel, choice: ModelChoice, document, tokens: int) -> None:
    pages = f"{document.pages} pages, " if document.pages else ""
    ratio = tokens / loaded.train_len
    err.print(f"{document.name}: {pages}{tokens} tokens, {ratio:.1f}x the model's {loaded.train_len}-token window "
              f"({choice.method})", style="dim")


def _say_stats(finished: Finished) -> None:
    err.print(
        f"prompt {finished.prompt_tokens} tokens, prefill {finished.prefill_seconds:.2f} s "
        f"({finished.prefill_tokens_per_second:.0f} tokens/s); generated {finished.generated_tokens} tokens "
        f"({finished.decode_tokens_per_second:.1f} tokens/s, {finished.reason}); "
        f"peak memory {finished.peak_memory_bytes / 2**30:.2f} GiB"
    )


def _run_facts(loaded: LoadedModel, choice: ModelChoice, document) -> dict:
    gali = asdict(choice.gali.resolved(loaded.train_len)) if choice.method == "gali" else None
    return {"model": choice.name, "method": choice.method, "gali": gali,
            "document": {"name": document.name, "kind": document.kind, "pages": document.pages}}


def _finished_facts(finished: Finished) -> dict:
    return {"finish_reason": finished.reason, "prompt_tokens": finished.prompt_tokens,
            "generated_tokens": finished.generated_tokens,
            "prefill_tokens_per_second": round(finished.prefill_tokens_per_second, 2),
            "decode_tokens_per_second": round(finished.decode_tokens_per_second, 2),
            "peak_memory_mib": round(finished.peak_memory_bytes / 2**20, 1)}


def _print_json(document: dict) -> None:
    sys.stdout.write(json.dumps(document, ensure_ascii=False) + "\n")


def _parse_lengths(text: str | None) -> list[int]:
    """"1k,2k,4k" -> [1024, 2048, 4096] (k = 1024, as in the paper); sorted, unique."""
    if not text:
        return []
    lengths = set()
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            value = int(part.removesuffix("k")) * scale
        except ValueError:
            raise typer.BadParameter(f"{part!r} is not a length such as 4096 or 4k", param_hint="--lengths")
        if value < 2:
            raise typer.BadParameter(f"lengths must be at least 2, got {part!r}", param_hint="--lengths")
        lengths.add(value)
    return sorted(lengths)


class _Bar:
    """The (done, total) callback of a Rich progress bar on stderr; a line per update when stderr is no terminal."""

    def __init__(self, progress: Progress, task, label: str) -> None:
        self.progress, self.task, self.label = progress, task, label

    def __call__(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total, visible=True)

    def with_figure(self, name: str) -> Callable[[int, int, float], None]:
        def update(done: int, total: int, figure: float) -> None:
            self(done, total)
            self.progress.update(self.task, description=f"{self.label} ({name} {figure:.3f})")
            if not err.is_terminal:
                err.print(f"{self.label}: {done}/{total} tokens, {name} {figure:.3f}")
        return update

    def done(self) -> None:
        self.progress.update(self.task, visible=False)


@contextmanager
def _progress(label: str, total: int | None):
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as progress:
        yield _Bar(progress, progress.add_task(label, total=total, visible=False), label)


def _run(action: Callable[[], None]) -> None:
    """Run a command: library errors become one line on stderr and an exit code (GALI_DEBUG=1: tracebacks)."""
    try:
        action()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)
    except GaliError as error:
        err.print(f"[red]gali:[/] {error}")
        raise typer.Exit(next((code for kind, code in EXIT_CODES.items() if isinstance(error, kind)), 1))
    except torch.cuda.OutOfMemoryError:
        err.print("[red]gali:[/] CUDA ran out of memory: try --quantize 4bit or a smaller --chunk-size")
        raise typer.Exit(4)
    except Exception as error:
        if os.environ.get("GALI_DEBUG"):
            raise
        err.print(f"[red]gali:[/] unexpected {type(error).__name__}: {error} (GALI_DEBUG=1 shows the traceback)")
        raise typer.Exit(1)


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


def main() -> None:
    app()
