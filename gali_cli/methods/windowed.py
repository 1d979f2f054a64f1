"""Attention split at a distance `window`, for methods that keep the keys within a window of each query at their true
distances and give the keys beyond it positions of their own (ReRoPE, Leaky ReRoPE, DPE, SelfExtend, SELF).

Neither part builds a (queries x keys) tensor. Each is a few mask-free attention calls that also return the
log-sum-exp of their logits, and the parts are merged exactly: softmax over a union of key sets is the parts' outputs
weighted by exp(lse_part - lse_all).

- Near keys, i - window < j <= i, with true distances: the queries are cut into tiles of `window` rows. A tile
  [a, a + n) sees its own keys [a, a + n) causally (one square causal call), and of the `window - 1` keys before a
  the nearest ones: key a - 1 - u is seen by rows r <= window - 2 - u. Flipped (queries last-to-first, keys nearest
  first), that triangle is an ordinary top-left causal call. Every tile uses the same table rows (positions relative
  to the tile), so the full tiles of a forward go through as one batch. One query (decoding) sees its `window`
  nearest keys in one call.
- Far keys, j <= i - window, with the rotations the method gives (already applied): the keys every query of the
  forward sees in full, plus a square causal call over the last ones, like engine.dense.split_causal_attention.

Every attention call here is the forward's `Partial` route (dense.PARTIAL[plan.partial]): torch's CPU flash kernel
outside autograd and dropout, else float32 logits a tile of rows at a time.

Shapes: B batch, H query heads, Hkv key/value heads, q queries (tokens [start, start + q)), D head dim.
"""


from collections.abc import Callable

import torch
from torch import nn

from ..engine.attention.dense import Partial, PartialAttention, merge_partials, partial_attention
from ..engine.attention.kept_keys import KeptKeys, Rotation
from ..engine.attention.plan import AttentionPlan
from ..engine.contract import Forward, Placement
from ..engine.math.rope import RopeTable, rotate, rotate_fused


def _rows(part: Partial, index: slice) -> Partial:
    return Partial(part.output[:, :, index], part.lse[:, :, index])


