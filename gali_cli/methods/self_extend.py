"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM"): exact positions for the nearest keys, grouped ones beyond.

A query i and a key j closer than the neighbour window W (i - j < W) attend with their true positions; farther keys
attend with grouped positions: the key at j // G, the query at i // G + W - W // G, so that grouped distances
continue where the window ends. Keys are cached without RoPE, like GALI's. Positions depend on (i, j) only, so any
split of the input into forwards gives the same result; a key's grouped position depends on j alone, so while
decoding the grouped keys are kept rotated from token to token, and those of the window at their token indices
(KeptKeys.split). The attention is windowed.py's grouped_attention, which SELF shares (its groups
grow along a logistic curve), over the windowed attention ReRoPE and DPE use too.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..errors import ConfigError
from .method import Method, SeamExample, neighbor_window, smallest_group
from .windowed import grouped_attention, grouped_placement


def group_shift(group_size: int, neighbor_window: int) -> int:
    """Added to the grouped query position, so that grouped distances start at the window's edge."""
    return neighbor_window - neighbor_window // group_size


def reach(group_size: int, neighbor_window: int, train_len: int) -> int:
    """The longest input whose positions all stay below train_len: (train_len - W) * G + W (LongLM's rule)."""
    return (train_len - neighbor_window) * group_size + neighbor_window


class SelfExtend(PositionalAttention):
    name = "self-extend"

    def __init__(self, group_size: int, neighbor_window: int, train_len: int) -> None:
        if group_size < 1:
            raise ConfigError(f"--group-size must be >= 1, got {group_size}")
        if not 0 < neighbor_window < train_len:
            raise ConfigError(
                f"--neighbor-window must be between 1 and train_len - 1 ({train_len - 1}), got {neighbor_window}"
            )
        self.group_size, self.neighbor_window, self.train_len = group_size, neighbor_window, train_len
        self.exact_until = neighbor_window  # every distance below the window: plain RoPE
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        grouped = (stop - 1) // self.group_size + group_shift(self.group_size, self.neighbor_window) + 1
        return max(grouped, 2 * self.neighbor_window)  # neighbour positions are relative to a tile (windowed.py)

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        size, window = self.group_size, self.neighbor_window
        # Grouped keys from j // G - i // G - shift, least at j = 0 and i = C - 1.
        return grouped_placement(query, keys, window, keys // size - (query // size + group_shift(size, window)),
                                 (keys.shape[0] - 1) // size + group_shift(size, window))

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """The neighbours at true distances, the grouped keys at j // G, the queries at i // G + W - W // G
        (windowed.grouped_attention)."""
        size, window = self.group_size, self.neighbor_window
        return grouped_attention(forward, self._kept, module, query, key, value, window, lambda j: j // size,
                                 lambda i: i // size + group_shift(size, window), scaling, dropout)


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    window = neighbor_window(settings, train_len, train_len // 4)
    size = settings.group_size or smallest_group(window, train_len, tokens)
    if reach(size, window, train_len) < tokens:
        raise ConfigError(
            f"--group-size {size} with --neighbor-window {window} reaches {reach(size, window, train_len)} tokens "
            f"within train_len {train_len}; the input has {tokens}: raise --group-size"
        )
    return {"train_len": train_len, "group_size": size, "neighbor_window": window}


METHOD = Method("self-extend", _settings, lambda config, settings, s: SelfExtend(
    s["group_size"], s["neighbor_window"], s["train_len"]), examples=(SeamExample(
        "self-extend", MethodSettings(group_size=4, neighbor_window=4),
        lambda model, s: ref.NaiveSelfExtend(model, s["group_size"], s["neighbor_window"])),))
