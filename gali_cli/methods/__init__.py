"""The length-extrapolation methods gali runs a Llama with, behind one interface (every command's --method).

| method | what | settings and defaults (L = train_len, N = input tokens) |
|---|---|---|
| original | the unpatched model: positions run past L | - |
| ntk | static NTK-aware scaling: rope_theta * factor^(d/(d-2)) | --factor, ceil(N / L) |
| dynamic-ntk | transformers' dynamic NTK, scaling once past L | --factor, ceil(N / L) |
| yarn | transformers' YaRN with original_max_position_embeddings = L | --factor, ceil(N / L) |
| self-extend | SelfExtend: exact neighbours, grouped positions beyond | --neighbor-window L/4, --group-size: the smallest that reaches N |
| chunk-llama | Dual Chunk Attention: intra-, successive- and inter-chunk | --dca-chunk-size 3L/4, --local-window L - chunk |
| gali | Greedy Attention Logit Interpolation | --chunk-size L/4, --local-window L/2, --noise |

A method patches a loaded model in place; `apply_method` first removes whatever was applied before, so one loaded
model can run them all in turn. Each also says where a forward may be cut without changing the results.
"""

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from transformers import PreTrainedModel

from ..config import MethodSettings
from ..engine.hooks import install, installed_method, uninstall
from ..engine.positions import chunk_plan
from ..errors import ConfigError
from .chunk_llama import DualChunkAttention
from .gali import apply_gali, gali_settings
from .rope_scaling import rescale, restore
from .self_extend import SelfExtend, reach


@dataclass(frozen=True)
class Method:
    """A method by name: how to apply it to a loaded model, and where its forwards may be cut."""

    name: str
    summary: str
    # (model, settings, train_len, input tokens) -> the settings it resolved, for reports
    apply: Callable[[PreTrainedModel, MethodSettings, int, int], dict]
    # Token indices in (start, stop] where a forward over [start, stop) may end; None: anywhere.
    boundaries: Callable[[PreTrainedModel, int, int], list[int]] | None = None
    # False when results depend on one forward over the whole input: no prefilled prefix can then be reused.
    prefix_reusable: bool = True


def default_factor(settings: MethodSettings, train_len: int, tokens: int) -> float:
    return settings.factor if settings.factor is not None else max(1, math.ceil(tokens / train_len))


def _apply_gali(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
    apply_gali(model, replace(settings.gali(), train_len=train_len))
    return gali_settings(model).facts()


def _gali_boundaries(model: PreTrainedModel, start: int, stop: int) -> list[int]:
    config = gali_settings(model)
    return [last for _, last in chunk_plan(start, stop, config.train_len, config.chunk_size)]


def _rope(kind: str) -> Callable[[PreTrainedModel, MethodSettings, int, int], dict]:
    def apply(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
        return {"train_len": train_len, **rescale(model, kind, default_factor(settings, train_len, tokens), train_len)}

    return apply


def _apply_self_extend(model: PreTrainedModel, settings: MethodSettings, train_len: int, tokens: int) -> dict:
    window = settings.neighbor_window if settings.neighbor_window is not None else train_len // 4
    if not 0 < window < train_len:
        raise ConfigError(f"--neighbor-window must be between 1 and {train_len - 1}, got {window}")
    size = settings.group_size or max(1, math.ceil((tokens - window) / (train_len - window)))
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


METHODS = {
    "original": Method("original", "the unpatched model: positions simply run past train_len",
                       lambda model, settings, train_len, tokens: {}),
    "ntk": Method("ntk", "static NTK-aware RoPE scaling", _rope("ntk")),
    # Dynamic NTK picks its frequencies from the longest position of each forward: one forward for the whole input.
    "dynamic-ntk": Method("dynamic-ntk", "dynamic NTK RoPE scaling (transformers)", _rope("dynamic-ntk"),
                          lambda model, start, stop: [stop], prefix_reusable=False),
    "yarn": Method("yarn", "YaRN RoPE scaling (transformers)", _rope("yarn")),
    "self-extend": Method("self-extend", "SelfExtend: grouped positions beyond a neighbour window",
                          _apply_self_extend),
    "chunk-llama": Method("chunk-llama", "ChunkLlama's Dual Chunk Attention", _apply_chunk_llama),
    "gali": Method("gali", "Greedy Attention Logit Interpolation", _apply_gali, _gali_boundaries),
}


def get_method(name: str) -> Method:
    """The method called `name`, or a ConfigError listing them all."""
    if name not in METHODS:
        raise ConfigError(f"--method must be one of {', '.join(METHODS)} (or all); got {name!r}")
    return METHODS[name]


def apply_method(model: PreTrainedModel, name: str, settings: MethodSettings, input_tokens: int) -> dict:
    """Run `model` with method `name` from now on (replacing any other); returns the settings it resolved."""
    method = get_method(name)
    model_window = model.config.max_position_embeddings
    train_len = settings.train_len if settings.train_len is not None else model_window
    if train_len > model_window:
        raise ConfigError(f"--train-len ({train_len}) exceeds the model's training window ({model_window})")
    remove_method(model)
    return method.apply(model, settings, train_len, input_tokens)


def remove_method(model: PreTrainedModel) -> None:
    """Back to the unpatched model, whichever method was applied."""
    if installed_method(model) is not None:
        uninstall(model)
    restore(model)
