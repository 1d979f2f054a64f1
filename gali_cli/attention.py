"""GALI attention (paper Alg. 3) on tensors, chunk by chunk; nothing here knows about transformers.

The paper interpolates two logit matrices, logit = (1 - c) q.K(ceil) + c q.K(floor), with c = ceil(p_k) - p_k.
c depends only on the key and RoPE is linear in the key, so this equals q.K_mix with one mixed key
K_mix = (1 - c) K(ceil) + c K(floor) = K * cos_mix + rotate_half(K) * sin_mix: one ordinary attention call, which
torch's scaled_dot_product_attention runs without ever forming the (queries x keys) logits. Only the noise needs
explicit logits, and those are built a tile of queries at a time.

Shapes: B batch, H query heads, Hkv key/value heads (GQA when Hkv < H), q queries, T keys, D head dim.
"""

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .errors import ConfigError, GaliWarning
from .noise import Noise, standard_normal
from .positions import Interpolation, group_size, grouping, interpolate

# Explicit logits held at once (a tile of queries): 1M float32, 4 MiB; noise or extra position sets take a few
# times that.
_LOGITS_TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class RopeTable:
    """cos/sin of the model's own rotary embedding at the integer positions 0..rows-1.

    GALI only ever rotates by integer positions (ceil and floor of p), so every rotation is a lookup here.
    `cos`/`sin` are in the model's dtype, bit-identical to what the model's rotary returns; `cos32`/`sin32` are the
    same values in float32, used to mix the ceil and floor rotations without rounding c.
    """

    cos: torch.Tensor  # (rows, D)
    sin: torch.Tensor
    cos32: torch.Tensor
    sin32: torch.Tensor


@dataclass(frozen=True)
class ChunkContext:
    """Everything one chunk's attention derives from its positions: built once per forward, shared by all layers.

    Queries are rotated at ceil(p), keys by the interpolated rotation (ceil and floor mixed by c). Inside one forward,
    keys [0, reuse) keep the mixed rotation the previous chunk gave them (same group size, so same positions), and
    the key tables only cover keys [reuse, keys): re-rotating all T keys for every chunk would cost O(T) per chunk.
    """

    queries: int  # the chunk's tokens: the last `queries` of its `keys`
    keys: int  # T, every token up to the end of the chunk
    group: int  # g of Alg. 2; 1 when nothing is interpolated
    grouped: int  # keys [0, grouped) have positions k / g
    reuse: int
    query_cos: torch.Tensor  # (queries, D), model dtype
    query_sin: torch.Tensor
    key_cos: torch.Tensor  # (keys - reuse, D), model dtype
    key_sin: torch.Tensor

    @property
    def interpolated(self) -> bool:
        return self.group > 1


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


def chunk_context(
    table: RopeTable, keys: int, queries: int, train_len: int, local_window: int, reuse: int = 0
) -> ChunkContext:
    """The context of a chunk ending at token `keys` with `queries` tokens, its tables on the table's device.

    `reuse` > 0 promises that the previous chunk of the same forward had the same group size and `reuse` grouped keys.
    """
    group, grouped = grouping(keys, train_len, local_window)
    query_rows = interpolate(keys, train_len, local_window, table.cos.device, first=keys - queries).ceil
    key_cos, key_sin = key_rotation(table, keys, reuse, keys, train_len, group, grouped)
    return ChunkContext(
        queries=queries,
        keys=keys,
        group=group,
        grouped=grouped,
        reuse=reuse,
        query_cos=table.cos[query_rows],
        query_sin=table.sin[query_rows],
        key_cos=key_cos,
        key_sin=key_sin,
    )


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


def chunk_contexts(
    table: RopeTable, pieces: list[tuple[int, int]], train_len: int, local_window: int
) -> list[ChunkContext]:
    """Contexts of a forward's successive pieces (from `chunk_plan`). A piece with the same group size as the one
    before it reuses that one's grouped keys: their positions k / g did not move."""
    contexts: list[ChunkContext] = []
    for first, last in pieces:
        previous = contexts[-1] if contexts else None
        group = group_size(last, train_len, local_window)
        reuse = previous.grouped if previous is not None and previous.interpolated and previous.group == group else 0
        contexts.append(chunk_context(table, last, last - first, train_len, local_window, reuse))
    return contexts


