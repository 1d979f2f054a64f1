"""Keys rotated once and kept with the KV cache, from forward to forward.

Some methods rotate each key by a rotation that depends on its token index alone (Leaky ReRoPE's far keys at j / k,
DPE's at j // s per frequency group, SelfExtend's grouped keys at j // G, ChunkLlama's keys at j mod s); GALI's
decoding rotates a key by where it stands relative to the grouped part (docs/dev/engine.md, "Decoding"), the same
for every key until the group size changes. Rotating all T cached keys again in every forward would cost O(T) per layer
and token while decoding; instead each layer keeps its rotated keys per cache object (a weak reference: they go when
the cache goes), with a `frame` naming what they were rotated for, and a forward that continues exactly where the
cache's last forward ended rotates only what moved. Anything else (another cache, a cache cut back, another batch
size, dtype or device, inference mode switched) rotates them all again.
"""

import weakref
from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch

from ..math.rope import rotate_fused

# (first, last) -> cos, sin (last - first, D): the rotation of tokens [first, last), the same for every layer
Rotation = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
TOKEN_INDEX = ()  # the frame of keys rotated by their token index alone (`KeptKeys.rotated`)


class _Kept(NamedTuple):
    count: int  # rows [0, count) hold the keys of tokens [0, count)
    frame: Hashable  # what they were rotated for (TOKEN_INDEX: a rotation of the token index alone)
    buffer: torch.Tensor  # (B, Hkv, capacity >= count, D)


class KeptKeys:
    """Per cache and layer, rotated keys in the keys' dtype (one more copy of the K cache)."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {layer: _Kept}

    def frame(self, cache: object | None, layer: int, key: torch.Tensor, start: int) -> Hashable | None:
        """The frame of the kept keys a forward over tokens [start, ...) of `key` (B, Hkv, >= start, D) can continue
        from, or None when there are none it can: nothing kept, not exactly `start` tokens, or a buffer this forward
        cannot write (another batch size, dtype or device, made inside torch.inference_mode and now outside it or the
        reverse)."""
        kept = None if cache is None else self._kept.get(cache, {}).get(layer)
        if kept is None or kept.count != start:
            return None
        buffer = kept.buffer
        usable = (buffer.shape[:2] == key.shape[:2] and buffer.device == key.device and buffer.dtype == key.dtype
                  and buffer.is_inference() == torch.is_inference_mode_enabled())
        return kept.frame if usable else None

    def buffer(self, cache: object | None, layer: int, key: torch.Tensor, stop: int, continued: int) -> torch.Tensor:
        """A buffer (B, Hkv, capacity >= stop, D) whose first `continued` rows are the kept ones (0: a new buffer);
        grown by a quarter at a time, so that appending is amortised O(1) per token."""
        buffer = self._kept[cache][layer].buffer if continued else None
        if buffer is None or buffer.shape[2] < stop:
            grown = key.new_empty(*key.shape[:2], stop + max(64, stop // 4), key.shape[-1])
            if continued:
                grown[:, :, :continued] = buffer[:, :, :continued]
            buffer = grown
        return buffer

    def keep(self, cache: object | None, layer: int, stop: int, frame: Hashable, buffer: torch.Tensor) -> None:
        """Keep `buffer`'s rows [0, stop), rotated for `frame`, for the next forward on `cache` (None: nothing)."""
        if cache is not None:
            self._kept.setdefault(cache, {})[layer] = _Kept(stop, frame, buffer)

    def rotated(self, cache: object | None, layer: int, key: torch.Tensor, start: int, stop: int,
                rotation: Rotation) -> torch.Tensor:
        """Keys of tokens [0, stop) rotated by a rotation of the token index alone: (B, Hkv, stop, D). key:
        (B, Hkv, >= stop, D) un-rotated, of a forward over tokens [start, stop) on `cache` (None: nothing is kept)."""
        if cache is None or torch.is_grad_enabled():  # under autograd every forward's keys stay intact
            cos, sin = rotation(0, stop)
            return rotate_fused(key[:, :, :stop], cos, sin)
        first = start if self.frame(cache, layer, key, start) == TOKEN_INDEX else 0
        buffer = self.buffer(cache, layer, key, stop, first)
        if stop > first:
            cos, sin = rotation(first, stop)
            rotate_fused(key[:, :, first:stop], cos, sin, out=buffer[:, :, first:stop])
        self.keep(cache, layer, stop, TOKEN_INDEX, buffer)
        return buffer[:, :, :stop]

    def split(self, cache: object | None, layer: int, key: torch.Tensor, start: int, stop: int, window: int,
              far: Rotation, near: Rotation) -> torch.Tensor:
        """Keys of tokens [0, stop) for a windowed method's decoding step (methods/windowed.py): those of
        [0, stop - window) rotated by `far` (where the method places its far keys), the last `window` by `near` (their
        token index, as the unpatched model rotates them), so that neither part is rotated again per token: from one
        step to the next one key leaves the window (rotated again, by `far`) and the new token's joins it. key:
        (B, Hkv, >= stop, D) un-rotated, of a forward over tokens [start, stop) on `cache` (None: nothing is kept).
        Returns (B, Hkv, stop, D)."""
        edge = max(0, stop - window)  # rows [0, edge) are far keys now
        if cache is None or torch.is_grad_enabled():  # under autograd every forward's keys stay intact
            return torch.cat([rotate_fused(key[:, :, first:last], *rotation(first, last))
                              for first, last, rotation in ((0, edge, far), (edge, stop, near)) if last > first], dim=2)
        frame = ("split", window)
        continued = start if self.frame(cache, layer, key, start) == frame else 0
        buffer = self.buffer(cache, layer, key, stop, continued)
        first_far = max(0, continued - window)  # ... of which [0, first_far) were far keys already
        for first, last, rotation in ((first_far, edge, far), (max(continued, edge), stop, near)):
            if last > first:
                cos, sin = rotation(first, last)
                rotate_fused(key[:, :, first:last], cos, sin, out=buffer[:, :, first:last])
        self.keep(cache, layer, stop, frame, buffer)
        return buffer[:, :, :stop]

    def forget(self, cache: object | None) -> None:
        """Drop what is kept for `cache`: a forward that rotated its keys without keeping them (a method that keeps
        keys only while decoding) makes the kept ones stale, even where their count would match a later forward."""
        if cache is not None:
            self._kept.pop(cache, None)
