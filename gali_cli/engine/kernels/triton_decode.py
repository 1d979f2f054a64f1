"""One decoded query's attention over the KV cache as a Triton kernel that rotates each key as it reads it.

The static decoding step (static_decode.py) places every cached key anew each token: a method's positions move as
the text grows (GALI's Alg. 2, SelfExtend's groups), so the un-rotated keys the cache holds are rotated by each
key's offset from the query. In PyTorch that is a pass that reads the keys and writes rotated copies, which the
attention then reads again: three passes over the keys where the unpatched model makes one (docs/dev/engine.md,
"Decoding on a GPU: one graph a token", has the step's times). Here each program loads tiles of raw
keys and their cos/sin rows, rotates them in registers and attends, so the keys are read once; GALI's noise is
computed in the kernel from the counter-based hash of noise.py (the very numbers of `standard_normal`), and keys past
the token's index are neither read nor masked: the index is read from a tensor, so a CUDA graph replays the same
launch for every token.

Flash-decoding: a fixed number of programs per (batch, key head), the heads sharing that key head as rows of each,
cut the keys up to the index into runs of whole tiles; the runs' partial softmaxes are merged by their log-sum-exps
in PyTorch (exact). Shapes: B batch, Hkv key/value heads, g query heads per key head, C the cache's rows, D head dim.

Importing this module needs triton; static_decode.py imports it only where the kernel is used. Tests run it on the CPU
through Triton's interpreter (TRITON_INTERPRET=1).
"""

import contextlib

import torch
import triton
import triton.language as tl