def gali_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: list[ChunkContext],
    scale: float,
    dropout: float = 0.0,
    noise: Noise | None = None,
) -> torch.Tensor:
    """Causal GALI attention of the successive chunks of one forward.

    Args:
        query: (B, H, q, D) un-rotated queries of all the chunks, in order.
        key, value: (B, Hkv, >= T, D) un-rotated keys and values of every token so far.
        chunks: the chunks' contexts, from `chunk_contexts`; the first one must not reuse rows.
        noise: the layer's noise settings, or None for noise-free GALI.

    Returns:
        (B, H, q, D) attention output.
    """
    if chunks[0].reuse:
        raise ValueError("the first chunk of a forward has no previous chunk to reuse keys from")
    # K_mix, the interpolation folded into the keys, kept across chunks: only rows that moved are rotated again.
    # Under autograd every chunk's keys must stay intact, so they are rebuilt without writing in place.
    differentiable = torch.is_grad_enabled()
    mixed = None if differentiable else key.new_empty(*key.shape[:2], chunks[-1].keys, key.shape[-1])
    outputs, row = [], 0
    for chunk in chunks:
        moved = slice(chunk.reuse, chunk.keys)
        if differentiable:
            rotated = rotate_fused(key[:, :, moved], chunk.key_cos, chunk.key_sin)
            mixed = rotated if not chunk.reuse else torch.cat((mixed[:, :, : chunk.reuse], rotated), dim=2)
        else:
            rotate_fused(key[:, :, moved], chunk.key_cos, chunk.key_sin, out=mixed[:, :, moved])
        chunk_query = rotate_fused(query[:, :, row : row + chunk.queries], chunk.query_cos, chunk.query_sin)
        chunk_key, chunk_value = mixed[:, :, : chunk.keys], value[:, :, : chunk.keys]
        if noise is None or not chunk.interpolated:
            outputs.append(causal_attention(chunk_query, chunk_key, chunk_value, scale, dropout))
        else:
            outputs.append(noisy_attention(chunk_query, chunk_key, chunk_value, chunk.group, chunk.grouped, scale,
                                           noise, dropout))
        row += chunk.queries
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """scaled_dot_product_attention where the q queries are the last q of the T keys (lower-right causal)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if q_len == 1 or q_len == kv_len:  # no mask needed: decoding, or a square causal block
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=q_len > 1, scale=scale, enable_gqa=gqa
        )
    if query.device.type == "cuda":
        return lower_right_causal_attention(query, key, value, scale, dropout)
    cpu_float32 = query.device.type == "cpu" and query.dtype == torch.float32  # bfloat16: the mask is faster
    # Forward only: autograd takes the log-sum-exp of that op as a constant, which would drop gradients.
    if cpu_float32 and dropout == 0.0 and not _needs_grad(query, key, value) and _CPU_FLASH_WITH_LSE is not None:
        return _split_causal_attention(query, key, value, scale)
    # Elsewhere a (q, T) bool mask: the flash kernel takes it with GQA and never forms the logits.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


# torch's CPU flash attention, which also returns the log-sum-exp of each query's logits (an aten op, not public API:
# without it, causal_attention passes a mask instead).
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """The CPU route of `causal_attention`, without a mask: the keys every query sees in full (all but the last q),
    then the causal square of the last q, merged by their log-sum-exps. A (q, T) mask would be built, converted and
    added to every logit, about a fifth of the attention's time in GALI's chunks."""
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


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


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


def noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal GALI attention with logit noise of rotated queries (B, H, q, D), the last q of the mixed keys
    (B, Hkv, T, D): the fused Triton kernel where it applies (see `fused_kernel_applies`; forward only, so not
    under autograd or dropout), else explicit float32 logits one tile of queries at a time. Both give the same
    noise."""
    if dropout == 0.0 and not _needs_grad(query, key, value) and fused_kernel_applies(query, key):
        from .triton_attention import noisy_gali_attention

        return noisy_gali_attention(query, key, value, group, grouped, scale, noise)
    return tiled_noisy_attention(query, key, value, group, grouped, scale, noise, dropout)


