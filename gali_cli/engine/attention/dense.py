"""Causal attention shared by every method: the routes of a chunk's causal attention, and explicit logits a tile of
queries at a time for methods that must build their logits.

Shapes: B batch, H query heads, Hkv key/value heads (GQA when Hkv < H), q queries, T keys, D head dim. A chunk's
q queries are the last q of its T keys (lower-right causal).
"""

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ...errors import GaliWarning
from ..math.partials import Partial, merge_partials
from .plan import AttentionPlan

# Explicit logits held at once (a tile of queries): on the CPU 1M float32, 4 MiB (cache-sized); on a GPU 32M, 128 MiB,
# since there each tile costs a few kernel launches whatever its size (at 4 MiB, 32 heads x 8k keys made tiles of
# 4 queries, and an 8k-token prefill of a Llama-3-8B took many times the unpatched model's on a GPU:
# docs/notes/2026-11-performance-history.md, "GPU (first measured 2026-11-26, one NVIDIA H200)"). Noise or extra
# position sets take a few times that.
_LOGITS_TILE_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 25}


def logits_tile_rows(device: torch.device, batch: int, heads: int, keys: int) -> int:
    """Query rows per tile of explicit float32 logits (B, H, rows, keys) on this device."""
    elements = _LOGITS_TILE_ELEMENTS.get(device.type, _LOGITS_TILE_ELEMENTS["cuda"])
    return max(1, elements // (batch * heads * keys))

# (query, key, value, scale, dropout) -> (B, H, q, D): causal attention of q < T queries, the last q of the T keys.
CausalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], torch.Tensor]


# (query, key, value, scale, causal=False, mask=None, dropout=0.0) -> Partial; see `flash_partial`.
PartialAttention = Callable[..., Partial]

# torch's CPU flash attention, which also returns the log-sum-exp of each query's logits (an aten op, not public API:
# without it, the CPU takes the masked route).
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# On CUDA, torch's memory-efficient attention, which returns the log-sum-exp when asked (an aten op, as the CPU one:
# without it, or where it fails its first-use check, parts take explicit logits). Any float dtype, head dims up to 256.
_CUDA_EFFICIENT_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def cpu_flash_available() -> bool:
    """Whether this torch has the CPU flash kernel with log-sum-exp (plan.py asks, once per forward)."""
    return _CPU_FLASH_WITH_LSE is not None


def cuda_partial_applies(query: torch.Tensor) -> bool:
    """Whether `cuda_partial` takes queries like these: head dims the kernel has (multiples of 8 up to 256)."""
    dim = query.shape[-1]
    return _CUDA_EFFICIENT_WITH_LSE is not None and dim % 8 == 0 and dim <= 256


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    dropout: float,
    plan: AttentionPlan,
) -> torch.Tensor:
    """scaled_dot_product_attention where the q queries are the last q of the T keys (lower-right causal), by the
    route the forward's `plan` names (`choice.plan_for`)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:  # no mask needed: decoding, or a square causal block
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=q_len > 1, scale=scale,
                                              enable_gqa=query.shape[1] != key.shape[1])
    return CAUSAL[plan.causal](query, key, value, scale, dropout)


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
    """The CPU route of `causal_attention`, without a mask: `causal_partial` by torch's flash kernel (the keys every
    query sees in full, then the causal square of the last q, merged by their log-sum-exps). A (q, T) mask would be
    built, converted and added to every logit, about a fifth of the attention's time in GALI's chunks.

    Forward only, float32: the plan sends autograd, dropout and other dtypes elsewhere.
    """
    return causal_partial(query, key, value, scale, flash_partial).output


def flash_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> Partial:
    """Attention of queries (B, H, q, D) over keys/values (B, Hkv, n, D) with its log-sum-exp, by torch's CPU flash
    kernel: every key visible (the default), top-left causal (`causal`: row r sees keys 0..r, the causal square when
    q == n), or as a bool `mask` (q, n) or (B, 1, q, n) says (True: visible). Every query must see at least one key
    (the kernel gives an empty row lse 0).

    Forward only, no dropout: the plan sends those to `explicit_partial`.
    """
    stacked, key, value = _stacked(query, key, value, causal)
    additive = None
    if mask is not None:
        # Query heads sharing a key head are stacked as rows: the mask repeats for each of them.
        mask = mask.reshape((1, 1, *mask.shape[-2:])) if mask.dim() == 2 else mask
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        additive = additive.repeat(1, 1, query.shape[1] // key.shape[1], 1)
    output, lse = _CPU_FLASH_WITH_LSE(stacked, key, value, 0.0, causal, attn_mask=additive, scale=scale)
    return Partial(output.reshape(query.shape), lse.reshape(query.shape[:3]))


def _stacked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value as the fused kernels take them with GQA: the query heads that share a key head stacked
    as the rows of one head (B, Hkv, H/Hkv * q, D), so no key is copied; for a `causal` call, whose flag needs one
    key head per query head, the keys and values repeated per query head instead."""
    batch, heads, _, dim = query.shape
    if causal and heads != key.shape[1]:
        per_kv = heads // key.shape[1]
        key, value = key.repeat_interleave(per_kv, dim=1), value.repeat_interleave(per_kv, dim=1)
    return query.reshape(batch, key.shape[1], -1, dim), key, value


