"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM"): exact positions for the nearest keys, grouped ones beyond.

A query i and a key j closer than the neighbour window W (i - j < W) attend with their true positions; farther keys
attend with grouped positions: the key at j // G, the query at i // G + W - W // G, so that grouped distances
continue where the window ends. Keys are cached without RoPE, like GALI's. Positions depend on (i, j) only, so any
split of the input into forwards gives the same result; a key's grouped position depends on j alone, so while
decoding the grouped keys are kept rotated from token to token, and those of the window at their token indices
(KeptKeys.split). The attention is engine/attention/windowed.py's, which ReRoPE and DPE share: neighbours
at true distances, farther keys as the method places them.
"""

import torch
from torch import nn

from ..engine.attention.windowed import kept_far_keys, windowed_attend
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.rope import rotate
from ..errors import ConfigError


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
        return max(grouped, 2 * self.neighbor_window)  # neighbour positions are relative to a tile (engine.windowed)

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        size, window = self.group_size, self.neighbor_window
        grouped = keys // size - (query // size + group_shift(size, window))
        # Neighbours at -(W - 1)..0; grouped keys from j // G - i // G - shift, least at j = 0 and i = C - 1.
        reach = max(window - 1, (keys.shape[0] - 1) // size + group_shift(size, window))
        return Placement(torch.where(query - keys < window, keys - query, grouped), reach=reach)

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """The neighbours (i - W < j <= i) at true distances and the grouped keys (j <= i - W) at grouped positions,
        merged by their log-sum-exps (engine.windowed)."""
        size, window, start, stop = self.group_size, self.neighbor_window, forward.start, forward.stop
        table = forward.table(query.device, query.dtype)

        def grouped_rotation(first_key: int, last_key: int) -> tuple[torch.Tensor, torch.Tensor]:
            def build() -> tuple[torch.Tensor, torch.Tensor]:
                rows = torch.arange(first_key, last_key, device=key.device) // size
                return table.cos[rows], table.sin[rows]

            return forward.memo(("grouped-keys", key.device, key.dtype, first_key, last_key), build)

        if stop - start == 1:  # decoding: the keys kept from the previous token, grouped or in the window
            grouped_key, at_token_index = kept_far_keys(self._kept, forward, module.layer_idx, query, key, window,
                                                        grouped_rotation)
        else:  # a longer forward rotates them for itself: keeping them would hold a copy of every layer's keys
            self._kept.forget(forward.cache)
            grouped_key, at_token_index = rotate(key[:, :, : stop - window], *grouped_rotation(0, stop - window)), None
        # Queries at i // G + W - W // G (the rows of queries without grouped keys are not used), in the model's
        # dtype like the grouped keys: windowed.far_attention then copies neither.
        query_index = torch.arange(start, stop, device=key.device) // size + group_shift(size, window)
        grouped_query = rotate(query, table.cos[query_index], table.sin[query_index])
        return windowed_attend(forward, query, key, value, grouped_query, grouped_key, window, scaling, dropout,
                               at_token_index)
