"""Hooking GALI into a transformers Llama through its public extension points only.

- The model's rotary embedding is swapped for a stand-in that leaves queries and keys un-rotated, so the KV cache
  holds keys without RoPE (a token's K/V still come from the forward that processed its chunk).
- A forward pre-hook on the LlamaModel cuts each forward into GALI chunks and passes the plan down as the keyword
  `gali_plan`, which transformers forwards to the attention function.
- The attention function registered as "gali" in `AttentionInterface` rotates each chunk by its own positions; a
  mask function registered in `AttentionMaskInterface` keeps transformers from building a (q x T) mask.

Position ids given to the model must stay a plain arange: GALI never fakes them (transformers would read
non-arange positions as packed sequences).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, LlamaModel, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward
from torch.utils.hooks import RemovableHandle

from .attention import ChunkContext, RopeTable, chunk_contexts, gali_attention, rotate
from .config import GaliConfig
from .errors import GaliError, UnsupportedModelError
from .noise import Noise
from .positions import chunk_plan

ATTENTION_NAME = "gali"
# Rope types whose frequencies do not depend on the sequence length: GALI's integer positions index them directly.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_FORWARD_ARGUMENTS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds")


@dataclass
class GaliState:
    """What `apply_gali` changed on a model, so that `remove_gali` can put it back."""

    config: GaliConfig  # resolved: no None left
    rotary: nn.Module
    original_attention: str
    hook: RemovableHandle | None = None

    def attention_function(self) -> Callable:
        """The attention function the unpatched model used, for chunks inside the training window."""
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.original_attention, eager_attention_forward)


class ForwardPlan:
    """One forward's GALI chunks over tokens [start, stop); rotation tables are built once and shared by all layers."""

    def __init__(self, state: GaliState, start: int, stop: int) -> None:
        self.state = state
        self.start, self.stop = start, stop
        self.pieces = chunk_plan(start, stop, state.config.train_len, state.config.chunk_size)
        self._tables: dict[tuple, RopeTable] = {}
        self._chunks: dict[tuple, list[ChunkContext]] = {}
        self._window_masks: dict[torch.device, Any] = {}

    def chunks(self, device: torch.device, dtype: torch.dtype) -> list[ChunkContext]:
        """The contexts of all pieces, for the layers on `device` (several with device maps)."""
        key = (device, dtype)
        if key not in self._chunks:
            config = self.state.config
            table = self._table(device, dtype)
            self._chunks[key] = chunk_contexts(table, self.pieces, config.train_len, config.local_window)
        return self._chunks[key]

    def _table(self, device: torch.device, dtype: torch.dtype) -> RopeTable:
        key = (device, dtype)
        if key not in self._tables:
            config = self.state.config
            # Positions reach train_len - 1, or train_len itself when there is no local window (Alg. 2's edge).
            rows = min(self.stop, config.train_len + (config.local_window == 0))
            positions = torch.arange(rows, device=device).unsqueeze(0)
            cos32, sin32 = self.state.rotary(torch.empty(0, dtype=torch.float32, device=device), positions)
            # .to(device): under a device map, accelerate's hook on the rotary module returns them on its own device.
            cos32, sin32 = cos32[0].float().to(device), sin32[0].float().to(device)
            self._tables[key] = RopeTable(cos32.to(dtype), sin32.to(dtype), cos32, sin32)
        return self._tables[key]

    def window_mask(self, module: nn.Module, query: torch.Tensor) -> Any:
        """The mask the unpatched model would pass to its attention for the piece inside the training window."""
        key = query.device
        if key not in self._window_masks:
            first, last = self.pieces[0]
            make_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(self.state.original_attention)
            self._window_masks[key] = None if make_mask is None else make_mask(
                batch_size=query.shape[0],
                q_length=last - first,
                kv_length=last,
                q_offset=first,
                kv_offset=0,
                mask_function=causal_mask_function,
                attention_mask=None,
                allow_is_causal_skip=True,
                dtype=query.dtype,
                config=module.config,
                use_vmap=False,
                device=query.device,
            )
        return self._window_masks[key]


def apply_gali(model: PreTrainedModel, config: GaliConfig | None = None) -> PreTrainedModel:
    """Patch a transformers Llama in place so that it reads inputs longer than its training window with GALI.

    Inputs up to `train_len` tokens run exactly as before. Applying again replaces the settings.

    Returns:
        The same model, for chaining.
    """
    base = _llama_model(model)
    resolved = (config or GaliConfig()).resolved(model.config.max_position_embeddings)  # before touching the model
    if hasattr(base, "_gali"):
        remove_gali(model)
    state = GaliState(resolved, base.rotary_emb, model.config._attn_implementation)
    base.rotary_emb = _UnrotatedQueriesAndKeys(base.rotary_emb, model.config)
    model.set_attn_implementation(ATTENTION_NAME)
    state.hook = base.register_forward_pre_hook(partial(_plan_forward, state), with_kwargs=True)
    base._gali = state
    return model


