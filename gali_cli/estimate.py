"""How long a prefill still needs: the time its first forwards took, scaled by the arithmetic cost of the rest.

A token's cost grows with the context: its projections and MLP cost the same everywhere, but it attends to every
earlier key (GALI too: each chunk's queries see all T keys). Counting both in FLOPs gives the shape of the cost
curve; the forwards already run give its scale on this machine, with this method and its overheads. The estimate is
an extrapolation: docs/performance.md says how close it came on the demo model.
"""

import time

from transformers import PretrainedConfig


def prefill_flops(config: PretrainedConfig, start: int, stop: int) -> float:
    """FLOPs of running tokens [start, stop) through a Llama that has the first `start` cached: per token, the
    attention projections and the MLP (a multiply-add per weight); per token and earlier key, q·k and the value sum
    (a multiply-add per head and dimension each)."""
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * config.intermediate_size
    per_key = 4 * heads * head_dim
    return config.num_hidden_layers * (2 * weights * (stop - start) + per_key * (stop * stop - start * start) / 2)


class PrefillClock:
    """Projects the seconds a prefill still needs from its progress, fed the same (done, total) as a progress bar.

    The clock starts at its first call with done == 0 (prefill's call before its first forward), or else when it is
    made; `start` tokens are already in the model's cache and do not count as done.
    """

    def __init__(self, config: PretrainedConfig, start: int = 0) -> None:
        self.config, self.start = config, start
        self.started = time.perf_counter()

    def seconds_left(self, done: int, total: int) -> float | None:
        """The expected seconds to reach `total`, or None before any token was timed."""
        now = time.perf_counter()
        if done <= 0:
            self.started = now
            return None
        spent = prefill_flops(self.config, self.start, self.start + done)
        left = prefill_flops(self.config, self.start + done, self.start + total)
        return (now - self.started) * left / spent


def duration(seconds: float) -> str:
    """37 -> "37 seconds", 5000 -> "83 minutes", 3e6 -> "35 days": as precise as an estimate can be."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 1.5 * size:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{seconds:.0f} seconds"
