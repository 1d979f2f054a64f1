"""SelfExtend (Jin et al. 2024, "LLM Maybe LongLM"): exact positions for the nearest keys, grouped ones beyond.

A query i and a key j closer than the neighbour window W (i - j < W) attend with their true positions; farther keys
attend with grouped positions: the key at j // G, the query at i // G + W - W // G, so that grouped distances
continue where the window ends. Keys are cached without RoPE, like GALI's. Positions depend on (i, j) only, so any
split of the input into forwards gives the same result; a key's grouped position depends on j alone, so while
decoding the grouped keys are kept rotated from token to token (engine/kept_keys.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.dense import Partial, PartialAttention, causal_partial, merge_partials, partial_route
from ..engine.hooks import Forward, PositionalAttention
from ..engine.kept_keys import KeptKeys
from ..engine.rope import RopeTable, rotate
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
        return max(grouped, 2 * self.neighbor_window)  # neighbour positions are relative to a band of 2 W keys

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """Two parts merged by their log-sum-exps: the grouped keys (j <= i - W), one lower-right causal attention
        at grouped positions; and the neighbours (i - W < j <= i) at true distances, in bands of 2 W keys."""
        size, window, start, stop = self.group_size, self.neighbor_window, forward.start, forward.stop
        table = forward.table(query.device, query.dtype)
        partial = forward.memo(("partial", query.device, query.dtype),
                               lambda: partial_route(query, key, value, dropout))
        near = neighbour_partial(query, key[:, :, :stop], value[:, :, :stop], start, window, table, scaling, partial)
        first = max(start, window)  # the first query that has grouped keys: i - W >= 0
        if first >= stop:
            return near.output.transpose(1, 2)

        def grouped_rotation(first_key: int, last_key: int) -> tuple[torch.Tensor, torch.Tensor]:
            def build() -> tuple[torch.Tensor, torch.Tensor]:
                rows = torch.arange(first_key, last_key, device=key.device) // size
                return table.cos[rows], table.sin[rows]

            return forward.memo(("grouped-keys", key.device, key.dtype, first_key, last_key), build)

        if stop - start == 1:  # decoding: the grouped keys kept from the previous token, the new one rotated
            grouped_key = self._kept.rotated(forward.cache, module.layer_idx, key, start, stop,
                                             grouped_rotation)[:, :, : stop - window]
        else:  # a longer forward rotates them for itself: keeping them would hold a copy of every layer's keys
            self._kept.forget(forward.cache)
            grouped_key = rotate(key[:, :, : stop - window], *grouped_rotation(0, stop - window))
        query_index = torch.arange(first, stop, device=key.device) // size + group_shift(size, window)
        grouped_query = rotate(query[:, :, first - start :], table.cos[query_index], table.sin[query_index])
        # Query i sees grouped keys 0..i - W: the last query sees all stop - W of them (lower-right causal).
        far = causal_partial(grouped_query, grouped_key, value[:, :, : stop - window], scaling, partial)
        rows = slice(first - start, None)
        merged = merge_partials([Partial(near.output[:, :, rows], near.lse[:, :, rows]), far]).output
        if first > start:
            merged = torch.cat((near.output[:, :, : first - start], merged), dim=2)
        return merged.transpose(1, 2)


def neighbour_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: int,
    window: int,
    table: RopeTable,
    scale: float,
    partial: PartialAttention,
) -> Partial:
    """Attention of queries (B, H, q, D) of tokens start.. over their neighbours, keys i - W < j <= i, at true
    distances: queries in blocks of W, each against the band of 2 W keys before its end, all bands batched in one
    call. Positions are relative to each band (keys at 0..2W-1, queries at W..2W-1), so angles stay small and one
    table slice serves every band. One query (decoding) sees its W neighbours without a band or a mask."""
    batch, heads, q_len, dim = query.shape
    if q_len == 1 and start >= window - 1:  # keys start - W + 1 .. start, at 0..W-1; the query at W - 1
        near_key = rotate(key[:, :, start - window + 1 : start + 1], table.cos[:window], table.sin[:window])
        near_query = rotate(query, table.cos[window - 1 : window], table.sin[window - 1 : window])
        return partial(near_query, near_key, value[:, :, start - window + 1 : start + 1], scale)
    kv_heads = key.shape[1]
    blocks = -(-q_len // window)
    padded = blocks * window
    cos, sin = table.cos[: 2 * window], table.sin[: 2 * window]
    # Block m holds queries start + mW .. start + mW + W - 1; its band, keys start + (m - 1) W .. start + (m + 1) W - 1.
    query = F.pad(query, (0, 0, 0, padded - q_len))
    query = query.view(batch, heads, blocks, window, dim).transpose(1, 2)  # (B, blocks, H, W, D)
    query = rotate(query, cos[window:], sin[window:]).reshape(batch * blocks, heads, window, dim)
    low, high = start - window, start + padded
    bands = []
    for tensor in (key, value):
        # Tokens low .. high - 1, zeros where there is none (before token 0, after the last query).
        span = F.pad(tensor[:, :, max(low, 0) : high], (0, 0, max(-low, 0), high - min(high, tensor.shape[2])))
        bands.append(span.unfold(2, 2 * window, window).permute(0, 2, 1, 4, 3))  # (B, blocks, Hkv, 2W, D)
    band_key = rotate(bands[0], cos, sin).reshape(batch * blocks, kv_heads, 2 * window, dim)
    band_value = bands[1].reshape(batch * blocks, kv_heads, 2 * window, dim)
    # Query t of a block (at W + t) sees band keys r with t < r <= W + t, and none before token 0.
    t = torch.arange(window, device=key.device).unsqueeze(1)
    r = torch.arange(2 * window, device=key.device)
    index = low + window * torch.arange(blocks, device=key.device).view(-1, 1, 1) + r  # token index of each key
    mask = (t < r) & (r <= window + t) & (index >= 0)  # (blocks, W, 2W)
    mask = mask.expand(batch, blocks, window, 2 * window).reshape(batch * blocks, 1, window, 2 * window)
    near = partial(query, band_key, band_value, scale, mask=mask)
    output = near.output.view(batch, blocks, heads, window, dim).transpose(1, 2).reshape(batch, heads, padded, dim)
    lse = near.lse.view(batch, blocks, heads, window).transpose(1, 2).reshape(batch, heads, padded)
    return Partial(output[:, :, :q_len], lse[:, :, :q_len])
