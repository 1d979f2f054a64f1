"""The length-extrapolation methods gali runs a Llama with, behind one interface (every command's --method).

| method | what | settings and defaults (L = train_len, N = input tokens) |
|---|---|---|
| original | the unpatched model: positions run past L | - |
| ntk | static NTK-aware scaling: rope_theta * factor^(d/(d-2)) | --factor, ceil(N / L) |
| dynamic-ntk | transformers' dynamic NTK, scaling once past L | --factor, ceil(N / L) |
| yarn | transformers' YaRN with original_max_position_embeddings = L | --factor, ceil(N / L) |
| self-extend | SelfExtend: exact neighbours, grouped positions beyond | --neighbor-window L/4, --group-size: the smallest that reaches N |
| chunk-llama | Dual Chunk Attention: intra-, successive- and inter-chunk | --dca-chunk-size 3L/4, --local-window L - chunk |
| rerope | ReRoPE: exact distances within a window, the window's edge beyond | --neighbor-window L/4, --logn |
| leaky-rerope | Leaky ReRoPE: distances beyond the window compressed by k | --neighbor-window L/4, --leaky-factor 16 (more if N needs it), --logn |
| dpe | DPE: SelfExtend per group of RoPE frequencies, a scale each | --neighbor-window L/8, --dpe-scales: published for the model, else the smallest that reaches N |
| gali | Greedy Attention Logit Interpolation | --chunk-size L/4, --local-window L/2, --noise |
| string | STRING: distances from S on shifted down to W, the largest never used | --shifted-offset 0.33L, --local-window 128 (at most S/2), --string-scale |
| lampe | LaMPE: exact head window, middle compressed into U by N, first tokens at true spacing | --neighbor-window L/16, --lampe-tail 200L/8192, --lampe-length min(3L/16, N); published for Llama-3-8B |
| self | SELF: SelfExtend whose groups grow along a logistic curve, up to c - 1 tokens | --neighbor-window L/8, --self-rate 0.02 (more if N needs it), --group-size (c): the smallest that reaches N |

Each method is one file here, written against the contract of engine/contract.py; this registry declares, per
name, how its settings resolve for an input and what it installs. Installing is not done here: `gali_cli.patching`
(`apply_method`, `prefill_spans`) puts a method into a loaded model through the seam (engine/seam/hooks.py), so no
file in methods/ imports the modules that hook transformers or record the decoding step.
"""  # noqa: E501 - the rows of a Markdown table cannot wrap

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from ..config import GaliConfig, MethodSettings
from ..engine.contract import PositionalAttention
from ..errors import ConfigError
from ..model.families import default_train_len
from .chunk_llama import DualChunkAttention
from .dpe import DPE, check_scales, default_groups, published_settings
from .gali import Gali
from .lampe import LaMPE, Layout, check_tail
from .lampe import published_settings as lampe_published
from .rerope import ReRoPE, leaky_reach
from .self_extend import SelfExtend, reach
from .self_logistic import OFFICIAL_RATE, LogisticSelfExtend
from .self_logistic import check as check_self
from .self_logistic import reach as self_reach
from .self_logistic import resolve as resolve_self
from .string_rope import StringRoPE, default_shift, default_window, published
from .string_rope import check as check_string
from .string_rope import reach as string_reach


@dataclass(frozen=True)
class Method:
    """A method by name: how its settings resolve for an input, what it installs, and where its forwards may be cut."""

    name: str
    # (model config, settings, train_len, input tokens) -> the settings it runs with, for reports; with tokens None
    # (before any input: gali info) only where `previewable`, refusing settings that make no sense for the model.
    resolve: Callable[[PretrainedConfig, MethodSettings, int, int | None], dict]
    # (model config, settings, resolved settings) -> the attention it installs; None: the model's own attention.
    attention: Callable[[PretrainedConfig, MethodSettings, dict], PositionalAttention] | None = None
    rope: str | None = None  # the rotary it rebuilds with transformers' rope types (rope_scaling.py), by kind
    # (installed attention, start, stop, cuts) -> token indices in (start, stop] where a forward over [start, stop)
    # may end, each of `cuts` ending one too; None: anywhere.
    boundaries: Callable[[PositionalAttention | None, int, int, list[int]], list[int]] | None = None
    # False when results depend on one forward over the whole input: no prefilled prefix can then be reused.
    prefix_reusable: bool = True
    previewable: bool = False


def default_factor(settings: MethodSettings, train_len: int, tokens: int | None) -> float:
    return settings.factor if settings.factor is not None else max(1, math.ceil((tokens or 0) / train_len))


