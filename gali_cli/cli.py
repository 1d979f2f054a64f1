"""The `gali` command: parse, call a run (gali_cli.runs), print (through gali_cli.display).

stdout carries only the answer (or the --json document); loading, progress, warnings and stats go to stderr.
Exit codes: 0 ok, 1 runtime error, 2 usage, 3 unreadable input, 4 model load or out of memory, 130 interrupted.

Neither this module nor what it imports loads torch or transformers: each command imports its run (which does)
only once its options are parsed.
"""

import dataclasses
import re
import sys
from typing import Annotated

import typer

from . import plots
from .config import MAX_INPUT_BYTES
from .display import fail
from .errors import ConfigError
from .exits import guarded, help_command, reader_gone, silence_stdout, stdout_file, usage_message
from .options import (
    AllowPartial,
    CacheDir,
    Command,
    File,
    Files,
    Group,
    JsonOutput,
    MaxInputSize,
    MaxNewTokens,
    MaxPromptTokens,
    NoCache,
    NoStream,
    Out,
    Password,
    Seed,
    ServedPromptTokens,
    ServeTemperature,
    ServeTopP,
    System,
    Temperature,
    TopK,
    TopP,
    Verbose,
    with_model_options,
)
from .prompts import SUMMARIZE, ask_instruction
from .runs.choices import Answering, ModelChoice, Reading, Serving
from .runs.prechecks import check_batch, check_first, check_serving, read_first

