"""The method contract: what a position-remapping method (GALI, SelfExtend, ChunkLlama, ReRoPE, DPE, STRING, LaMPE,
SELF) implements and what it is handed, in one module. A method subclasses `PositionalAttention`; the hooks
(seam/hooks.py) call its `attend` with a `Forward` for every layer of a prefill chunk or eager decoding step, and the
static decoding step (seam/static_decode.py) asks its `decode_placement` once per token for a `Placement`, which the
PyTorch step and both kernels (kernels/triton_decode.py, kernels/native_decode.py) consume. `KeptKeys` holds the
rotated keys a method keeps with the KV cache between forwards.

Nothing here hooks transformers or records the decoding step: a method imports this module, the math and the
attention routes, never the seam.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import StaticCache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .attention.choice import plan_for
from .attention.kept_keys import KeptKeys, Rotation
from .attention.plan import AttentionPlan
from .math.noise import Noise
from .math.rope import RopeTable, rotate, rotation

__all__ = ["Forward", "Installed", "KeptKeys", "Placement", "PositionalAttention", "Rotation"]


class PositionalAttention(ABC):
    """A method that rotates queries and keys itself, with positions of its own, from un-rotated ones."""

    name: str  # the attention implementation it registers as
    exact_until: int  # a forward ending at or before this token is computed exactly as the unpatched model does

    @abstractmethod
    def table_rows(self, start: int, stop: int) -> int:
        """How many integer positions (from 0) the rotations of a forward over tokens [start, stop) use."""

    @abstractmethod
    def attend(self, forward: "Forward", module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """Attention of the forward's queries (B, H, q, D) over keys/values (B, Hkv, >= stop, D): (B, q, H, D)."""

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> "Placement":
        """Where one decoded query, at the token index `query` (a 0-d int64 tensor), places the keys of token indices
        `keys` (C,), for the static decoding step (static_decode.py): tensor operations only, nothing that reads
        `query` in Python, so that a CUDA graph replays it for any index. A method that does not say decodes
        eagerly."""
        raise NotImplementedError

    def noise(self, layer: int) -> Noise | None:
        """The logit noise layer `layer` draws where a placement gives a `noise_sigma` (GALI's), whichever route
        attends: the forward's or the static step's. None: the method adds none."""
        return None


@dataclass
class Installed:
    """What `install` changed on a model, so that `uninstall` can put it back."""

    method: PositionalAttention
    rotary: nn.Module  # what the method rotates by: the model's rotary (two kinds: the global layers' rope of it)
    original_attention: str
    config: Any  # the config object the model had, perhaps shared with other models
    hook: RemovableHandle | None = None
    check: RemovableHandle | None = None
    module: nn.Module | None = None  # the model's rotary module, put back by `uninstall`
    local_rotary: Any = None  # the local layers' rope where a family has two kinds (model/families.py), else None


