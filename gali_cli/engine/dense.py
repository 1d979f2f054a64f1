"""Causal attention shared by every method: the routes of a chunk's causal attention, and explicit logits a tile of
queries at a time for methods that must build their logits.

Shapes: B batch, H query heads, Hkv key/value heads (GQA when Hkv < H), q queries, T keys, D head dim. A chunk's
q queries are the last q of its T keys (lower-right causal).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Explicit logits held at once (a tile of queries): 1M float32, 4 MiB; noise or extra position sets take a few
# times that.
_LOGITS_TILE_ELEMENTS = 1 << 20

# (query, key, value, scale, dropout) -> (B, H, q, D): causal attention of q < T queries, the last q of the T keys.
CausalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor]

# torch's CPU flash attention, which also returns the log-sum-exp of each query's logits (an aten op, not public API:
# without it, the CPU takes the masked route).
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an op on these tensors: forward-only routes must then step aside."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def causal_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float = 0.0) -> CausalAttention:
    """The route `causal_attention` takes when a chunk has fewer queries than keys, for tensors like these.

    Device, dtype and dropout are fixed for a forward, so a forward decides this once (from its first layer's
    tensors) and every chunk of every layer takes the route: on CUDA the lower-right causal bias; on the CPU in
    float32 the mask-free split (which still steps aside for a layer that needs gradients); elsewhere a bool mask.
    """
    if query.device.type == "cuda":
        return lower_right_causal_attention
    cpu_float32 = query.device.type == "cpu" and query.dtype == torch.float32  # bfloat16: the mask is faster
    # Forward only: autograd takes the log-sum-exp of that op as a constant, which would drop gradients.
    if cpu_float32 and dropout == 0.0 and not needs_grad(query, key, value) and _CPU_FLASH_WITH_LSE is not None:
        return split_causal_attention
    return masked_causal_attention


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    dropout: float = 0.0,
    route: CausalAttention | None = None,
) -> torch.Tensor:
    """scaled_dot_product_attention where the q queries are the last q of the T keys (lower-right causal).

    `route`: from `causal_route`, decided once per forward; chosen here when not given.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:  # no mask needed: decoding, or a square causal block
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=q_len > 1, scale=scale,
                                              enable_gqa=query.shape[1] != key.shape[1])
    route = route or causal_route(query, key, value, dropout)
    return route(query, key, value, scale, dropout)


def masked_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """The general route of `causal_attention`: a (q, T) bool mask, which the flash kernel takes with GQA without
    ever forming the logits."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])


def split_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """The CPU float32 route of `causal_attention`, without a mask: the keys every query sees in full (all but the
    last q), then the causal square of the last q, merged by their log-sum-exps. A (q, T) mask would be built,
    converted and added to every logit, about a fifth of the attention's time in GALI's chunks.

    Forward only: under autograd or dropout it takes the masked route.
    """
    if dropout != 0.0 or needs_grad(query, key, value):
        return masked_causal_attention(query, key, value, scale, dropout)
    batch, heads, q_len, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2] - q_len
    per_kv = heads // kv_heads
    # Query heads sharing a key head, stacked as rows: no query row needs a mask against the past keys.
    stacked = query.reshape(batch, kv_heads, per_kv * q_len, dim)
    past_out, past_lse = _CPU_FLASH_WITH_LSE(stacked, key[:, :, :past], value[:, :, :past], 0.0, False, scale=scale)
    own_key, own_value = key[:, :, past:], value[:, :, past:]
    if per_kv > 1:
        own_key, own_value = own_key.repeat_interleave(per_kv, dim=1), own_value.repeat_interleave(per_kv, dim=1)
    own_out, own_lse = _CPU_FLASH_WITH_LSE(query, own_key, own_value, 0.0, True, scale=scale)
    # softmax over both parts = their outputs weighted by exp(lse) / (exp(lse_past) + exp(lse_own))
    own_share = torch.sigmoid(own_lse.reshape(batch, heads, q_len, 1) - past_lse.reshape(batch, heads, q_len, 1))
    return torch.lerp(past_out.reshape(batch, heads, q_len, dim), own_out, own_share)


def lower_right_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """The CUDA route of `causal_attention`: torch's lower-right CausalBias, which the memory-efficient kernel runs
    without a mask. That kernel has no GQA, so grouped key/value heads are repeated first."""
    if query.shape[1] != key.shape[1]:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    bias = causal_lower_right(query.shape[2], key.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scale)


def grouped_logits(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 logits (B, H, n, T) of rotated queries (B, H, n, D) against rotated keys (B, Hkv, T, D).

    The query heads that share a key head are stacked into the rows of one matrix product, so keys are never
    repeated per head.
    """
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    stacked = query.float().reshape(batch, kv_heads, heads // kv_heads * rows, dim)
    return (torch.matmul(stacked, key.float().transpose(-1, -2)) * scale).view(batch, heads, rows, -1)


def tiled_attention(
    logits: Callable[[slice], torch.Tensor], value: torch.Tensor, heads: int, queries: int, dropout: float = 0.0
) -> torch.Tensor:
    """softmax(logits) @ value, a tile of query rows at a time, so that explicit logits never exceed a tile.

    Args:
        logits: gives the masked float32 logits (B, H, n, T) of the query rows in a slice.
        value: (B, Hkv, T, D).

    Returns:
        (B, H, queries, D) in the value's dtype.
    """
    batch, kv_heads, kv_len, dim = value.shape
    value32 = value.float()
    output = value.new_empty(batch, heads, queries, dim)
    tile = max(1, _LOGITS_TILE_ELEMENTS // (batch * heads * kv_len))
    for start in range(0, queries, tile):
        rows = slice(start, min(start + tile, queries))
        probs = F.dropout(torch.softmax(logits(rows), dim=-1), p=dropout)
        probs = probs.view(batch, kv_heads, -1, kv_len)  # heads sharing a key head, stacked as rows
        output[:, :, rows] = torch.matmul(probs, value32).view(batch, heads, -1, dim).to(value.dtype)
    return output


def mask_future(logits: torch.Tensor, query_index: torch.Tensor) -> None:
    """Causal mask in place on logits (B, H, n, T): query i sees keys j <= i."""
    future = torch.arange(logits.shape[-1], device=logits.device) > query_index.unsqueeze(-1)  # (n, T)
    logits.masked_fill_(future, float("-inf"))
