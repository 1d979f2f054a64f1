"""How long a prefill still needs, fitted to the time its forwards have taken so far; and how long a prompt this
machine can hold and read in reasonable time (the default bound on a prompt's tokens).

A forward's time is modelled as `a * tokens + b * pairs`, where `pairs` counts (query, earlier key) pairs: a
token's projections and MLP cost the same everywhere, while it attends to every earlier key (GALI too: each chunk's
queries see all T keys), so tokens get dearer as the context grows. `a` and `b` are fitted by least squares to the
forwards already run, which measures what this machine, method and noise path really cost per key (on CPU, noisy
GALI's attention costs ten times more per FLOP than the matrix products around it: a FLOP count alone misses that).
With a single forward timed (or a fit that comes out negative), the ratio of `b` to `a` comes from the FLOPs: as
attention never costs less per FLOP than the matrix products, that estimate is a lower bound. The estimate is an
extrapolation: docs/performance.md says how close it came.
"""

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by gali info, which answers without torch
    import torch
    from transformers import PretrainedConfig

READ_SECONDS = 300.0  # the longest a default-bounded prompt should take to read
# Sustained FLOP/s a prefill gets, GALI's attention included (on CPU it costs ten times more per FLOP than the matrix
# products): low on purpose, so the bound errs towards refusing rather than holding the model for an hour.
FLOPS_PER_SECOND = {"cpu": 5e10, "cuda": 1e13}
MEMORY_SHARE = 0.5  # of the free memory, for the prompt's keys and values (activations and the rest need room)


def prefill_flops(config: "PretrainedConfig") -> tuple[float, float]:
    """FLOPs of a Llama's forward per token (the projections and the MLP: a multiply-add per weight) and per
    (query, earlier key) pair (q·k and the value sum: a multiply-add per head and dimension each)."""
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * 2 * weights, config.num_hidden_layers * 4 * heads * head_dim


def pairs(start: int, stop: int) -> float:
    """(query, key) pairs of causal attention for queries [start, stop) over all keys before them."""
    return (stop * stop - start * start) / 2


class PrefillClock:
    """Projects the seconds a prefill still needs from its progress, fed the same (done, total) as a progress bar:
    each call after the first closes a forward, whose time joins the fit.

    The clock starts at a call with done == 0 (prefill's call before its first forward), or else when it is made;
    `start` tokens are already in the model's cache (they count as context, not as work done).
    """

    def __init__(self, config: "PretrainedConfig", start: int = 0) -> None:
        self.per_token, self.per_pair = prefill_flops(config)
        self.start = start
        self.started = self._last = time.perf_counter()
        self._done = 0
        self.forwards: list[tuple[float, float, float]] = []  # (tokens, pairs, seconds) of each forward timed
        self.fitted = False  # whether the last estimate was fitted (else: a lower bound from the FLOPs' shape)

    def seconds_left(self, done: int, total: int) -> float | None:
        """The expected seconds to reach `total`, or None before any forward was timed."""
        now = time.perf_counter()
        if done <= 0:
            self.started = self._last = now
            self._done, self.forwards = 0, []
            return None
        if done > self._done:
            self.forwards.append((done - self._done, pairs(self.start + self._done, self.start + done),
                                  now - self._last))
            self._last, self._done = now, done
        if not self.forwards:
            return None
        per_token, per_pair, self.fitted = self._fit()
        return per_token * (total - done) + per_pair * pairs(self.start + done, self.start + total)

    def _fit(self) -> tuple[float, float, bool]:
        """Seconds per token and per pair, and whether they were fitted: least squares over the forwards, neither
        negative; else the FLOPs' ratio, scaled to the time spent."""
        tt = sum(n * n for n, _, _ in self.forwards)
        tp = sum(n * p for n, p, _ in self.forwards)
        pp = sum(p * p for _, p, _ in self.forwards)
        ts = sum(n * s for n, _, s in self.forwards)
        ps = sum(p * s for _, p, s in self.forwards)
        determinant = tt * pp - tp * tp
        if len(self.forwards) > 1 and determinant > 1e-9 * tt * pp:
            per_token, per_pair = (ts * pp - ps * tp) / determinant, (ps * tt - ts * tp) / determinant
            if per_token >= 0 and per_pair >= 0:
                return per_token, per_pair, True
        flops = sum(n * self.per_token + p * self.per_pair for n, p, _ in self.forwards)
        scale = sum(s for _, _, s in self.forwards) / flops
        return scale * self.per_token, scale * self.per_pair, False