class Forward:
    """One forward over tokens [start, stop): what all its layers share, built once on first use."""

    def __init__(self, installed: Installed, start: int, stop: int, cache: Any = None) -> None:
        self.installed = installed
        self.start, self.stop = start, stop
        self.cache = cache  # the model's KV cache object, if it was given one
        # A StaticCache hands every layer all its slots; any other cache exactly the keys of tokens [0, stop).
        self.preallocated = isinstance(cache, StaticCache)
        self.plan: AttentionPlan | None = None  # decided by the first layer (`attention_plan`)
        self._memo: dict[tuple, Any] = {}

    def attention_plan(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                       noise: bool = False) -> AttentionPlan:
        """The routes every layer of this forward takes (plan.py): decided by its first layer, from its tensors
        (their device and dtype are first known there), and followed by the others without checking again."""
        if self.plan is None:
            self.plan = plan_for(query, key, value, dropout, noise)
        return self.plan

    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """`build()` once per forward and key (e.g. per device and dtype); later layers reuse it."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def table(self, device: torch.device, dtype: torch.dtype) -> RopeTable:
        """The model's own cos/sin at positions 0..rows-1, in `dtype` and in float32."""
        return self.memo(("table", device, dtype), lambda: self._build_table(device, dtype))

    def at_token_index(self, first: int, last: int, device: torch.device,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (last - first, D) of the model's rotary at token indices [first, last), where the unpatched model
        rotates them (any index, float64 angles: rope.rotation), in `dtype`; built once per forward."""
        rotary = self.installed.rotary
        return self.memo(("token-index", device, dtype, first, last), lambda: rotation(
            torch.arange(first, last, device=device).unsqueeze(-1), rotary.inv_freq, rotary.attention_scaling, dtype))

    def _build_table(self, device: torch.device, dtype: torch.dtype) -> RopeTable:
        method = self.installed.method
        # The exact path needs the plain positions 0..stop-1 while the method promises exactness.
        rows = max(method.table_rows(self.start, self.stop), min(self.stop, method.exact_until))
        positions = torch.arange(rows, device=device).unsqueeze(0)
        cos32, sin32 = self.installed.rotary(torch.empty(0, dtype=torch.float32, device=device), positions)
        # .to(device): under a device map, accelerate's hook on the rotary module returns them on its own device.
        cos32, sin32 = cos32[0].float().to(device), sin32[0].float().to(device)
        return RopeTable(cos32.to(dtype), sin32.to(dtype), cos32, sin32)

    def exact_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        last: int, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """The unpatched model's computation for this forward's queries up to token `last`: the same rotation
        (plain RoPE from the model's own table), attention function and mask. Returns (B, n, H, D)."""
        queries = last - self.start
        table = self.table(query.device, query.dtype)
        query = rotate(query[:, :, :queries], table.cos[self.start : last], table.sin[self.start : last])
        key = rotate(key[:, :, :last], table.cos[:last], table.sin[:last])
        mask = self.memo(("mask", last, query.device), lambda: self._original_mask(module, query, last))
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.installed.original_attention, eager_attention_forward)
        output, _ = attention(module, query, key, value[:, :, :last], mask, dropout=dropout, scaling=scaling,
                              **kwargs)
        return output

    def local_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        window: int, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """A local layer's attention (a family with two kinds of layers): as the unpatched model computes it, with
        the local rope at the true positions and the sliding window of `window` tokens, over the keys of tokens
        [start - window + 1, stop) only (the cache holds them all). Returns (B, q, H, D).

        The queries go in blocks of `window`, each over its own keys (the window before it and itself): a forward of
        n queries then computes about 2·window logits a query rather than n + window, most of them masked (the
        unpatched model's masked square)."""
        first = max(0, self.start - window + 1)
        cos, sin = self.memo(("local", query.device, query.dtype), lambda: self._local_table(query, first))
        query = rotate(query[:, :, : self.stop - self.start], cos[self.start - first :], sin[self.start - first :])
        key = rotate(key[:, :, first : self.stop], cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.installed.original_attention, eager_attention_forward)
        blocks = []
        for block in range(self.start, self.stop, window):
            last = min(block + window, self.stop)
            keys_from = max(first, block - window + 1)
            mask = self.memo(("local-mask", block, query.device), partial(
                self._original_mask, module, query[:, :, : last - block], last, keys_from,
                sliding_window_causal_mask_function(window), queries_from=block))
            output, _ = attention(module, query[:, :, block - self.start : last - self.start],
                                  key[:, :, keys_from - first : last - first], value[:, :, keys_from:last], mask,
                                  dropout=dropout, scaling=scaling, **kwargs)
            blocks.append(output)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    def _local_table(self, query: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The local rope's cos/sin at tokens [first, stop), computed as the unpatched model computes them."""
        positions = torch.arange(first, self.stop, device=query.device).unsqueeze(0)
        cos, sin = self.installed.local_rotary(query, positions)
        return cos[0].to(query.device), sin[0].to(query.device)

    def _original_mask(self, module: nn.Module, query: torch.Tensor, last: int, first_key: int = 0,
                       window_function: Callable | None = None, queries_from: int | None = None) -> Any:
        """The unpatched model's mask for the queries of tokens [queries_from (default: start), last) over the keys
        of tokens [first_key, last), as its attention implementation takes it (None: that implementation needs
        none)."""
        make_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(self.installed.original_attention)
        if make_mask is None:
            return None
        queries_from = self.start if queries_from is None else queries_from
        return make_mask(batch_size=query.shape[0], q_length=last - queries_from, kv_length=last - first_key,
                         q_offset=queries_from, kv_offset=first_key,
                         mask_function=window_function or causal_mask_function, attention_mask=None,
                         allow_is_causal_skip=window_function is None, dtype=query.dtype, config=module.config,
                         use_vmap=False, device=query.device)


class Placement(NamedTuple):
    """Where one decoded query places each of the cache's keys, as tensors (no Python value depends on the query's
    index), the same for every layer.

    `offset`: the key's position minus the query's, float64 or whole numbers, (C,) or (C, D/2) for a position per
        frequency (DPE).
    `weight`: GALI's interpolation: key j is rotated by (1 - c) R(offset) + c R(offset - 1), c = weight[j] (None: 0).
    `noise_sigma`: GALI's noise strength per key (float32, 0 where c = 0); each layer draws its own normals.
    `query_scale`: multiplies the query (ReRoPE's log n, STRING's and LaMPE's logit scale).
    `reach`: the offsets of the keys up to the query are whole numbers in [-reach, 0] (GALI's: inside the training
        window). A kernel then rotates each key from a table of RoPE per offset, reach + 2 rows made once, instead of
        a (C, D/2) table of float64 angles made every step (a cost that grows with the cache and kept GALI's step
        behind the unpatched one on a GPU: docs/notes/2026-11-performance-history.md, "GPU: decoding as a CUDA graph
        (issue 26)") and read by every layer. None: no such bound.
    """

    offset: torch.Tensor
    weight: torch.Tensor | None = None
    noise_sigma: torch.Tensor | None = None
    query_scale: torch.Tensor | float = 1.0
    reach: int | None = None
