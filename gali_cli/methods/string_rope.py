"""STRING (An et al., ICLR 2025, "Why Does the Effective Context Length of LLMs Fall Short?"; HKUNLP/STRING):
shifted rotary positions, so that no pair uses the largest, least-trained distances.

A query i and a key j closer than the shift S keep their true distance d = i - j; a farther pair gets d - S + W,
where the local window W < S: the S largest distances of the training window are never used, the distances in
[W, S) serve far pairs too, and only the W nearest keys see distances below W. With L the training window, the
authors run S = 0.33 L and W = 128 (their README's quick start and their RULER runs on Llama-3.1-8B/70B); the input
then stays within the trained distances up to L + S - W tokens (`reach`); past that its distances, like the unpatched
model's, run beyond L.

As in the official code (string_for_llama.py, which scales the rotary's cos/sin by 1 + 0.1 ln 2, "similar with
Yarn"), every logit is multiplied by (1 + 0.1 ln 2)^2 (applied here to the softmax scale), unless --no-string-scale.

Two attentions merged by log-sum-exp (windowed.py): the near keys at their true distances, the far keys at their
true positions j against queries rotated at i - S + W. Keys are cached without RoPE; the far keys' rotations depend
on j only, so they are rotated once and kept while decoding. Positions depend on (i, j) only: any split of the input
into forwards gives the same result, and a document's prefilled state serves any later question.
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
from .dpe import llama3_8b
from .method import Method, SeamExample
from .windowed import decoding_at_token_index, windowed_attend

SHIFT_RATIO = 0.33  # S = int(0.33 L), as the official README and RULER scripts set it
LOCAL_WINDOW = 128  # W, the official default
LOGIT_SCALE = (1 + 0.1 * math.log(2)) ** 2  # the official code's cos/sin factor, once on queries and once on keys


def default_shift(train_len: int) -> int:
    return max(1, int(SHIFT_RATIO * train_len))


def default_window(shift: int) -> int:
    """The authors' 128, at most half the shift (for windows too small for it)."""
    return min(LOCAL_WINDOW, shift // 2)


def reach(shift: int, window: int, train_len: int) -> int:
    """The longest input whose distances all stay below train_len: the largest, N - 1 - S + W, at most L - 1."""
    return train_len + shift - window


def published(config: PretrainedConfig, train_len: int) -> str | None:
    """The model whose settings the authors ran (S = 0.33 L, W = 128) when `config` is one, at its own window."""
    return llama3_8b(config) if train_len == config.max_position_embeddings else None


def check(shift: int, window: int, train_len: int) -> None:
    if not 0 < shift <= train_len:
        raise ConfigError(f"--shifted-offset must be between 1 and train_len ({train_len}), got {shift}")
    if not 0 <= window < shift:
        raise ConfigError(f"--local-window must be between 0 and --shifted-offset - 1 ({shift - 1}) for string, "
                          f"got {window}")


class StringRoPE(PositionalAttention):
    name = "string"

    def __init__(self, shift: int, window: int, train_len: int, scale: bool = True) -> None:
        check(shift, window, train_len)
        self.shift, self.window, self.train_len = shift, window, train_len
        self.logit_scale = LOGIT_SCALE if scale else 1.0
        # Every distance below S is plain RoPE; the logit scale, when on, applies from the first token on.
        self.exact_until = 0 if scale else shift
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        return 2 * self.shift  # near keys are rotated relative to their tile of S queries

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        far = keys - (query - self.shift + self.window)  # the query at i - S + W, far keys where they are
        # Near keys at -(S - 1)..0; far ones at (j - i) + S - W, least at j = 0 and i = C - 1.
        reach = max(self.shift - 1, keys.shape[0] - 1 - self.shift + self.window)
        return Placement(torch.where(query - keys < self.shift, keys - query, far), query_scale=self.logit_scale,
                         reach=reach)

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        shift, start, stop = self.shift, forward.start, forward.stop
        cos, sin = forward.memo(("string-query", query.device), lambda: self._rotation(
            forward, torch.arange(start, stop, device=query.device) - shift + self.window, torch.float32))
        far_query = rotate(query.float(), cos, sin)

        def key_rotation(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
            return forward.memo(("string-key", key.device, key.dtype, first, last), lambda: self._rotation(
                forward, torch.arange(first, last, device=key.device), key.dtype))

        far_key = self._kept.rotated(forward.cache, module.layer_idx, key, start, stop, key_rotation)
        # The far keys sit at their token indices: decoding takes the window's keys from them as they are.
        at_token_index = decoding_at_token_index(forward, query, far_key) if stop - start == 1 else None
        return windowed_attend(forward, query, key, value, far_query, far_key, shift, scaling * self.logit_scale,
                               dropout, at_token_index)

    @staticmethod
    def _rotation(forward: Forward, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = forward.installed.rotary
        return rotation(positions.unsqueeze(-1), rotary.inv_freq, rotary.attention_scaling, dtype)


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    shift = settings.shifted_offset if settings.shifted_offset is not None else default_shift(train_len)
    window = settings.local_window if settings.local_window is not None else default_window(shift)
    check(shift, window, train_len)
    authors = settings.shifted_offset is None and settings.local_window is None
    return {"train_len": train_len, "shifted_offset": shift, "local_window": window,
            "string_scale": settings.string_scale, "reaches": reach(shift, window, train_len),
            "string_published": published(config, train_len) if authors else None}


METHOD = Method("string", _settings, lambda config, settings, s: StringRoPE(
    s["shifted_offset"], s["local_window"], s["train_len"], s["string_scale"]), examples=(SeamExample(
        "string", MethodSettings(shifted_offset=5, local_window=2),
        lambda model, s: ref.NaiveString(model, s["shifted_offset"], s["local_window"])),))
