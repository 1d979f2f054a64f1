"""RoPE on tensors: the model's own cos/sin tables, rotations by them, GALI's interpolated key rotations, and rotations
at any (fractional, far, per-frequency) positions in float64.

GALI only ever rotates by integer positions (ceil and floor of p) or by a mix of two neighbouring ones, so every
rotation is a lookup in, or an interpolation between rows of, the model's table. Shapes: B batch, heads, n rows,
D head dim.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of the model's own rotary embedding at the integer positions 0..rows-1.

    `cos`/`sin` are in the model's dtype, bit-identical to what the model's rotary returns; `cos32`/`sin32` are the
    same values in float32, used to mix the ceil and floor rotations without rounding c.
    """

    cos: torch.Tensor  # (rows, D)
    sin: torch.Tensor
    cos32: torch.Tensor
    sin32: torch.Tensor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with per-row tables: x (B, heads, n, D), cos/sin (n, D). Same operations, in the same order, as
    transformers' apply_rotary_pos_emb, so integer positions give bit-identical results."""
    return (x * cos) + (rotate_half(x) * sin)


def rotate_fused(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The rotation of `rotate` in two passes over x instead of six (the last bit may round differently).

    Used for the many keys of GALI chunks: [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2], written into `out` if given
    (outside autograd only).
    """
    half = x.shape[-1] // 2
    out = torch.mul(x, cos, out=out) if out is not None else x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def key_rotation(
    table: RopeTable, keys: int, first: int, last: int, train_len: int, group: int, grouped: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (last - first, D), model dtype, of the interpolated rotation of keys [first, last) among `keys`.

    A grouped key k = m g + r sits at p = m + r / g, between the integer positions m and m + 1 with c = 1 - r / g,
    so its mixed rotation is (1 - c) R(m + 1) + c R(m) = R(m) + (r / g) (R(m + 1) - R(m)): a (blocks, g) outer
    product of table rows and fractions, mixed in float32 so that c survives, rounded once. Exact-tail keys keep
    integer positions, k - (keys - train_len) (k itself within the window): a slice of the model's own table.
    """
    end = min(grouped, last)  # rows [first, end) are grouped, [max(first, grouped), last) exact
    low, high = first // group, -(-end // group)  # the blocks m that the grouped rows fall in
    start = low * group if first < end else first  # the buffer starts at a block boundary
    size = max(high * group, last) - start
    fraction = torch.arange(group, dtype=torch.float32, device=table.cos.device).div_(group).unsqueeze(-1)
    shift = max(keys - train_len, 0)  # inside the window every key keeps its own position
    tables = []
    for full32, full in ((table.cos32, table.cos), (table.sin32, table.sin)):
        out = full.new_empty(size, full.shape[-1])
        if first < end:
            # (blocks, 1, D); row m + 1 exists: grouped positions stay below the exact tail, which ends in the table
            below, above = full32[low:high].unsqueeze(1), full32[low + 1 : high + 1].unsqueeze(1)
            blocks = out[: (high - low) * group].view(high - low, group, -1)  # row k - start = (m - low) g + r
            if full.dtype == torch.float32:
                torch.lerp(below, above, fraction, out=blocks)
            else:
                blocks.copy_(torch.lerp(below, above, fraction))
        if last > max(first, grouped):  # written after the blocks: it may overwrite rows past `grouped`
            out[max(first, grouped) - start : last - start] = full[max(first, grouped) - shift : last - shift]
        tables.append(out[first - start : last - start])
    return tables[0], tables[1]


def rotation(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (n, D) of the model's rotary embedding at any positions: (n, 1) for a position per row, (n, D/2) for
    one per frequency. As the rotary computes them (cat(freqs, freqs), times its attention scaling), but with angles in
    float64, so that positions far beyond the window or between integers lose no precision."""
    angles = positions.double() * inv_freq.double().to(positions.device)
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)


AbsoluteTable = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # token indices -> cos, sin (n, D)


def absolute_table(inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> AbsoluteTable:
    """cos/sin at any token index, as `rotation` computes them."""

    def lookup(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotation(positions.unsqueeze(-1), inv_freq, attention_scaling, dtype)

    return lookup
