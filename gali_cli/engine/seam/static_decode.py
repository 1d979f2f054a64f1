"""A decoding step with static shapes, for CUDA graphs (docs/dev/engine.md, "Decoding on a GPU: one graph a token").

On a GPU the eager decoding step is bound by dispatch, not by memory: most of an 8B model's step went to Python and
kernel launches, not to reading its weights (docs/notes/2026-11-performance-history.md, "GPU (first measured
2026-11-26, one NVIDIA H200)"). A CUDA graph replays a step's kernels with one
launch, but only a step whose kernels read everything that changes from token to token from the same tensors:
here the token id and its index are two one-element tensors, the KV cache is the rows `kv_cache.reserve` made room
for, and no key past the newest one is attended (the kernels stop at the index they read from its tensor; the
PyTorch route masks). Nothing in the step depends on the index in Python, but on the CPU, where nothing is graphed.

Each method says where a decoded query places each key relative to itself (`Placement`, from its `decode_placement`,
a function of tensors): RoPE sees only the difference of positions, so the query stays un-rotated and each key is
rotated by its offset, recomputed every step from the un-rotated keys the cache holds (O(T) per layer): as the
attention reads it, in triton_decode's kernel on a GPU and native_decode's on a CPU (`attention_route`,
attention/decode_route.py), else in PyTorch first. The unpatched model and the rope-scaling methods cache rotated
keys as transformers does: the step rotates the new query and key with the model's own rotary at the token's index.
A cache stored in 16 bits (--kv-dtype; kv_cache.GrowingLayer) is read as it is stored: the kernels widen each row
as they load it, the PyTorch route attends a float copy of the rows, and the step's own row is written rounded.

The step is the decoder layer written out over the model's own modules (norms, projections, MLP), as gpt-fast
writes it, a family's differences declared as data (static_layers.py: Gemma 3's norms, and its local layers, which
attend their window's rows at true positions); `generate.decode` holds it to the model's own forward (the
prefill's logits of the prompt's last token) before any graph is captured, and one that differs decodes eagerly.
Shapes: B batch, H query heads, Hkv key/value heads, C the cache's rows, D head dim.
"""

import functools
import time
import warnings
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from ...errors import GaliWarning
from ...model.families import LOCAL, family_of
from ..attention.decode_route import (
    DYNAMIC_ROPE,
    ROUTE_WORDS,
    ROUTES,
    attention_route,
    decode_choice,
    no_static_step,
    static_pays,
)
from ..attention.dense import Partial, biased_partial, merge_partials
from ..contract import Placement, PositionalAttention
from ..math.noise import head_streams, standard_normal
from ..math.rope import rotate, rotate_fused
from ..math.rope import rotation as rope_rotation
from . import static_layers
from .hooks import installed_method, llama_model
from .kv_cache import GrowingLayer
from .packed_modules import model_device, model_dtype
from .projections import Projections
from .static_layers import Rope, Rotation, Span, decoder_layer, step_projections

# The first step's logits against the model's own forward: max difference / largest logit. In half precision the
# two round differently, and random weights amplify it layer after layer, every method alike, the unpatched model
# too (docs/dev/engine.md, "Decoding on a GPU: one graph a token"; the figures in docs/notes/2026-11-performance-
# history.md, "GPU: decoding as a CUDA graph (issue 26)"); a step that places keys wrongly or misses a part of the
# layer is off by O(1).
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.15
# Keys per block of a decoding step's attention, per device type (`split_key_attention`): a GPU needs blocks to be
# busy; on a CPU one call was faster (docs/performance.md, "Decoding, ms a token").
KEY_BLOCK = {"cuda": 256}


