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
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ...compat import warn_if_untested
from ...errors import GaliError, UnsupportedModelError
from ...model.families import GLOBAL, LOCAL, family_of, layer_is_local, rope_parameters, why_no_methods
from ..contract import Forward, Installed, PositionalAttention
from .cache_argument import cached_tokens, forward_arguments, seam_error

# Rope types whose frequencies do not depend on the sequence length: integer positions index them directly.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    rotary, local = base.rotary_emb, None
    if family_of(model.config).layer_kinds:  # the methods rotate by the global layers' rope; local layers by theirs
        rotary = KindRotary(base.rotary_emb, GLOBAL)
        local = KindRotary(base.rotary_emb, LOCAL) if LOCAL in model.config.layer_types else None
    installed = Installed(method, rotary, model.config._attn_implementation, model.config, module=base.rotary_emb,
                          local_rotary=local)
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
    base.rotary_emb = installed.module
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


class KindRotary:
    """One kind's rope of a rotary that takes the layer kind (Gemma 3's): called with (x, positions) and holding
    `inv_freq` and `attention_scaling`, as a Llama's rotary."""

    def __init__(self, rotary: nn.Module, kind: str) -> None:
        self.rotary, self.kind = rotary, kind

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.rotary, f"{self.kind}_inv_freq")

    @property
    def attention_scaling(self) -> float:
        return getattr(self.rotary, f"{self.kind}_attention_scaling")

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids, self.kind)


class _UnrotatedQueriesAndKeys(nn.Module):
    """Stands in for the model's rotary embedding: cos = 1, sin = 0, so attention receives q and k un-rotated."""

    def __init__(self, rotary: nn.Module, config) -> None:
        super().__init__()
        self.rotary = rotary  # kept as a child so that .to() and device maps still move it
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *kind) -> tuple[torch.Tensor, torch.Tensor]:
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
    if rope_forward.installed.local_rotary is not None and layer_is_local(module.config, module.layer_idx):
        output = rope_forward.local_attention(module, query, key, value, module.config.sliding_window, scaling,
                                              dropout, **kwargs)
    elif rope_forward.stop <= method.exact_until:
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
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported: its frequencies depend on the sequence length "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return base
