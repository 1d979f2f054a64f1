"""LaMPE (Length-aware Multi-grained Positional Encoding, arXiv 2508.02308; scar-on/LaMPE): three regions of
distances, the middle one compressed by a ratio that follows the input's length.

For an input of N tokens, with a head window H, a mapping length U and a tail size S (the official code's `head`,
`use_length` and `tail`; its LongBench run, llama_cache1.py, is the one restated here):

- m(x) = floor(x * U / (N - 1)) maps the tokens 0..N-1 onto 0..U, in float32 as the official code computes it.
- head: a key within H of its query (i - j < H) keeps its true distance.
- tail: the first tokens, keys j <= i - (N - R), sit at distance (i - b2) - j: true spacing, placed where the
  middle ends. R is S moved up to the end of a run of equal m (the official `find_chunk_last_index`).
- middle: every other key is at distance (m(i) + b1) - m(j), b1 = H - 1 - m(H) so that it continues from the head
  window's edge; b2 = (N - 1 - R) - m(N - 1 - R) - b1 joins the tail to it.

Queries and keys are both scaled by 1 + 0.1 ln 2 (the official code scales cos and sin), so every logit is
(1 + 0.1 ln 2)^2 times the model's. An input shorter than 2H runs with true distances (still scaled), as the official
code does; so does every token decoded after it.

The positions depend on N: a prefix read for one input is not the prefix of a longer one (no document cache, the
whole input prefilled for each question). While decoding (tokens i >= N) the map stays N's, as the official code
keeps it: the query's middle position stays at m(N - 1) + b1 = U + b1, keys keep m(j) (generated keys that leave the
head window, j >= N, at m(N - 1)), and the tail takes one more key per token (i - (N - R) grows). So the middle
keys' rotations depend on j alone and are kept from token to token.

Differences from the official code, by design: its prefill counts the key at distance H twice (in the head window
and in the middle) and, for the last R queries, the key at j = i - (N - R) twice (tail and middle); here every key
is in exactly one region, as its decoding has it. Its decoding fails past H generated tokens; here the map stays
defined (above).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.attention.dense import Partial, PartialAttention, causal_partial, merge_partials, partial_attention
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..engine.math.rope import rotate, rotation
from ..errors import ConfigError
from .dpe import published_settings as llama3_match
from .method import Method, SeamExample, neighbor_window
from .windowed import far_attention, near_attention

# The official code multiplies cos and sin by this for queries and keys alike (YaRN's 0.1 ln s + 1 at s = 2).
SCALE = 0.1 * math.log(2) + 1

# The official LongBench run on Llama-3-8B-Instruct (run_cmd.sh, pred.py): head 512, tail 200, mapping length 1536
# (the input's length when shorter). Llama-3's 8192 window, so H = L/16, S = 200/8192 L, U = 3L/16 elsewhere.
PUBLISHED = {"Meta-Llama-3-8B-Instruct": (512, 200, 1536)}


def published_settings(config: PretrainedConfig) -> tuple[str, int, int, int] | None:
    """(model, head, tail, mapping length) when `config` is Llama-3-8B (the model LaMPE's settings were run on)."""
    match = llama3_match(config)  # the same architecture match as DPE's
    if match is None or match[0] not in PUBLISHED:
        return None
    return (match[0], *PUBLISHED[match[0]])


def mapping(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """m(x) = floor(x * U / (N - 1)) for token indices x < N, as the official code computes it: U divided by a
    long tensor (float32, which torch rounds differently from U / (N - 1) in float32 or float64), times the long
    token indices. The rounding decides where m steps, and whether m(N - 1) is U or U - 1."""
    ratio = length / torch.tensor(count - 1)  # a float32 scalar on the host: a decoding graph reads it as a constant
    return torch.floor(ratio * tokens.long()).long()


def check_tail(tail: int, head: int) -> None:
    """A ConfigError unless the tail is shorter than the head window (the official code's regions assume it)."""
    if not 0 < tail < head:
        raise ConfigError(f"--lampe-tail must be between 1 and the head window (--neighbor-window) - 1 ({head - 1}), "
                          f"got {tail}")


@dataclass(frozen=True)
class Layout:
    """Where LaMPE's regions lie for an input of `tokens` tokens (see the module docstring)."""

    head: int
    length: int
    tokens: int
    tail_end: int  # R
    head_shift: int  # b1
    tail_shift: int  # b2

    @classmethod
    def of(cls, head: int, tail: int, length: int, tokens: int) -> "Layout":
        if tokens < 2 * head:  # true distances throughout
            return cls(head, length, tokens, 0, 0, 0)
        m = mapping(torch.arange(tokens), tokens, length)
        end = tail
        while end + 1 < tokens and m[end] == m[end + 1]:
            end += 1
        head_shift = head - 1 - int(m[head])
        return cls(head, length, tokens, end, head_shift, (tokens - 1 - end) - int(m[tokens - 1 - end]) - head_shift)

    @property
    def plain(self) -> bool:
        return self.tokens < 2 * self.head

    def middle(self, tokens: torch.Tensor) -> torch.Tensor:
        """m(x) of these tokens, those past the input at m(N - 1)."""
        return mapping(tokens.clamp(max=self.tokens - 1), self.tokens, self.length)

    def reach(self) -> int:
        """The largest distance in the prefill: the middle's at the last query or the tail's first key."""
        return self.tokens - 1 if self.plain else max(self.length + self.head_shift, self.tokens - 1 - self.tail_shift)


class LaMPE(PositionalAttention):
    name = "lampe"
    exact_until = 0  # every logit is scaled

    def __init__(self, head: int, tail: int, length: int, tokens: int, train_len: int) -> None:
        if not 0 < head < train_len:
            raise ConfigError(f"--neighbor-window must be between 1 and train_len - 1 ({train_len - 1}), got {head}")
        check_tail(tail, head)
        if length < 1:
            raise ConfigError(f"--lampe-length must be >= 1, got {length}")
        self.layout = Layout.of(head, tail, length, tokens)
        self._kept = KeptKeys()

    def table_rows(self, start: int, stop: int) -> int:
        return 2 * self.layout.head  # head keys are rotated relative to their tile (windowed.py)

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        """The head window at true distances; the tail (j <= i - (N - R)) against the query at i - b2; the middle
        at m(j) against m(i) + b1 (both clamped to the input's map)."""
        layout, distance = self.layout, (keys - query)
        if layout.plain:
            return Placement(distance.double(), query_scale=SCALE**2)
        middle = layout.middle(keys) - (layout.middle(query) + layout.head_shift)
        far = torch.where(keys <= query - (layout.tokens - layout.tail_end), distance + layout.tail_shift, middle)
        return Placement(torch.where(query - keys < layout.head, distance, far).double(), query_scale=SCALE**2)

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        layout, start, stop = self.layout, forward.start, forward.stop
        scale = scaling * SCALE**2
        partial = partial_attention(forward.attention_plan(query, key, value, dropout), value.dtype)
        if layout.plain:
            key = self._kept.rotated(forward.cache, module.layer_idx, key, start, stop,
                                     lambda first, last: self._at(forward, torch.arange(first, last), key.dtype,
                                                                                  key.device))
            part = causal_partial(rotate(query, *self._at(forward, torch.arange(start, stop), query.dtype,
                                                          query.device)), key,
                                  value[:, :, :stop], scale, partial)
            return part.output.to(value.dtype).transpose(1, 2)
        table = forward.table(query.device, query.dtype)
        near = near_attention(query, key, value, table, layout.head, start, scale, partial, dropout)
        middle_query = rotate(query.float(), *forward.memo(("lampe-query", query.device), lambda: self._at(
            forward, layout.middle(torch.arange(start, stop)) + layout.head_shift, torch.float32, query.device)))
        middle_key = self._kept.rotated(forward.cache, module.layer_idx, key, start, stop, lambda first, last: (
            forward.memo(("lampe-key", key.device, key.dtype, first, last), lambda: self._at(
                forward, layout.middle(torch.arange(first, last)), key.dtype, key.device))))
        late = min(max(start, layout.tokens - layout.tail_end), stop)  # the first query with tail keys
        parts = [self._empty(query, late - start)]
        if late > start:
            parts[0] = far_attention(middle_query[:, :, : late - start], middle_key, value, layout.head, start, scale,
                                     partial, dropout) or parts[0]
        if late < stop:
            parts.append(self._late(forward, query, key, value, middle_query[:, :, late - start :], middle_key, late,
                                    scale, partial))
        far = Partial(torch.cat([p.output for p in parts], dim=2), torch.cat([p.lse for p in parts], dim=2))
        return merge_partials([near, far]).output.to(value.dtype).transpose(1, 2)

    def _late(self, forward: Forward, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              middle_query: torch.Tensor, middle_key: torch.Tensor, late: int, scale: float,
              partial: PartialAttention) -> Partial:
        """Queries [late, stop) over their tail and middle keys: the first `split` keys under masks (rows x split,
        split <= R + decoded tokens), the middle keys after them as ordinary far keys."""
        layout, stop = self.layout, forward.stop
        head, offset = layout.head, layout.tokens - layout.tail_end  # tail: j <= i - offset
        split = stop - offset
        i = torch.arange(late, stop, device=query.device).unsqueeze(1)
        j = torch.arange(split, device=query.device).unsqueeze(0)
        tail_seen = (j <= i - offset) & (j <= i - head)
        tail_query = rotate(query[:, :, late - forward.start :].float(), *self._at(
            forward, torch.arange(late, stop) - layout.tail_shift, torch.float32, query.device))
        tail_key = rotate(key[:, :, :split].float(), *self._at(forward, torch.arange(split), torch.float32,
                                                                key.device))
        values = value[:, :, :split].float()
        parts = [_masked(partial, tail_query, tail_key, values, scale, tail_seen),
                 _masked(partial, middle_query, middle_key[:, :, :split].float(), values, scale,
                         (j > i - offset) & (j <= i - head))]
        beyond = far_attention(middle_query, middle_key[:, :, split:], value[:, :, split:], head + split, late, scale,
                               partial)
        return merge_partials([part for part in [*parts, beyond] if part is not None])

    @staticmethod
    def _empty(query: torch.Tensor, rows: int) -> Partial:
        batch, heads, _, dim = query.shape
        return Partial(query.new_zeros(batch, heads, rows, dim, dtype=torch.float32),
                       query.new_full((batch, heads, rows), float("-inf"), dtype=torch.float32))

    @staticmethod
    def _at(forward: Forward, positions: torch.Tensor, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (n, D) at these positions (float64 angles), on `device`."""
        rotary = forward.installed.rotary
        return rotation(positions.to(device).unsqueeze(-1), rotary.inv_freq, rotary.attention_scaling, dtype)


def _masked(partial: PartialAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            seen: torch.Tensor) -> Partial | None:
    """Attention under a bool mask (rows, keys); rows that see no key get lse -inf (the kernels need one each)."""
    any_seen = seen.any(-1)
    if not bool(any_seen.any()):
        return None
    part = partial(query, key, value, scale, mask=seen | ~any_seen.unsqueeze(-1))
    return Partial(part.output.float().masked_fill(~any_seen[:, None], 0.0),
                   part.lse.masked_fill(~any_seen, float("-inf")))


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # The authors' settings hold for the model's own window only.
    published = published_settings(config) if train_len == config.max_position_embeddings else None
    head = neighbor_window(settings, train_len, published[1] if published else max(2, train_len // 16))
    tail = settings.lampe_tail or (published[2] if published else min(head - 1, max(1, round(train_len * 200 / 8192))))
    length = settings.lampe_length or (published[3] if published else 3 * train_len // 16)
    check_tail(tail, head)
    resolved = {"train_len": train_len, "neighbor_window": head, "lampe_tail": tail,
                "lampe_length": length if tokens is None else min(length, tokens),
                "lampe_published": published[0] if published else None}
    if tokens is not None:
        resolved["tokens"] = tokens  # the map follows the input's length: part of the settings it ran with
        resolved["reach"] = Layout.of(head, tail, resolved["lampe_length"], tokens).reach()
    return resolved


METHOD = Method("lampe", _settings, lambda config, settings, s: LaMPE(
    s["neighbor_window"], s["lampe_tail"], s["lampe_length"], s["tokens"], s["train_len"]), examples=(SeamExample(
        "lampe", MethodSettings(neighbor_window=4, lampe_tail=2, lampe_length=6),
        lambda model, s: ref.NaiveLaMPE(model, s["neighbor_window"], s["lampe_tail"], s["lampe_length"],
                                        s["tokens"])),))