def tiled_noisy_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: int,
    grouped: int,
    scale: float,
    noise: Noise,
    dropout: float = 0.0,
) -> torch.Tensor:
    """The PyTorch path of `noisy_attention`, and the kernel's reference: explicit logits, a tile at a time."""
    first = key.shape[2] - query.shape[2]  # token index of the first query

    def logits(rows: slice) -> torch.Tensor:
        scores = grouped_logits(query[:, :, rows], key, scale)
        query_index = torch.arange(first + rows.start, first + rows.stop, device=key.device)
        add_noise(scores, query_index, group, grouped, noise)
        mask_future(scores, query_index)
        return scores

    return tiled_attention(logits, value, query.shape[1], query.shape[2], dropout)


_KERNEL_CHOICES = ("auto", "triton", "torch")


def kernel_choice() -> str:
    """$GALI_KERNEL (auto, triton or torch; auto when unset), checked."""
    choice = os.environ.get("GALI_KERNEL", "auto").strip().lower() or "auto"
    if choice not in _KERNEL_CHOICES:
        raise ConfigError(f"GALI_KERNEL must be one of {', '.join(_KERNEL_CHOICES)}, got {choice!r}")
    return choice


def fused_kernel_applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether noisy attention runs the fused Triton kernel, as $GALI_KERNEL says.

    auto (default): on CUDA, when triton is installed, the shapes suit it, and the kernel passed its check on this
    device (`kernel_verified`). triton: always (errors if it cannot; on the CPU only under TRITON_INTERPRET=1, which
    the tests use). torch: never, the PyTorch path.
    """
    choice = kernel_choice()
    if choice == "torch" or (choice == "auto" and query.device.type != "cuda"):
        return False
    if not _triton_installed():
        if choice == "triton":
            raise ConfigError("GALI_KERNEL=triton, but triton is not installed (pip install triton)")
        return False
    from .triton_attention import supports

    if choice == "triton":
        if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"GALI_KERNEL=triton needs a CUDA device, the model is on {query.device.type}")
        if not supports(query, key):
            raise ConfigError(f"GALI_KERNEL=triton: the kernel needs a power-of-two head dim of 16..256 and "
                              f"float16/bfloat16/float32, got {query.shape[-1]} and {query.dtype}")
        return True
    heads_per_kv = query.shape[1] // key.shape[1]
    return supports(query, key) and kernel_verified(query.device, query.dtype, query.shape[-1], heads_per_kv)


@functools.cache
def _triton_installed() -> bool:
    """Looked up once: noisy attention asks for every chunk of every layer."""
    return importlib.util.find_spec("triton") is not None


def noisy_attention_path(device: torch.device) -> str:
    """Which path noisy GALI attention would take on `device`, in words (for `gali info`)."""
    choice = kernel_choice()
    if choice == "torch":
        return "PyTorch (GALI_KERNEL=torch)"
    if not _triton_installed():
        return "PyTorch (triton is not installed)"
    if device.type != "cuda" and choice == "auto":
        return "PyTorch (the fused kernel needs CUDA)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "error: GALI_KERNEL=triton needs CUDA"
    from triton import __version__ as triton_version

    checked = ", checked against PyTorch on first use" if choice == "auto" else ""
    return f"fused Triton kernel (triton {triton_version}{checked})"


@functools.cache
def kernel_verified(device: torch.device, dtype: torch.dtype, head_dim: int, heads_per_kv: int) -> bool:
    """Run the kernel once on a small problem of the model's head dim (which picks the compiled variant and its tiles)
    and head grouping, and compare it with the PyTorch path, so that a GPU, driver or triton version the kernel was
    never tried on falls back to the PyTorch path (with a warning) instead of failing or answering wrongly."""
    from .triton_attention import noisy_gali_attention

    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 2 * heads_per_kv, 70, head_dim), (1, 2, 200, head_dim), (1, 2, 200, head_dim))
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    noise = Noise(seed=1, layer=0, scale=1.0)
    try:
        fused = noisy_gali_attention(query, key, value, 3, 96, 0.125, noise).float()
    except Exception as error:  # compilation or launch failures of every kind
        warnings.warn(f"the fused GALI kernel does not run here ({type(error).__name__}: {error}); noisy attention "
                      f"uses the slower PyTorch path", GaliWarning, stacklevel=2)
        return False
    reference = tiled_noisy_attention(query, key, value, 3, 96, 0.125, noise).float()
    error = (fused - reference).abs().max().item()
    tolerance = (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, reference.abs().max().item())
    if not error <= tolerance:  # also catches NaN
        warnings.warn(f"the fused GALI kernel disagrees with the PyTorch path on this device (max error {error:.2g}); "
                      f"noisy attention uses the PyTorch path", GaliWarning, stacklevel=2)
        return False
    return True


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


def add_noise(logits: torch.Tensor, query_index: torch.Tensor, group: int, grouped: int, noise: Noise) -> None:
    """Add N(0, sigma^2) in place to scaled logits (B, H, n, T) wherever c != 0 (before the causal mask).

    sigma = (i - j) / T * scale, i the query's and j the key's token index, T the number of keys (paper Alg. 3).
    c != 0 exactly for the grouped keys j < grouped whose position j / group is not an integer.
    """
    batch, heads, _, kv_len = logits.shape
    key_index = torch.arange(grouped, device=logits.device)
    sigma = (query_index.unsqueeze(-1) - key_index).float() * (noise.scale / kv_len)  # (n, grouped)
    sigma = sigma * (key_index % group != 0)
    logits[..., :grouped] += standard_normal(noise, batch, heads, query_index, grouped) * sigma


def mask_future(logits: torch.Tensor, query_index: torch.Tensor) -> None:
    """Causal mask in place on logits (B, H, n, T): query i sees keys j <= i."""
    future = torch.arange(logits.shape[-1], device=logits.device) > query_index.unsqueeze(-1)  # (n, T)
    logits.masked_fill_(future, float("-inf"))


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
    batch, heads, q_len, _ = query.shape
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


@dataclass
class DecodeState:
    """One layer's keys as decoding needs them, kept from token to token (see docs/engine.md, "Decoding").

    Rows [0, grouped) hold the keys rotated by their interpolated positions for group size `group` (GALI's frame,
    where the query sits at its own position p_q); rows [grouped, keys) hold the keys rotated at their own token
    index (the absolute frame, where the query sits at its token index): an exact-tail key's distance to the query
    is the same in both frames, so it is rotated once, when its token arrives.
    """

    group: int
    grouped: int
    keys: int
    rotated: torch.Tensor  # (B, Hkv, capacity >= keys, D), model dtype

    def origin(self, batch: int) -> tuple[int, int, int] | None:
        """(group, grouped, keys) for a step to continue from, or None when this buffer cannot be written again:
        another batch size, or made inside torch.inference_mode and now outside it (or the reverse)."""
        if self.rotated.shape[0] != batch or self.rotated.is_inference() != torch.is_inference_mode_enabled():
            return None
        return self.group, self.grouped, self.keys


AbsoluteTable = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # token indices -> cos, sin (n, D)


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step rotates, and by what: the same for every layer whose state comes from the same
    `origin`, so it is built once per forward."""

    group: int
    grouped: int
    keys: int
    rebuild: bool  # no state to continue from: every row is rotated
    moved: int  # rows [moved, grouped) join GALI's frame
    moved_cos: torch.Tensor | None
    moved_sin: torch.Tensor | None
    fresh: int  # rows [fresh, keys) are rotated into the absolute frame
    fresh_cos: torch.Tensor | None
    fresh_sin: torch.Tensor | None
    query_cos: torch.Tensor  # the query in GALI's frame, at p_q
    query_sin: torch.Tensor
    absolute_query_cos: torch.Tensor | None  # the query at its token index, for the exact tail (None: no tail)
    absolute_query_sin: torch.Tensor | None


