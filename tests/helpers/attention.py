"""Random queries, keys and values, and a RoPE table, for the attention kernels' tests (head dim 16 unless given)."""

import torch

from gali_cli.engine.math.rope import RopeTable

HEAD_DIM = 16


def rope_table(rows: int, dtype: torch.dtype = torch.float32) -> RopeTable:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.arange(rows).float().unsqueeze(1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return RopeTable(angles.cos().to(dtype), angles.sin().to(dtype), angles.cos(), angles.sin())


def qkv(batch, heads, kv_heads, q_len, kv_len, dtype=torch.float32, seed=0, dim=HEAD_DIM, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim))
    return tuple(torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
