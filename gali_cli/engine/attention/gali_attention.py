"""GALI's prefill attention (paper Alg. 3) on tensors, chunk by chunk; nothing here knows about transformers.

The paper interpolates two logit matrices, logit = (1 - c) q.K(ceil) + c q.K(floor), with c = ceil(p_k) - p_k.
c depends only on the key and RoPE is linear in the key, so this equals q.K_mix with one mixed key
K_mix = (1 - c) K(ceil) + c K(floor) = K * cos_mix + rotate_half(K) * sin_mix: one ordinary attention call, which
torch's scaled_dot_product_attention runs without ever forming the (queries x keys) logits. Only the noise needs
explicit logits (noisy_attention.py).

Shapes: B batch, H query heads, Hkv key/value heads (GQA when Hkv < H), q queries, T keys, D head dim.
"""

import itertools
from dataclasses import dataclass

import torch

from ..math.noise import Noise
from ..math.positions import group_size, grouping, interpolate
from ..math.rope import RopeTable, key_rotation, rotate_fused
from .dense import Partial, causal_attention, flash_partial, merge_partials
from .noisy_attention import NOISY, NOISY_PARTIAL, NoisyPartial
from .plan import AttentionPlan


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


def noisy(chunks: list[ChunkContext], noise: Noise | None) -> bool:
    """Whether a forward over these chunks adds noise: noise is on and some chunk is interpolated. Only then is the
    noisy route planned, so that a kernel GALI_KERNEL forces and cannot run fails where it would run."""
    return noise is not None and any(chunk.interpolated for chunk in chunks)


def gali_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: list[ChunkContext],
    scale: float,
    plan: AttentionPlan,
    dropout: float = 0.0,
    noise: Noise | None = None,
) -> torch.Tensor:
    """Causal GALI attention of the successive chunks of one forward.

    Args:
        query: (B, H, q, D) un-rotated queries of all the chunks, in order.
        key, value: (B, Hkv, >= T, D) un-rotated keys and values of every token so far.
        chunks: the chunks' contexts, from `chunk_contexts`; the first one must not reuse rows.
        noise: the layer's noise settings, or None for noise-free GALI.
        plan: the forward's (`Forward.attention_plan`, with noise when some chunk is noisy), decided once per
            forward by its first layer.

    Returns:
        (B, H, q, D) attention output.
    """
    if chunks[0].reuse:
        raise ValueError("the first chunk of a forward has no previous chunk to reuse keys from")
    if plan.split and all(chunk.grouped <= chunk.keys - chunk.queries for chunk in chunks):
        return split_gali_attention(query, key, value, chunks, scale, noise,
                                    NOISY_PARTIAL[plan.noisy_partial] if plan.noise else None)
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
            outputs.append(causal_attention(chunk_query, chunk_key, chunk_value, scale, dropout, plan))
        else:
            outputs.append(NOISY[plan.noisy](chunk_query, chunk_key, chunk_value, chunk.group, chunk.grouped, scale,
                                             noise, dropout))
        row += chunk.queries
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def split_gali_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: list[ChunkContext],
    scale: float,
    noise: Noise | None = None,
    noisy_partial: NoisyPartial | None = None,
) -> torch.Tensor:
    """`gali_attention` on the CPU, in fewer and larger calls: each chunk's queries over the keys before it (one
    mask-free flash call, or `noisy_partial` with noise), then the causal squares of every chunk's queries over its
    own keys in one batched call, merged by their log-sum-exps.

    A chunk's own keys lie in its exact tail (the caller checks it: chunk.grouped <= keys - queries), where queries
    and keys sit at integer positions, so its square is plain causal RoPE attention and no noise reaches it. Batched,
    the squares cost one call per layer instead of one per chunk, and the merge one per layer (docs/dev/engine.md,
    "Work shared across chunks and layers"). Forward only (no autograd, no dropout).
    """
    queries, stop = sum(chunk.queries for chunk in chunks), chunks[-1].keys
    # Every chunk's queries rotated at once: a query sits at the same (integer) position as its own key in its chunk.
    query_cos = torch.cat([chunk.query_cos for chunk in chunks]) if len(chunks) > 1 else chunks[0].query_cos
    query_sin = torch.cat([chunk.query_sin for chunk in chunks]) if len(chunks) > 1 else chunks[0].query_sin
    rotated = rotate_fused(query, query_cos, query_sin)
    mixed = key.new_empty(*key.shape[:2], stop, key.shape[-1])
    pasts, row = [], 0
    for chunk in chunks:
        rows, past = slice(row, row + chunk.queries), chunk.keys - chunk.queries
        rotate_fused(key[:, :, chunk.reuse : past], chunk.key_cos[: past - chunk.reuse],
                     chunk.key_sin[: past - chunk.reuse], out=mixed[:, :, chunk.reuse : past])
        if noise is not None and chunk.interpolated:
            pasts.append(noisy_partial(rotated[:, :, rows], mixed[:, :, :past], value[:, :, :past], scale, noise, past,
                                       chunk.group, chunk.grouped, chunk.keys))
        else:
            pasts.append(flash_partial(rotated[:, :, rows], mixed[:, :, :past], value[:, :, :past], scale))
        row += chunk.queries
    before = Partial(torch.cat([part.output for part in pasts], dim=2), torch.cat([part.lse for part in pasts], dim=2))
    # Each chunk's own keys, rotated where its queries are: the squares see relative positions only.
    own = rotate_fused(key[:, :, stop - queries : stop], query_cos, query_sin)
    squares = own_squares(rotated, own, value[:, :, stop - queries : stop], [chunk.queries for chunk in chunks], scale)
    return merge_partials([before, squares]).output


def own_squares(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sizes: list[int], scale: float) -> Partial:
    """Causal attention of each chunk's queries over its own keys: query (B, H, Q, D), key/value (B, Hkv, Q, D), the
    chunks one after another with these sizes. Runs of chunks of one size go through the flash kernel as one batch."""
    outputs, lses, row = [], [], 0
    for size, run in itertools.groupby(sizes):
        count = len(list(run))
        rows = slice(row, row + count * size)

        def batched(x: torch.Tensor) -> torch.Tensor:  # (B, heads, count * size, D) -> (B * count, heads, size, D)
            # Called only below, in this same iteration, so the loop's current values are the ones meant.
            return x[:, :, rows].unflatten(2, (count, size)).transpose(1, 2).flatten(0, 1)  # noqa: B023

        part = flash_partial(batched(query), batched(key), batched(value), scale, causal=True)
        outputs.append(part.output.unflatten(0, (query.shape[0], count)).transpose(1, 2).flatten(2, 3))
        lses.append(part.lse.unflatten(0, (query.shape[0], count)).transpose(1, 2).flatten(2, 3))
        row += count * size
    if len(outputs) == 1:
        return Partial(outputs[0], lses[0])
    return Partial(torch.cat(outputs, dim=2), torch.cat(lses, dim=2))
