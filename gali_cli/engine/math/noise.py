"""GALI's Gaussian logit noise as a pure function of (seed, layer, batch, head, query index, key index).

Counter-based instead of a stateful generator: the noise a logit gets does not depend on how the work was split
(one forward or chunk by chunk, tile sizes, batch layout, device), and a fused kernel can compute the very same
values from the same integers. Only 32-bit multiply, xor and shift are used, so the hash is easy to port.
"""

import math
from dataclasses import dataclass
from typing import TypeVar

import torch

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so products of 32-bit values fit in int64 without overflow.
MULTIPLIER_A = 0x7FEB352D
MULTIPLIER_B = 0x5BD1E995
GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class Noise:
    """Where a layer's noise comes from, and how strong it is (sigma = (i - j) / T * scale)."""

    seed: int
    layer: int
    scale: float


IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def mix32(x: IntOrTensor) -> IntOrTensor:
    """A bijective avalanche hash of 32-bit values, for Python ints or int64 tensors holding them."""
    x = x ^ (x >> 16)
    x = (x * MULTIPLIER_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MULTIPLIER_B) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: int, layer: int) -> int:
    """The 32-bit key of one layer's noise under a seed (seeds up to 64 bits all count)."""
    key = mix32((seed & MASK32) ^ GOLDEN)
    key = mix32(key ^ ((seed >> 32) & MASK32))
    return mix32(key ^ (layer & MASK32))


def head_streams(noise: Noise, batch_size: int, heads: int, device: torch.device) -> torch.Tensor:
    """The 32-bit stream of each (batch, head) pair, flattened as b * heads + h: int64 of shape (B * H,)."""
    return mix32(stream_key(noise.seed, noise.layer) ^ torch.arange(batch_size * heads, device=device))


def standard_normal(
    noise: Noise, batch_size: int, heads: int, query_index: torch.Tensor, key_count: int
) -> torch.Tensor:
    """N(0, 1) samples for every (batch, head, query, key < key_count), as float32 of shape (B, H, q, key_count).

    `query_index` holds the queries' absolute token indices; keys are indexed from 0. Keys 2m and 2m + 1 share one
    hashed pair of uniforms, whose Box-Muller transform gives two independent normals (cosine and sine branch).
    """
    device = query_index.device
    streams = head_streams(noise, batch_size, heads, device)
    rows = mix32(streams.view(batch_size, heads, 1) ^ mix32(query_index.long() & MASK32))  # (B, H, q)
    pairs = mix32(torch.arange((key_count + 1) // 2, device=device) ^ GOLDEN)  # (n/2,)
    bits = mix32(rows.unsqueeze(-1) ^ pairs)  # (B, H, q, n/2)
    # Two independent 24-bit uniforms (exact in float32); +0.5 keeps the first one off 0.
    radius = torch.sqrt(-2.0 * torch.log(((bits >> 8).float() + 0.5) * 2.0**-24))
    angle = (mix32(bits ^ GOLDEN) >> 8).float() * (2.0 * math.pi * 2.0**-24)
    normals = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=-1)
    return normals.flatten(-2)[..., :key_count]