def remove_gali(model: PreTrainedModel) -> PreTrainedModel:
    """Undo `apply_gali`: the original rotary module, attention implementation and no hook."""
    base = _llama_model(model)
    state = getattr(base, "_gali", None)
    if state is None:
        raise GaliError("remove_gali: GALI is not applied to this model")
    state.hook.remove()
    base.rotary_emb = state.rotary
    model.set_attn_implementation(state.original_attention)
    del base._gali
    return model


def gali_settings(model: PreTrainedModel) -> GaliConfig | None:
    """The resolved settings GALI runs with on `model`, or None when it is not applied."""
    state = getattr(_llama_model(model), "_gali", None)
    return None if state is None else state.config


class _UnrotatedQueriesAndKeys(nn.Module):
    """Stands in for the model's rotary embedding: cos = 1, sin = 0, so attention receives q and k un-rotated."""

    def __init__(self, rotary: nn.Module, config) -> None:
        super().__init__()
        self.rotary = rotary  # kept as a child so that .to() and device maps still move it
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape[:2], self.head_dim)
        return x.new_ones(1, 1, 1).expand(shape), x.new_zeros(1, 1, 1).expand(shape)


def _plan_forward(state: GaliState, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the LlamaModel: cut this forward into chunks and hand the plan to every layer."""
    given = {**dict(zip(_FORWARD_ARGUMENTS, args)), **kwargs}
    tokens = given.get("input_ids")
    if tokens is None:
        tokens = given.get("inputs_embeds")
    if tokens is None:
        return None  # transformers reports the missing input itself
    if module.config._attn_implementation != ATTENTION_NAME:
        raise GaliError(
            f"the attention implementation was changed to {module.config._attn_implementation!r} after apply_gali; "
            "call remove_gali first"
        )
    new_tokens = tokens.shape[1]
    cache = given.get("past_key_values")
    start = int(cache.get_seq_length()) if cache is not None else 0  # a StaticCache returns a live tensor
    position_ids = given.get("position_ids")
    if position_ids is not None:
        expected = torch.arange(start, start + new_tokens, device=position_ids.device)
        if not torch.equal(position_ids, expected.expand_as(position_ids)):
            raise GaliError(
                "GALI computes positions itself: position_ids must be omitted or count up from the cache length"
            )
    kwargs["gali_plan"] = ForwardPlan(state, start, start + new_tokens)
    return args, kwargs


def _gali_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    gali_plan: ForwardPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "gali" attention: query (B, H, q, D), key/value (B, Hkv, >= T, D), all un-rotated."""
    if gali_plan is None:
        raise GaliError("GALI attention needs the model's forward (it plans the chunks); call the model, not a layer")
    if attention_mask is not None:
        raise GaliError("GALI builds its own causal masks; a custom 4D attention_mask is not supported")
    new_tokens = gali_plan.stop - gali_plan.start
    if query.shape[2] != new_tokens or key.shape[2] < gali_plan.stop:
        raise GaliError(
            f"GALI expected {new_tokens} new tokens over {gali_plan.stop} cached keys, got {query.shape[2]} over "
            f"{key.shape[2]}: was the cache shared with another model or truncated?"
        )
    config = gali_plan.state.config
    chunks = gali_plan.chunks(query.device, query.dtype)
    outputs = []
    if not chunks[0].interpolated:  # only the first piece can lie inside the training window
        window, chunks = chunks[0], chunks[1:]
        # Exactly the computation of the unpatched model: same rotation, same attention function, same mask.
        window_query = rotate(query[:, :, : window.queries], window.query_cos, window.query_sin)
        window_key = rotate(key[:, :, : window.keys], window.key_cos, window.key_sin)
        output, _ = gali_plan.state.attention_function()(
            module,
            window_query,
            window_key,
            value[:, :, : window.keys],
            gali_plan.window_mask(module, window_query),
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        outputs.append(output)
    if chunks:
        noise = Noise(config.seed, module.layer_idx, config.noise_scale) if config.noise else None
        beyond = query[:, :, query.shape[2] - sum(chunk.queries for chunk in chunks) :]
        outputs.append(gali_attention(beyond, key, value, chunks, scaling, dropout, noise).transpose(1, 2))
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return output.contiguous(), None


def _gali_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs) -> None:
    """GALI masks each chunk itself; this only rejects padding, which its positions cannot account for."""
    if attention_mask is not None and not bool(attention_mask[:, :kv_length].all()):
        raise GaliError(
            "GALI needs unpadded input: every sequence in a batch must have the same length (attention_mask has 0s)"
        )
    return None


def _llama_model(model: nn.Module) -> LlamaModel:
    """The LlamaModel inside `model`, or an error naming what is not supported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        raise UnsupportedModelError(
            f"GALI supports Llama models (Llama 2, 3, 3.1); this is {type(model).__name__} "
            f"with model_type {model_type!r}"
        )
    base = model if isinstance(model, LlamaModel) else getattr(model, "model", None)
    if not isinstance(base, LlamaModel) or not hasattr(base, "rotary_emb"):
        raise UnsupportedModelError(f"GALI found no LlamaModel with a rotary embedding inside {type(model).__name__}")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"GALI does not support rope_type {rope_type!r}: its frequencies depend on the sequence length "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return base


AttentionInterface.register(ATTENTION_NAME, _gali_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _gali_mask)
