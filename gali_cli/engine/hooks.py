"""Hooking a position-remapping attention (GALI, SelfExtend, Dual Chunk Attention) into a transformers Llama through
its public extension points only.

- The model's rotary embedding is swapped for a stand-in that leaves queries and keys un-rotated, so the KV cache
  holds keys without RoPE (a token's K/V still come from the forward that processed it).
- A forward pre-hook on the LlamaModel reads how many tokens are cached and how many are new (finding the cache
  whatever the installed release calls it: seam.py), and passes a `Forward` down as the keyword `rope_forward`,
  which transformers forwards to the attention function. The attention checks that the keys it receives are exactly
  the forward's (for a growing cache: the forward's end), so a release that hands the cache over differently fails
  loudly instead of computing at wrong positions; a forward hook checks that the cache the forward was planned from
  is the one its layers filled.
- The method's attention is registered in `AttentionInterface` under its name; a mask function under the same name
  keeps transformers from building a (q x T) mask: the methods mask their own way.
- Transformers picks the attention from the model's config object, which models built from one config share: the
  patched model gets its own copy first, so that patching one never switches the others.

Position ids given to the model must stay a plain arange: the methods never fake them (transformers would read
non-arange positions as packed sequences).
"""

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import AttentionInterface, PreTrainedModel, StaticCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from ..compat import warn_if_untested
from ..errors import GaliError, UnsupportedModelError
from ..model.families import family_of, why_no_methods
from .plan import AttentionPlan, plan_for
from .rope import RopeTable, rotate, rotation
from .seam import cached_tokens, forward_arguments, seam_error

if TYPE_CHECKING:
    from .static_decode import Placement

# Rope types whose frequencies do not depend on the sequence length: integer positions index them directly.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


@dataclass
class Installed:
    """What `install` changed on a model, so that `uninstall` can put it back."""

    method: PositionalAttention
    rotary: nn.Module
    original_attention: str
    config: Any  # the config object the model had, perhaps shared with other models
    hook: RemovableHandle | None = None
    check: RemovableHandle | None = None


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

    def _original_mask(self, module: nn.Module, query: torch.Tensor, last: int) -> Any:
        make_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(self.installed.original_attention)
        if make_mask is None:
            return None
        return make_mask(batch_size=query.shape[0], q_length=last - self.start, kv_length=last, q_offset=self.start,
                         kv_offset=0, mask_function=causal_mask_function, attention_mask=None,
                         allow_is_causal_skip=True, dtype=query.dtype, config=module.config, use_vmap=False,
                         device=query.device)


def install(model: PreTrainedModel, method: PositionalAttention) -> None:
    """Patch `model` in place to compute attention with `method`, replacing any method installed before."""
    base = llama_model(model)
    refusal = why_no_methods(model.config)
    if refusal is not None:
        raise UnsupportedModelError(f"{method.name} does not apply to this model: {refusal}")
    warn_if_untested()
    if hasattr(base, "_positional"):
        uninstall(model)
    AttentionInterface.register(method.name, _attention)
    AttentionMaskInterface.register(method.name, _no_mask)
    installed = Installed(method, base.rotary_emb, model.config._attn_implementation, model.config)
    _replace_config(model, model.config, copy.deepcopy(model.config))
    base.rotary_emb = _UnrotatedQueriesAndKeys(base.rotary_emb, model.config)
    model.set_attn_implementation(method.name)
    installed.hook = base.register_forward_pre_hook(partial(_plan_forward, installed), with_kwargs=True)
    installed.check = base.register_forward_hook(_check_cache_filled, with_kwargs=True)
    base._positional = installed


def uninstall(model: PreTrainedModel) -> None:
    """Undo `install`: the original rotary module, attention implementation and no hook."""
    base = llama_model(model)
    installed = getattr(base, "_positional", None)
    if installed is None:
        raise GaliError("no position-remapping method is applied to this model")
    installed.hook.remove()
    installed.check.remove()
    base.rotary_emb = installed.rotary
    _replace_config(model, model.config, installed.config)  # it still names the original attention
    del base._positional


def installed_method(model: PreTrainedModel) -> PositionalAttention | None:
    installed = getattr(llama_model(model), "_positional", None)
    return None if installed is None else installed.method


def original_rotary(model: PreTrainedModel) -> nn.Module | None:
    """The model's own rotary embedding that an installed method set aside (its frequencies and attention scaling
    are what the method rotates by), or None when no method is installed."""
    installed = getattr(llama_model(model), "_positional", None)
    return None if installed is None else installed.rotary


def _replace_config(model: nn.Module, old: Any, new: Any) -> None:
    """Every module of `model` that holds the config object `old` (the model, its layers, attention, rotary) gets
    `new` instead."""
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


