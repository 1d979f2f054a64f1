"""GALI's position arithmetic (paper Appendix D, Algorithms 1 and 2) as plain functions.

Everything here is integer or fp64 math: the interpolation weight c = ceil(p) - p must never be computed in the
model's dtype (in bf16 it rounds to 0 once train_len >= 512 and GALI silently turns into plain RoPE).
"""

from typing import NamedTuple

import torch


def chunk_plan(start: int, stop: int, train_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """Cut a forward over tokens [start, stop) into GALI chunks.

    Alg. 1 puts chunk boundaries at token indices train_len, train_len + s, train_len + 2s, ...; a forward is also cut
    at its own end, so a one-token forward (decoding) is a one-token chunk. Feeding the pieces one forward each gives
    the same result as one forward over all of them.

    Returns:
        The pieces as (first token, one past the last token), in order.
    """
    if not 0 <= start < stop:
        raise ValueError(f"a forward needs 0 <= start < stop, got [{start}, {stop})")
    if start < train_len:
        boundary = train_len
    else:
        boundary = train_len + ((start - train_len) // chunk_size + 1) * chunk_size
    pieces = []
    while boundary < stop:
        pieces.append((start, boundary))
        start, boundary = boundary, boundary + chunk_size
    pieces.append((start, stop))
    return pieces


def planned_chunks(start: int, stop: int, cuts: list[int], train_len: int,
                   chunk_size: int) -> list[list[tuple[int, int]]]:
    """`chunk_plan` of each stretch between the `cuts` inside (start, stop): a prefill whose forwards end at these
    chunks' ends (each cut among them) gives the results of one forward per stretch (GALI's chunks, ReAttention's)."""
    ends = [*sorted({cut for cut in cuts if start < cut < stop}), stop]
    return [chunk_plan(first, last, train_len, chunk_size) for first, last in zip([start, *ends[:-1]], ends)]


def _where(condition, if_true, otherwise):
    """torch.where for 0-d tensors, a conditional for Python integers: the position arithmetic below runs on both."""
    if isinstance(condition, torch.Tensor):
        return torch.where(condition, if_true, otherwise)
    return if_true if condition else otherwise


def group_size(total_len: int, train_len: int, local_window: int) -> int:
    """g of Eq. (3): how many tokens share each unit interval when `total_len` keys are attended (1: none do).
    `total_len` may be a 0-d int64 tensor (the static decoding step's, never read on the host)."""
    return _where(total_len <= train_len, 1, -((local_window - total_len) // (train_len - local_window)))


def grouping(total_len: int, train_len: int, local_window: int) -> tuple[int, int]:
    """(g, G): the group size, and how many of the first keys are grouped (at positions k / g); the other
    total_len - G keep exact integer positions ending at train_len - 1. (1, 0) within the window. Integers, or 0-d
    tensors for a 0-d `total_len`."""
    g = group_size(total_len, train_len, local_window)
    blocks = -((train_len - total_len) // _where(g > 1, g - 1, 1))  # i when Alg. 2's loop stops
    return g, _where(g > 1, total_len - train_len + blocks, 0)


class Interpolation(NamedTuple):
    """Positions of keys [first, total_len) of a chunk, split for attention logit interpolation (Alg. 3).

    Key k sits at p_k = ceil - weight; its logit is (1 - c) q.K(ceil) + c q.K(floor) with c = weight.
    Keys [0, grouped) have positions k / group (fractional unless group divides k); the rest keep exact integer
    positions (the local window and the rest of the tail).
    """

    ceil: torch.Tensor  # (total_len - first,) int64
    floor: torch.Tensor  # (total_len - first,) int64
    weight: torch.Tensor  # (total_len - first,) float64, in [0, 1)
    group: int
    grouped: int


def key_positions(keys: torch.Tensor, total_len: int | torch.Tensor, train_len: int,
                  local_window: int) -> Interpolation:
    """Alg. 2 with target_len = total_len, in closed form and exact integer arithmetic, for the token indices `keys`.

    Alg. 2 emits blocks [i, i + 1/g, ..., i + (g-1)/g] for i = 0, 1, ... until train_len - i + g*i >= total_len,
    then keeps the first total_len - (train_len - i) of them followed by the exact positions i, ..., train_len - 1.
    Entry k of the grouped part is k / g, so no loop is needed. The newest key always sits at train_len - 1
    (except with local_window = 0 and total_len a multiple of train_len, where Alg. 2 leaves no exact tail).
    `total_len` may be a 0-d int64 tensor: the static decoding step places its keys without reading it on the host.
    """
    g, grouped = grouping(total_len, train_len, local_window)
    remainder = torch.remainder(keys, g)
    fractional = (keys < grouped) & (remainder > 0)
    floor = torch.where(keys < grouped, keys // g, keys - _where(total_len > train_len, total_len - train_len, 0))
    weight = torch.where(fractional, (g - remainder).double() / g, 0.0)
    return Interpolation(floor + fractional, floor, weight, g, grouped)


def interpolate(
    total_len: int, train_len: int, local_window: int, device: torch.device | str | None = None, first: int = 0
) -> Interpolation:
    """`key_positions` of keys [first, total_len) of a chunk of `total_len` keys."""
    return key_positions(torch.arange(first, total_len, device=device), total_len, train_len, local_window)


def gali_positions(total_len: int, train_len: int, local_window: int) -> torch.Tensor:
    """The (fractional) positions of Alg. 2, float64, e.g. for display or for checking against the paper."""
    interp = interpolate(total_len, train_len, local_window)
    return interp.ceil.double() - interp.weight