from ..math.partials import merge_runs
from .triton_attention import _GOLDEN, _LOG2E, _TURN, _UNIT, _mix32

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit(do_not_specialize=["table_rows", "kv_heads", "group", "heads"])
def _decode_splits(
    rows, key, value, cos, sin, table_row, mix, table_rows, index_at, sigma, streams, out, lse,
    stride_rb, stride_rh, stride_rg, stride_rd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_cn, stride_cd,
    stride_ob, stride_os, stride_og, stride_od,
    kv_heads, group, heads, scale,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE: tl.constexpr, GATHER: tl.constexpr, MIX: tl.constexpr, NOISE: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    splits = tl.num_programs(0)
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

    # The keys up to the token's index, cut into `splits` runs of whole tiles (even starts: noise pairs stay whole);
    # the runs past the last key are empty. Nothing after the index is read.
    count = tl.load(index_at) + 1
    per_split = tl.cdiv(tl.cdiv(count, splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, count)
    if NOISE:  # heads kv_head * g + r, numbered b * heads + h as noise.head_streams numbers them
        stream = tl.load(streams + batch * heads + kv_head * group + heads_here, mask=real, other=0).to(tl.uint32)
        row_hash = _mix32(stream ^ _mix32((count - 1).to(tl.uint32)))

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
            read = live
            if GATHER:  # key j's row of a table of offsets (masked to the table: a row outside it reads nothing)
                row = tl.load(table_row + cols, mask=live, other=0)
                read = live & (row >= 0) & (row < table_rows - MIX)
            else:  # row j: a table of the cache's rows
                row = cols
            table = row[:, None].to(tl.int64) * stride_cn + half[None, :] * stride_cd
            c = tl.load(cos + table, mask=read[:, None], other=0.0).to(tl.float32)
            s = tl.load(sin + table, mask=read[:, None], other=0.0).to(tl.float32)
            if MIX:  # GALI: (1 - w) R(p) + w R(p - 1), the next row
                w = tl.load(mix + cols, mask=live, other=0.0)[:, None]
                c += w * (tl.load(cos + table + stride_cn, mask=read[:, None], other=0.0).to(tl.float32) - c)
                s += w * (tl.load(sin + table + stride_cn, mask=read[:, None], other=0.0).to(tl.float32) - s)
            k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s
        logits = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        logits += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
        logits *= scale
        if NOISE:  # keys 2m and 2m + 1 share a hashed pair of uniforms: Box-Muller's cosine and sine branches
            pairs = _mix32((first // 2 + tl.arange(0, BLOCK_N // 2)).to(tl.uint32) ^ _GOLDEN)
            bits = _mix32(row_hash[:, None] ^ pairs[None, :])
            radius = tl.sqrt_rn(-2.0 * tl.log(((bits >> 8).to(tl.float32) + 0.5) * _UNIT))
            angle = (_mix32(bits ^ _GOLDEN) >> 8).to(tl.float32) * _TURN
            normal = tl.interleave(radius * tl.cos(angle), radius * tl.sin(angle))
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

    # An empty run read nothing: output 0 and log-sum-exp -inf, which weigh nothing in the merge.
    seen = running_sum > 0
    result = accumulator / tl.where(seen, running_sum, 1.0)[:, None]
    run_lse = tl.where(seen, (running_max + tl.log2(tl.where(seen, running_sum, 1.0))) * _LN2, float("-inf"))
    out_rows = pair * stride_ob + split * stride_os + heads_here * stride_og
    tl.store(out + out_rows[:, None] + dims[None, :] * stride_od, result, mask=real[:, None])
    tl.store(lse + (pair * splits + split) * group + heads_here, run_lse, mask=real)


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
    splits: int | None = None,
    table_rows: torch.Tensor | None = None,
    mix: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query's attention, its heads sharing a key head stacked as `rows` (B, Hkv, g, D), over the cache's keys
    and values (B, Hkv, C, D) up to the token index `index` (a one-element tensor), the rest never read. Keys and
    values may be stored in another dtype than the rows (a 16-bit cache of a float32 model: --kv-dtype): each tile is
    widened to float32 as it is loaded, and the rows' dtype alone sets the products' precision.

    Args:
        cos, sin: (C, D/2), or (C, D) with equal halves (the first D/2 columns are read), rotating each key as
            rope.rotate_fused does before it is attended (None: the keys are attended as they are).
        table_rows: (C,) int32: key j is rotated by row table_rows[j] of cos/sin, a table of any length (a row
            outside it reads zeros: the caller keeps them inside, as GALI's closed form does); `mix` (C,) float32:
            that row interpolated towards the next by mix[j] (GALI's offsets from a RoPE table per offset).
        sigma: GALI's noise strength per key, float32 (C,), added after scaling to the logit of key j with
            noise.standard_normal's draw for (stream, index, j); `streams`: the layer's noise.head_streams (B * H,).
        splits: programs per (batch, key head), each attending a run of the keys up to the index (flash-decoding;
            None: `decode_splits`).

    Returns:
        (B, Hkv, g, D) float32.
    """
    batch, kv_heads, group, dim = rows.shape
    if (cos is None) != (sin is None) or (sigma is None) != (streams is None):
        raise ValueError("cos and sin go together, and so do sigma and streams")
    if cos is not None and cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same layout")
    if (table_rows is None and mix is not None) or (table_rows is not None and cos is None) or any(
            x is not None and (x.shape != (keys.shape[2],) or x.stride(0) != 1) for x in (table_rows, mix)) or (
            table_rows is not None and table_rows.dtype != torch.int32) or (mix is not None and mix.dtype !=
                                                                             torch.float32):
        raise ValueError("table rows go with a table, a mix with table rows: int32 and float32, one per cache row")
    splits = splits or decode_splits(rows.device, batch * kv_heads, keys.shape[2])
    out = torch.empty(batch * kv_heads, splits, group, dim, dtype=torch.float32, device=rows.device)
    lse = torch.empty(batch * kv_heads, splits, group, dtype=torch.float32, device=rows.device)
    table = cos if cos is not None else keys  # unused pointers when not rotating / without noise
    noise = sigma is not None
    # Narrower tiles where registers run short: with the noise's arithmetic, float32 operands, or wide heads.
    tile = 32 if noise or rows.dtype == torch.float32 or dim > 128 else 64
    with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():
        _decode_splits[(splits, batch * kv_heads)](
            rows, keys, values, table, sin if sin is not None else keys,
            table_rows if table_rows is not None else index, mix if mix is not None else lse,
            table.shape[0] if cos is not None else 0, index,
            sigma if noise else lse, streams if noise else lse, out, lse,
            *rows.stride(), *keys.stride(), *values.stride(), *table.stride()[-2:], *out.stride(),
            kv_heads, group, group * kv_heads, scale,
            HEAD_DIM=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tile, ROTATE=cos is not None,
            GATHER=table_rows is not None, MIX=mix is not None, NOISE=noise,
            PRECISION="ieee" if rows.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2,
        )
    return merge_runs(out.view(batch, kv_heads, splits, group, dim), lse.view(batch, kv_heads, splits, group))


def decode_splits(device: torch.device, pairs: int, capacity: int) -> int:
    """Programs per (batch, key head): enough for two per multiprocessor, none with fewer than 256 of the cache's
    rows. Fixed for a cache (a CUDA graph replays one launch), so the partial results to merge stay few whatever
    the capacity (sized by the capacity they cost the merge milliseconds a token on an 8B model's 128k cache:
    docs/notes/2026-11-performance-history.md, "GPU: decoding as a CUDA graph (issue 26)")."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(triton.cdiv(capacity, 256), triton.cdiv(2 * processors, pairs)))


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel takes these heads: a power-of-two head dim of 32..256 in float16/bfloat16, up to 128 in
    float32 (whose 256-wide tiles want more shared memory than an H100 gives a block)."""
    widest = 128 if dtype == torch.float32 else 256
    return 32 <= head_dim <= widest and head_dim & (head_dim - 1) == 0 and dtype in (
        torch.float16, torch.bfloat16, torch.float32)
