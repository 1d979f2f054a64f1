"""The KV cache gali generates with: transformers' DynamicCache, with layers that append in place.

transformers' DynamicLayer appends a forward's keys and values with `torch.cat`, which copies the whole cache: every
decoded token reads and writes all T cached keys and values once more, on top of the attention reading them. On a
CPU, whose decode step is bound by memory traffic, that is the largest cost after the weights (docs/performance.md,
"16-bit KV cache (2026-12-07)", and docs/notes/2026-11-performance-history.md, "Decode on the CPU: the KV cache,
and torch.compile (issue 26)").
`GrowingLayer` keeps the keys and values in a buffer with room to spare (or exactly the room `reserve` asked for)
and writes each forward's rows into it; `keys`/`values` are views of its first rows, so everything that reads a
DynamicCache — transformers, the document cache, `truncate_cache` — reads it unchanged.

Built on the cache classes' public constructor (`DynamicCache.layers` holds one layer object per decoder layer) and
the layer's public contract (`update` returns the keys and values of every token so far); the seam check and the
equivalence tests run through it on every transformers release gali admits.
"""

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ...errors import UnsupportedModelError
from ...model.families import has_layer_kinds

_SPARE_MIN = 64  # rows of room added, at least, when a buffer must grow past what was reserved


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in buffers (B, Hkv, capacity, D) that grow by a quarter at a time,
    so that appending a token is amortised O(1) instead of O(T).

    Anything that replaces `keys`/`values` (a cut by `truncate_cache` or `crop`, a batch selection) is respected:
    a view of the buffer's first rows is continued in place (a cut's rows are overwritten, as they are dropped); any
    other tensor is copied into a new buffer at the next append. Under autograd it appends as DynamicLayer does
    (in-place writes would break the graph of earlier forwards), in the rows' own dtype.

    `storage_dtype`: the dtype the buffers hold (None: the dtype of the rows written, the compute dtype).
    """

    def __init__(self, *args, storage_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reserved = 0  # tokens the next allocation makes room for (`reserve`)
        self.storage_dtype = storage_dtype
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self._buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        stop = count + key_states.shape[-2]
        if not self._continues(key_states, count, stop):
            capacity = self.reserved if stop <= self.reserved else stop + max(_SPARE_MIN, stop // 4)
            buffers = []
            for held, new in ((self.keys, key_states), (self.values, value_states)):
                buffer = new.new_empty(*new.shape[:2], capacity, new.shape[-1], dtype=self._stored_dtype(new))
                if count:
                    buffer[:, :, :count] = held
                buffers.append(buffer)
            self._buffers = (buffers[0], buffers[1])
        key_buffer, value_buffer = self._buffers
        key_buffer[:, :, count:stop] = self.stored(key_states)
        value_buffer[:, :, count:stop] = self.stored(value_states)
        self.keys, self.values = key_buffer[:, :, :stop], value_buffer[:, :, :stop]
        # the stored rows themselves, or a copy in the compute dtype (transformers and the methods compute in it)
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)

    def _stored_dtype(self, rows: torch.Tensor) -> torch.dtype:
        return self.storage_dtype or rows.dtype

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` as the buffers hold them: every write goes through here, `update`'s and the static step's."""
        return rows.to(self._stored_dtype(rows))

    def write(self, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one token's key and value (B, Hkv, 1, D) at row `index` (a one-element tensor, so that a CUDA graph
        replays the write for any token) of the buffers, past `keys`/`values` (the static step; `extend` follows)."""
        for buffer, row in zip(self._buffers, (key, value), strict=True):
            buffer.index_copy_(2, index.view(1), self.stored(row))

    def _continues(self, new: torch.Tensor, count: int, stop: int) -> bool:
        """Whether `keys`/`values` are still views of the first `count` rows of this layer's buffers, and the
        buffers can take rows up to `stop` of tensors like `new` (same batch, heads, stored dtype, device, inference
        mode)."""
        if self._buffers is None:
            return False
        key_buffer, value_buffer = self._buffers
        return (key_buffer.shape[2] >= stop and key_buffer.shape[:2] == new.shape[:2]
                and key_buffer.shape[-1] == new.shape[-1] and key_buffer.dtype == self._stored_dtype(new)
                and key_buffer.device == new.device
                and key_buffer.is_inference() == torch.is_inference_mode_enabled()
                and all(held.dim() == 4 and held.data_ptr() == buffer.data_ptr() and held.shape[2] == count
                        and held.stride() == buffer.stride()
                        for held, buffer in ((self.keys, key_buffer), (self.values, value_buffer))))

    def capacity(self) -> int:
        """Rows the buffers hold, 0 unless `keys`/`values` are views of their first rows (what a step writing its
        own rows continues from)."""
        count = self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0
        return self._buffers[0].shape[2] if count and self._continues(self.keys, count, count) else 0

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers (B, Hkv, capacity, D) in the stored dtype, for a step that reads them as they are
        and writes its row itself (static_decode.StaticDecoder: `write`, then `extend`)."""
        return self._buffers

    def extend(self, stop: int) -> None:
        """Make `keys`/`values` the buffers' first `stop` rows (a step wrote the rows past them)."""
        key_buffer, value_buffer = self._buffers
        self.keys, self.values = key_buffer[:, :, :stop], value_buffer[:, :, :stop]

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def new_cache(model: PreTrainedModel, kv_dtype: torch.dtype | None = None) -> DynamicCache:
    """An empty KV cache for `model` whose layers append in place (`GrowingLayer`), storing keys and values in
    `kv_dtype` (--kv-dtype; None: the model's compute dtype, as transformers stores them). A family with local layers
    (model/families.py: Gemma 3) gets every layer's keys kept, as one length to cut, save and hand to the methods;
    its local layers still attend within their window."""
    cache = DynamicCache(config=model.config)
    growing = has_layer_kinds(model.config) or all(type(layer) is DynamicLayer for layer in cache.layers)
    if not growing:  # sliding windows: not a Llama's
        if kv_dtype is not None:
            named = str(kv_dtype).removeprefix("torch.")
            raise UnsupportedModelError(f"--kv-dtype {named} needs gali's KV cache, which {type(model).__name__}'s "
                                        "sliding-window layers do not use; leave --kv-dtype out")
        return cache
    cache.layers = [GrowingLayer(storage_dtype=kv_dtype) for _ in cache.layers]
    return cache


def reserve(cache: DynamicCache, tokens: int) -> None:
    """Make room for `tokens` tokens in all, when the cache next grows (the prompt plus the longest answer), so
    that a generation allocates once and holds no spare rows beyond what it may use."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.reserved = tokens
