"""The eager oracle of the engine's prefill attention: Alg. 3 as written, on the engine's own tables and positions.

Unlike reference_model.py, it shares the engine's inputs (RoPE tables, Alg. 2 positions, the noise and mask helpers) and
checks only the attention formulation: two rotated copies of the keys, two full logit matrices, interpolated. Tests
and `gali info --check` (self_check.py) hold `gali_attention` to it; benchmarks/bench_speed.py runs it as the anchor
(the authors' formulation).
"""

import torch

from ..attention.dense import mask_future
from ..attention.noisy_attention import add_noise
from ..math.noise import Noise
from ..math.positions import Interpolation
from ..math.rope import RopeTable, rotate


def reference_gali_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: RopeTable,
    interp: Interpolation,
    scale: float,
    noise: Noise | None = None,
) -> torch.Tensor:
    """Alg. 3 as written: two rotated copies of the keys, two logit matrices, interpolated. Float32, eager.

    The oracle for `gali_attention` in tests, and the straightforward formulation of the authors' code; it holds a
    chunk's full (B, H, q, T) logits twice, so keep chunks small.
    """
    _, heads, q_len, _ = query.shape
    heads_per_kv = heads // key.shape[1]
    cos, sin = table.cos32, table.sin32
    query_ceil = rotate(query.float(), cos[interp.ceil[-q_len:]], sin[interp.ceil[-q_len:]])
    key_ceil = rotate(key.float(), cos[interp.ceil], sin[interp.ceil]).repeat_interleave(heads_per_kv, dim=1)
    key_floor = rotate(key.float(), cos[interp.floor], sin[interp.floor]).repeat_interleave(heads_per_kv, dim=1)
    logits_ceil_key = torch.matmul(query_ceil, key_ceil.transpose(-1, -2)) * scale  # interval floor(r)
    logits_floor_key = torch.matmul(query_ceil, key_floor.transpose(-1, -2)) * scale  # interval ceil(r)
    c = interp.weight.float()
    logits = logits_ceil_key - (logits_ceil_key - logits_floor_key) * c
    query_index = torch.arange(key.shape[2] - q_len, key.shape[2], device=key.device)
    if noise is not None:
        add_noise(logits, query_index, interp.group, interp.grouped, noise)
    mask_future(logits, query_index)
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, value.float().repeat_interleave(heads_per_kv, dim=1)).to(value.dtype)