app = typer.Typer(name="gali", cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")  # help paragraphs reflow to the terminal's width


@app.command(cls=Command)
@guarded
@with_model_options
def summarize(
    files: Files, out: Out = None, password: Password = None, allow_partial: AllowPartial = False,
    max_input_size: MaxInputSize = MAX_INPUT_BYTES,
    max_prompt_tokens: MaxPromptTokens = None,
    max_new_tokens: MaxNewTokens = 1024, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = 0, system: System = None,
    no_stream: NoStream = False, cache_dir: CacheDir = None, no_cache: NoCache = False,
    json_output: JsonOutput = False, verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Summarize a document: the summary streams to stdout.

    Batch mode: with several DOCS, or with --out FILE, the model loads once and each document appends a JSON line to
    FILE as it is done (path, content hash, settings, output, tokens, timings; a line on stderr too). A rerun skips
    the documents already done; a document that fails is recorded and the rest go on (exit 1). Under torchrun or
    accelerate launch each process takes its share.

    Example: gali summarize report.pdf --quantize 4bit > summary.txt

    Example: gali summarize reports/ --out summaries.jsonl
    """
    answering = _answering(locals())
    reading = Reading(password, max_input_size, max_prompt_tokens, allow_partial)
    _answer(files, out, "summarize", SUMMARIZE, None, choice, reading, answering)


@app.command(cls=Command)
@guarded
@with_model_options
def ask(
    files: Files,
    question: Annotated[str, typer.Argument(metavar="QUESTION", help="The question about the document(s).")],
    out: Out = None, password: Password = None, allow_partial: AllowPartial = False,
    max_input_size: MaxInputSize = MAX_INPUT_BYTES,
    max_prompt_tokens: MaxPromptTokens = None,
    max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = 0, system: System = None, no_stream: NoStream = False, cache_dir: CacheDir = None,
    no_cache: NoCache = False, json_output: JsonOutput = False, verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Answer QUESTION about a document: the answer streams to stdout.

    The document's prefilled state is cached, so the next question about it starts at once. Several DOCS, or
    --out FILE: batch mode, as in gali summarize --help.

    Example: gali ask contract.txt "When does the lease end?"

    Example: gali ask contracts/*.pdf "When does the lease end?" --out leases.jsonl
    """
    if not question.strip():
        raise ConfigError("QUESTION is empty")
    answering = _answering(locals())
    reading = Reading(password, max_input_size, max_prompt_tokens, allow_partial)
    _answer(files, out, "ask", ask_instruction(question), question, choice, reading, answering)


def _answering(options: dict) -> Answering:
    """summarize's, ask's and chat's answer options, given as the command's parameters by name (its `locals()`),
    as one Answering: --no-stream turned into `stream`, every other field under its own name."""
    names = [field.name for field in dataclasses.fields(Answering) if field.name != "stream"]
    return Answering(stream=not options["no_stream"], **{name: options[name] for name in names})


def _answer(files: list[str], out: str | None, command: str, instruction: str, question: str | None,
            choice: ModelChoice, reading: Reading, answering: Answering) -> None:
    """One document streams its answer; several (or --out) make a batch, which exits 1 if any failed."""
    if out or len(files) > 1:
        check_batch(files, out, choice)  # before the run imports torch, as read_first: a usage error costs no wait
        from .runs.batches import answer_batch

        if answer_batch(files, out, command, instruction, question, choice, reading, answering):
            raise typer.Exit(1)
    else:
        document = read_first(choice, files[0], reading)
        from .runs.answer import answer

        answer(document, instruction, choice, reading, answering)


@app.command(cls=Command)
@guarded
@with_model_options(many_methods=True)
def ppl(
    files: Files, out: Out = None, password: Password = None, allow_partial: AllowPartial = False,
    max_input_size: MaxInputSize = MAX_INPUT_BYTES,
    max_prompt_tokens: MaxPromptTokens = None,
    max_tokens: Annotated[int | None, typer.Option(min=2, metavar="N", help="Evaluate the first N tokens only.")]
    = None,
    lengths: Annotated[str | None, typer.Option(metavar="L,L...", help="PPL over the first L tokens for each L, e.g. "
                                                                       "1k,2k,4k (k = 1024).")] = None,
    csv: Annotated[bool, typer.Option("--csv", metavar="", help="Print method,length,ppl rows as CSV.")] = False,
    plot: Annotated[str | None, typer.Option(metavar="FILE", help="Also save PPL against length as an image, e.g. "
                                                                  "ppl.png (needs pip install -e \".\\[plot]\").")]
    = None,
    json_output: JsonOutput = False, verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Perplexity of a document, by method and length: exp(mean NLL of tokens 2..N).

    Each token is predicted from its whole prefix, in one pass per method. Several DOCS, or --out FILE: batch mode,
    as in gali summarize --help, and the corpus's token-weighted perplexity at the end.

    Example: gali ppl book.txt --method gali,yarn,original --lengths 2k,4k,8k,16k

    Example: gali ppl corpus/ --out ppl.jsonl --method gali,yarn --max-tokens 16384
    """
    wanted = _parse_lengths(lengths)
    if wanted and max_tokens and wanted[-1] > max_tokens:
        raise ConfigError(f"--lengths goes to {wanted[-1]} tokens, past --max-tokens {max_tokens}")
    if json_output and csv:
        raise ConfigError("--json and --csv both print on stdout: choose one")
    if plot:
        if (out or len(files) > 1) and not wanted:
            raise ConfigError("--plot draws perplexity against length: with several documents it needs --lengths")
        plots.check_plotting(plot)
    reading = Reading(password, max_input_size, max_prompt_tokens, allow_partial)
    if out or len(files) > 1:
        check_batch(files, out, choice)
        from .runs.batches import perplexity_batch

        if perplexity_batch(files, out, choice, reading, max_tokens, wanted, json_output, csv, plot, verbose):
            raise typer.Exit(1)
    else:
        document = read_first(choice, files[0], reading)
        from .runs.ppl import perplexity

        perplexity(document, choice, reading, max_tokens, wanted, json_output, csv, plot, verbose)


def _parse_lengths(text: str | None, shortest: int = 2, why: str = "perplexity needs at least 2 tokens",
                   longest: int | None = None) -> list[int]:
    """"1k,2k,4k" -> [1024, 2048, 4096] (k = 1024, as in the paper); sorted, unique, from `shortest` (`why` says
    why) to `longest` tokens."""
    lengths = set()
    for part in (text or "").split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(part.removesuffix("k")) * (1024 if part.endswith("k") else 1)
        except ValueError:
            raise ConfigError(f"--lengths: {part!r} is not a length such as 4096 or 4k") from None
        if value < shortest:
            raise ConfigError(f"--lengths: {part!r} is too short, {why}")
        if longest and value > longest:
            raise ConfigError(f"--lengths: {part!r} is past {longest // 1024}k tokens, the longest prompt gali eval "
                              "builds")
        lengths.add(value)
    return sorted(lengths)


@app.command(name="eval", cls=Command)
@guarded
@with_model_options(many_methods=True)
def eval_(
    tasks: Annotated[list[str], typer.Argument(metavar="TASKS", show_default=False,
                                               help="RULER tasks: niah_single_1/2/3, niah_multikey_1/2/3, "
                                                    "niah_multivalue, niah_multiquery, vt, cwe, fwe; LongBench: "
                                                    "longbench (its 16 English datasets) or longbench/DATASET.")],
    lengths: Annotated[str, typer.Option(metavar="L,L...", help="Prompt lengths in tokens of the model's tokenizer, "
                                                                "answer included (k = 1024).")] = "4k,8k,16k",
    samples: Annotated[int, typer.Option(min=1, metavar="N", help="Samples per task and length.")] = 10,
    seed: Annotated[int, typer.Option(min=0, metavar="N", help="Seed the samples are generated from (RULER's "
                                                               "default).")] = 42,
    haystack: Annotated[str | None, typer.Option(metavar="FILE", help="Hide the needles in this document (text or "
                                                                      "PDF) instead of the shipped public-domain "
                                                                      "text.")] = None,
    out: Annotated[str | None, typer.Option(metavar="FILE", help="Append one JSON line per answer here; a rerun "
                                                                 "skips the answers already there.")] = None,
    longbench_data: Annotated[str | None, typer.Option(metavar="DIR", help="Your copy of LongBench v1: the folder "
                                                                           "of its data/*.jsonl files, or of the "
                                                                           "parquet copy lm-eval reads.")] = None,
    truncation: Annotated[str, typer.Option(metavar="official|paper", help="LongBench prompts cut in the middle to "
                                                                           "the length (official pred.py), or to "
                                                                           "length - answer - 50 (the GALI "
                                                                           "authors').")] = "official",
    system: Annotated[str | None, typer.Option(metavar="TEXT", help="A system message before each sample that "
                                                                   "goes through the chat template (the GALI "
                                                                   "authors' LongBench runs used one).")] = None,
    prompt_style: Annotated[str, typer.Option(metavar="STYLE", help="task: each question in the task's own "
                                                                    "words; plain, wrapped or brief: alone after "
                                                                    "the document in that gali ask wrapper.")]
    = "task",
    password: Password = None, allow_partial: AllowPartial = False,
    max_input_size: MaxInputSize = MAX_INPUT_BYTES,
    max_prompt_tokens: MaxPromptTokens = None,
    csv: Annotated[bool, typer.Option("--csv", metavar="", help="Print task,length,method,score rows as CSV.")]
    = False,
    plot: Annotated[str | None, typer.Option(metavar="FILE", help="Also save score against length as an image "
                                                                  "(needs pip install -e \".\\[plot]\").")] = None,
    cache_dir: CacheDir = None, no_cache: NoCache = False, json_output: JsonOutput = False,
    choice: ModelChoice = None,
) -> None:
    """Score each method on synthetic long-context tasks (RULER's recipes), per task and length.

    Each sample is answered greedily as gali ask answers, scored as RULER scores it, and with --out appended as a
    JSON line (prediction, score, the method's settings, time), so a killed run resumes; under torchrun each
    process takes its share. The table's best score per row is in bold.

    Example: gali eval niah_single_1 vt -m smollm2 --train-len 1024 --lengths 2k,4k --method gali,original

    Example: gali eval niah_single_2 --haystack report.pdf --method all --out eval.jsonl
    """
    from .evaluation.longbench import TRUNCATIONS
    from .evaluation.tasks import LONGEST, check_tasks

    wanted = _parse_lengths(lengths, 1, "a prompt needs at least 1 token", LONGEST)
    if not wanted:
        raise ConfigError("--lengths: give at least one length, e.g. 4k")
    if json_output and csv:
        raise ConfigError("--json and --csv both print on stdout: choose one")
    if plot:
        plots.check_plotting(plot)
    names = check_tasks(tasks)
    if truncation not in TRUNCATIONS:
        raise ConfigError(f"--truncation must be one of {', '.join(TRUNCATIONS)}; got {truncation!r}")
    from .runs.evaluate import PROMPT_STYLES, Evaluation, evaluate

    if prompt_style not in PROMPT_STYLES:
        raise ConfigError(f"--prompt-style must be one of {', '.join(PROMPT_STYLES)}; got {prompt_style!r}")
    if haystack:
        check_first(choice, haystack)

    evaluate(choice, Evaluation(tuple(names), tuple(wanted), samples, seed, haystack, out, json_output, csv, plot,
                                cache_dir, no_cache, longbench_data, truncation, system, prompt_style),
             Reading(password, max_input_size, max_prompt_tokens, allow_partial))


@app.command(cls=Command)
@guarded
@with_model_options
def chat(
    file: File, password: Password = None, allow_partial: AllowPartial = False,
    max_input_size: MaxInputSize = MAX_INPUT_BYTES,
    max_prompt_tokens: MaxPromptTokens = None,
    max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = 0, system: System = None, no_stream: NoStream = False, cache_dir: CacheDir = None,
    no_cache: NoCache = False,
    json_output: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object per answer, a line "
                                                                       "each.")] = False,
    verbose: Verbose = False, choice: ModelChoice = None,
) -> None:
    """Read FILE once, then answer the questions typed at the prompt, keeping the conversation.

    Answers stream to stdout; questions may also be piped in, one a line. Ctrl-C stops an answer, Ctrl-D (or Ctrl-C
    at the prompt) leaves.

    Example: gali chat report.pdf -m demo
    """
    if file == "-":
        raise ConfigError("gali chat reads its questions from standard input: give FILE as a path")
    answering = _answering(locals())
    reading = Reading(password, max_input_size, max_prompt_tokens, allow_partial)
    document = read_first(choice, file, reading)
    from .runs.answer import chat as run_chat

    run_chat(document, choice, reading, answering)


def _web_origin(value: str) -> str:
    """--allow-origin's value as browsers send an Origin header (scheme://host[:port]), or *; else a usage error."""
    if value != "*" and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+", value):
        raise typer.BadParameter(f"{value!r} is not a web origin such as http://localhost:3000 (or *)")
    return value


@app.command(cls=Command)
@guarded
@with_model_options
def serve(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on; 0.0.0.0 opens the server to the "
                                                           "network (then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, metavar="N",
                                      help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="GALI_API_KEY", show_default=False, metavar="KEY",
                                                help="Require 'Authorization: Bearer KEY' on /v1/.")] = None,
    model_name: Annotated[str | None, typer.Option(metavar="NAME", help="The model's name for clients (default: "
                                                                        "the --model value).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Longest answer when a request sets no "
                                                                         "max_tokens.")] = 1024,
    temperature: ServeTemperature = 0.0, top_p: ServeTopP = 1.0,
    queue_size: Annotated[int, typer.Option(min=1, metavar="N", help="Requests that may wait for the model; past "
                                                                     "them, 429 with Retry-After.")] = 16,
    max_request_mib: Annotated[int, typer.Option(min=1, metavar="N", help="Largest request body, in MiB (413 "
                                                                          "past it).")] = 32,
    max_prompt_tokens: ServedPromptTokens = None,
    allow_host: Annotated[list[str] | None, typer.Option(metavar="NAME", show_default=False, help=(
        "Also answer requests whose Host header names NAME, any port (a proxy's or a DNS name; '*': any). By "
        "default only localhost, 127.0.0.1 and [::1] at the server's port, and on a non-loopback --host also its "
        "IP addresses and host name: a web page's DNS rebinding is refused. Repeatable."))] = None,
    allow_origin: Annotated[list[str] | None, typer.Option(parser=_web_origin, metavar="ORIGIN", show_default=False,
                                                           help="Let web pages of ORIGIN (e.g. "
                                                                "http://localhost:3000; '*': any) use the server "
                                                                "(CORS); requests from other origins are refused. "
                                                                "Repeatable.")] = None,
    cache_dir: CacheDir = None, no_cache: NoCache = False, choice: ModelChoice = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API that reads prompts longer than its window.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health. Needs pip install -e ".\\[serve]".
    One model, many clients: requests queue for it, and a client that disconnects stops its answer. A second question
    about a document starts from the document's prefilled state. --noise-seed seeds the noise; a request without a
    seed samples with a random one. SIGTERM or Ctrl-C stop it cleanly; access log lines go to stderr.

    Example: gali serve -m demo

    Example: gali serve --quantize 4bit --host 0.0.0.0 --api-key "$(openssl rand -hex 16)"
    """
    check_serving(choice)  # before anything loads: what to install, then the settings
    from .runs.serve import serve as run_server

    run_server(choice, Serving(host, port, api_key, model_name, max_new_tokens, temperature, top_p, queue_size,
                               max_request_mib, cache_dir, no_cache, tuple(allow_host or ()),
                               tuple(allow_origin or ()), max_prompt_tokens))


cache_app = typer.Typer(name="cache", cls=Group, no_args_is_help=True,
                        help="The document cache: prefilled states of documents asked about (GALI_CACHE_DIR, "
                             "GALI_CACHE_LIMIT); and the model cache: GGUF tokenizers read once (GALI_MODEL_CACHE).")
app.add_typer(cache_app)


@cache_app.command("list", cls=Command)
@guarded
def cache_list(cache_dir: CacheDir = None, json_output: JsonOutput = False) -> None:
    """List cached documents, then the model cache's entries, most recently used first.

    Example: gali cache list
    """
    from .runs.cache import list_cache

    list_cache(cache_dir, json_output)


@cache_app.command("clear", cls=Command)
@guarded
def cache_clear(cache_dir: CacheDir = None, models: Annotated[bool, typer.Option(
        "--models", metavar="",
        help="Delete the model cache's entries instead (a GGUF's next load reads its tokenizer again).")] = False,
) -> None:
    """Delete every cached document state.

    Example: gali cache clear
    """
    from .runs.cache import clear_cache

    clear_cache(cache_dir, models)


@cache_app.command("prune", cls=Command)
@guarded
def cache_prune() -> None:
    """Delete the model cache's entries this installation cannot use: written by another transformers release or an
    older gali (whole float copies), or from a GGUF gone or changed. (Unused 30 days, they go at the next build.)

    Example: gali cache prune
    """
    from .runs.cache import prune_cache

    prune_cache()


@app.command(cls=Command)
@guarded
@with_model_options(many_methods=True)
def info(
    json_output: JsonOutput = False,
    check: Annotated[bool, typer.Option("--check", metavar="", help="Also run the engine's self-check on the device: "
                                        "each fast attention path against the PyTorch path, GALI against Alg. 3, "
                                        "timed.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Every attention route in words, and "
                                          "the path noise would take when it is off.")] = False,
    choice: ModelChoice = None,
) -> None:
    """Describe the model, device, CUDA, bitsandbytes and GALI settings, without loading weights.

    Example: gali info --check   (on a GPU: is the fused kernel right there, and how fast?)
    """
    from .runs.info import show_info

    show_info(choice, json_output, check, verbose)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        sys.stdout.write(f"gali {__version__}\n")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                          help="Print the version.")] = False,
) -> None:
    """Read documents longer than a Llama's training window, with Greedy Attention Logit Interpolation (GALI)."""


def main(args: list[str] | None = None) -> int:
    """The `gali` executable: like `app()`, but usage errors too are one line on stderr, and a reader of stdout
    that stops early (`| head`) ends it quietly with exit 0, as for other Unix tools."""
    stdout = stdout_file()
    try:
        code = app(args=args, standalone_mode=False)
        sys.stdout.flush()  # now, so that a closed pipe is seen here and not in the interpreter's last flush
    except typer.TyperException as error:  # a usage error: unknown option, bad value, missing argument
        fail(f"{usage_message(error)} (see {help_command(error)})")
        return error.exit_code
    except typer.Abort:
        return 1
    except BrokenPipeError:
        code = 1
    except SystemExit as exit:  # Typer's and Rich's own answer to a closed pipe (e.g. --help | head): exit 1
        if exit.code != 1:
            raise
        code = 1
    code = code if isinstance(code, int) else 0
    if code in (0, 1) and reader_gone(stdout):
        silence_stdout()
        return 0
    return code