class _UnrotatedQueriesAndKeys(nn.Module):
    """Stands in for the model's rotary embedding: cos = 1, sin = 0, so attention receives q and k un-rotated."""

    def __init__(self, rotary: nn.Module, config) -> None:
        super().__init__()
        self.rotary = rotary  # kept as a child so that .to() and device maps still move it
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape[:2], self.head_dim)
        return x.new_ones(1, 1, 1).expand(shape), x.new_zeros(1, 1, 1).expand(shape)


def _plan_forward(installed: Installed, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the LlamaModel: hand the forward's extent to every layer."""
    given = forward_arguments(module, args, kwargs)
    tokens = given.get("input_ids")
    if tokens is None:
        tokens = given.get("inputs_embeds")
    if tokens is None:
        return None  # transformers reports the missing input itself
    if module.config._attn_implementation != installed.method.name:
        raise GaliError(
            f"the attention implementation was changed to {module.config._attn_implementation!r} after "
            f"{installed.method.name} was applied; remove the method first"
        )
    new_tokens = tokens.shape[1]
    cache = given["cache"]
    start = cached_tokens(cache)
    position_ids = given.get("position_ids")
    if position_ids is not None:
        expected = torch.arange(start, start + new_tokens, device=position_ids.device)
        if not torch.equal(position_ids, expected.expand_as(position_ids)):
            raise GaliError(
                f"{installed.method.name} computes positions itself: position_ids must be omitted or count up from "
                "the cache length"
            )
    kwargs["rope_forward"] = Forward(installed, start, start + new_tokens, cache)
    return args, kwargs


def _check_cache_filled(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook of the LlamaModel: the cache the forward was planned from must be the one the layers filled.
    A release that ignores the name the cache was given by (e.g. `cache=` before 5.24) runs every forward on a new,
    empty cache; nothing in the attention can notice that, so the forward's result is refused here."""
    forward = kwargs.get("rope_forward")
    if forward is not None and forward.cache is not None and cached_tokens(forward.cache) != forward.stop:
        raise seam_error(
            f"the KV cache holds {cached_tokens(forward.cache)} tokens after the forward, not {forward.stop}: the "
            "forward did not fill it (given under a name this release ignores?)"
        )


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    rope_forward: Forward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention: query (B, H, q, D), key/value (B, Hkv, >= T, D), all un-rotated."""
    if rope_forward is None:
        raise GaliError("this attention needs the model's forward (it knows the positions); call the model")
    if attention_mask is not None:
        raise GaliError("a custom 4D attention_mask is not supported: the method builds its own causal masks")
    _check_extent(rope_forward, module, query, key)
    method = rope_forward.installed.method
    if rope_forward.stop <= method.exact_until:
        output = rope_forward.exact_attention(module, query, key, value, rope_forward.stop, scaling, dropout,
                                              **kwargs)
    else:
        output = method.attend(rope_forward, module, query, key, value, scaling, dropout, **kwargs)
    # Methods merge their parts in float32; the layer's output projection takes the model's dtype.
    return output.to(value.dtype).contiguous(), None


def _check_extent(forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
    """The attention must receive this forward's queries over exactly the keys of tokens [0, stop) (a StaticCache:
    at least that many slots). Anything else means the hook saw a different cache than the attention uses (the
    cache argument handed over in a way gali does not know) or that the cache was changed behind gali's back:
    positions computed from it would be wrong, so nothing is computed."""
    new_tokens = forward.stop - forward.start
    keys_match = key.shape[2] >= forward.stop if forward.preallocated else key.shape[2] == forward.stop
    if query.shape[2] != new_tokens or not keys_match:
        raise seam_error(
            f"layer {getattr(module, 'layer_idx', '?')} received {query.shape[2]} queries over {key.shape[2]} keys, "
            f"expected {new_tokens} over {'at least ' if forward.preallocated else ''}{forward.stop} (tokens "
            f"{forward.start}..{forward.stop}): the cache reached it unseen by gali's hook, or was cut or shared "
            "between forwards"
        )


def _no_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs) -> None:
    """The methods mask their own way; this only rejects padding, which their positions cannot account for."""
    if attention_mask is not None and not bool(attention_mask[:, :kv_length].all()):
        raise GaliError(
            "unpadded input needed: every sequence in a batch must have the same length (attention_mask has 0s)"
        )
    return None


def llama_model(model: nn.Module) -> PreTrainedModel:
    """The decoder model inside `model` (a LlamaModel, or its counterpart in a family of model/families.py), or an
    error naming what is not supported."""
    config = getattr(model, "config", None)
    family = family_of(config, type(model).__name__)
    base = model if hasattr(model, "rotary_emb") else getattr(model, "model", None)
    if not isinstance(base, PreTrainedModel) or not hasattr(base, "rotary_emb") or not hasattr(base, "layers"):
        raise UnsupportedModelError(f"no {family.name} decoder with a rotary embedding inside {type(model).__name__}")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported: its frequencies depend on the sequence length "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return base