class JobClock:
    """A long job's overall progress: how many of its parts are done, and the seconds the rest should take.

    Each part has a size (its tokens) and a kind (e.g. a method at a length). A part still to run is projected to
    take what the finished parts of its kind took on average; a part of a kind not seen yet, the seconds per token
    of all the finished parts times its size. The part under way counts with the share of it done (`within`).
    """

    def __init__(self, parts: list[tuple[object, float]]) -> None:
        self.parts = parts
        self.done = 0  # parts finished, in order
        self.started = self._part_started = time.perf_counter()
        self._seconds: dict[object, list[float]] = {}  # seconds of each finished part, by kind
        self._sizes = 0.0  # size of the finished parts

    @property
    def total(self) -> int:
        return len(self.parts)

    def finish(self) -> float:
        """The part under way is done; returns the seconds it took."""
        now = time.perf_counter()
        seconds, (kind, size) = now - self._part_started, self.parts[self.done]
        self._seconds.setdefault(kind, []).append(seconds)
        self._sizes += size
        self.done += 1
        self._part_started = now
        return seconds

    def seconds_left(self, within: float = 0.0) -> float | None:
        """The expected seconds until every part is done (`within`: the share of the part under way done so far);
        None before there is anything to project from."""
        if self.done >= len(self.parts):
            return 0.0
        now_part = time.perf_counter() - self._part_started
        if self._sizes > 0:
            per_size = sum(map(sum, self._seconds.values())) / self._sizes
        elif within > 0 and self.parts[self.done][1] > 0:  # nothing finished yet: the part under way's own pace
            per_size = now_part / within / self.parts[self.done][1]
        else:
            return None
        left = 0.0
        for index in range(self.done, len(self.parts)):
            kind, size = self.parts[index]
            seen = self._seconds.get(kind)
            expected = sum(seen) / len(seen) if seen else per_size * size
            left += max(expected - now_part, expected * (1 - within)) if index == self.done else expected
        return left


def duration(seconds: float) -> str:
    """37 -> "37 seconds", 5000 -> "83 minutes", 3e6 -> "35 days": as precise as an estimate can be."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 1.5 * size:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{seconds:.0f} seconds"


def kv_bytes_per_token(config: "PretrainedConfig", element_bytes: int) -> int:
    """Bytes of one token's keys and values, in all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_bytes(config.num_hidden_layers, config.num_key_value_heads, head_dim, element_bytes)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one token's keys and values in `layers` layers of `kv_heads` heads (gali info reads them from
    model/config.py's ModelConfig, without transformers)."""
    return 2 * layers * kv_heads * head_dim * element_bytes


def free_memory(device: "torch.device") -> int:
    """Bytes free for new tensors: the GPU's free memory, or the RAM the kernel calls available."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def holdable_tokens(token_bytes: int, window: int, free_bytes: int) -> int:
    """The longest prompt whose keys and values (`token_bytes` a token: kv_bytes_per_token) fit MEMORY_SHARE of
    `free_bytes`; never less than the model's `window`. The default bound of the commands that read on the user's own
    machine: they show their progress and an estimate, and Ctrl-C stops them, so only what cannot fit is refused up
    front."""
    return max(window, int(MEMORY_SHARE * free_bytes // token_bytes))


def readable_tokens(config: "PretrainedConfig", element_bytes: int, free_bytes: int, flops_per_second: float,
                    seconds: float = READ_SECONDS) -> int:
    """The longest prompt whose keys and values fit MEMORY_SHARE of `free_bytes` and whose prefill takes at most
    `seconds` at `flops_per_second` (tokens * per_token + pairs * per_pair FLOPs, as PrefillClock models it); never
    less than the model's window."""
    by_memory = int(MEMORY_SHARE * free_bytes // kv_bytes_per_token(config, element_bytes))
    per_token, per_pair = prefill_flops(config)
    budget = flops_per_second * seconds
    # per_pair * T**2 / 2 + per_token * T = budget, solved for T
    by_time = int((-per_token + (per_token**2 + 2 * per_pair * budget) ** 0.5) / per_pair)
    return max(config.max_position_embeddings, min(by_memory, by_time))
