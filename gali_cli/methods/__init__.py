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

A method patches a loaded model in place; `apply_method` first removes whatever was applied before, so one loaded
model can run them all in turn. Each also says where a forward may be cut without changing the results, and
`prefill_spans` turns that into the forwards every prefill runs (conversation, server, ppl, batch, benchmarks).
"""  # noqa: E501 - the rows of a Markdown table cannot wrap

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from transformers import PretrainedConfig, PreTrainedModel

from ..compat import warn_if_untested
from ..config import MethodSettings
from ..engine.contract import PositionalAttention
from ..engine.seam.hooks import install, installed_method, uninstall
from ..errors import ConfigError
from ..generate import forward_spans
from ..model.families import default_train_len
from .chunk_llama import DualChunkAttention
from .dpe import DPE, check_scales, default_groups, published_settings
from .gali import Gali, apply_gali, gali_settings
from .lampe import LaMPE, Layout, check_tail
from .lampe import published_settings as lampe_published
from .rerope import ReRoPE, leaky_reach
from .rope_scaling import rescale, restore
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
    """A method by name: how to apply it to a loaded model, and where its forwards may be cut."""

    name: str
    # (model, settings, train_len, input tokens) -> the settings it resolved, for reports
    apply: Callable[[PreTrainedModel, MethodSettings, int, int], dict]
    # (model, start, stop, cuts) -> token indices in (start, stop] where a forward over [start, stop) may end, each
    # of `cuts` ending one too; None: anywhere.
    boundaries: Callable[..., list[int]] | None = None
    # False when results depend on one forward over the whole input: no prefilled prefix can then be reused.
    prefix_reusable: bool = True
    # (model config, settings, train_len, None) -> what it would resolve, known before any input (gali info); it
    # refuses settings that make no sense for that model.
    preview: Callable[[PretrainedConfig, MethodSettings, int, None], dict] | None = None


def default_factor(settings: MethodSettings, train_len: int, tokens: int) -> float:
    return settings.factor if settings.factor is not None else max(1, math.ceil(tokens / train_len))


def _apply_gali(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
    apply_gali(model, replace(settings.gali(), train_len=train_len))
    return gali_settings(model).facts()


def _gali_boundaries(model: PreTrainedModel, start: int, stop: int, cuts: Iterable[int] = ()) -> list[int]:
    return installed_method(model).chunk_ends(start, stop, list(cuts))


def _rope(kind: str) -> Callable[[PreTrainedModel, MethodSettings, int, int], dict]:
    def apply(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
        return {"train_len": train_len, **rescale(model, kind, default_factor(settings, train_len, tokens), train_len)}

    return apply


def smallest_group(window: int, train_len: int, tokens: int) -> int:
    """The smallest SelfExtend group size whose positions reach `tokens` within train_len (LongLM's rule)."""
    return max(1, math.ceil((tokens - window) / (train_len - window)))


def _window(settings: MethodSettings, train_len: int, default: int) -> int:
    window = settings.neighbor_window if settings.neighbor_window is not None else default
    if not 0 < window < train_len:
        raise ConfigError(f"--neighbor-window must be between 1 and {train_len - 1}, got {window}")
    return window


def _apply_self_extend(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
    window = _window(settings, train_len, train_len // 4)
    size = settings.group_size or smallest_group(window, train_len, tokens)
    if reach(size, window, train_len) < tokens:
        raise ConfigError(
            f"--group-size {size} with --neighbor-window {window} reaches {reach(size, window, train_len)} tokens "
            f"within train_len {train_len}; the input has {tokens}: raise --group-size"
        )
    install(model, SelfExtend(size, window, train_len))
    return {"train_len": train_len, "group_size": size, "neighbor_window": window}


def _apply_chunk_llama(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
    size = settings.dca_chunk_size if settings.dca_chunk_size is not None else 3 * train_len // 4
    window = settings.local_window if settings.local_window is not None else train_len - size
    install(model, DualChunkAttention(size, window, train_len - 1))
    return {"train_len": train_len, "dca_chunk_size": size, "local_window": window}


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


def _installing(resolve: Callable[[PretrainedConfig, MethodSettings, int, int | None], dict],
                build: Callable[[PretrainedConfig, dict], PositionalAttention]) -> Callable[..., dict]:
    """A method's `apply`: resolve its settings for the input, then install the attention built from them."""

    def apply(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
        resolved = resolve(model.config, settings, train_len, tokens)
        install(model, build(model.config, resolved))
        return resolved

    return apply


METHODS = {
    "original": Method("original", lambda model, settings, train_len, tokens: {}),
    "ntk": Method("ntk", _rope("ntk")),
    # Dynamic NTK picks its frequencies from the longest position of each forward: one forward for the whole input.
    "dynamic-ntk": Method("dynamic-ntk", _rope("dynamic-ntk"), lambda model, start, stop, cuts=(): [stop],
                          prefix_reusable=False),
    "yarn": Method("yarn", _rope("yarn")),
    "self-extend": Method("self-extend", _apply_self_extend),
    "chunk-llama": Method("chunk-llama", _apply_chunk_llama),
    "rerope": Method("rerope", _installing(
        _rerope, lambda config, s: ReRoPE(s["neighbor_window"], s["train_len"], None, s["logn"])), preview=_rerope),
    "leaky-rerope": Method("leaky-rerope", _installing(
        _leaky_rerope, lambda config, s: ReRoPE(s["neighbor_window"], s["train_len"], s["leaky_factor"], s["logn"])),
        preview=_leaky_rerope),
    "dpe": Method("dpe", _installing(
        _dpe, lambda config, s: DPE(tuple(s["dpe_scales"]), s["neighbor_window"], s["train_len"], _head_dim(config))),
        preview=_dpe),
    "gali": Method("gali", _apply_gali, _gali_boundaries),
    "string": Method("string", _installing(
        _string, lambda config, s: StringRoPE(s["shifted_offset"], s["local_window"], s["train_len"],
                                                      s["string_scale"])),
        preview=_string),
    # Its map follows the input's length: a prefix read for one input is not that of another.
    "lampe": Method("lampe", _installing(_lampe, lambda config, s: LaMPE(
        s["neighbor_window"], s["lampe_tail"], s["lampe_length"], s["tokens"], s["train_len"])),
        prefix_reusable=False, preview=_lampe),
    "self": Method("self", _installing(_self, lambda config, s: LogisticSelfExtend(
        s["group_size"], s["self_rate"], s["neighbor_window"], s["train_len"])), preview=_self),
}


def get_method(name: str) -> Method:
    """The method called `name`, or a ConfigError listing them all."""
    if name not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)} (or all); got {name!r}")
    return METHODS[name]


def apply_method(model: PreTrainedModel, name: str, settings: MethodSettings, input_tokens: int) -> dict:
    """Run `model` with method `name` from now on (replacing any other); returns the settings it resolved."""
    method = get_method(name)
    train_len = _train_len(model.config, settings)
    warn_if_untested()
    remove_method(model)
    return method.apply(model, settings, train_len, input_tokens)


def prefill_spans(model: PreTrainedModel, name: str, start: int, stop: int, cuts: Iterable[int] = (),
                  step: int | None = None) -> list[tuple[int, int]]:
    """The forwards a prefill of tokens [start, stop) runs with method `name` as applied to `model`: about `step`
    tokens each (default: 8 GALI chunks, at least 256 tokens; 8 * train_len / 8 for other methods), ending only
    where the method allows, and at each of `cuts` (unless the method needs the whole input in one forward). GALI
    keeps the plan for its forwards.
    """
    method, installed = get_method(name), installed_method(model)
    cuts = sorted({cut for cut in cuts if start < cut < stop}) if method.prefix_reusable else []
    gali = installed if isinstance(installed, Gali) else None
    if gali is not None:  # planned once, here: the forwards take their chunks from this plan
        ends = gali.keep_plan(start, stop, cuts)
    else:
        ends = method.boundaries(model, start, stop, cuts) if method.boundaries else None
    step = step or max(256, 8 * (gali.config.chunk_size if gali else model.config.max_position_embeddings // 8))
    spans, ends = [], None if ends is None else sorted(ends)
    for first, last in zip([start, *cuts], [*cuts, stop]):  # the ends within each stretch by bisection: many cuts
        spans += forward_spans(first, last, step,  # (a prompt of many messages) stay linear
                               None if ends is None else ends[bisect_right(ends, first):bisect_right(ends, last)])
    return spans


def forward_ends(model: PreTrainedModel, name: str, start: int, stop: int) -> list[int] | None:
    """Token indices in (start, stop] where a forward of method `name` (as applied to `model`) may end without
    changing the results; None: anywhere."""
    boundaries = get_method(name).boundaries
    return boundaries(model, start, stop) if boundaries else None


def preview_method(config: PretrainedConfig, name: str, settings: MethodSettings) -> dict | None:
    """The settings method `name` would run a model with this config with, as far as they are known before the
    input (None when the method does not say); a ConfigError for settings that make no sense for the model."""
    method = get_method(name)
    train_len = _train_len(config, settings)
    return method.preview(config, settings, train_len, None) if method.preview else None


def kept_window(name: str, train_len: int | None, model_window: int) -> int:
    """The window method `name` keeps positions within: `train_len` (--train-len) where given, though the original
    model ignores it, else the model's: what an input's length is told against."""
    return train_len if train_len is not None and name != "original" else model_window


def _train_len(config: PretrainedConfig, settings: MethodSettings) -> int:
    window = default_train_len(config)
    train_len = settings.train_len if settings.train_len is not None else window
    if train_len > window:
        raise ConfigError(f"--train-len ({train_len}) exceeds the model's training window ({window})")
    return train_len


def remove_method(model: PreTrainedModel) -> None:
    """Back to the unpatched model, whichever method was applied."""
    if installed_method(model) is not None:
        uninstall(model)
    restore(model)
