"""GALI decoding (docs/dev/engine.md, "Decoding"): one new token attends over the cache without re-rotating it.

Each layer keeps its keys rotated from token to token (kept_keys.KeptKeys, in the frame (group, grouped) below); what
a step rotates, and by what, is the same for every layer (`DecodeStep`), so it is built once per token. Shapes: B batch,
H query heads, Hkv key/value heads, T keys, D head dim.
"""

from dataclasses import dataclass

import torch

from ..math.noise import Noise
from ..math.positions import interpolate
from ..math.rope import AbsoluteTable, RopeTable, key_rotation, rotate, rotate_fused
from .dense import merge_partials, partial_attention
from .noisy_attention import NOISY_PARTIAL
from .plan import AttentionPlan


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step rotates, and by what: the same for every layer whose kept keys are in the same `origin`
    frame, so it is built once per forward.

    The kept keys' rows [0, grouped) hold the keys rotated by their interpolated positions for group size `group`
    (GALI's frame, where the query sits at its own position p_q); rows [grouped, keys) hold the keys rotated at their
    own token index (the absolute frame, where the query sits at its token index): an exact-tail key's distance to
    the query is the same in both frames, so it is rotated once, when its token arrives.
    """

    group: int
    grouped: int
    keys: int
    rebuild: bool  # no kept keys to continue from: every row is rotated
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


def decode_step(
    origin: tuple[int, int] | None,
    keys: int,
    table: RopeTable,
    absolute: AbsoluteTable,
    train_len: int,
    local_window: int,
) -> DecodeStep:
    """The step to `keys` keys from kept keys of tokens [0, keys - 1) in the frame `origin` (group, grouped), or
    from nothing (None).

    From one step to the next only a key or two leave the exact tail for the grouped part (every grouped key moves
    when g changes, rarely): those are rotated again, the new token's key once, nothing else. Kept keys of another g
    are rotated again.
    """
    device = table.cos.device
    query_row = interpolate(keys, train_len, local_window, device, first=keys - 1)
    group, grouped = query_row.group, query_row.grouped
    rebuild = origin is None or origin[0] != group
    moved = 0 if rebuild else origin[1]
    fresh = grouped if rebuild else max(grouped, keys - 1)
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
    rotated: torch.Tensor,
    step: DecodeStep,
    scale: float,
    plan: AttentionPlan,
    noise: Noise | None = None,
) -> torch.Tensor:
    """GALI attention of one new token (the last of the T keys) without re-rotating the cache.

    Args:
        query: (B, H, 1, D) un-rotated query of token T - 1.
        key, value: (B, Hkv, T, D) un-rotated keys and values.
        rotated: (B, Hkv, >= T, D) the layer's kept keys (kept_keys.KeptKeys.buffer), rows [0, T - 1) in the frame
            `step` continues from (none when `step.rebuild`); the step's rows are rotated into it, in place.
        step: from `decode_step`, for the kept keys' frame.
        plan: the forward's (`Forward.attention_plan`, with noise when `noise` is given), decided once per token
            for all layers.

    Returns:
        (B, H, 1, D) attention output.
    """
    keys = step.keys
    if step.moved_cos is not None:  # rows that joined the grouped part: GALI's frame
        rotate_fused(key[:, :, step.moved : step.grouped], step.moved_cos, step.moved_sin,
                     out=rotated[:, :, step.moved : step.grouped])
    if step.fresh_cos is not None:  # rows of the exact tail not rotated yet: the absolute frame
        rotate_fused(key[:, :, step.fresh : keys], step.fresh_cos, step.fresh_sin, out=rotated[:, :, step.fresh : keys])

    # Two parts merged by their log-sum-exps: the grouped keys in GALI's frame (with noise), the exact tail in the
    # absolute frame; one softmax over both, as if their logits had been concatenated.
    partial = partial_attention(plan, value.dtype)
    in_gali_frame = rotate(query, step.query_cos, step.query_sin)
    grouped_key, grouped_value = rotated[:, :, : step.grouped], value[:, :, : step.grouped]
    if noise is None:
        parts = [partial(in_gali_frame, grouped_key, grouped_value, scale)]
    else:
        parts = [NOISY_PARTIAL[plan.noisy_partial](in_gali_frame, grouped_key, grouped_value, scale, noise, keys - 1,
                                                   step.group, step.grouped, keys)]
    if step.absolute_query_cos is not None:
        in_absolute = rotate(query, step.absolute_query_cos, step.absolute_query_sin)
        parts.append(partial(in_absolute, rotated[:, :, step.grouped : keys], value[:, :, step.grouped : keys],
                                    scale))
    return merge_partials(parts).output
