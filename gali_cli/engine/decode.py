"""GALI decoding (docs/engine.md, "Decoding"): one new token attends over the cache without re-rotating it.

Each layer keeps its keys rotated from token to token (`DecodeState`); what a step rotates, and by what, is the same
for every layer (`DecodeStep`), so it is built once per token. Shapes: B batch, H query heads, Hkv key/value heads,
T keys, D head dim.
"""

from dataclasses import dataclass

import torch

from .dense import PartialAttention, merge_partials, partial_route
from .noise import Noise
from .noisy_attention import NoisyPartial, noisy_partial_route
from .positions import interpolate
from .rope import AbsoluteTable, RopeTable, key_rotation, rotate, rotate_fused


@dataclass
class DecodeState:
    """One layer's keys as decoding needs them, kept from token to token (see docs/engine.md, "Decoding").

    Rows [0, grouped) hold the keys rotated by their interpolated positions for group size `group` (GALI's frame,
    where the query sits at its own position p_q); rows [grouped, keys) hold the keys rotated at their own token
    index (the absolute frame, where the query sits at its token index): an exact-tail key's distance to the query
    is the same in both frames, so it is rotated once, when its token arrives.
    """

    group: int
    grouped: int
    keys: int
    rotated: torch.Tensor  # (B, Hkv, capacity >= keys, D), model dtype

    def origin(self, batch: int) -> tuple[int, int, int] | None:
        """(group, grouped, keys) for a step to continue from, or None when this buffer cannot be written again:
        another batch size, or made inside torch.inference_mode and now outside it (or the reverse)."""
        if self.rotated.shape[0] != batch or self.rotated.is_inference() != torch.is_inference_mode_enabled():
            return None
        return self.group, self.grouped, self.keys


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step rotates, and by what: the same for every layer whose state comes from the same
    `origin`, so it is built once per forward."""

    group: int
    grouped: int
    keys: int
    rebuild: bool  # no state to continue from: every row is rotated
    moved: int  # rows [moved, grouped) join GALI's frame
    moved_cos: torch.Tensor | None
    moved_sin: torch.Tensor | None
    fresh: int  # rows [fresh, keys) are rotated into the absolute frame
    fresh_cos: torch.Tensor | None
    fresh_sin: torch.Tensor | None
    query_cos: torch.Tensor  # the query in GALI's frame, at p_q
    query_sin: torch.Tensor
    absolute_query_cos: torch.Tensor | None  # the query at its token index, for the exact tail (None: no tail)
    absolute_query_sin: torch.Tensor | None


@dataclass(frozen=True)
class DecodeRoutes:
    """How a decode step computes its two parts (fixed by device, dtype and $GALI_KERNEL: decided once per token)."""

    partial: PartialAttention  # keys without noise
    noisy: NoisyPartial  # grouped keys with noise


def decode_routes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> DecodeRoutes:
    return DecodeRoutes(partial_route(query, key, value), noisy_partial_route(query, key, value))


def decode_step(
    origin: tuple[int, int, int] | None,
    keys: int,
    table: RopeTable,
    absolute: AbsoluteTable,
    train_len: int,
    local_window: int,
) -> DecodeStep:
    """The step to `keys` keys from a state at `origin` (group, grouped, keys), or from nothing.

    From one step to the next only a key or two leave the exact tail for the grouped part (every grouped key moves
    when g changes, rarely): those are rotated again, the new token's key once, nothing else. A state that is not
    exactly one token behind, or has another g, is rebuilt.
    """
    device = table.cos.device
    query_row = interpolate(keys, train_len, local_window, device, first=keys - 1)
    group, grouped = query_row.group, query_row.grouped
    rebuild = origin is None or origin[2] != keys - 1 or origin[0] != group
    moved = 0 if rebuild else origin[1]
    fresh = grouped if rebuild else max(grouped, origin[2])
    moved_cos = moved_sin = fresh_cos = fresh_sin = absolute_cos = absolute_sin = None
    if grouped > moved:
        moved_cos, moved_sin = key_rotation(table, keys, moved, grouped, train_len, group, grouped)
    if keys > fresh:
        fresh_cos, fresh_sin = absolute(torch.arange(fresh, keys, device=device))
    if keys > grouped:
        absolute_cos, absolute_sin = absolute(torch.tensor([keys - 1], device=device))
    return DecodeStep(group, grouped, keys, rebuild, moved, moved_cos, moved_sin, fresh, fresh_cos, fresh_sin,
                      table.cos[query_row.ceil], table.sin[query_row.ceil], absolute_cos, absolute_sin)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: DecodeState | None,
    step: DecodeStep,
    scale: float,
    noise: Noise | None = None,
    routes: DecodeRoutes | None = None,
) -> tuple[torch.Tensor, DecodeState]:
    """GALI attention of one new token (the last of the T keys) without re-rotating the cache.

    Args:
        query: (B, H, 1, D) un-rotated query of token T - 1.
        key, value: (B, Hkv, T, D) un-rotated keys and values.
        state: what the previous step returned for this cache and layer (unused when `step.rebuild`).
        step: from `decode_step`, for this state's origin.
        routes: from `decode_routes`, decided once per token for all layers; decided here when not given.

    Returns:
        (B, H, 1, D) attention output, and the state for the next step.
    """
    keys = step.keys
    if step.rebuild:
        rotated = key.new_empty(*key.shape[:2], _capacity(keys), key.shape[-1])
    elif state.rotated.shape[2] < keys:
        rotated = key.new_empty(*key.shape[:2], _capacity(keys), key.shape[-1])
        rotated[:, :, : state.keys] = state.rotated[:, :, : state.keys]
    else:
        rotated = state.rotated
    if step.moved_cos is not None:  # rows that joined the grouped part: GALI's frame
        rotate_fused(key[:, :, step.moved : step.grouped], step.moved_cos, step.moved_sin,
                     out=rotated[:, :, step.moved : step.grouped])
    if step.fresh_cos is not None:  # rows of the exact tail not rotated yet: the absolute frame
        rotate_fused(key[:, :, step.fresh : keys], step.fresh_cos, step.fresh_sin, out=rotated[:, :, step.fresh : keys])

    # Two parts merged by their log-sum-exps: the grouped keys in GALI's frame (with noise), the exact tail in the
    # absolute frame; one softmax over both, as if their logits had been concatenated.
    routes = routes or decode_routes(query, key, value)
    in_gali_frame = rotate(query, step.query_cos, step.query_sin)
    grouped_key, grouped_value = rotated[:, :, : step.grouped], value[:, :, : step.grouped]
    if noise is None:
        parts = [routes.partial(in_gali_frame, grouped_key, grouped_value, scale)]
    else:
        parts = [routes.noisy(in_gali_frame, grouped_key, grouped_value, scale, noise, keys - 1, step.group,
                              step.grouped, keys)]
    if step.absolute_query_cos is not None:
        in_absolute = rotate(query, step.absolute_query_cos, step.absolute_query_sin)
        parts.append(routes.partial(in_absolute, rotated[:, :, step.grouped : keys], value[:, :, step.grouped : keys],
                                    scale))
    output = merge_partials(parts).output
    return output, DecodeState(step.group, step.grouped, keys, rotated)


def _capacity(keys: int) -> int:
    """Room for the rotated keys: grown by a quarter at a time, so that appending is amortised O(1) per token."""
    return keys + max(64, keys // 4)
