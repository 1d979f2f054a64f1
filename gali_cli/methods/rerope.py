"""ReRoPE and Leaky ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", kexue.fm/archives/9708; bojone/rerope).

A query i and a key j closer than the window w keep their true distance d = i - j; beyond it the distance is clamped
to w (ReRoPE) or compressed to w + (d - w) / k (Leaky ReRoPE), so that it never leaves the trained range. As in the
official code, queries past train_len are also scaled by log(i + 1) / log(train_len) ("log n" scaling, optional).

The official code builds two logit matrices. Here neither part has one (windowed.py): beyond the window,
ReRoPE's logit is q.R(w)^T k for every pair, one attention of queries rotated at w over the un-rotated keys the cache
holds anyway; Leaky ReRoPE's distance is linear in d, so it is RoPE with positions i / k + w - w / k for queries and
j / k for keys (rotated once per key and kept while decoding). Positions depend on (i, j) only, so any split of the
input into forwards gives the same result.
"""

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.rope import rotate, rotation
from ..errors import ConfigError
from .method import Method, SeamExample, neighbor_window
from .windowed import kept_far_keys, windowed_attend


def leaky_reach(window: int, factor: float, train_len: int) -> int:
    """The longest input whose compressed distances w + (d - w) / k all stay below train_len."""
    return math.floor(window + factor * (train_len - 1 - window)) + 1


class ReRoPE(PositionalAttention):
    """ReRoPE (factor None) or Leaky ReRoPE (factor k > 1) with window w."""

    def __init__(self, window: int, train_len: int, factor: float | None = None, logn: bool = True) -> None:
        if not 0 < window < train_len:
            raise ConfigError(f"--neighbor-window must be between 1 and train_len - 1 ({train_len - 1}), got {window}")
        if factor is not None and not 1 < factor < float("inf"):
            raise ConfigError(f"--leaky-factor must be a number > 1, got {factor}")
        self.name = "rerope" if factor is None else "leaky-rerope"
        self.window, self.train_len, self.factor, self.logn = window, train_len, factor, logn
        self.exact_until = window  # every distance below the window: plain RoPE (and log n is 1 within train_len)
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        return 2 * self.window  # near keys are rotated relative to their tile; ReRoPE's far queries sit at w

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        window, distance = self.window, (keys - query).double()
        if self.factor is None:
            far = torch.full_like(distance, -window)
        else:  # keys at j / k, the query at i / k + w - w / k
            far = distance / self.factor - window + window / self.factor
        scale = 1.0
        if self.logn:  # as _logn: max(1, log(i + 1) / log(train_len)), float64 rounded to float32
            scale = ((query + 1).double().log() / math.log(self.train_len)).clamp(min=1).float()
        placed = torch.where(query - keys < window, distance, far)
        if self.factor is None:  # whole offsets: -(w - 1)..0 near, -w far
            return Placement(placed.long(), query_scale=scale, reach=window)
        return Placement(placed, query_scale=scale)

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        window, start, stop = self.window, forward.start, forward.stop
        table = forward.table(query.device, query.dtype)
        query = query.float()
        if self.logn and stop > self.train_len:
            query = query * forward.memo(("logn", query.device), lambda: self._logn(start, stop, query.device))
        if self.factor is None:  # distance w for every far pair: queries at w, keys where they are (un-rotated)
            # The un-rotated keys miss RoPE's attention scaling (YaRN's), which every rotated pair has twice.
            scale = forward.installed.rotary.attention_scaling
            far_query = rotate(query, table.cos32[window] * scale, table.sin32[window] * scale)
            far_key, at_token_index = key[:, :, : max(0, stop - window)], None
        else:
            cos, sin = forward.memo(("leaky-query", query.device), lambda: self._leaky(
                forward, torch.arange(start, stop, device=query.device), window - window / self.factor, torch.float32))
            far_query = rotate(query, cos, sin)

            def key_rotation(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
                return forward.memo(("leaky-key", key.device, key.dtype, first, last), lambda: self._leaky(
                    forward, torch.arange(first, last, device=key.device), 0.0, key.dtype))

            far_key, at_token_index = kept_far_keys(self._kept, forward, module.layer_idx, query, key, window,
                                                    key_rotation)
        return windowed_attend(forward, query, key, value, far_query, far_key, window, scaling, dropout,
                               at_token_index)

    def _logn(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """max(1, log(i + 1) / log(train_len)) per query token i: (q, 1)."""
        tokens = torch.arange(start + 1, stop + 1, device=device, dtype=torch.float64)
        return (tokens.log() / math.log(self.train_len)).clamp(min=1).float().unsqueeze(-1)

    def _leaky(self, forward: Forward, tokens: torch.Tensor, offset: float,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at positions tokens / k + offset (float64 angles)."""
        rotary = forward.installed.rotary
        positions = tokens.double().unsqueeze(-1) / self.factor + offset
        return rotation(positions, rotary.inv_freq, rotary.attention_scaling, dtype)


def _rerope(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    return {"train_len": train_len, "neighbor_window": neighbor_window(settings, train_len, train_len // 4),
            "logn": settings.logn}


def _leaky_rerope(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    window = neighbor_window(settings, train_len, train_len // 4)
    # The official code's k = 16, raised to the smallest whole k whose distances stay within train_len.
    factor = settings.leaky_factor or max(16, math.ceil(((tokens or 0) - 1 - window) / (train_len - 1 - window)))
    reaches = leaky_reach(window, factor, train_len)
    if tokens is not None and reaches < tokens:
        raise ConfigError(f"--leaky-factor {factor} with --neighbor-window {window} reaches {reaches} tokens within "
                          f"train_len {train_len}; the input has {tokens}: raise --leaky-factor")
    resolved = {"train_len": train_len, "neighbor_window": window, "leaky_factor": factor, "logn": settings.logn}
    return resolved if tokens is not None else {**resolved, "reaches": reaches}


RE_ROPE = Method("rerope", _rerope, lambda config, settings, s: ReRoPE(
    s["neighbor_window"], s["train_len"], None, s["logn"]), examples=(SeamExample(
        "rerope", MethodSettings(neighbor_window=4),
        lambda model, s: ref.NaiveReRoPE(model, s["neighbor_window"], None, s["train_len"])),))
LEAKY_RE_ROPE = Method("leaky-rerope", _leaky_rerope, lambda config, settings, s: ReRoPE(
    s["neighbor_window"], s["train_len"], s["leaky_factor"], s["logn"]), examples=(SeamExample(
        "leaky-rerope", MethodSettings(neighbor_window=4, leaky_factor=8.0),
        lambda model, s: ref.NaiveReRoPE(model, s["neighbor_window"], s["leaky_factor"], s["train_len"])),))
