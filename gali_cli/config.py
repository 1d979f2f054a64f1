"""GALI's and the other methods' settings, validated once, with messages that name the CLI flag to change.

This module imports neither torch nor transformers: the command line parses its options into these before anything
heavy loads.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class GaliConfig:
    """Settings of Greedy Attention Logit Interpolation (paper §3).

    Args:
        train_len: L_tr, the window the model was trained on. Positions stay in [0, train_len - 1] (they reach
            train_len only with local_window = 0, where Alg. 2 leaves no exact tail).
            None means the model's `max_position_embeddings`; a smaller value narrows the interval range,
            which the paper finds can help.
        chunk_size: s, tokens per chunk beyond train_len; each chunk gets its own interpolated positions.
            None means train_len // 4 (docs/benchmarks.md says why).
        local_window: L_w, the newest tokens of every chunk that keep exact, un-interpolated positions.
            None means train_len // 2: the exact tail must hold at least a chunk (docs/benchmarks.md).
        noise: add the paper's Gaussian logit noise where logits are interpolated. Off by default: on real prose
            (SmolLM2-135M, KJV Genesis) and on the demo model it raised perplexity, and on a CPU it slows prefill
            (docs/benchmarks.md, "A real model on real prose").
        noise_scale: multiplies the noise's standard deviation (i - j) / T.
        seed: makes the noise reproducible (the command line's --noise-seed).
    """

    train_len: int | None = None
    chunk_size: int | None = None
    local_window: int | None = None
    noise: bool = False
    noise_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("--train-len", self.train_len, minimum=2)
        _check_int("--chunk-size", self.chunk_size, minimum=1)
        _check_int("--local-window", self.local_window, minimum=0)
        _check_int("--noise-seed", self.seed, minimum=0)
        if isinstance(self.noise_scale, bool) or not isinstance(self.noise_scale, (int, float)):
            raise ConfigError(f"--noise-scale must be a number, got {self.noise_scale!r}")
        if not 0 <= self.noise_scale < float("inf"):
            raise ConfigError(f"--noise-scale must be a finite number >= 0, got {self.noise_scale}")
        if self.train_len is not None and self.local_window is not None and self.local_window >= self.train_len:
            raise ConfigError(
                f"--local-window ({self.local_window}) must be smaller than --train-len ({self.train_len}): "
                "interpolated positions have to fit between them"
            )

    def facts(self) -> dict:
        """The settings as the command line names them (the noise's seed is --noise-seed there: --seed seeds
        sampling), without the noise's when it is off: what a document's prefilled state depends on."""
        noise = {"noise_scale": self.noise_scale, "noise_seed": self.seed} if self.noise else {}
        return {"train_len": self.train_len, "chunk_size": self.chunk_size, "local_window": self.local_window,
                "noise": self.noise, **noise}

    def resolved(self, model_train_len: int) -> "GaliConfig":
        """This config with every None filled in, for a model trained on `model_train_len` tokens."""
        train_len = self.train_len if self.train_len is not None else model_train_len
        if train_len > model_train_len:
            raise ConfigError(
                f"--train-len ({train_len}) exceeds the model's training window ({model_train_len}); "
                "GALI only reuses positions the model was trained on"
            )
        return replace(
            self,
            train_len=train_len,
            chunk_size=self.chunk_size if self.chunk_size is not None else max(1, train_len // 4),
            local_window=self.local_window if self.local_window is not None else train_len // 2,
        )


MAX_INPUT_BYTES = 256 * 2**20  # inputs are refused past this (--max-input-size): more than almost any PDF, ~60M tokens
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30, "t": 2**40,
          "tb": 2**40}


def parse_size(text: str, setting: str) -> int:
    """ "20G", "512mb", "1000000" -> bytes (binary units); `setting` (a flag or variable) names it in the error."""
    cleaned = text.strip().lower().replace(" ", "").removesuffix("ib")
    number = cleaned.rstrip("kmgtb")
    unit = cleaned[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in _UNITS or not 0 <= value < float("inf"):
        raise ConfigError(f"{setting} must be a size such as 20G or 512M, got {text!r}")
    return int(value * _UNITS[unit])


def expand_home(path: str, setting: str) -> Path:
    """`path` with a leading "~" or "~user" as that home directory; ConfigError naming `setting` (a flag or variable)
    when there is no such user or no home to expand to (pathlib raises RuntimeError)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        user = path.split("/", 1)[0]
        raise ConfigError(f"{setting} {path}: cannot expand {user!r} (no such user or home directory); "
                          "give the path in full") from None


def format_size(count: int) -> str:
    """1536 -> "1.5K", 268435456 -> "256M": binary units, as parse_size reads them."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if count >= scale:
            return f"{count / scale:.4g}{unit}"
    return str(count)


def _check_int(flag: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{flag} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{flag} must be >= {minimum}, got {value}")


def parse_scales(text: str) -> tuple[int, ...] | str:
    """'2,8,2,8' -> (2, 8, 2, 8): DPE's scales, one per group of RoPE frequencies; text that is not such a list stays
    text, which MethodSettings refuses with the flag's message."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        return text


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line: every command that takes a model gets it as an option."""

    help: str
    panel: str  # the --help section it is listed in
    declarations: tuple[str, ...] = ()  # e.g. ("--noise/--no-noise",); none: --field-name
    parser: Callable[[str], Any] | None = None  # the option's text to the field's value, for types Typer lacks


def _flag(default: Any, panel: str, help: str, *declarations: str, parser: Callable[[str], Any] | None = None) -> Any:
    """A settings field that is also a command-line option (gali_cli.options derives the option from it)."""
    return field(default=default, metadata={"flag": Flag(help, panel, declarations, parser)})


_GALI, _OTHER = "GALI (defaults follow the training window)", "Other methods"


@dataclass(frozen=True)
class MethodSettings:
    """The settings of every length-extrapolation method; each method reads its own. None means the method's
    default, usually relative to train_len and to the input's length (see gali_cli.methods).

    A field declared with `_flag` is an option of every command that takes a model, with that help text: a new
    method setting is one field here (plus its check in __post_init__) and the method that reads it.
    """

    train_len: int | None = _flag(None, _GALI, "The training window to stay within (default: the model's).")
    chunk_size: int | None = _flag(None, _GALI, "Tokens per chunk beyond it (default: train-len / 4; "
                                                "reattention: train-len / 8).")
    local_window: int | None = _flag(None, _GALI, "Newest tokens kept at exact positions (default: train-len / 2; "
                                                  "chunk-llama: train-len - dca-chunk-size; string: 128; "
                                                  "reattention: its local window, train-len / 2).")
    noise: bool = _flag(False, _GALI, "The paper's Gaussian logit noise (off by default: on real prose it raised "
                                          "perplexity, and it slows each forward).",
                        "--noise/--no-noise")
    noise_scale: float = 1.0  # gali; the Python API's alone
    noise_seed: int = _flag(0, _GALI, "Seed of the noise: fixed, so that a document always reads the same (and "
                                      "its cached state serves every later question).")
    factor: float | None = _flag(None, _OTHER, "ntk, dynamic-ntk, yarn: the scaling factor (default: input tokens / "
                                               "train-len, rounded up).")
    group_size: int | None = _flag(None, _OTHER, "self-extend: tokens per group; self: the capacity c, its groups "
                                                 "grow to c - 1 tokens (default: the smallest that reaches the "
                                                 "input).")
    neighbor_window: int | None = _flag(None, _OTHER, "self-extend, self, rerope, leaky-rerope, dpe, lampe: keys at "
                                                      "exact distances (default: train-len / 4; self, dpe: "
                                                      "train-len / 8; lampe: its head, train-len / 16).")
    dca_chunk_size: int | None = _flag(None, _OTHER, "chunk-llama: chunk size (default: 3/4 of train-len).")
    leaky_factor: float | None = _flag(None, _OTHER, "leaky-rerope: k, distances past the window grow 1/k as fast "
                                                     "(default: 16, more if the input needs it).")
    logn: bool = _flag(True, _OTHER, "rerope, leaky-rerope: queries past train-len scaled by log(i+1) / "
                                     "log(train-len), as in the official code.", "--logn/--no-logn")
    dpe_scales: tuple[int, ...] | None = _flag(
        None, _OTHER, "dpe: one scale per group of RoPE frequencies, highest first, e.g. 2,8,2,8,32,32,32,4 "
                      "(default: the authors' for Llama-3(.1)-8B, else the smallest that reaches the input).",
        parser=parse_scales)
    shifted_offset: int | None = _flag(
        None, _OTHER, "string: S, distances from S on shift down to local-window (W), dropping the S largest "
                      "(default: 0.33 train-len; W: 128, at most S / 2).")
    string_scale: bool = _flag(True, _OTHER, "string: every logit times (1 + 0.1 ln 2)^2, as the official code "
                                             "scales its cos/sin (on SmolLM2 it raised perplexity).",
                               "--string-scale/--no-string-scale")
    lampe_tail: int | None = _flag(None, _OTHER, "lampe: the first tokens kept at true spacing beyond the compressed "
                                                 "middle (default: 200 per 8192 of train-len).")
    lampe_length: int | None = _flag(None, _OTHER, "lampe: the positions the middle is compressed into, U (default: "
                                                   "3/16 of train-len, at most the input's length).")
    self_rate: float | None = _flag(None, _OTHER, "self: r, the rate at which its groups grow along the logistic "
                                                  "curve c / (1 + (c - 1) e^(-r x)) of the grouped position x "
                                                  "(default: the official code's 0.02, more if the input needs it).")
    sink_tokens: int | None = _flag(None, _OTHER, "reattention: the first tokens every query attends (default: 32, "
                                                  "at most train-len / 16).")
    top_keys: int | None = _flag(None, _OTHER, "reattention: the keys each query head picks by its un-rotated logits "
                                            "(default: 4).")
    span_size: int | None = _flag(None, _OTHER, "reattention: the tokens around each picked key that it brings "
                                                "(default: 32, at most train-len / 16).")
    recall_clip: int | None = _flag(None, _OTHER, "reattention: at most this many picked keys, the most picked "
                                                  "first (default: as many spans as fit train-len beside the sink "
                                                  "and the local window).")

    def __post_init__(self) -> None:
        self.gali()  # validates the settings GALI shares
        _check_int("--group-size", self.group_size, minimum=1)
        _check_int("--neighbor-window", self.neighbor_window, minimum=1)
        _check_int("--dca-chunk-size", self.dca_chunk_size, minimum=1)
        _check_int("--shifted-offset", self.shifted_offset, minimum=1)
        _check_int("--lampe-tail", self.lampe_tail, minimum=1)
        _check_int("--lampe-length", self.lampe_length, minimum=1)
        _check_int("--sink-tokens", self.sink_tokens, minimum=0)
        _check_int("--top-keys", self.top_keys, minimum=1)
        _check_int("--span-size", self.span_size, minimum=1)
        _check_int("--recall-clip", self.recall_clip, minimum=1)
        if self.factor is not None and (isinstance(self.factor, bool) or not isinstance(self.factor, (int, float))
                                        or not 1 <= self.factor < float("inf")):
            raise ConfigError(f"--factor must be a number >= 1, got {self.factor!r}")
        if self.self_rate is not None and (isinstance(self.self_rate, bool) or not isinstance(
                self.self_rate, (int, float)) or not 0 < self.self_rate < float("inf")):
            raise ConfigError(f"--self-rate must be a number > 0, got {self.self_rate!r}")
        if self.leaky_factor is not None and (
                isinstance(self.leaky_factor, bool) or not isinstance(self.leaky_factor, (int, float))
                or not 1 < self.leaky_factor < float("inf")):
            raise ConfigError(f"--leaky-factor must be a number > 1, got {self.leaky_factor!r}")
        if self.dpe_scales is not None and (
                not isinstance(self.dpe_scales, tuple) or not self.dpe_scales
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.dpe_scales)):
            shown = ",".join(map(str, self.dpe_scales)) if isinstance(self.dpe_scales, tuple) else self.dpe_scales
            raise ConfigError(f"--dpe-scales must be whole numbers >= 1 separated by commas, one per group of RoPE "
                              f"frequencies (e.g. 2,8,2,8); got {shown!r}")

    def gali(self) -> GaliConfig:
        return GaliConfig(self.train_len, self.chunk_size, self.local_window, self.noise, self.noise_scale,
                          self.noise_seed)
