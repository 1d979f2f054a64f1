"""SELF (arXiv 2505.17296, "SELF: Self-Extend the Context Length With a Logistic Growth Function"; code:
alexeipc/SELF-LLM): SelfExtend whose groups grow along a logistic curve instead of holding G keys each.

The grouped position x holds s(x) = min(floor(f(x)), c - 1) tokens, where f(x) = c / (1 + (c - 1) e^(-r x)) is the
logistic curve from f(0) = 1 towards the capacity c at the rate r: the keys just past the neighbour window keep
about one position each, farther ones share a position with ever more, up to c - 1. Token j's grouped position
G(j) is the x whose tokens include j: S(x) <= j < S(x + 1), S(x) = s(0) + ... + s(x - 1). As in SelfExtend, a
query i and a key j closer than the neighbour window W attend at their true positions; farther keys sit at G(j),
the query at W + G(i - W), so that the nearest grouped key (j = i - W) is W away, where the window ends.

G is a tensor of cumulative group sizes searched once (`grouped_positions`), so every lookup is indexing, and it
depends on j alone: any split of the input into forwards gives the same result, decoding keeps the grouped keys
rotated from token to token, and the static decoding step places keys by tensor indexing. The attention itself is
SelfExtend's (windowed.grouped_attention) with these two maps. docs/methods.md says where this
follows the official code and where it does not (its decoding path).
"""

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from ..config import MethodSettings
from ..engine.checks import reference_model as ref
from ..engine.contract import Forward, KeptKeys, Placement, PositionalAttention
from ..errors import ConfigError
from .method import Method, SeamExample, neighbor_window
from .windowed import grouped_attention, grouped_placement

OFFICIAL_RATE = 0.02  # r as the official code runs it: its position generator's default, the only one it reaches
FASTEST_RATE = 100.0  # e^(-100 x) vanishes beside 1 from x = 1 on: every group past the first holds c - 1


def group_sizes(capacity: int, rate: float, count: int) -> torch.Tensor:
    """s(0..count-1), the tokens each grouped position holds (int64): min(floor(f(x)), c - 1), f the paper's
    logistic group size in float64. Every size is at least 1 (f(0) = 1 and f grows), the cap keeps the last sizes
    at c - 1 where e^(-r x) no longer changes 1 + (c - 1) e^(-r x) in float64."""
    x = torch.arange(count, dtype=torch.float64)
    logistic = capacity / (1 + (capacity - 1) * torch.exp(-rate * x))
    return logistic.floor().long().clamp(max=capacity - 1)


def grouped_positions(capacity: int, rate: float, count: int) -> torch.Tensor:
    """G(0..count-1) (int64): how many positions end at or before each token, ends S(x + 1) = s(0) + ... + s(x).
    `count` positions hold at least `count` tokens, as every size is at least 1."""
    ends = group_sizes(capacity, rate, count).cumsum(0)
    return torch.searchsorted(ends, torch.arange(count), right=True)


def reach(capacity: int, rate: float, window: int, train_len: int) -> int:
    """The longest input whose positions all stay below train_len: the last query, N - 1, sits at W + G(N - 1 - W)
    <= train_len - 1, i.e. N <= W + S(train_len - W), the tokens the train_len - W grouped positions hold."""
    return window + int(group_sizes(capacity, rate, train_len - window).sum())


def smallest_capacity(rate: float, window: int, train_len: int, tokens: int) -> int | None:
    """The smallest capacity c >= 2 whose positions reach `tokens` within train_len (SelfExtend's rule for its group
    size), by bisection: a larger c never holds fewer tokens per position (f grows with c). None when none up to
    `most_capacity` does: there the sizes follow e^(r x) rather than c, and the rate is too slow for the input."""
    high = most_capacity(tokens)
    if reach(high, rate, window, train_len) < tokens:
        return None
    low = 1  # not a capacity; reach(high) >= tokens throughout
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if reach(middle, rate, window, train_len) < tokens else (low, middle)
    return high


def most_capacity(tokens: int) -> int:
    """The largest capacity searched: groups of 2N tokens are more than an input of N can fill."""
    return max(2, 2 * tokens)


def smallest_rate(window: int, train_len: int, tokens: int) -> float:
    """The official 0.02, or where no capacity reaches `tokens` with it (a small train_len - W: the groups grow too
    slowly within it), the first multiple of 0.01 with which one does, as --leaky-factor is raised past its default.
    A window that leaves too few grouped positions for any rate is refused, naming --neighbor-window."""
    def reaches(hundredths: int) -> bool:  # the most any capacity reaches grows with the rate, as f does
        return reach(most_capacity(tokens), hundredths / 100, window, train_len) >= tokens

    low, high = round(OFFICIAL_RATE * 100), round(FASTEST_RATE * 100)
    if reaches(low):
        return OFFICIAL_RATE
    if not reaches(high):
        raise ConfigError(f"--neighbor-window {window} leaves {train_len - window} grouped positions within train_len "
                          f"{train_len}, too few for self to reach the input's {tokens} tokens at any --self-rate: "
                          f"lower --neighbor-window")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if not reaches(middle) else (low, middle)
    return high / 100


