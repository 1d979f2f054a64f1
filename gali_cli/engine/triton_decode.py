"""One decoded query's attention over the KV cache as a Triton kernel that rotates each key as it reads it.

The static decoding step (static_decode.py) places every cached key anew each token: a method's positions move as
the text grows (GALI's Alg. 2, SelfExtend's groups), so the un-rotated keys the cache holds are rotated by each
key's offset from the query. In PyTorch that is a pass that reads the keys and writes rotated copies, which the
attention then reads again: three passes over the keys where the unpatched model makes one (measured on an H200
after 32k tokens: 18.2 ms a token for the methods against 11.8 unpatched). Here each program loads a block of raw
keys and their cos/sin rows, rotates them in registers and attends, so the keys are read once; GALI's noise is
computed in the kernel from the counter-based hash of noise.py (the very numbers of `standard_normal`), and keys past
the token's index are neither read nor masked: the index is read from a tensor, so a CUDA graph replays the same
launch for every token.

Flash-decoding: each program owns `block` keys of one (batch, key head) and the heads sharing that key head as rows;
the blocks' partial softmaxes are merged by their log-sum-exps in PyTorch (exact). Shapes: B batch, Hkv key/value
heads, g query heads per key head, C the cache's rows, D head dim.

Importing this module needs triton; static_decode.py imports it only where the kernel is used. Tests run it on the CPU
through Triton's interpreter (TRITON_INTERPRET=1).
"""

import contextlib

import torch
import triton
import triton.language as tl

from .triton_attention import _GOLDEN, _LOG2E, _TURN, _UNIT, _mix32

_LN2 = tl.constexpr(0.6931471805599453)
KEYS_PER_TILE = 64  # keys loaded at once inside a program's block


