"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM"): exact positions for the nearest keys, grouped ones beyond.

A query i and a key j closer than the neighbour window W (i - j < W) attend with their true positions; farther keys
attend with grouped positions: the key at j // G, the query at i // G + W - W // G, so that grouped distances
continue where the window ends. Keys are cached without RoPE, like GALI's. Positions depend on (i, j) only, so any
split of the input into forwards gives the same result.
"""

import torch
from torch import nn

from ..engine.dense import grouped_logits, mask_future, tiled_attention
from ..engine.hooks import Forward, PositionalAttention
from ..engine.rope import rotate
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

    def table_rows(self, start: int, stop: int) -> int:
        grouped = (stop - 1) // self.group_size + group_shift(self.group_size, self.neighbor_window) + 1
        return max(grouped, stop - start + self.neighbor_window)  # neighbour positions are relative to a band

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        size, window = self.group_size, self.neighbor_window
        start, stop = forward.start, forward.stop
        table = forward.table(query.device, query.dtype)
        cos, sin = table.cos32, table.sin32
        key, value = key[:, :, :stop].float(), value[:, :, :stop]
        key_index = torch.arange(stop, device=key.device)
        grouped_keys = rotate(key, cos[key_index // size], sin[key_index // size])  # (B, Hkv, T, D)
        shift = group_shift(size, window)

        def logits(rows: slice) -> torch.Tensor:
            query_index = torch.arange(start + rows.start, start + rows.stop, device=key.device)
            rows_query = query[:, :, rows].float()
            grouped_query = rotate(rows_query, cos[query_index // size + shift], sin[query_index // size + shift])
            scores = grouped_logits(grouped_query, grouped_keys, scaling)  # (B, H, n, T)
            # Neighbours: true distances, rotated relative to the band's first key to keep angles small.
            low, high = max(0, rows.start + start - window + 1), start + rows.stop
            band = torch.arange(high - low, device=key.device)
            near_query = rotate(rows_query, cos[query_index - low], sin[query_index - low])
            near = grouped_logits(near_query, rotate(key[:, :, low:high], cos[band], sin[band]), scaling)
            close = (query_index.unsqueeze(1) - (band + low)) < window  # (n, band)
            scores[..., low:high] = torch.where(close, near, scores[..., low:high])
            mask_future(scores, query_index)
            return scores

        return tiled_attention(logits, value, query.shape[1], query.shape[2], dropout).transpose(1, 2)