def near_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: RopeTable, window: int,
                   start: int, scale: float, partial: PartialAttention, dropout: float = 0.0,
                   at_token_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> Partial:
    """Attention of query (B, H, q, D), tokens [start, start + q), over its near keys, i - window < j <= i, with RoPE
    at their true distances. key/value: (B, Hkv, >= start + q, D), un-rotated. `table` needs 2 * window rows.
    `at_token_index`: see `windowed_attention`.

    Every row sees at least itself: the result has a finite lse everywhere.
    """
    rows = query.shape[2]
    if rows == 1 and start >= window - 1:  # decoding: keys start - window + 1 .. start at 0..window-1, the query last
        cos, sin = table.cos32, table.sin32
        near = slice(start - window + 1, start + 1)
        if at_token_index is not None:  # the same distances, from keys the method keeps rotated
            rotated_query, rotated_key = at_token_index
            dtype = torch.promote_types(rotated_query.dtype, rotated_key.dtype)
            return partial(rotated_query.to(dtype), rotated_key[:, :, near].to(dtype), value[:, :, near].to(dtype),
                           scale, dropout=dropout)
        # The window's keys are rotated again every token (they move): in two passes over them (rotate_fused).
        return partial(rotate(query.float(), cos[window - 1 : window], sin[window - 1 : window]),
                       rotate_fused(key[:, :, near].float(), cos[:window], sin[:window]), value[:, :, near].float(),
                       scale, dropout=dropout)
    # Tiles of `window` rows. The full tiles whose earlier keys all exist run as one batch; a first tile too close to
    # token 0 and a last, shorter tile run alone.
    first_full = 0 if start >= window - 1 else 1
    groups = [(0, 1)] if first_full else []
    if rows // window > first_full:
        groups.append((first_full, rows // window - first_full))
    if rows % window and rows // window >= first_full:
        groups.append((rows // window, 1))
    parts = []
    for tile, count in groups:
        row = tile * window
        a = start + row  # the first query token of the group
        n = min(window, rows - row)
        m = min(window - 1, a)  # keys before each tile that its rows may see

        def blocks(x: torch.Tensor, first: int, length: int) -> torch.Tensor:
            """x's rows [first + c * window, first + c * window + length) for each tile c: (B, heads, count, length,
            D), a view."""
            # Called only below, in this same iteration, so `count` is the current group's.
            end = first + (count - 1) * window + length  # noqa: B023
            return x[:, :, first:end].unfold(2, length, window).transpose(-1, -2)

        earlier = (blocks(key, a - m, m), blocks(value, a - m, m)) if m else (None, None)
        part = _tiles(blocks(query, row, n), blocks(key, a, n), blocks(value, a, n), *earlier, table, window, scale,
                      partial, dropout)
        parts.append(Partial(part.output.flatten(2, 3), part.lse.flatten(2, 3)))
    return Partial(torch.cat([part.output for part in parts], dim=2), torch.cat([part.lse for part in parts], dim=2))


def _tiles(query: torch.Tensor, own_key: torch.Tensor, own_value: torch.Tensor, earlier_key: torch.Tensor | None,
           earlier_value: torch.Tensor | None, table: RopeTable, window: int, scale: float, partial: PartialAttention,
           dropout: float) -> Partial:
    """Near attention of `count` tiles of n queries: query (B, H, count, n, D) with their own keys/values
    (B, Hkv, count, n, D) and the m <= window - 1 tokens before each tile (B, Hkv, count, m, D; None when m = 0),
    all un-rotated.

    Positions are relative to each tile: its own tokens at 0..n-1 for the causal square; for the earlier keys, the
    queries at window..window+n-1 and the keys at window-m..window-1. Returns (B, H, count, n, ...).
    """
    batch, _heads, count, n, _dim = query.shape
    m = earlier_key.shape[3] if earlier_key is not None else 0
    cos, sin = table.cos32, table.sin32

    def batched(x: torch.Tensor) -> torch.Tensor:  # (B, heads, count, rows, D) -> (B * count, heads, rows, D)
        return x.transpose(1, 2).flatten(0, 1)

    query = query.float()
    result = partial(batched(rotate(query, cos[:n], sin[:n])), batched(rotate(own_key.float(), cos[:n], sin[:n])),
                     batched(own_value.float()), scale, causal=True, dropout=dropout)
    if m:
        late = batched(rotate(query, cos[window : window + n], sin[window : window + n]))  # seen from earlier keys
        earlier = batched(rotate(earlier_key.float(), cos[window - m : window], sin[window - m : window]))
        earlier_value = batched(earlier_value.float())
        # Earlier key a - m + u is seen by row r iff r + m - u < window: the keys from u = n + m - window on by every
        # row, the `triangle` before them by fewer rows the farther they are.
        triangle = max(0, n + m - window)
        if m > triangle:
            result = merge_partials([result, partial(late, earlier[:, :, triangle:], earlier_value[:, :, triangle:],
                                                      scale, dropout=dropout)])
        if triangle:
            # Flipped (rows last to first, keys nearest first), row n - 2 - r sees the keys up to its own index:
            # top-left causal. Row n - 1 sees none of them.
            seen = partial(late[:, :, : n - 1].flip(2), earlier[:, :, :triangle].flip(2),
                           earlier_value[:, :, :triangle].flip(2), scale, causal=True, dropout=dropout)
            head = merge_partials([_rows(result, slice(0, n - 1)), Partial(seen.output.flip(2), seen.lse.flip(2))])
            tail = _rows(result, slice(n - 1, n))
            result = Partial(torch.cat((head.output, tail.output), dim=2), torch.cat((head.lse, tail.lse), dim=2))
    # (B * count, H, n, ...) -> (B, H, count, n, ...)
    return Partial(result.output.unflatten(0, (batch, count)).transpose(1, 2),
                   result.lse.unflatten(0, (batch, count)).transpose(1, 2))


def far_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, start: int, scale: float,
                  partial: PartialAttention, dropout: float = 0.0) -> Partial | None:
    """Attention of rotated queries (B, H, q, D), tokens [start, start + q), over their far keys j <= i - window,
    rotated as the method places them: key (B, Hkv, >= start + q - window, D). None when no query has a far key.
    The output is float32.

    Rows of tokens below `window` have none: their lse is -inf.
    """
    stop = start + query.shape[2]
    first = max(start, window)  # the first query with a far key
    if first >= stop:
        return None
    # In the wider of the queries' and keys' dtypes: far keys in the model's dtype are not copied when the method
    # rotated its queries in that dtype too (SelfExtend); the result in float32, as the near part's.
    dtype = torch.promote_types(query.dtype, key.dtype)
    late = query[:, :, first - start :].to(dtype)
    key, value = key.to(dtype), value.to(dtype)
    if stop - start == 1:  # one query (decoding) sees every far key
        part = partial(late, key[:, :, : stop - window], value[:, :, : stop - window], scale, dropout=dropout)
        return Partial(part.output.float(), part.lse)
    # Query i sees keys [0, i - window]: the keys before first - window in full, then a causal square.
    part = partial(late, key[:, :, first - window : stop - window], value[:, :, first - window : stop - window],
                   scale, causal=True, dropout=dropout)
    if first > window:
        part = merge_partials([part, partial(late, key[:, :, : first - window], value[:, :, : first - window], scale,
                                             dropout=dropout)])
    part = Partial(part.output.float(), part.lse)
    if first == start:
        return part
    before = first - start  # rows without far keys
    return Partial(torch.cat((part.output.new_zeros(*part.output.shape[:2], before, part.output.shape[3]),
                              part.output), dim=2),
                   torch.cat((part.lse.new_full((*part.lse.shape[:2], before), float("-inf")), part.lse), dim=2))


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: RopeTable,
                       far_query: torch.Tensor, far_key: torch.Tensor, window: int, start: int, scale: float,
                       plan: AttentionPlan, dropout: float = 0.0,
                       at_token_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Near keys at true distances, far keys as the method rotated them, merged: (B, H, q, D) in the value's dtype.

    Args:
        query: (B, H, q, D) un-rotated queries of tokens [start, start + q).
        key, value: (B, Hkv, >= start + q, D) un-rotated keys and values.
        table: the model's cos/sin, at least 2 * window rows.
        far_query: (B, H, q, D) the queries rotated for their far keys.
        far_key: (B, Hkv, >= start + q - window, D) the keys rotated as far keys.
        plan: the forward's (`Forward.attention_plan`), decided once per forward by its first layer.
        at_token_index: (query (B, H, 1, D), keys (B, Hkv, >= start + 1, D)) rotated at their token indices, as the
            unpatched model rotates them, when the method keeps its keys so (STRING's far keys are): a decoding
            step then reads the window's keys from them instead of rotating the window again (the distances are the
            same; RoPE sees only distances).
    """
    partial = partial_attention(plan, value.dtype)
    near = near_attention(query, key, value, table, window, start, scale, partial, dropout, at_token_index)
    far = far_attention(far_query, far_key, value, window, start, scale, partial, dropout)
    return (near if far is None else merge_partials([near, far])).output.to(value.dtype)


def windowed_attend(forward: Forward, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    far_query: torch.Tensor, far_key: torch.Tensor, window: int, scale: float, dropout: float,
                    at_token_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A windowed method's `attend` once it has placed its far queries and keys: `windowed_attention` over the keys
    of tokens [0, forward.stop) with the forward's table and plan, in the layout transformers' attention functions
    return, (B, q, H, D)."""
    stop = forward.stop
    plan = forward.attention_plan(query, key, value, dropout)
    output = windowed_attention(query, key[:, :, :stop], value[:, :, :stop], forward.table(query.device, query.dtype),
                                far_query, far_key, window, forward.start, scale, plan, dropout, at_token_index)
    return output.transpose(1, 2)


def kept_far_keys(kept: KeptKeys, forward: "Forward", layer: int, query: torch.Tensor, key: torch.Tensor, window: int,
                  far: Rotation) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """A windowed method's far keys, rotated by `far` (a rotation of the token index alone) and kept on the forward's
    cache, and `windowed_attention`'s `at_token_index`: (far_key, None) for a longer forward; for a decoding step the
    keys of `KeptKeys.split`, whose window rows are at their token indices, with the query rotated to match, so that
    the step rotates one or two keys instead of the whole window.

    query: (B, H, 1 or q, D) un-rotated (any scaling applied); key: (B, Hkv, >= stop, D) un-rotated.
    """
    start, stop = forward.start, forward.stop
    if stop - start > 1:
        return kept.rotated(forward.cache, layer, key, start, stop, far), None
    keys = kept.split(forward.cache, layer, key, start, stop, window, far,
                      lambda first, last: forward.at_token_index(first, last, key.device, key.dtype))
    return keys, decoding_at_token_index(forward, query, keys)


def decoding_at_token_index(forward: "Forward", query: torch.Tensor,
                            keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`windowed_attention`'s `at_token_index` for a decoding step whose window's keys `keys` (B, Hkv, >= stop, D)
    are kept at their token indices: the query (B, H, 1, D) rotated to its own token index, in float32."""
    cos, sin = forward.at_token_index(forward.start, forward.stop, query.device, torch.float32)
    return rotate(query.float(), cos, sin), keys


# Token indices (an int64 tensor) -> the rows of the model's RoPE table they are rotated by: a grouped method's map.
GroupedRows = Callable[[torch.Tensor], torch.Tensor]


def grouped_attention(forward: Forward, kept: KeptKeys, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, window: int, key_rows: GroupedRows, query_rows: GroupedRows, scale: float,
                      dropout: float) -> torch.Tensor:
    """A grouped method's attention (SelfExtend, SELF): the neighbours (i - window < j <= i) at true distances, the
    keys beyond at grouped positions, key j at row key_rows(j) and query i at row query_rows(i), merged by their
    log-sum-exps (`windowed_attention`). Both maps are of the token index alone, so a decoding step keeps the grouped
    keys rotated from token to token (`kept_far_keys`) and any split into forwards gives the same result.

    query: (B, H, q, D) un-rotated; key/value: (B, Hkv, >= stop, D) un-rotated; `forward.table` must hold every row
    the maps give for this forward and 2 * window. Returns (B, q, H, D).
    """
    start, stop = forward.start, forward.stop
    table = forward.table(query.device, query.dtype)

    def grouped_rotation(first_key: int, last_key: int) -> tuple[torch.Tensor, torch.Tensor]:
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            rows = key_rows(torch.arange(first_key, last_key, device=key.device))
            return table.cos[rows], table.sin[rows]

        return forward.memo(("grouped-keys", key.device, key.dtype, first_key, last_key), build)

    if stop - start == 1:  # decoding: the keys kept from the previous token, grouped or in the window
        grouped_key, at_token_index = kept_far_keys(kept, forward, module.layer_idx, query, key, window,
                                                    grouped_rotation)
    else:  # a longer forward rotates them for itself: keeping them would hold a copy of every layer's keys
        kept.forget(forward.cache)
        grouped_key, at_token_index = rotate(key[:, :, : stop - window], *grouped_rotation(0, stop - window)), None
    # The queries in the model's dtype like the grouped keys (the rows of queries without grouped keys are not used):
    # far_attention then copies neither.
    rows = query_rows(torch.arange(start, stop, device=key.device))
    grouped_query = rotate(query, table.cos[rows], table.sin[rows])
    return windowed_attend(forward, query, key, value, grouped_query, grouped_key, window, scale, dropout,
                           at_token_index)


def grouped_placement(query: torch.Tensor, keys: torch.Tensor, window: int, grouped_offset: torch.Tensor,
                      farthest: int) -> Placement:
    """A grouped method's static decoding placement: the neighbours at their true offsets (-(window - 1)..0), the
    others at `grouped_offset` (C,), key_rows(j) - query_rows(i), of which `farthest` bounds the magnitude for every
    query the cache's C rows can hold."""
    return Placement(torch.where(query - keys < window, keys - query, grouped_offset), reach=max(window - 1, farthest))
