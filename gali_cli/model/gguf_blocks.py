"""A GGUF tensor's quantized blocks read as grids: per sub-block of 16 or 32 weights a step and a base, and per
weight an integer code, so that weight = base + step * code exactly as the gguf package dequantizes it.

Every quant type that llama.cpp's common files use (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K to Q6_K)
stores each sub-block as an affine grid: a float16 scale (times a small integer sub-scale for the K-quants), an
offset, and codes of 2 to 8 bits. Held that way a weight takes a byte and its sub-block two float32s (1.25 bytes a
weight for sub-blocks of 32, 1.5 for 16), a small multiple of the file's 0.56-1.06 bytes, instead of float32's 4.
The grids are exact: step * code is a product of a float16 scale, a sub-scale of at most 8 bits and a code of at
most 8 bits, which float32 holds without rounding, so base + step * code rounds once, as the gguf package's own
`d * q + m` does (tests/app/test_gguf_weights.py holds every type to it bit for bit).

The readers mirror the layouts of the gguf package's `dequantize_blocks` (gguf/quants.py), vectorised over the
blocks with numpy; the IQ types (codebooks, not grids), TQ and MXFP4 are not read here (`GRID_TYPES`). The names
of a layer's tensors and the projections stacked in one grid are declared here once (`LAYER_TENSORS`, `GROUPS`), for
the loader (gguf_weights.py) and for `resident_bytes`, which counts the stacking without importing torch.
Shapes: R rows, C columns (weights a row), S sub-blocks a row.
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

QK_K = 256  # weights per K-quant super-block
# The ggml type numbers (gguf.GGMLQuantizationType) read as grids, with their blocks' weights and bytes and the
# weights of the sub-blocks that share a step and a base.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
F32, F16, BF16 = 0, 1, 30
GRID_TYPES = {  # type: (name, weights a block, bytes a block, weights a sub-block)
    Q4_0: ("Q4_0", 32, 18, 32), Q4_1: ("Q4_1", 32, 20, 32), Q5_0: ("Q5_0", 32, 22, 32),
    Q5_1: ("Q5_1", 32, 24, 32), Q8_0: ("Q8_0", 32, 34, 32), Q2_K: ("Q2_K", QK_K, 84, 16),
    Q3_K: ("Q3_K", QK_K, 110, 16), Q4_K: ("Q4_K", QK_K, 144, 32), Q5_K: ("Q5_K", QK_K, 176, 32),
    Q6_K: ("Q6_K", QK_K, 210, 16),
}
FLOAT_TYPES = {F32: ("F32", np.float32), F16: ("F16", np.float16), BF16: ("BF16", np.int16)}
# transformers' module names inside a decoder layer -> llama.cpp's tensor names inside a block.
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Gemma 3 has four norms a layer: llama.cpp's ffn_norm is its pre-feedforward norm.
GEMMA3_LAYER_TENSORS = {**LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
                        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# The projections one product serves in decoding, stacked in one grid (gguf_weights.py), by owner and members.
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
# The same groups by llama.cpp's names (a block's tensor -> its group's owner), for `resident_bytes`.
_STACKED = {LAYER_TENSORS[f"{owner}.{member}"]: owner for owner, members in GROUPS for member in members}
# Weights converted at once: bounds the numpy temporaries (a few times this many bytes).
_CHUNK_WEIGHTS = 1 << 22


@dataclass(frozen=True)
class GridArrays:
    """A matrix (R, C) as codes (R, C) uint8 and per sub-block of `block` weights a step and a base (R, C / block)
    float32: weight[r, c] = base[r, c // block] + step[r, c // block] * codes[r, c]."""

    codes: np.ndarray
    step: np.ndarray
    base: np.ndarray
    block: int


def type_name(ggml_type: int) -> str:
    """The type's name as llama.cpp spells it (Q4_K, IQ4_NL, ...), or its number where the gguf package has none."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def resident_bytes(tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> int:
    """Bytes a GGUF's tensors take in memory as gali holds them on the CPU (gguf_weights.py), from (name, shape,
    type) alone: a grid type's weights a byte each and two float32s per sub-block, a float type's as stored; q, k
    and v, and gate and up, of one layer stacked at the finest sub-block among them."""
    groups: dict[str, list[tuple[int, int]]] = {}  # group -> (weights, block) of its members
    total = 0
    for name, shape, ggml_type in tensors:
        weights = math.prod(shape)
        if ggml_type not in GRID_TYPES:
            total += weights * (4 if ggml_type == F32 else 2)
            continue
        parts = name.split(".")
        stacked = len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _STACKED
        key = f"{parts[1]}.{_STACKED[parts[2]]}" if stacked else name
        groups.setdefault(key, []).append((weights, GRID_TYPES[ggml_type][3]))
    for members in groups.values():
        block = min(block for _, block in members)
        total += sum(weights + weights // block * 8 for weights, _ in members)
    return total


def row_bytes(ggml_type: int, columns: int) -> int:
    """Bytes one row of `columns` weights takes in the file."""
    if ggml_type in FLOAT_TYPES:
        return columns * (4 if ggml_type == F32 else 2)
    _, weights, size, _ = GRID_TYPES[ggml_type]
    return columns // weights * size


def read_grid(raw: np.ndarray | Callable[[int, int], np.ndarray], ggml_type: int, columns: int,
              rows: int | None = None) -> GridArrays:
    """The rows of a tensor of type `ggml_type` (a key of GRID_TYPES) as grids: `raw` is its bytes (R, row_bytes)
    uint8, or a function giving rows [start, stop) of them (R = `rows`), so that a large tensor is never held whole
    in its file's form beside its grids."""
    _, _, size, block = GRID_TYPES[ggml_type]
    rows = raw.shape[0] if rows is None else rows
    rows_of = raw if callable(raw) else lambda start, stop: raw[start:stop]
    codes = np.empty((rows, columns), dtype=np.uint8)
    step = np.empty((rows, columns // block), dtype=np.float32)
    base = np.empty_like(step)
    per_chunk = max(1, _CHUNK_WEIGHTS // columns)
    for start in range(0, rows, per_chunk):
        stop = min(rows, start + per_chunk)
        blocks = rows_of(start, stop).reshape(-1, size)
        chunk_codes, chunk_step, chunk_base = _READERS[ggml_type](blocks)
        codes[start:stop] = chunk_codes.reshape(stop - start, columns)
        step[start:stop] = chunk_step.reshape(stop - start, -1)
        base[start:stop] = chunk_base.reshape(stop - start, -1)
    return GridArrays(codes, step, base, block)


def read_float(raw: np.ndarray, ggml_type: int, columns: int) -> np.ndarray:
    """The rows `raw` (R, row_bytes) uint8 of an F32, F16 or BF16 tensor (R, C) in their own 32 or 16 bits: a BF16
    tensor's as int16 (numpy has no bfloat16; torch views them as one, `.view(torch.bfloat16)`)."""
    kind = FLOAT_TYPES[ggml_type][1]
    return np.ascontiguousarray(raw).view(kind).reshape(raw.shape[0], columns)


def _half(column: np.ndarray) -> np.ndarray:
    """Two bytes a block (n, 2) as float32 (n, 1)."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, group: int) -> np.ndarray:
    """Bytes (n, k * group) as their low nibbles then high nibbles per group of `group` bytes: (n, k * 2 * group)."""
    n = packed.shape[0]
    split = packed.reshape(n, -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: np.ndarray, count: int, group: int, width: int = 1) -> np.ndarray:
    """Bytes (n, k * group) as `count` fields of `width` bits each, lowest first, per group: (n, k * count * group)."""
    n = packed.shape[0]
    shifts = np.arange(0, count * width, width, dtype=np.uint8).reshape(1, 1, count, 1)
    return ((packed.reshape(n, -1, 1, group) >> shifts) & np.uint8((1 << width) - 1)).reshape(n, -1)


def _q4_0(blocks: np.ndarray):
    d = _half(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, -8 * d


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[:, 4:], 16), _half(blocks[:, :2]), _half(blocks[:, 2:4])


def _five_bits(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Q5's codes: the low nibbles (n, 32) and, from the block's 32-bit word `high` (n, 4), bit j for weight j."""
    bits = (np.ascontiguousarray(high).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return low | (bits.astype(np.uint8) << np.uint8(4))


def _q5_0(blocks: np.ndarray):
    d = _half(blocks[:, :2])
    return _five_bits(_nibbles(blocks[:, 6:], 16), blocks[:, 2:6]), d, -16 * d


def _q5_1(blocks: np.ndarray):
    codes = _five_bits(_nibbles(blocks[:, 8:], 16), blocks[:, 4:8])
    return codes, _half(blocks[:, :2]), _half(blocks[:, 2:4])


def _q8_0(blocks: np.ndarray):
    d = _half(blocks[:, :2])
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d


def _q2_k(blocks: np.ndarray):
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
    step = d * (scales & np.uint8(0x0F)).astype(np.float32)
    return _bits(qs, 4, 32, 2), step, -(dmin * (scales >> 4).astype(np.float32))


def _q3_k(blocks: np.ndarray):
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _half(blocks[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    scales = ((low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    step = d * scales.astype(np.float32)
    # weight = step * (low 2 bits - 4 where the mask bit is 0): codes low + 4 * mask bit, 0..7, base -4 * step
    codes = _bits(qs, 4, 32, 2) + (_bits(hmask, 8, 32) << np.uint8(2))
    return codes, step, -4 * step


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 6-bit sub-scales and sub-minima (n, 8) each, from their 12 packed bytes at 4..16."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minima = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), minima.astype(np.float32)


def _q4_k(blocks: np.ndarray):
    scales, minima = _k_scales(blocks)
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    return _nibbles(blocks[:, 16:], 32), d * scales, -(dmin * minima)


def _q5_k(blocks: np.ndarray):
    scales, minima = _k_scales(blocks)
    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])
    codes = _nibbles(blocks[:, 48:], 32) | (_bits(blocks[:, 16:48], 8, 32) << np.uint8(4))
    return codes, d * scales, -(dmin * minima)


def _q6_k(blocks: np.ndarray):
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _half(blocks[:, 208:210])
    step = d * scales.view(np.int8).astype(np.float32)
    codes = _nibbles(ql, 64) | (_bits(qh, 4, 32, 2) << np.uint8(4))  # 0..63, the weight being step * (code - 32)
    return codes, step, -32 * step


_READERS = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k,
            Q5_K: _q5_k, Q6_K: _q6_k}