def decode_step(
    origin: tuple[int, int, int] | None,
    keys: int,
    table: RopeTable,
    absolute: AbsoluteTable,
    train_len: int,
    local_window: int,
) -> DecodeStep:
    """The step to `keys` keys from a state at `origin` (group, grouped, keys), or from nothing.

    From one step to the next only a key or two leave the exact tail for the grouped part (every grouped key moves
    when g changes, rarely): those are rotated again, the new token's key once, nothing else. A state that is not
    exactly one token behind, or has another g, is rebuilt.
    """
    device = table.cos.device
    query_row = interpolate(keys, train_len, local_window, device, first=keys - 1)
    group, grouped = query_row.group, query_row.grouped
    rebuild = origin is None or origin[2] != keys - 1 or origin[0] != group
    moved = 0 if rebuild else origin[1]
    fresh = grouped if rebuild else max(grouped, origin[2])
    moved_cos = moved_sin = fresh_cos = fresh_sin = absolute_cos = absolute_sin = None
    if grouped > moved:
        moved_cos, moved_sin = key_rotation(table, keys, moved, grouped, train_len, group, grouped)
    if keys > fresh:
        fresh_cos, fresh_sin = absolute(torch.arange(fresh, keys, device=device))
    if keys > grouped:
        absolute_cos, absolute_sin = absolute(torch.tensor([keys - 1], device=device))
    return DecodeStep(group, grouped, keys, rebuild, moved, moved_cos, moved_sin, fresh, fresh_cos, fresh_sin,
                      table.cos[query_row.ceil], table.sin[query_row.ceil], absolute_cos, absolute_sin)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: DecodeState | None,
    step: DecodeStep,
    scale: float,
    noise: Noise | None = None,
) -> tuple[torch.Tensor, DecodeState]:
    """GALI attention of one new token (the last of the T keys) without re-rotating the cache.

    Args:
        query: (B, H, 1, D) un-rotated query of token T - 1.
        key, value: (B, Hkv, T, D) un-rotated keys and values.
        state: what the previous step returned for this cache and layer (unused when `step.rebuild`).
        step: from `decode_step`, for this state's origin.

    Returns:
        (B, H, 1, D) attention output, and the state for the next step.
    """
    keys = step.keys
    if step.rebuild:
        rotated = key.new_empty(*key.shape[:2], _capacity(keys), key.shape[-1])
    elif state.rotated.shape[2] < keys:
        rotated = key.new_empty(*key.shape[:2], _capacity(keys), key.shape[-1])
        rotated[:, :, : state.keys] = state.rotated[:, :, : state.keys]
    else:
        rotated = state.rotated
    if step.moved_cos is not None:  # rows that joined the grouped part: GALI's frame
        rotate_fused(key[:, :, step.moved : step.grouped], step.moved_cos, step.moved_sin,
                     out=rotated[:, :, step.moved : step.grouped])
    if step.fresh_cos is not None:  # rows of the exact tail not rotated yet: the absolute frame
        rotate_fused(key[:, :, step.fresh : keys], step.fresh_cos, step.fresh_sin, out=rotated[:, :, step.fresh : keys])

    logits = [grouped_logits(rotate(query, step.query_cos, step.query_sin), rotated[:, :, : step.grouped], scale)]
    if step.absolute_query_cos is not None:
        in_absolute = rotate(query, step.absolute_query_cos, step.absolute_query_sin)
        logits.append(grouped_logits(in_absolute, rotated[:, :, step.grouped : keys], scale))
    scores = torch.cat(logits, dim=-1)
    if noise is not None:
        add_noise(scores, torch.tensor([keys - 1], device=key.device), step.group, step.grouped, noise)
    output = tiled_attention(lambda rows: scores, value[:, :, :keys], query.shape[1], 1)
    return output, DecodeState(step.group, step.grouped, keys, rotated)


def _capacity(keys: int) -> int:
    """Room for the rotated keys: grown by a quarter at a time, so that appending is amortised O(1) per token."""
    return keys + max(64, keys // 4)


def absolute_table(inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> AbsoluteTable:
    """cos/sin at any token index, as the model's rotary embedding computes them (cat(freqs, freqs), times its
    attention scaling), but with angles in float64: token indices far beyond the window lose no precision."""
    frequencies = inv_freq.double()

    def lookup(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.double().unsqueeze(-1) * frequencies.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)

    return lookup
