"""Every length-extrapolation method by name, without importing one: the one list the CLI, `gali info`, the docs and
the tests derive theirs from.

A method lives in its own module of methods/ (its attention against engine/contract.py, how its settings resolve,
what it installs: a `Method` named `attribute` there); this table says where, and what a command must know before
torch loads: the name a user types, whether `gali info` can show its settings before an input, whether a prefilled
document can be reused, and its row in docs/methods.md (generated: `summary_table`). `get_method` imports the module
the first time a method is used, as vLLM's model registry does, so `gali --help` and a mistyped name cost no torch.
Adding a method: its module, a line here, its settings field(s), its reference, its docs prose, its tests.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import MethodSettings
from ..errors import ConfigError

if TYPE_CHECKING:
    from .method import Method


@dataclass(frozen=True)
class Registered:
    """A method as the registry knows it, before its module is imported."""

    module: str  # methods/<module>.py defines it
    attribute: str  # the `Method` there
    what: str  # docs/methods.md's summary table: what it does,
    settings: str  # its settings and their defaults (L = train_len, N = input tokens),
    exact: str  # and the distance up to which it equals the model
    # gali info shows its settings before any input, and they are checked before a document is read
    previewable: bool = False
    # The same from the model's window alone, without torch: (settings, window) -> its settings, or a ConfigError
    window_preview: Callable[[MethodSettings, int], dict] | None = None
    # False when results depend on one forward over the whole input: no prefilled prefix can then be reused
    prefix_reusable: bool = True
    honours_train_len: bool = True  # False: the unrestricted model, whatever --train-len says
    # False: it decodes eagerly (the static decoding step needs a placement that depends on token indices alone)
    static_step: bool = True


REGISTRY: dict[str, Registered] = {
    "original": Registered(
        "rope_scaling", "ORIGINAL", "the unpatched model: positions simply run past L", "-", "always itself",
        honours_train_len=False),
    "ntk": Registered(
        "rope_scaling", "NTK", "static NTK-aware scaling: `rope_theta * factor^(d/(d-2))`",
        "`--factor` (ceil(N/L), at least 1)", "-"),
    "dynamic-ntk": Registered(
        "rope_scaling", "DYNAMIC_NTK", "transformers' `dynamic` rope type, scaling once a forward passes L",
        "`--factor` (ceil(N/L))", "L, per forward", prefix_reusable=False, static_step=False),
    "yarn": Registered(
        "rope_scaling", "YARN", "transformers' `yarn` rope type, `original_max_position_embeddings = L`",
        "`--factor` (ceil(N/L))", "-"),
    "self-extend": Registered(
        "self_extend", "METHOD", "SelfExtend: true positions for the W nearest keys, grouped beyond",
        "`--neighbor-window` W (L/4), `--group-size` G (smallest reaching N)", "W"),
    "chunk-llama": Registered(
        "chunk_llama", "METHOD", "ChunkLlama's Dual Chunk Attention: intra-, successive-, inter-chunk",
        "`--dca-chunk-size` s (3L/4), `--local-window` w (L - s)", "s"),
    "rerope": Registered(
        "rerope", "RE_ROPE", "ReRoPE: true distances below a window w, w beyond it",
        "`--neighbor-window` w (L/4), `--logn` (on)", "w", previewable=True),
    "leaky-rerope": Registered(
        "rerope", "LEAKY_RE_ROPE", "Leaky ReRoPE: true distances below w, `w + (d - w) / k` beyond",
        "`--neighbor-window` w (L/4), `--leaky-factor` k (16, raised to keep distances below L), `--logn` (on)", "w",
        previewable=True),
    "dpe": Registered(
        "dpe", "METHOD", "DPE: SelfExtend per group of RoPE frequencies, a scale each",
        "`--neighbor-window` W (L/8), `--dpe-scales` (the authors' for Llama-3-8B and Llama-3.1-8B, else every group "
        "the smallest scale reaching N)", "W", previewable=True),
    "gali": Registered(
        "gali", "METHOD", "Greedy Attention Logit Interpolation",
        "`--chunk-size` (L/4), `--local-window` (L/2), `--noise`", "L",
        window_preview=lambda settings, window: settings.gali().resolved(window).facts()),
    "string": Registered(
        "string_rope", "METHOD",
        "STRING: true distances below S, `d - S + W` from S on (the S largest distances never used)",
        "`--shifted-offset` S (int(0.33 L)), `--local-window` W (128, at most S/2), `--string-scale` (on)",
        "S with `--no-string-scale`, else -", previewable=True),
    # Its map follows the input's length: a prefix read for one input is not that of another.
    "lampe": Registered(
        "lampe", "METHOD",
        "LaMPE: true distances in a head window H, the middle compressed into U by N, the first tokens at true spacing",
        "`--neighbor-window` H (L/16), `--lampe-tail` S (200 per 8192 of L), `--lampe-length` U (3L/16, at most N); "
        "512, 200, 1536 for Llama-3-8B", "- (logits scaled)", previewable=True, prefix_reusable=False),
    "self": Registered(
        "self_logistic", "METHOD", "SELF: SelfExtend whose groups grow along a logistic curve, from 1 token to c - 1",
        "`--neighbor-window` W (L/8), `--self-rate` r (0.02, raised if no c reaches N with it), `--group-size` c "
        "(smallest reaching N)", "W + the positions holding one token (35 to 70 at r = 0.02)", previewable=True),
    "reattention": Registered(
        "reattention", "METHOD",
        "ReAttention: each chunk attends the first tokens, the spans its queries' un-rotated top-k pick and the "
        "local window, at positions inside L",
        "`--sink-tokens` (32, at most L/16), `--top-keys` (4), `--span-size` (32, at most L/16), `--local-window` "
        "(L/2), `--recall-clip` (the spans that fit L), `--chunk-size` (L/8)", "L", previewable=True,
        static_step=False),  # what it attends depends on the query's content
}
NAMES = tuple(REGISTRY)  # in the order gali lists them
DEFAULT = "gali"  # what --method is when not given
UNPATCHED = "original"  # the model as transformers runs it, the baseline every table starts from
PREVIEWED = tuple(name for name, registered in REGISTRY.items() if registered.previewable)


def parse_methods(text: str, many: bool = True) -> tuple[str, ...]:
    """'gali, yarn' -> ('gali', 'yarn'); 'all' -> every method. Without `many` (a command that runs one method),
    one name only. An unknown or missing name is a ConfigError that offers what the command takes."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not many and (len(names) > 1 or names == ("all",)):
        raise ConfigError(f"--method takes one method here, got {text!r} (lists and 'all' are for gali ppl)")
    methods = NAMES if many and names == ("all",) else names
    takes = f"one of {', '.join(NAMES)}" + (", a comma list of them, or all" if many else "")
    for name in methods or ("",):
        if name not in NAMES:
            raise ConfigError(f"--method must be {takes}; got {name!r}")
    return methods


def registered(name: str) -> Registered:
    """The registry's line for `name`, or a ConfigError listing every method."""
    if name not in REGISTRY:
        raise ConfigError(f"--method must be one of {', '.join(NAMES)} (or all); got {name!r}")
    return REGISTRY[name]


def get_method(name: str) -> "Method":
    """The method called `name`, its module imported on first use; a ConfigError listing them all for another."""
    line = registered(name)
    return getattr(importlib.import_module(f"{__package__}.{line.module}"), line.attribute)


def all_methods() -> dict[str, "Method"]:
    """Every method by name, in the registry's order (imports them all: for tests, benchmarks and the oracle)."""
    return {name: get_method(name) for name in NAMES}


def summary_table() -> str:
    """docs/methods.md's summary table, in Markdown."""
    rows = ["| method | what | settings (defaults) | exact up to |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {line.what} | {line.settings} | {line.exact} |" for name, line in REGISTRY.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # docs/methods.md's table, regenerated
    print(summary_table(), end="")
