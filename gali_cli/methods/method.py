"""What every method module declares (`Method`), and the rules their settings share: the neighbour window, the
smallest group that reaches an input, the head dimension.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from ..config import MethodSettings
from ..engine.checks.reference_model import NaiveLlama
from ..engine.contract import PositionalAttention
from ..errors import ConfigError


@dataclass(frozen=True)
class SeamExample:
    """The method as `gali info --check` runs it on a tiny random model (seam_check.py): its settings there, and its
    float64 restatement (engine/checks/reference_model.py) from the patched model and the resolved settings."""

    label: str
    settings: MethodSettings
    reference: Callable[[PreTrainedModel, dict], NaiveLlama]
    decodes: bool = True  # False: only its prefill has a plain restatement


@dataclass(frozen=True)
class Method:
    """A method: how its settings resolve for an input, what it installs, and where its forwards may be cut (what
    a command must know of it before torch loads is its line in registry.py)."""

    name: str
    # (model config, settings, train_len, input tokens) -> the settings it runs with, for reports; with tokens None
    # (before any input: gali info) only where the registry says it is previewable, refusing settings that make no
    # sense for the model.
    resolve: Callable[[PretrainedConfig, MethodSettings, int, int | None], dict]
    # (model config, settings, resolved settings) -> the attention it installs; None: the model's own attention.
    attention: Callable[[PretrainedConfig, MethodSettings, dict], PositionalAttention] | None = None
    rope: str | None = None  # the rotary it rebuilds with transformers' rope types (rope_scaling.py), by kind
    # (installed attention, start, stop, cuts) -> token indices in (start, stop] where a forward over [start, stop)
    # may end, each of `cuts` ending one too; None: anywhere.
    boundaries: Callable[[PositionalAttention | None, int, int, list[int]], list[int]] | None = None
    # `boundaries` for a prefill about to run: the installed attention may keep the plan for its forwards (GALI
    # keeps its chunks); None: `boundaries`.
    plan: Callable[[PositionalAttention | None, int, int, list[int]], list[int]] | None = None
    # (installed attention) -> the tokens a prefill's forward takes at most, by the method's own measure; None: the
    # model's window.
    step: Callable[[PositionalAttention | None], int] | None = None
    examples: tuple[SeamExample, ...] = ()  # what the seam check holds it to


def smallest_group(window: int, train_len: int, tokens: int) -> int:
    """The smallest SelfExtend group size whose positions reach `tokens` within train_len (LongLM's rule)."""
    return max(1, math.ceil((tokens - window) / (train_len - window)))


def neighbor_window(settings: MethodSettings, train_len: int, default: int) -> int:
    """--neighbor-window, else `default`; refused outside (0, train_len)."""
    window = settings.neighbor_window if settings.neighbor_window is not None else default
    if not 0 < window < train_len:
        raise ConfigError(f"--neighbor-window must be between 1 and {train_len - 1}, got {window}")
    return window


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