@triton.jit(do_not_specialize=["kv_heads", "group", "heads"])
def _decode_blocks(
    rows, key, value, cos, sin, index_at, sigma, streams, out, lse,
    stride_rb, stride_rh, stride_rg, stride_rd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cn, stride_cd,
    stride_ob, stride_oc, stride_og, stride_od,
    kv_heads, group, heads, scale,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, KEYS: tl.constexpr,
    ROTATE: tl.constexpr, NOISE: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    pair = tl.program_id(1)  # b * kv_heads + key head
    batch = (pair // kv_heads).to(tl.int64)  # 64-bit offsets: a long context's cache passes 2**31 elements
    kv_head = (pair % kv_heads).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2

    heads_here = tl.arange(0, BLOCK_G)
    real = heads_here < group  # rows past g are padding for tl.dot's 16-row minimum, never stored
    half = tl.arange(0, HALF)
    dims = tl.arange(0, HEAD_DIM)
    query_rows = rows + batch * stride_rb + kv_head * stride_rh + heads_here[:, None] * stride_rg
    q1 = tl.load(query_rows + half[None, :] * stride_rd, mask=real[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(query_rows + (half[None, :] + HALF) * stride_rd, mask=real[:, None], other=0.0).to(tl.float32)
    key_base = key + batch * stride_kb + kv_head * stride_kh
    value_base = value + batch * stride_vb + kv_head * stride_vh

    index = tl.load(index_at)  # the decoded token's index: keys after it are not read
    start = block * KEYS
    end = tl.minimum(start + KEYS, index + 1)
    if NOISE:  # heads kv_head * g + r, numbered b * heads + h as noise.head_streams numbers them
        stream = tl.load(streams + batch * heads + kv_head * group + heads_here, mask=real, other=0).to(tl.uint32)
        row_hash = _mix32(stream ^ _mix32(index.to(tl.uint32)))

    running_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_G,), tl.float32)
    accumulator = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    for first in range(start, end, BLOCK_N):
        cols = first + tl.arange(0, BLOCK_N)
        live = cols < end
        at = key_base + cols[:, None] * stride_kn
        k1 = tl.load(at + half[None, :] * stride_kd, mask=live[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(at + (half[None, :] + HALF) * stride_kd, mask=live[:, None], other=0.0).to(tl.float32)
        if ROTATE:  # rope.rotate_fused: [k1, k2] -> [k1 c - k2 s, k2 c + k1 s], the tables' halves being equal
            table = cols[:, None] * stride_cn + half[None, :] * stride_cd
            c = tl.load(cos + table, mask=live[:, None], other=0.0).to(tl.float32)
            s = tl.load(sin + table, mask=live[:, None], other=0.0).to(tl.float32)
            k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s
        logits = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        logits += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        logits *= scale
        if NOISE:  # keys 2m and 2m + 1 share a hashed pair of uniforms: Box-Muller's cosine and sine branches
            bits = _mix32(row_hash[:, None] ^ _mix32((cols // 2).to(tl.uint32) ^ _GOLDEN)[None, :])
            radius = tl.sqrt_rn(-2.0 * tl.log(((bits >> 8).to(tl.float32) + 0.5) * _UNIT))
            angle = (_mix32(bits ^ _GOLDEN) >> 8).to(tl.float32) * _TURN
            normal = tl.where((cols % 2 == 0)[None, :], radius * tl.cos(angle), radius * tl.sin(angle))
            logits += normal * tl.load(sigma + cols, mask=live, other=0.0)[None, :]
        logits = tl.where(live[None, :], logits * _LOG2E, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(logits, 1))
        probs = tl.exp2(logits - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        v = tl.load(value_base + cols[:, None] * stride_vn + dims[None, :] * stride_vd, mask=live[:, None],
                    other=0.0).to(tl.float32)
        accumulator = accumulator * rescale[:, None] + tl.dot(probs, v, input_precision=PRECISION)
        running_max = new_max

    # A block wholly past the index read nothing: output 0 and log-sum-exp -inf, which weigh nothing in the merge.
    seen = running_sum > 0
    result = accumulator / tl.where(seen, running_sum, 1.0)[:, None]
    block_lse = tl.where(seen, (running_max + tl.log2(tl.where(seen, running_sum, 1.0))) * _LN2, float("-inf"))
    out_rows = pair * stride_ob + block * stride_oc + heads_here * stride_og
    tl.store(out + out_rows[:, None] + dims[None, :] * stride_od, result, mask=real[:, None])
    tl.store(lse + (pair * tl.num_programs(0) + block) * group + heads_here, block_lse, mask=real)


def rotating_decode_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    sigma: torch.Tensor | None = None,
    streams: torch.Tensor | None = None,
    block: int = 256,
) -> torch.Tensor:
    """One query's attention, its heads sharing a key head stacked as `rows` (B, Hkv, g, D), over the cache's keys
    and values (B, Hkv, C, D) up to the token index `index` (a one-element tensor), the rest never read.

    Args:
        cos, sin: (C, D) tables whose halves are equal, rotating each key as rope.rotate_fused does before it is
            attended (None: the keys are attended as they are).
        sigma: GALI's noise strength per key, float32 (C,), added after scaling to the logit of key j with
            noise.standard_normal's draw for (stream, index, j); `streams`: the layer's noise.head_streams (B * H,).
        block: keys per program (flash-decoding); a multiple of the kernel's 64-key tile.

    Returns:
        (B, Hkv, g, D) float32.
    """
    batch, kv_heads, group, dim = rows.shape
    count = keys.shape[2]
    if (cos is None) != (sin is None) or (sigma is None) != (streams is None) or block % KEYS_PER_TILE:
        raise ValueError("cos and sin, sigma and streams go together; block must be a multiple of 64")
    if cos is not None and cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same layout")
    blocks = triton.cdiv(count, block)
    out = torch.empty(batch * kv_heads, blocks, group, dim, dtype=torch.float32, device=rows.device)
    lse = torch.empty(batch * kv_heads, blocks, group, dtype=torch.float32, device=rows.device)
    table = cos if cos is not None else keys  # unused pointers when not rotating / without noise
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"
    with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():
        _decode_blocks[(blocks, batch * kv_heads)](
            rows, keys, values, table, sin if sin is not None else keys, index,
            sigma if sigma is not None else lse, streams if streams is not None else lse, out, lse,
            *rows.stride(), *keys.stride(), *values.stride(), *table.stride()[-2:], *out.stride(),
            kv_heads, group, group * kv_heads, scale,
            HEAD_DIM=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=KEYS_PER_TILE, KEYS=block,
            ROTATE=cos is not None, NOISE=sigma is not None, PRECISION=precision, num_warps=4, num_stages=2,
        )
    lse = lse.view(batch, kv_heads, blocks, group)
    total = torch.logsumexp(lse, dim=2, keepdim=True)  # block 0 holds key 0, seen by every token: finite
    share = torch.exp(lse - total).unsqueeze(-1)
    return (out.view(batch, kv_heads, blocks, group, dim) * share).sum(2)


def supports(rows: torch.Tensor) -> bool:
    """Whether the kernel takes these heads: a power-of-two head dim of 32..256, float16/bfloat16/float32."""
    dim = rows.shape[-1]
    return 32 <= dim <= 256 and dim & (dim - 1) == 0 and rows.dtype in (torch.float16, torch.bfloat16, torch.float32)
