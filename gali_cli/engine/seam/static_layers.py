"""The static decoding step's layers (static_decode.py): one decoder layer written out over the model's own modules
for every family, what a family changes declared as data (model/families.py), and which of the cache's rows each
kind of layer attends, rotated how.

A Llama layer (Mistral's, Qwen2's and Qwen3's too) is h += o_proj(attention(input_layernorm(h))), then
h += mlp(post_attention_layernorm(h)); Qwen3 and Gemma 3 norm each head's q and k before RoPE (`Family.qk_norm`).
Gemma 3 (`Family.sandwich_norms`) norms the attention's output before adding it (post_attention_layernorm) and the
MLP's input and output by norms of their own (pre_ and post_feedforward_layernorm). The rest of Gemma 3 is in the
modules the step calls: RMSNorms by 1 + weight, the GELU-tanh MLP, the embedding's sqrt(hidden), the logits' scale
`query_pre_attn_scalar`^-1/2 (the attention module's `scaling`); a final logit soft-cap, where a config sets one, is
applied after the head as the causal LM applies it.

Layers of two kinds (Gemma 3, `families.layer_is_local`): a global layer attends every cached key, placed by the
method; a local layer is computed as the unpatched model computes it, on its own rope at the true positions, over
the last `sliding_window` keys only: key j with i - W < j <= i, as transformers' `sliding_window_overlay` (the
prefill's `Forward.local_attention` too). Its cache keeps every key (kv_cache.new_cache), so the step attends a
window of min(W, C) rows (`window_span`): a view on the CPU, where nothing is graphed and the index is read, and a
gather by the index tensor elsewhere, so that a CUDA graph replays it for any token. Under a method the cache holds
those keys un-rotated: the window's row r is rotated by its offset r - (the query's row), a whole number in
[-(W - 1), 0] (a reach of W - 1, as a method declares one); without a method it holds them rotated by the local
rope, and the new query and key are rotated at the index. Every route (PyTorch, native, Triton) attends a window as
it attends the whole cache. Shapes: B batch, H query heads, Hkv key/value heads, C the cache's rows, D head dim.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ...model.families import GLOBAL, LOCAL, family_of, layer_is_local
from ..contract import Placement
from .hooks import KindRotary, llama_model, original_rotary
from .packed_modules import PackedLinear, grid_product_available
from .projections import LayerProjections, Projections, gguf_grids, grid_projections, module_projections


class Rotation(NamedTuple):
    """What a step's layers of one kind share: with `placement` None, cos/sin (B, 1, 1, D) of the token's index,
    rotating the new query and key (the cache holds keys rotated as transformers rotates them); else cos/sin (C, D or
    D/2) rotating each cached key by its offset from the un-rotated query, with the rest of the method's `placement`;
    or, with `table_rows`, cos/sin (reach + 2, D) float32 of the offsets 0, -1, -2, ..., key j rotated by row
    table_rows[j] (minus its offset) mixed towards the next row by `mix` (GALI's weight; None: not mixed)."""

    cos: torch.Tensor
    sin: torch.Tensor
    placement: Placement | None
    table_rows: torch.Tensor | None = None
    mix: torch.Tensor | None = None


class Rope(NamedTuple):
    """A rope the step rotates cached keys by: its frequencies (D/2,) float64 and its attention scaling squared
    (RoPE's m on the query times m on the key)."""

    inv_freq: torch.Tensor
    scaling: float


class Span(NamedTuple):
    """The cache's rows one kind of layer attends in a step: `rows` of them, `take(buffer)` taking them from a
    buffer (B, Hkv, capacity, D) as (B, Hkv, rows, D), the query's row `index` among them (a 0-d tensor), and for the
    PyTorch route `mask` (1, 1, 1, rows): the dtype's lowest finite bias on rows past the query (finite: a block of
    keys all past it then has a finite log-sum-exp, and weighs nothing in the merge)."""

    rows: int
    index: torch.Tensor
    take: Callable[[torch.Tensor], torch.Tensor]
    mask: torch.Tensor | None


def layer_kinds(config: Any, layers: int) -> tuple[str, ...]:
    """Each layer's kind: LOCAL for a family's local layers, GLOBAL for the rest (every layer of a Llama)."""
    return tuple(LOCAL if layer_is_local(config, number) else GLOBAL for number in range(layers))


def method_ropes(model: nn.Module, kinds: tuple[str, ...], device: torch.device) -> dict[str, Rope]:
    """The ropes an installed method's step rotates cached keys by: the method's (the global layers') and, for local
    layers, their own, from the model's rotary that the method set aside."""
    rotary = original_rotary(model)
    ropes = {GLOBAL: Rope(rotary.inv_freq.to(device, torch.float64), float(rotary.attention_scaling) ** 2)}
    if LOCAL in kinds:
        local = KindRotary(rotary.rotary, LOCAL)
        ropes[LOCAL] = Rope(local.inv_freq.to(device, torch.float64), float(local.attention_scaling) ** 2)
    return ropes


def token_rotation(model: nn.Module, hidden: torch.Tensor, index: torch.Tensor, kind: str, kinds: bool) -> Rotation:
    """The unpatched model's rotation of the new query and key at the token's `index`, by the rotary of the layer
    `kind` where the family has `kinds` (Gemma 3's takes the kind), in the hidden states' dtype."""
    positions = index.view(1, 1).expand(hidden.shape[0], 1)
    cos, sin = llama_model(model).rotary_emb(hidden, positions, *((kind,) if kinds else ()))
    return Rotation(cos.unsqueeze(1), sin.unsqueeze(1), None)


def past(rows: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, 1, len(rows)): the dtype's lowest finite bias on the rows past `index`, 0 on the others."""
    return torch.zeros(rows.shape[0], dtype=dtype, device=rows.device).masked_fill_(
        rows > index, torch.finfo(dtype).min).view(1, 1, 1, -1)


def span(kind: str, index: torch.Tensor, window: int | None, capacity: int, dtype: torch.dtype, masked: bool,
         gather: bool) -> Span:
    """The rows a layer of `kind` attends: `window_span` for a local one, else `whole_span`."""
    if kind == LOCAL:
        return window_span(index, window, capacity, dtype, masked, gather)
    return whole_span(index, capacity, dtype, masked)


def whole_span(index: torch.Tensor, capacity: int, dtype: torch.dtype, masked: bool) -> Span:
    """A global layer's rows: all the reserved ones, masked past the index where `masked` (the PyTorch route; the
    kernels read nothing past it)."""
    mask = past(torch.arange(capacity, device=index.device), index, dtype) if masked else None
    return Span(capacity, index, lambda buffer: buffer[:, :, :capacity], mask)


def window_span(index: torch.Tensor, window: int, capacity: int, dtype: torch.dtype, masked: bool,
                gather: bool) -> Span:
    """A local layer's rows: the `window` (W) keys up to the token's `index`, i - W < j <= i, as min(W, C) rows from
    max(0, i - W + 1), the query's row i - that (rows past it, before the window fills, masked or unread). `gather`:
    the rows gathered by the index tensor, with no host read (for a CUDA graph); else a view from the row read."""
    rows = min(window, capacity)
    start = (index - (rows - 1)).clamp(min=0)
    if not gather:
        first = int(start)

        def take(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.narrow(2, first, rows)
    else:
        picked = start + torch.arange(rows, device=index.device)

        def take(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.index_select(2, picked)
    query = index - start
    mask = past(torch.arange(rows, device=index.device), query, dtype) if masked else None
    return Span(rows, query, take, mask)


def window_placement(span: Span) -> Placement:
    """Where a local layer's query places its window's keys under a method (whose cache holds them un-rotated): at
    their true offsets r - (the query's row), a reach of rows - 1."""
    return Placement(torch.arange(span.rows, device=span.index.device) - span.index, reach=span.rows - 1)


def decoder_layer(parts: LayerProjections, qk_norm: bool, hidden: torch.Tensor,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]) -> torch.Tensor:
    """One decoder layer of the step on the residual stream `hidden` (B, 1, hidden): the pieces of `parts` around
    the attention (a Llama's, or `SandwichProjections`), each head's q and k normed where `qk_norm`, and
    `attend(query, key, value, scaling)` for the attention of the un-rotated query (B, H, 1, D) over the cache, its
    key and value (B, Hkv, 1, D) written there."""
    attention = parts.layer.self_attn
    shape = (hidden.shape[0], 1, -1, attention.head_dim)
    query, key, value = parts.attention_inputs(hidden)  # of the input norm
    query = query.view(shape).transpose(1, 2)  # (B, H, 1, D)
    key = key.view(shape).transpose(1, 2)  # (B, Hkv, 1, D)
    value = value.view(shape).transpose(1, 2)
    if qk_norm:
        query, key = attention.q_norm(query), attention.k_norm(key)
    output = attend(query, key, value, attention.scaling)
    hidden = parts.add_attention_output(hidden, output.transpose(1, 2).reshape(hidden.shape[0], 1, -1))
    return parts.add_mlp(hidden)


class GridNorm(NamedTuple):
    """A norm as the grid product fuses one before its product (`GridWeight`'s `norm`: x / rms(x) * weight), for
    Gemma's RMSNorm: its weight the 1 + weight it scales by (float32, contiguous), its epsilon."""

    weight: torch.Tensor
    variance_epsilon: float


def grid_norm(norm: nn.Module, offset: float) -> GridNorm:
    """`norm` (an RMSNorm scaling by offset + weight, epsilon `eps`) as the grid product takes it."""
    return GridNorm((offset + norm.weight.detach().float()).contiguous(), float(norm.eps))


@dataclass(frozen=True)
class SandwichProjections(LayerProjections):
    """A Gemma 3 layer's pieces around its attention (`Family.sandwich_norms`): h + post_attention_layernorm(o(x)),
    then h + post_feedforward_layernorm(down(act(gate(n)) * up(n))) for n = pre_feedforward_layernorm(h), act its
    GELU-tanh (the MLP's `act_fn`). Where a GGUF's projections are grids, q, k and v are one product, gate and up
    another, each with its norm fused (`input_norm`, `mlp_norm`: `GridNorm`s); the norms after them are modules."""

    input_norm: GridNorm | None = None
    mlp_norm: GridNorm | None = None

    def attention_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return super().attention_inputs(hidden)
        return self.qkv(hidden, norm=self.input_norm).split(self.qkv_sizes, dim=-1)

    def add_attention_output(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        output = self.layer.self_attn.o_proj(x) if self.output is None else self.output(x)
        return hidden + self.layer.post_attention_layernorm(output)

    def add_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        mlp = self.layer.mlp
        if self.gate_up is None:
            normed = self.layer.pre_feedforward_layernorm(hidden)
            gate, up = mlp.gate_proj(normed), mlp.up_proj(normed)
        else:
            gate, up = self.gate_up(hidden, norm=self.mlp_norm).chunk(2, dim=-1)
        inner = mlp.act_fn(gate) * up
        output = mlp.down_proj(inner) if self.down is None else self.down(inner)
        return hidden + self.layer.post_feedforward_layernorm(output)


def step_projections(model: nn.Module, grids: bool) -> Projections:
    """The pieces the step multiplies by: projections.py's `grid_projections` where `grids` (the native route),
    else `module_projections`. A family with sandwich norms (Gemma 3) gets `SandwichProjections`: on grids where
    `grids` and every projection is a GGUF's (PackedLinear) whose grids the product takes here (and no hook is on a
    module it would skip), its final norm fused into the head's product too; else over its modules."""
    family = family_of(model.config)
    if not family.sandwich_norms:
        return grid_projections(model) if grids else module_projections(model)
    base, head = llama_model(model), model.get_output_embeddings()
    modules = [head, *(m for layer in base.layers for m in layer.modules()), base.norm]
    linears = [m for m in modules if isinstance(m, nn.Linear | PackedLinear)]
    packed = grids and grid_product_available() and all(isinstance(m, PackedLinear) for m in linears) and not any(
        m._forward_hooks or m._forward_pre_hooks for m in modules)
    plain = gguf_grids(base, head) if packed else module_projections(model)
    offset = family.norm_offset
    layers = tuple(SandwichProjections(
        parts.layer, parts.qkv, parts.output, parts.gate_up, parts.down,
        None if parts.qkv is None else grid_norm(parts.layer.input_layernorm, offset),
        None if parts.gate_up is None else grid_norm(parts.layer.pre_feedforward_layernorm, offset))
        for parts in plain.layers)
    norm = base.norm if plain.head_grid is None else grid_norm(base.norm, offset)
    return Projections(layers, norm, head, plain.head_grid)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The head's logits capped as the causal LM caps them (Gemma's `final_logit_softcapping`; None: as they are)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