def resolve(capacity: int | None, rate: float | None, window: int, train_len: int, tokens: int) -> tuple[int, float]:
    """The capacity and rate an input of `tokens` runs with: given ones checked, missing ones the smallest that reach
    it, the rate first (with a capacity given, the official one); every refusal a one-line ConfigError naming the flag
    to change."""
    if capacity is not None:
        rate = rate or OFFICIAL_RATE
        check(capacity, rate, window, train_len)
        reaches = reach(capacity, rate, window, train_len)
        if reaches < tokens:
            raise ConfigError(f"--group-size {capacity} with --self-rate {rate} and --neighbor-window {window} "
                              f"reaches {reaches} tokens within train_len {train_len}; the input has {tokens}: raise "
                              f"--group-size (or --self-rate)")
        return capacity, rate
    rate = rate or smallest_rate(window, train_len, tokens)
    capacity = smallest_capacity(rate, window, train_len, tokens)
    if capacity is None:  # only a rate given can be too slow
        raise ConfigError(f"self with --self-rate {rate} and --neighbor-window {window} reaches at most "
                          f"{reach(most_capacity(tokens), rate, window, train_len)} tokens within train_len "
                          f"{train_len}, whatever --group-size; the input has {tokens}: raise --self-rate")
    return capacity, rate


def check(capacity: int, rate: float, window: int, train_len: int) -> None:
    """Settings SELF cannot run with, each a one-line ConfigError naming its flag."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
        raise ConfigError(f"--group-size must be a whole number >= 2 for self (its groups grow towards "
                          f"group-size - 1 tokens), got {capacity!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise ConfigError(f"--self-rate must be a number > 0, got {rate!r}")
    if not 0 < window < train_len:
        raise ConfigError(f"--neighbor-window must be between 1 and train_len - 1 ({train_len - 1}), got {window}")


class LogisticSelfExtend(PositionalAttention):
    name = "self"

    def __init__(self, capacity: int, rate: float, neighbor_window: int, train_len: int) -> None:
        check(capacity, rate, neighbor_window, train_len)
        self.capacity, self.rate, self.neighbor_window, self.train_len = capacity, rate, neighbor_window, train_len
        # While the positions past the window hold one token each, G(j) = j and every distance is the true one.
        sizes = group_sizes(capacity, rate, train_len - neighbor_window)
        grouped = (sizes > 1).nonzero()
        self.exact_until = neighbor_window + (int(grouped[0]) if len(grouped) else len(sizes))
        self._kept = KeptKeys()
        self._map = torch.zeros(0, dtype=torch.long)  # G on the CPU, for the rows and reaches read in Python
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """G of at least tokens 0..length-1 on `device`, grown by doubling; the static decoding step asks for its
        cache's rows before a CUDA graph is recorded, so the recorded step only indexes it."""
        if len(self._map) < length:
            self._map = grouped_positions(self.capacity, self.rate, max(length, 2 * len(self._map), 256))
            self._on_device.clear()
        if device.type == "cpu":
            return self._map
        if device not in self._on_device:
            self._on_device[device] = self._map.to(device)
        return self._on_device[device]

    def _query_row(self, token: int) -> int:
        """W + G(i - W), the grouped query position of token i (W for the tokens inside the window, which have no
        grouped keys)."""
        index = max(0, token - self.neighbor_window)
        return self.neighbor_window + int(self.positions(index + 1, torch.device("cpu"))[index])

    def table_rows(self, start: int, stop: int) -> int:
        # Grouped rows up to the last query's; neighbour positions are relative to a tile (windowed.py).
        return max(self._query_row(stop - 1) + 1, 2 * self.neighbor_window)

    def decode_placement(self, query: torch.Tensor, keys: torch.Tensor) -> Placement:
        window, count = self.neighbor_window, keys.shape[0]
        positions = self.positions(count, keys.device)
        grouped = positions[keys] - (window + positions[(query - window).clamp(min=0)])
        # The farthest grouped offset: key 0 seen from the cache's last row, W + G(C - 1 - W).
        return grouped_placement(query, keys, window, grouped, self._query_row(count - 1))

    def attend(self, forward: Forward, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float, dropout: float, **kwargs) -> torch.Tensor:
        """The neighbours at true distances, the grouped keys at G(j), the queries at W + G(i - W)
        (windowed.grouped_attention)."""
        window = self.neighbor_window
        positions = self.positions(forward.stop, key.device)
        return grouped_attention(forward, self._kept, module, query, key, value, window, lambda j: positions[j],
                                 lambda i: window + positions[(i - window).clamp(min=0)], scaling, dropout)


def _settings(config: PretrainedConfig, settings: MethodSettings, train_len: int, tokens: int | None) -> dict:
    # W = L/8: the official PG19 script's 512 of Llama-2's 4096.
    window = neighbor_window(settings, train_len, max(1, train_len // 8))
    resolved = {"train_len": train_len, "neighbor_window": window}
    if tokens is not None:
        capacity, rate = resolve(settings.group_size, settings.self_rate, window, train_len, tokens)
        return {**resolved, "self_rate": rate, "group_size": capacity}
    rate = settings.self_rate or OFFICIAL_RATE
    if settings.group_size is None:
        return {**resolved, "self_rate": rate, "group_size": "the smallest that reaches the input"}
    check(settings.group_size, rate, window, train_len)
    return {**resolved, "self_rate": rate, "group_size": settings.group_size,
            "reaches": reach(settings.group_size, rate, window, train_len)}


METHOD = Method("self", _settings, lambda config, settings, s: LogisticSelfExtend(
    s["group_size"], s["self_rate"], s["neighbor_window"], s["train_len"]), examples=(SeamExample(
        "self", MethodSettings(group_size=6, neighbor_window=4, self_rate=0.5),
        lambda model, s: ref.NaiveSELF(model, s["group_size"], s["self_rate"], s["neighbor_window"])),))