def why_not_static(model: PreTrainedModel, cache: DynamicCache) -> str | None:
    """Why `model` cannot decode on `cache` with the static step (None: it can)."""
    base = llama_model(model)
    family = family_of(model.config)
    if type(model).__name__ != family.causal_lm or any(type(layer).__name__ != family.decoder_layer
                                                       for layer in base.layers):
        return f"{type(model).__name__} is not a plain {family.causal_lm}"
    if family.no_static_step is not None:
        return family.no_static_step
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped, which the static step's attention does not apply"
    devices = {parameter.device for parameter in model.parameters()}
    if len(devices) != 1:
        return "the model is spread over several devices"
    if not all(isinstance(layer, GrowingLayer) and layer.capacity() for layer in cache.layers):
        return "the KV cache is not gali's, with rows reserved"
    method = installed_method(model)
    if method is None:
        rope_type = getattr(getattr(base.rotary_emb, "rescaled", base.rotary_emb), "rope_type", "default")
        if any("dynamic" in kind for kind in (rope_type.values() if isinstance(rope_type, dict) else [rope_type])):
            return DYNAMIC_ROPE
        return None
    if type(method).decode_placement is PositionalAttention.decode_placement:
        return no_static_step(method.name)
    return None


def static_decoder(model: PreTrainedModel, cache: DynamicCache) -> "StaticDecoder | None":
    """The static step for decoding `model` on `cache` where GALI_DECODE asks for it and the model and cache allow
    it (`why_not_static`), else None: decode eagerly.

    auto takes it where it was measured to pay (docs/dev/engine.md; the figures in docs/notes/2026-11-performance-
    history.md, "The static step through the native kernel (issue 26)"): on a GPU for every method (a graph replay);
    on a CPU, where nothing is graphed, for every method where the native kernel attends (faster than the eager step
    of SelfExtend and GALI, as fast as the unpatched step), else for the models whose cache holds rotated keys (the
    unpatched model, NTK, YaRN), not for the position-remapping methods, whose eager step
    keeps its rotated keys from token to token and beats rotating them all in PyTorch past a few thousand tokens
    (`static_pays`)."""
    choice = decode_choice()
    if choice == "eager" or why_not_static(model, cache):
        return None
    route = model_route(model)
    pays = static_pays(model_device(model).type, route, installed_method(model) is not None)
    return StaticDecoder(model, cache, route) if choice == "static" or pays else None