def cuda_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    compute_dtype: torch.dtype | None = None,
) -> Partial:
    """`flash_partial` on a GPU, by torch's memory-efficient CUDA kernel: no (queries x keys) tensor at any length.
    With `compute_dtype`, the inputs are rounded to it first and the output comes back in float32 (see
    `partial_attention`). A `mask` (rare: LaMPE's last rows) goes to `explicit_partial`, whose tiles are as good there.

    Forward only, no dropout: the plan sends those to `explicit_partial`.
    """
    if mask is not None:
        return explicit_partial(query, key, value, scale, causal, mask, dropout)
    if compute_dtype is not None:
        part = cuda_partial(query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype), scale, causal)
        return Partial(part.output.float(), part.lse)
    stacked, key, value = _stacked(query, key, value, causal)
    output, lse, _, _ = _CUDA_EFFICIENT_WITH_LSE(stacked, key, value, None, True, 0.0, causal, scale=scale)
    lse = lse[..., : stacked.shape[2]]  # the kernel pads its log-sum-exp rows to a multiple of 32
    return Partial(output.reshape(query.shape), lse.reshape(query.shape[:3]))


def biased_partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                   scale: float) -> Partial:
    """Attention of queries (B, H, q, D) over keys/values (B, H, n, D), head for head (no GQA), under an additive
    float `bias` (B, H, q, n) in the queries' dtype, with its log-sum-exp: torch's flash kernel on the CPU, its
    memory-efficient kernel on CUDA (which wants the bias's rows 16-aligned: padded here). Keys and values may be
    any strided views with contiguous rows. Every query must see a key at a finite bias."""
    if query.device.type == "cuda":
        width = -(-bias.shape[-1] // 16) * 16
        padded = bias.new_empty(*bias.shape[:-1], width)[..., : bias.shape[-1]]
        padded.copy_(bias)
        output, lse, _, _ = _CUDA_EFFICIENT_WITH_LSE(query, key, value, padded, True, 0.0, False, scale=scale)
        return Partial(output, lse[..., : query.shape[2]])
    output, lse = _CPU_FLASH_WITH_LSE(query, key, value, 0.0, False, attn_mask=bias, scale=scale)
    return Partial(output, lse)


@functools.cache
def cuda_partial_verified(device: torch.device, dtype: torch.dtype) -> bool:
    """Run `cuda_partial` once on small problems (keys seen in full, grouped heads; a causal square) and compare it,
    log-sum-exp included, with explicit logits, so that a torch or GPU where the kernel is missing or differs takes
    the explicit route (with a warning) instead of failing or answering wrongly."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype)
                         for shape in ((2, 4, 37, 64), (2, 2, 101, 64), (2, 2, 101, 64)))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    try:
        with torch.inference_mode():
            pairs = [(cuda_partial(*call, 0.125), explicit_partial(*call, 0.125))
                     for call in ((query, key, value), (query, key[:, :, :37], value[:, :, :37]))]
            pairs.append((cuda_partial(query, key[:, :, :37], value[:, :, :37], 0.125, causal=True),
                          explicit_partial(query, key[:, :, :37], value[:, :, :37], 0.125, causal=True)))
            error = max(partial_difference(got, expected) for got, expected in pairs)
    except Exception as failure:  # a missing kernel, an unsupported dtype or layout on this torch or GPU
        warnings.warn(f"torch's memory-efficient CUDA attention does not run here ({type(failure).__name__}: "
                      f"{failure}); attention parts take explicit logits (slower)", GaliWarning, stacklevel=2)
        return False
    if not error <= tolerance:  # also catches NaN
        warnings.warn(f"torch's memory-efficient CUDA attention disagrees with explicit logits here (max error "
                      f"{error:.2g}); attention parts take explicit logits (slower)", GaliWarning, stacklevel=2)
        return False
    return True


def partial_difference(got: Partial, expected: Partial) -> float:
    """The largest difference between two answers of one partial attention, outputs and log-sum-exps alike."""
    return max((got.output.float() - expected.output.float()).abs().max().item(),
               (got.lse.float() - expected.lse.float()).abs().max().item())


def explicit_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> Partial:
    """`flash_partial` from explicit float32 logits, a tile of queries at a time: any device, autograd, dropout."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    value32 = value.float()
    outputs, lses = [], []
    tile = logits_tile_rows(query.device, batch, heads, kv_len)
    for start in range(0, q_len, tile):
        rows = slice(start, min(start + tile, q_len))
        logits = grouped_logits(query[:, :, rows], key, scale)  # (B, H, n, T)
        if causal:
            mask_future(logits, torch.arange(rows.start, rows.stop, device=query.device))
        if mask is not None:
            logits = logits.masked_fill(~mask[..., rows, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        probs = F.dropout(torch.exp(logits - lse.unsqueeze(-1)), p=dropout)
        probs = probs.view(batch, kv_heads, -1, kv_len)  # heads sharing a key head, stacked as rows
        outputs.append(torch.matmul(probs, value32).view(batch, heads, -1, dim))
        lses.append(lse)
    return Partial(torch.cat(outputs, dim=2).to(value.dtype), torch.cat(lses, dim=2))


def causal_partial(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, partial: PartialAttention
) -> Partial:
    """Lower-right causal attention (the q queries are the last q of the n keys) as two mask-free parts: the keys
    before the queries, which every query sees, and the causal square of the queries' own keys."""
    if query.shape[2] == 1:  # decoding: one query sees every key
        return partial(query, key, value, scale)
    past = key.shape[2] - query.shape[2]
    own = partial(query, key[:, :, past:], value[:, :, past:], scale, causal=True)
    if past == 0:
        return own
    return merge_partials([partial(query, key[:, :, :past], value[:, :, :past], scale), own])


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
    tile = logits_tile_rows(value.device, batch, heads, kv_len)
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


def partial_attention(plan: AttentionPlan, model_dtype: torch.dtype) -> PartialAttention:
    """The plan's route for attention parts in a model of `model_dtype` (its values'). The methods rotate queries and
    keys for their parts in float32 (positions far past the window need it); on CUDA in half precision the parts are
    then rounded once to the model's dtype and attended on tensor cores, as the unpatched model attends (in float32
    the kernel has none, and a 32k-token prefill of ReRoPE took several times the unpatched model's on a GPU:
    docs/notes/2026-11-performance-history.md, "GPU (first measured 2026-11-26, one NVIDIA H200)"), their outputs
    back in float32 for merging."""
    route = PARTIAL[plan.partial]
    if plan.partial == "cuda" and model_dtype in (torch.bfloat16, torch.float16):
        return functools.partial(route, compute_dtype=model_dtype)
    return route


# The plan's routes (plan.CAUSAL_WORDS, plan.PARTIAL_WORDS say them in words).
CAUSAL: dict[str, CausalAttention] = {"lower-right": lower_right_causal_attention, "split": split_causal_attention,
                                      "masked": masked_causal_attention}
PARTIAL: dict[str, PartialAttention] = {"flash": flash_partial, "cuda": cuda_partial, "explicit": explicit_partial}
