"""Noisy GALI attention as one fused Triton kernel: flash-style online softmax with the noise made in the kernel.

The PyTorch path (noisy_attention.tiled_noisy_attention) has to materialise float32 logits, a tile of queries at a
time, to add the noise. Here every program owns a block of queries of one (batch, head), walks the keys a block at a
time, and computes the Gaussian noise of each (query, key) logit from the same counter-based hash as noise.py: the
logits exist only in registers, memory stays that of flash attention, and the noise is the very same numbers as
the reference path's (tests compare both under TRITON_INTERPRET=1, which runs this file on the CPU).

Importing this module needs triton; noisy_attention.py imports it only when the kernel is used.
"""

import contextlib
import math

import torch
import triton
import triton.language as tl

from ..math.noise import GOLDEN, MULTIPLIER_A, MULTIPLIER_B, Noise, head_streams

_GOLDEN = tl.constexpr(GOLDEN)
_MULTIPLIER_A = tl.constexpr(MULTIPLIER_A)
_MULTIPLIER_B = tl.constexpr(MULTIPLIER_B)
_UNIT = tl.constexpr(2.0**-24)  # 24-bit integers to [0, 1)
_TURN = tl.constexpr(2.0 * math.pi * 2.0**-24)  # 24-bit integers to angles in [0, 2 pi)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _mix32(x):
    """noise.mix32 on uint32 values: the products wrap modulo 2**32, as the reference masks them."""
    x = x ^ (x >> 16)
    x = x * _MULTIPLIER_A
    x = x ^ (x >> 15)
    x = x * _MULTIPLIER_B
    return x ^ (x >> 16)


# The per-chunk integers stay runtime values: specialising on them (== 1, multiples of 16) would compile new variants
# as a long prefill walks through its chunks.
@triton.jit(do_not_specialize=["queries", "first", "group", "grouped"])
def _noisy_gali_forward(
    query, key, value, out, streams,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    heads, heads_per_kv, queries, first, group, grouped, scale, sigma_per_index,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    stream_index = tl.program_id(1)  # b * heads + h, as noise.head_streams numbers them
    batch = (stream_index // heads).to(tl.int64)  # 64-bit offsets: a long context's cache passes 2**31 elements
    head = (stream_index % heads).to(tl.int64)
    kv_head = head // heads_per_kv

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    query_index = first + rows  # token indices; rows past `queries` are padding, never stored
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(query + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qm + dims[None, :] * stride_qd,
                mask=rows[:, None] < queries, other=0.0)
    key_base = key + batch * stride_kb + kv_head * stride_kh
    value_base = value + batch * stride_vb + kv_head * stride_vh

    stream = tl.load(streams + stream_index).to(tl.uint32)
    row_hash = _mix32(stream ^ _mix32(query_index.to(tl.uint32)))  # (BLOCK_M,)

    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    accumulator = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # Causal: this block's last query sees keys up to its own index; key 0 is seen by every query, so the first
    # key block always gives each row a finite maximum.
    end = tl.minimum(first + (block + 1) * BLOCK_M, first + queries)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(key_base + cols[None, :] * stride_kn + dims[:, None] * stride_kd, mask=cols[None, :] < end,
                    other=0.0)
        logits = tl.dot(q, k, input_precision=PRECISION) * scale
        if start < grouped:
            # Keys 2m and 2m + 1 share a hashed pair of uniforms: Box-Muller's cosine and sine branches.
            pairs = _mix32((start // 2 + tl.arange(0, BLOCK_N // 2)).to(tl.uint32) ^ _GOLDEN)
            bits = _mix32(row_hash[:, None] ^ pairs[None, :])
            radius = tl.sqrt_rn(-2.0 * tl.log(((bits >> 8).to(tl.float32) + 0.5) * _UNIT))
            angle = (_mix32(bits ^ _GOLDEN) >> 8).to(tl.float32) * _TURN
            normal = tl.interleave(radius * tl.cos(angle), radius * tl.sin(angle))
            sigma = (query_index[:, None] - cols[None, :]).to(tl.float32) * sigma_per_index
            noisy = (cols[None, :] < grouped) & (cols[None, :] % group != 0)  # exactly where c != 0
            logits += tl.where(noisy, normal * sigma, 0.0)
        visible = (cols[None, :] <= query_index[:, None]) & (cols[None, :] < end)
        logits = tl.where(visible, logits * _LOG2E, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(logits, 1))
        probs = tl.exp2(logits - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        v = tl.load(value_base + cols[:, None] * stride_vn + dims[None, :] * stride_vd, mask=cols[:, None] < end,
                    other=0.0)
        accumulator = accumulator * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    result = accumulator / running_sum[:, None]
    tl.store(out + batch * stride_ob + head * stride_oh + rows[:, None] * stride_om + dims[None, :] * stride_od,
             result.to(out.dtype.element_ty), mask=rows[:, None] < queries)


def noisy_gali_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal GALI attention with logit noise, the q queries being the last q of the T keys.

    Args:
        query: (B, H, q, D) queries rotated at ceil(p).
        key: (B, Hkv, T, D) keys with the interpolated rotation (K_mix); value: (B, Hkv, T, D).
        group, grouped: g of Alg. 2 and the number of grouped keys (noise goes where c != 0).
        block_m, block_n: tile sizes (defaults suit the GPU; tests pass small ones to cover partial tiles).

    Returns:
        (B, H, q, D) in the value's dtype; the noise is noise.standard_normal's, sigma = (i - j) / T * scale.
    """
    batch, heads, queries, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    capability = torch.cuda.get_device_capability(query.device) if query.is_cuda else (9, 0)
    default_m, default_n, warps = tiles(dim, query.dtype, capability)
    block_m, block_n = block_m or default_m, block_n or default_n
    out = torch.empty(query.shape, dtype=value.dtype, device=value.device)
    streams = head_streams(noise, batch, heads, query.device)
    grid = (triton.cdiv(queries, block_m), batch * heads)
    # Triton launches on the current device and stream: make them the tensors' (models split over GPUs).
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _noisy_gali_forward[grid](
            query, key, value, out, streams,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            heads, heads // kv_heads, queries, kv_len - queries, group, grouped, scale, noise.scale / kv_len,
            HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=2,
        )
    return out


def tiles(dim: int, dtype: torch.dtype, capability: tuple[int, int]) -> tuple[int, int, int]:
    """(queries per program, keys per step, warps) for a head dim, dtype and CUDA compute capability.

    Large tiles where shared memory allows them; smaller for float32, head dims over 128 and pre-Ampere GPUs,
    whose tiles would not fit (tests compile every case for each GPU generation and check its shared memory).
    """
    small = dtype == torch.float32 or capability < (8, 0)
    if small and dim > 128:
        return 32, 16, 4
    if small or dim > 128:
        return 64, 32, 4
    return 128, 64, 8


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes: a power-of-two head dim of 16..256 (tl.dot's tiles)."""
    dim = query.shape[-1]
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    return 16 <= dim <= 256 and dim & (dim - 1) == 0 and query.dtype in dtypes and key.dtype == query.dtype
