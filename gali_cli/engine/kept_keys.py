"""Keys rotated once, when their token arrives, and kept with the KV cache.

Some methods rotate each key by a rotation that depends on its token index alone (Leaky ReRoPE's far keys at j / k,
DPE's at j // s per frequency group, SelfExtend's grouped keys at j // G, ChunkLlama's keys at j mod s). Rotating all T cached keys again in every forward would cost O(T) per layer and
token while decoding; instead each layer keeps its rotated keys per cache object (a weak reference: they go when the
cache goes), and a forward that continues exactly where the cache's last forward ended rotates only its own tokens.
Anything else (another cache, a cache cut back, another batch size, inference mode switched) rotates them all again.
"""

import weakref
from collections.abc import Callable

import torch

from .rope import rotate_fused

# (first, last) -> cos, sin (last - first, D): the rotation of tokens [first, last), the same for every layer
Rotation = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class KeptKeys:
    """Per cache and layer, keys rotated by a `Rotation`, in the keys' dtype (one more copy of the K cache)."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {layer: (count, buffer)}

    def rotated(self, cache: object | None, layer: int, key: torch.Tensor, start: int, stop: int,
                rotation: Rotation) -> torch.Tensor:
        """Keys of tokens [0, stop) rotated: (B, Hkv, stop, D). key: (B, Hkv, >= stop, D) un-rotated, of a forward
        over tokens [start, stop) on `cache` (None: nothing is kept)."""
        if cache is None or torch.is_grad_enabled():  # under autograd every forward's keys stay intact
            cos, sin = rotation(0, stop)
            return rotate_fused(key[:, :, :stop], cos, sin)
        layers = self._kept.setdefault(cache, {})
        count, buffer = layers.get(layer, (0, None))
        usable = (buffer is not None and count == start and buffer.shape[:2] == key.shape[:2]
                  and buffer.device == key.device and buffer.dtype == key.dtype
                  and buffer.is_inference() == torch.is_inference_mode_enabled())
        first = start if usable else 0
        if not usable or buffer.shape[2] < stop:
            grown = key.new_empty(*key.shape[:2], stop + max(64, stop // 4), key.shape[-1])  # amortised growth
            if usable:
                grown[:, :, :first] = buffer[:, :, :first]
            buffer = grown
        if stop > first:
            cos, sin = rotation(first, stop)
            rotate_fused(key[:, :, first:stop], cos, sin, out=buffer[:, :, first:stop])
        layers[layer] = (stop, buffer)
        return buffer[:, :, :stop]

    def forget(self, cache: object | None) -> None:
        """Drop what is kept for `cache`: a forward that rotated its keys without keeping them (a method that keeps
        keys only while decoding) makes the kept ones stale, even where their count would match a later forward."""
        if cache is not None:
            self._kept.pop(cache, None)