def smallest_group(window: int, train_len: int, tokens: int) -> int:
    """The smallest SelfExtend group size whose positions reach `tokens` within train_len (LongLM's rule)."""
    return max(1, math.ceil((tokens - window) / (train_len - window)))


def _window(settings: MethodSettings, train_len: int, default: int) -> int:
    window = settings.neighbor_window if settings.neighbor_window is not None else default
    if not 0 < window < train_len:
        raise ConfigError(f"--neighbor-window must be between 1 and {train_len - 1}, got {window}")
    return window


def _rerope(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    return {"train_len": train_len, "neighbor_window": _window(settings, train_len, train_len // 4),
            "logn": settings.logn}


def _leaky_rerope(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    window = _window(settings, train_len, train_len // 4)
    # The official code's k = 16, raised to the smallest whole k whose distances stay within train_len.
    factor = settings.leaky_factor or max(16, math.ceil(((tokens or 0) - 1 - window) / (train_len - 1 - window)))
    reaches = leaky_reach(window, factor, train_len)
    if tokens is not None and reaches < tokens:
        raise ConfigError(f"--leaky-factor {factor} with --neighbor-window {window} reaches {reaches} tokens within "
                          f"train_len {train_len}; the input has {tokens}: raise --leaky-factor")
    resolved = {"train_len": train_len, "neighbor_window": window, "leaky_factor": factor, "logn": settings.logn}
    return resolved if tokens is not None else {**resolved, "reaches": reaches}


def _dpe(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # The authors' settings hold for the model's own window only.
    published = published_settings(config) if train_len == config.max_position_embeddings else None
    window = _window(settings, train_len, published[1] if published else train_len // 8)
    if settings.dpe_scales or published:
        scales = list(settings.dpe_scales or published[2])
        check_scales(tuple(scales), _head_dim(config))
    elif tokens is None:
        scales = "the smallest that reaches the input, in every group"
    else:
        scales = [smallest_group(window, train_len, tokens)] * default_groups(_head_dim(config))
    return {"train_len": train_len, "neighbor_window": window, "dpe_scales": scales,
            "dpe_published": published[0] if published and not settings.dpe_scales else None}


def _string(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    shift = settings.shifted_offset if settings.shifted_offset is not None else default_shift(train_len)
    window = settings.local_window if settings.local_window is not None else default_window(shift)
    check_string(shift, window, train_len)
    authors = settings.shifted_offset is None and settings.local_window is None
    return {"train_len": train_len, "shifted_offset": shift, "local_window": window,
            "string_scale": settings.string_scale, "reaches": string_reach(shift, window, train_len),
            "string_published": published(config, train_len) if authors else None}


def _lampe(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # The authors' settings hold for the model's own window only.
    published = lampe_published(config) if train_len == config.max_position_embeddings else None
    head = _window(settings, train_len, published[1] if published else max(2, train_len // 16))
    tail = settings.lampe_tail or (published[2] if published else min(head - 1, max(1, round(train_len * 200 / 8192))))
    length = settings.lampe_length or (published[3] if published else 3 * train_len // 16)
    check_tail(tail, head)
    resolved = {"train_len": train_len, "neighbor_window": head, "lampe_tail": tail,
                "lampe_length": length if tokens is None else min(length, tokens),
                "lampe_published": published[0] if published else None}
    if tokens is not None:
        resolved["tokens"] = tokens  # the map follows the input's length: part of the settings it ran with
        resolved["reach"] = Layout.of(head, tail, resolved["lampe_length"], tokens).reach()
    return resolved


def _self(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # W = L/8: the official PG19 script's 512 of Llama-2's 4096.
    window = _window(settings, train_len, max(1, train_len // 8))
    resolved = {"train_len": train_len, "neighbor_window": window}
    if tokens is not None:
        capacity, rate = resolve_self(settings.group_size, settings.self_rate, window, train_len, tokens)
        return {**resolved, "self_rate": rate, "group_size": capacity}
    rate = settings.self_rate or OFFICIAL_RATE
    if settings.group_size is None:
        return {**resolved, "self_rate": rate, "group_size": "the smallest that reaches the input"}
    check_self(settings.group_size, rate, window, train_len)
    return {**resolved, "self_rate": rate, "group_size": settings.group_size,
            "reaches": self_reach(settings.group_size, rate, window, train_len)}


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _self_extend(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    window = _window(settings, train_len, train_len // 4)
    size = settings.group_size or smallest_group(window, train_len, tokens)
    if reach(size, window, train_len) < tokens:
        raise ConfigError(
            f"--group-size {size} with --neighbor-window {window} reaches {reach(size, window, train_len)} tokens "
            f"within train_len {train_len}; the input has {tokens}: raise --group-size"
        )
    return {"train_len": train_len, "group_size": size, "neighbor_window": window}


def _chunk_llama(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    size = settings.dca_chunk_size if settings.dca_chunk_size is not None else 3 * train_len // 4
    window = settings.local_window if settings.local_window is not None else train_len - size
    return {"train_len": train_len, "dca_chunk_size": size, "local_window": window}


def gali_config(config: PretrainedConfig, settings: MethodSettings, train_len: int) -> GaliConfig:
    """GALI's settings for a model with this config, every None filled in."""
    return replace(settings.gali(), train_len=train_len).resolved(default_train_len(config))


def _rope_factor(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    return {"train_len": train_len, "factor": default_factor(settings, train_len, tokens)}


METHODS = {
    "original": Method("original", lambda config, settings, train_len, tokens: {}),
    "ntk": Method("ntk", _rope_factor, rope="ntk"),
    # Dynamic NTK picks its frequencies from the longest position of each forward: one forward for the whole input.
    "dynamic-ntk": Method("dynamic-ntk", _rope_factor, rope="dynamic-ntk",
                          boundaries=lambda method, start, stop, cuts: [stop], prefix_reusable=False),
    "yarn": Method("yarn", _rope_factor, rope="yarn"),
    "self-extend": Method("self-extend", _self_extend, lambda config, settings, s: SelfExtend(
        s["group_size"], s["neighbor_window"], s["train_len"])),
    "chunk-llama": Method("chunk-llama", _chunk_llama, lambda config, settings, s: DualChunkAttention(
        s["dca_chunk_size"], s["local_window"], s["train_len"] - 1)),
    "rerope": Method("rerope", _rerope, lambda config, settings, s: ReRoPE(
        s["neighbor_window"], s["train_len"], None, s["logn"]), previewable=True),
    "leaky-rerope": Method("leaky-rerope", _leaky_rerope, lambda config, settings, s: ReRoPE(
        s["neighbor_window"], s["train_len"], s["leaky_factor"], s["logn"]), previewable=True),
    "dpe": Method("dpe", _dpe, lambda config, settings, s: DPE(
        tuple(s["dpe_scales"]), s["neighbor_window"], s["train_len"], _head_dim(config)), previewable=True),
    "gali": Method("gali", lambda config, settings, train_len, tokens: gali_config(config, settings, train_len).facts(),
                   lambda config, settings, s: Gali(gali_config(config, settings, s["train_len"])),
                   boundaries=lambda method, start, stop, cuts: method.chunk_ends(start, stop, cuts)),
    "string": Method("string", _string, lambda config, settings, s: StringRoPE(
        s["shifted_offset"], s["local_window"], s["train_len"], s["string_scale"]), previewable=True),
    # Its map follows the input's length: a prefix read for one input is not that of another.
    "lampe": Method("lampe", _lampe, lambda config, settings, s: LaMPE(
        s["neighbor_window"], s["lampe_tail"], s["lampe_length"], s["tokens"], s["train_len"]),
        prefix_reusable=False, previewable=True),
    "self": Method("self", _self, lambda config, settings, s: LogisticSelfExtend(
        s["group_size"], s["self_rate"], s["neighbor_window"], s["train_len"]), previewable=True),
}


def get_method(name: str) -> Method:
    """The method called `name`, or a ConfigError listing them all."""
    if name not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)} (or all); got {name!r}")
    return METHODS[name]


def preview_method(config: PretrainedConfig, name: str, settings: MethodSettings) -> dict | None:
    """The settings method `name` would run a model with this config with, as far as they are known before the
    input (None when the method does not say); a ConfigError for settings that make no sense for the model."""
    method = get_method(name)
    train_len = train_len_of(config, settings)
    return method.resolve(config, settings, train_len, None) if method.previewable else None


def kept_window(name: str, train_len: int | None, model_window: int) -> int:
    """The window method `name` keeps positions within: `train_len` (--train-len) where given, though the original
    model ignores it, else the model's: what an input's length is told against."""
    return train_len if train_len is not None and name != "original" else model_window


def train_len_of(config: PretrainedConfig, settings: MethodSettings) -> int:
    """--train-len, or the model's own window (model/families.py); never past that window."""
    window = default_train_len(config)
    train_len = settings.train_len if settings.train_len is not None else window
    if train_len > window:
        raise ConfigError(f"--train-len ({train_len}) exceeds the model's training window ({window})")
    return train_len
