"""The prefill's time estimate: the arithmetic shape of its cost, scaled by the time already spent."""

import pytest
from transformers import LlamaConfig

import gali_cli.estimate as estimate
from gali_cli.estimate import PrefillClock, duration, prefill_flops

CONFIG = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64)  # the demo model's shapes


def test_flops_count_weights_per_token_and_attention_per_key():
    per_token = 6 * 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768)
    per_key = 6 * 4 * 4 * 64
    assert prefill_flops(CONFIG, 0, 1) == pytest.approx(per_token + per_key / 2)
    assert prefill_flops(CONFIG, 0, 100) == pytest.approx(100 * per_token + per_key * 100**2 / 2)
    assert prefill_flops(CONFIG, 0, 300) == pytest.approx(prefill_flops(CONFIG, 0, 100) + prefill_flops(CONFIG, 100, 300))


def test_the_clock_scales_the_time_spent_by_the_cost_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: now[0])
    clock = PrefillClock(CONFIG)
    now[0] = 130.0  # loading a cached state, tokenizing: not prefill
    assert clock.seconds_left(0, 4096) is None  # the prefill begins
    now[0] = 132.0
    left = clock.seconds_left(512, 4096)
    assert left == pytest.approx(2.0 * prefill_flops(CONFIG, 512, 4096) / prefill_flops(CONFIG, 0, 512))
    assert left > 2.0 * 7  # later tokens attend to more keys: dearer than the first
    assert clock.seconds_left(4096, 4096) == 0


@pytest.mark.parametrize("seconds, text", [(37, "37 seconds"), (100, "1.7 minutes"), (5000, "83 minutes"), (6000, "1.7 hours"),
                                           (3e6, "35 days"), (7.6e7, "880 days")])
def test_durations_read_as_estimates(seconds, text):
    assert duration(seconds) == text