def model_route(model: PreTrainedModel) -> str:
    """`attention_route` for `model`'s device, dtype and heads."""
    config = model.config
    head_dim = llama_model(model).layers[0].self_attn.head_dim
    return attention_route(model_device(model), model_dtype(model), head_dim,
                           config.num_attention_heads // config.num_key_value_heads)


class StaticDecoder:
    """One decoding step of `model` on `cache` as a function of two one-element tensors (the token, its index),
    over the cache's reserved rows; replayed as a CUDA graph on a GPU once it is checked against the model's own
    forward (`check`). `route`: how it attends over the cache ("triton", "native" or "torch"; None: `model_route`).
    `grid_weights`: whether the native route multiplies by the projections held on grids where they lie on them
    (projections.py; False: in PyTorch, as benchmarks compare).
    """

    def __init__(self, model: PreTrainedModel, cache: DynamicCache, route: str | None = None,
                 grid_weights: bool = True) -> None:
        self.model = model
        self.base = llama_model(model)
        self.method = installed_method(model)
        self.layers = cache.layers
        self.capacity = min(layer.capacity() for layer in self.layers)
        for layer in self.layers:  # rows not written yet hold whatever the allocator left, NaN included: the step
            count = layer.keys.shape[-2]  # attends over them masked, and NaN times 0 is NaN, so they are zeroed
            for buffer in layer.storage():
                buffer[:, :, count:].zero_()
        self.device, self.dtype = model_device(model), model_dtype(model)
        self.key_block = KEY_BLOCK.get(self.device.type)
        if route not in (None, *ROUTES):
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        self.route = route or model_route(model)
        self.streams: dict[int, torch.Tensor] = {}  # each layer's noise streams, for the Triton kernel
        self.offset_tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # `_offset_table`
        self.kernel_splits: int | None = None  # runs per key head (None: the kernel's own choice)
        batch = self.layers[0].keys.shape[0]
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.index = torch.zeros((), dtype=torch.long, device=self.device)
        self.keys = torch.arange(self.capacity, device=self.device)
        self.family = family_of(model.config)
        self.kinds = static_layers.layer_kinds(model.config, len(self.layers))  # global, or local (Gemma 3)
        self.window = model.config.sliding_window if LOCAL in self.kinds else None
        self.gather_windows = self.device.type != "cpu"  # a local layer's window: no host read where graphed
        self.final_cap = getattr(model.config, "final_logit_softcapping", None)
        # The ropes the method's keys are rotated by (the global layers', and the local layers' own), per layer kind
        self.ropes: dict[str, Rope] = {} if self.method is None else static_layers.method_ropes(
            model, self.kinds, self.device)
        self.grid_weights = grid_weights
        self.projections: Projections = step_projections(model, False)  # grids on the native route (`_first_static`)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output
        self.checked = False  # the step agreed with the model's own forward (`check`)
        self.difference: float | None = None
        self.capture_seconds = 0.0

    def step(self, token: int, index: int) -> torch.Tensor:
        """The logits (vocab,) float32 after token `token` at token index `index` (the cache holds tokens [0,
        index) and afterwards [0, index]); a view the next step overwrites when graphed."""
        if index >= self.capacity:
            raise ValueError(f"token index {index} is past the {self.capacity} rows reserved")
        self.token.fill_(token)
        self.index.fill_(index)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._step()
        for layer in self.layers:  # the cache's views now end after this token, as an eager forward leaves them
            layer.extend(index + 1)
        return logits[0, -1]

    def first_step(self, token: int, index: int, eager: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The first step, held to the model's own forward: `eager()` appends token `token` at `index` to the cache
        and returns its logits, which this returns, after `check`ing the static step against them."""
        logits = eager()
        self.check(token, index, logits)
        return logits

    def check(self, token: int, index: int, expected: torch.Tensor) -> bool:
        """Hold the static step to the model's own forward, whose logits after token `token` at `index` (the last row
        the cache holds) are `expected`: the step is taken at that index (its row of keys and values then put back
        as the forward wrote it), and `checked` set when their logits agree within rounding. `generate.decode` holds
        it to the prefill's logits of the prompt's last token, which cost no forward of their own (an eager forward
        to check against costs several steps: 4-11 of the graph's on a GPU, docs/performance.md).

        On a GPU it then records the step as a CUDA graph (this step was its warm-up; recording runs no kernel),
        which later `step`s replay. A step that disagrees, or a graph that cannot be recorded, warns once: decoding
        stays eager. Through a kernel (`route` triton or native), a step that fails or disagrees is taken again with
        the keys rotated in PyTorch, and held to the forward in turn. Returns `checked`."""
        written = [tuple(buffer[:, :, index].clone() for buffer in layer.storage()) for layer in self.layers]
        try:
            self.difference = difference(self._first_static(token, index), expected)
            if self.route != "torch" and not agrees(self.dtype, self.difference):
                kernel_difference, self.route = self.difference, "torch"
                self.projections = step_projections(self.model, False)
                self.difference = difference(self.step(token, index), expected)
                if agrees(self.dtype, self.difference):
                    warnings.warn(f"the decoding kernel differs from the model's own forward here (relative "
                                  f"difference {kernel_difference:.2g}); attending in PyTorch", GaliWarning,
                                  stacklevel=2)
        finally:  # the forward's own row: what follows reads the keys and values it would have read without a check
            for layer, rows in zip(self.layers, written, strict=True):
                for buffer, row in zip(layer.storage(), rows, strict=True):
                    buffer[:, :, index] = row
        if not agrees(self.dtype, self.difference):
            warnings.warn(f"the static decoding step differs from the model's own forward here (relative "
                          f"difference {self.difference:.2g}); decoding eagerly", GaliWarning, stacklevel=2)
            return False
        if self.device.type == "cuda":
            started = time.perf_counter()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.logits = self._step()
            except RuntimeError as failure:
                warnings.warn(f"the decoding step cannot be recorded as a CUDA graph here ({failure}); decoding "
                              f"eagerly", GaliWarning, stacklevel=2)
                return False
            self.graph, self.capture_seconds = graph, time.perf_counter() - started
        self.checked = True
        return True

    def description(self) -> str:
        """How this step decodes, in words (for -v): graphed or not, its attention's route, and the share of the
        projections' weights it multiplies as bytes on grids."""
        parts = ["static step" + (" as a CUDA graph" if self.graph is not None else ""),
                 ROUTE_WORDS[self.route]]
        share = self.projections.grid_share()
        if share:
            parts.append(f"{share:.0%} of the projections' weights as bytes")
        return ", ".join(parts)

    def _first_static(self, token: int, index: int) -> torch.Tensor:
        """The first static step's logits (a copy); a kernel that cannot be built or launched here (Triton's
        compiler, the GPU's resources) warns and leaves the attention to PyTorch. On the native route the model's
        projections are held on grids where they lie on them (projections.py: packed now, after the answer's first
        token, once per model)."""
        if self.route == "torch":
            return self.step(token, index).clone()
        if self.route == "native" and self.grid_weights:
            self.projections = step_projections(self.model, True)
        try:
            self._check_reach(index)
            return self.step(token, index).clone()
        except Exception as failure:  # whatever Triton raises compiling or launching is this check's finding
            warnings.warn(f"the decoding kernel cannot run here ({type(failure).__name__}: "
                          f"{' '.join(str(failure).split())[:160]}); attending in PyTorch", GaliWarning, stacklevel=3)
            self.route, self.projections = "torch", step_projections(self.model, False)
            return self.step(token, index).clone()

    def _check_reach(self, index: int) -> None:
        """Where the method declares a reach, that its offsets keep to it at this token and at the last this step
        will see (whose keys lie farthest; tests/engine/seam/test_static_decode.py sweeps every token): a kernel
        reads its table rows by them, and a graph reads nothing on the host afterwards."""
        if self.method is None:
            return
        for query in {index, self.capacity - 1}:
            placement = self.method.decode_placement(torch.tensor(query, device=self.device), self.keys)
            if placement.reach is None:
                return
            offsets = placement.offset[: query + 1]
            if offsets.is_floating_point() or int(offsets.min()) < -placement.reach or int(offsets.max()) > 0:
                raise ValueError(f"{type(self.method).__name__}'s offsets at token {query} leave its declared reach "
                                 f"{placement.reach} ({int(offsets.min())}..{int(offsets.max())})")

    def _step(self) -> torch.Tensor:
        """The step itself: (B, 1, vocab) float32 logits. Every tensor it reads that changes from token to token is
        `self.token`, `self.index` or the cache's buffers (on the CPU, a local layer's window is read from the index:
        nothing is graphed there)."""
        masked = self.route == "torch"  # the kernels read the index themselves, and no key past it
        spans = {kind: static_layers.span(kind, self.index, self.window, self.capacity, self.dtype, masked,
                                          self.gather_windows) for kind in set(self.kinds)}
        hidden = self.base.embed_tokens(self.token)
        rotations = {kind: self._rotation(kind, hidden, span) for kind, span in spans.items()}  # shared by layers
        for number, parts in enumerate(self.projections.layers):  # the model's layers, their projections on grids
            kind = self.kinds[number]
            hidden = decoder_layer(parts, self.family.qk_norm, hidden, functools.partial(
                self._attend, number, rotations[kind], spans[kind]))
        return static_layers.soft_capped(self.projections.logits(hidden).float(), self.final_cap)

    def _rotation(self, kind: str, hidden: torch.Tensor, span: Span) -> Rotation:
        """How a layer of `kind` rotates: the unpatched model's new query and key at the index (in the hidden
        states' dtype), or each key by its offset from the method's placement (a local layer's: its window's)."""
        if self.method is None:
            return static_layers.token_rotation(self.model, hidden, self.index, kind, self.family.layer_kinds)
        if kind == LOCAL:
            return self._key_rotation(static_layers.window_placement(span), kind)
        return self._key_rotation(self.method.decode_placement(self.index, self.keys), kind)

    def _key_rotation(self, placement: Placement, kind: str) -> Rotation:
        """cos/sin (C, D) in the model's dtype rotating each key by its offset (float64 angles, as the methods'
        far rotations) on the rope of layers of `kind`, shared by them; (C, D/2) for the kernels, which need one of
        the equal halves; or, for a kernel and offsets within a reach, a row per key of `_offset_table`."""
        if placement.reach is not None and placement.offset.dim() == 1 and self.route != "torch":
            # no key of the cache lies farther than its capacity: a table past it (GALI's reach is train_len, 32k
            # for Gemma 3) would only take memory
            cos, sin = self._offset_table(min(placement.reach, self.capacity), kind)
            mix = None if placement.weight is None else placement.weight.float()
            return Rotation(cos, sin, placement, placement.offset.neg().int(), mix)
        inv_freq, scaling = self.ropes[kind]
        offset = placement.offset if placement.offset.dim() == 2 else placement.offset.unsqueeze(-1)
        angles = offset * inv_freq
        cos, sin = angles.cos(), angles.sin()
        if placement.weight is not None:  # GALI: (1 - c) R(p) + c R(p - 1)
            below = angles - inv_freq
            weight = placement.weight.unsqueeze(-1)
            cos, sin = torch.lerp(cos, below.cos(), weight), torch.lerp(sin, below.sin(), weight)
        if self.route == "torch":  # the kernels read the first half of a table whose halves are equal
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        cos, sin = (x.mul(scaling).to(self.dtype) for x in (cos, sin))
        return Rotation(cos, sin, placement)

    def _offset_table(self, reach: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (reach + 2, D) float32 of the offsets 0, -1, ..., -(reach + 1) on the rope of layers of `kind`
        (row d: offset -d; the last row is GALI's R(p - 1) at the farthest key; the kernels read the first of the
        equal halves), as `_key_rotation`'s table. Made at the first step, before a CUDA graph is recorded, and
        kept."""
        if (reach, kind) not in self.offset_tables:
            offsets = torch.arange(reach + 2, device=self.device).neg().unsqueeze(-1)
            self.offset_tables[reach, kind] = rope_rotation(offsets, *self.ropes[kind], torch.float32)
        return self.offset_tables[reach, kind]

    def _attend(self, number: int, rotation: Rotation, span: Span, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scaling: float) -> torch.Tensor:
        """Layer `number`'s attention of the one query over the cache's rows of its `span`, its key and value written
        at the index."""
        layer = self.layers[number]
        where = rotation.placement
        if where is None:  # the cache holds keys rotated at their token indices, as transformers rotates them
            query, key = rotate(query, rotation.cos, rotation.sin), rotate(key, rotation.cos, rotation.sin)
        layer.write(self.index, key, value)  # in the cache's stored dtype
        keys, values = (span.take(buffer) for buffer in layer.storage())
        if self.route != "torch":  # the kernels load the stored rows, converting each as they read it
            return self._kernel_attend(number, scaling, query, keys, values, rotation, span.index)
        # A 16-bit cache of a float32 model: its rows read in float32, a transient copy of the rows attended
        keys, values = keys.to(self.dtype), values.to(self.dtype)
        bias = span.mask
        if where is not None:
            keys = rotate_fused(keys, rotation.cos, rotation.sin)
            query = query * where.query_scale
            if where.noise_sigma is not None:
                draws = standard_normal(self.method.noise(number), query.shape[0], query.shape[1], self.index.view(1),
                                        span.rows)
                bias = (draws * where.noise_sigma).to(self.dtype) + bias  # (B, H, 1, C), on the scaled logits
        batch, heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        rows = query.to(keys.dtype).view(batch, kv_heads, heads // kv_heads, dim)  # heads sharing a key head as rows
        if bias.shape[1] > 1:
            bias = bias.view(batch, kv_heads, heads // kv_heads, span.rows)
        output = split_key_attention(rows, keys, values, bias, scaling, self.key_block)
        return output.view(batch, heads, 1, dim).to(values.dtype)

    def _kernel_attend(self, number: int, scaling: float, query: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, rotation: Rotation, index: torch.Tensor) -> torch.Tensor:
        """`_attend` through the route's kernel (triton_decode's or native_decode's) over `keys` up to row `index`:
        the keys rotated as they are read, GALI's noise drawn in it, nothing past the index read."""
        where = rotation.placement
        cos = sin = sigma = streams = None
        if where is not None:
            cos, sin = rotation.cos, rotation.sin
            query = query * where.query_scale
            if where.noise_sigma is not None:
                sigma, streams = where.noise_sigma, self._noise_streams(number, query.shape[0], query.shape[1])
        batch, heads, _, dim = query.shape
        rows = query.to(self.dtype).view(batch, keys.shape[1], heads // keys.shape[1], dim)
        if self.route == "triton":
            from ..kernels.triton_decode import rotating_decode_attention

            output = rotating_decode_attention(rows, keys, values, index, scaling, cos, sin, sigma, streams,
                                               self.kernel_splits, rotation.table_rows, rotation.mix)
        else:  # nothing is graphed on a CPU: the index is read here
            from ..kernels.native_decode import native_decode_attention

            output = native_decode_attention(rows, keys, values, int(index), scaling, cos, sin, sigma, streams,
                                             self.kernel_splits, rotation.table_rows, rotation.mix)
        return output.view(batch, heads, 1, dim).to(self.dtype)

    def _noise_streams(self, number: int, batch: int, heads: int) -> torch.Tensor:
        """Layer `number`'s noise.head_streams in the kernel's format (int64 on the device for Triton, made on the
        first step, before any graph is recorded; int32 on the CPU for the native kernel, as its noise kernel keeps
        them)."""
        noise = self.method.noise(number)
        if self.route == "native":
            from ..kernels.native_noise import cpu_head_streams

            return cpu_head_streams(noise, batch, heads)
        if number not in self.streams:
            self.streams[number] = head_streams(noise, batch, heads, self.device)
        return self.streams[number]


def split_key_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                        scale: float, block: int | None) -> torch.Tensor:
    """One query's attention, its heads sharing a key head stacked as `rows` (B, Hkv, g, D), over keys/values
    (B, Hkv, C, D) under an additive `bias` (broadcast to (B, Hkv, g, C)): (B, Hkv, g, D) float32, contiguous.

    Flash-decoding: one attention call spreads over the device by heads and query blocks only, 8 blocks of work for
    a Llama-3 decoding step on a GPU of 132 multiprocessors, which then read the cache far below its bandwidth
    (docs/notes/2026-11-performance-history.md, "GPU: decoding as a CUDA graph (issue 26)").
    Cut into blocks of `block` keys, each block its own head of one call (views of the cache, nothing copied), the
    blocks' partial softmaxes merged by their log-sum-exps (exact), the keys past the last whole block a second call.
    `block` None: one call over all keys.
    """
    batch, kv_heads, group, dim = rows.shape
    count = keys.shape[2]
    blocks = count // block if block else 0
    whole = blocks * (block or 0)
    bias = bias.expand(batch, kv_heads, group, count)
    parts = []
    if blocks:
        def per_block(x: torch.Tensor) -> torch.Tensor:  # (B, Hkv, C, D) -> (B * Hkv, blocks, block, D), a view
            return x[:, :, :whole].reshape(batch * kv_heads, blocks, block, dim)

        queries = rows.reshape(batch * kv_heads, 1, group, dim).expand(-1, blocks, -1, -1).contiguous()
        block_bias = bias[..., :whole].reshape(batch * kv_heads, group, blocks, block).transpose(1, 2)
        part = biased_partial(queries, per_block(keys), per_block(values), block_bias.contiguous(), scale)
        lse = part.lse.view(batch, kv_heads, blocks, group)
        total = torch.logsumexp(lse, dim=2)
        share = torch.exp(lse - total.unsqueeze(2)).unsqueeze(-1)
        output = (part.output.view(batch, kv_heads, blocks, group, dim).float() * share).sum(2)
        parts.append(Partial(output, total))
    if whole < count:
        part = biased_partial(rows, keys[:, :, whole:], values[:, :, whole:], bias[..., whole:].contiguous(), scale)
        parts.append(Partial(part.output.float(), part.lse))
    # Contiguous: torch's memory-efficient CUDA kernel returns its output as a transposed view (it computes in
    # (B, q, H, D)), which a lone part would hand on as it is, and the caller views the rows as heads.
    return merge_partials(parts).output.contiguous()


def difference(static: torch.Tensor, eager: torch.Tensor) -> float:
    """How far the static step's logits are from the model's own forward's for the same token, relative to the
    largest logit."""
    return float((static.float() - eager.float()).abs().max() / eager.float().abs().max().clamp(min=1e-6))


def agrees(dtype: torch.dtype, relative_difference: float) -> bool:
    """Whether a `difference` is within the rounding of `dtype` (a step that placed a key wrongly is far off)."""
    return relative_difference <= CHECK_TOLERANCE.get(dtype, HALF_TOLERANCE)
