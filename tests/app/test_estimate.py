"""The prefill's time estimate: a cost per token and per (query, key) pair, fitted to the forwards timed so far."""

import pytest
from transformers import AutoConfig, LlamaConfig

import gali_cli.estimate as estimate
from gali_cli.estimate import (
    FLOPS_PER_SECOND,
    PrefillClock,
    duration,
    kv_bytes_per_token,
    pairs,
    prefill_flops,
    readable_tokens,
)

CONFIG = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64)  # the demo model's shapes


@pytest.fixture
def clock(monkeypatch):
    """A PrefillClock on a fake clock: `clock.at(seconds)` sets the time."""
    now = [0.0]
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: now[0])
    made = PrefillClock(CONFIG)
    made.at = lambda seconds: now.__setitem__(0, seconds)
    return made


def test_flops_per_token_and_per_pair():
    assert prefill_flops(CONFIG) == (6 * 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768), 6 * 4 * 4 * 64)
    assert pairs(0, 100) + pairs(100, 300) == pairs(0, 300) == 300 * 300 / 2


def test_one_forward_scales_the_flops_and_later_tokens_cost_more(clock):
    clock.at(30.0)  # loading a cached state, tokenizing: not prefill
    assert clock.seconds_left(0, 4096) is None  # the prefill begins
    clock.at(32.0)
    per_token, per_pair = prefill_flops(CONFIG)
    flops = lambda start, stop: per_token * (stop - start) + per_pair * pairs(start, stop)  # noqa: E731
    assert clock.seconds_left(512, 4096) == pytest.approx(2.0 * flops(512, 4096) / flops(0, 512))
    assert clock.seconds_left(512, 4096) > 2.0 * 7  # attention's share grows with the context
    assert not clock.fitted  # a lower bound: attention costs at least its FLOPs' share


def test_forwards_fit_the_cost_per_token_and_per_pair(clock):
    """Forwards that take 1 ms a token plus 1 us a pair (what the FLOPs would not say) predict the rest exactly."""
    def cost(start: int, stop: int) -> float:
        return 1e-3 * (stop - start) + 1e-6 * pairs(start, stop)

    clock.seconds_left(0, 8192)
    spent = 0.0
    for start in range(0, 2048, 512):
        spent += cost(start, start + 512)
        clock.at(spent)
        left = clock.seconds_left(start + 512, 8192)
    assert left == pytest.approx(cost(2048, 8192)) and clock.fitted
    assert clock.seconds_left(8192, 8192) == 0


def test_a_noisy_fit_never_goes_negative(clock):
    clock.seconds_left(0, 4096)
    for done, seconds in [(512, 2.0), (1024, 2.5), (1536, 2.6)]:  # the second and third forward barely slower
        clock.at(seconds)
        assert clock.seconds_left(done, 4096) > 0


@pytest.mark.parametrize("seconds, text", [(37, "37 seconds"), (100, "1.7 minutes"), (5000, "83 minutes"),
                                           (6000, "1.7 hours"), (3e6, "35 days"), (7.6e7, "880 days")])
def test_durations_read_as_estimates(seconds, text):
    assert duration(seconds) == text


def test_readable_tokens_is_bounded_by_memory_and_by_reading_time():
    """The demo model's 1,000-part request (about 120k tokens) is past the CPU's default; a GPU's is larger, and
    little free memory bounds it, never below the model's window."""
    config = AutoConfig.from_pretrained("gali_cli/model/demo")
    assert kv_bytes_per_token(config, 2) == 2 * 6 * 2 * 64 * 2
    on_cpu = readable_tokens(config, 4, 64 * 2**30, FLOPS_PER_SECOND["cpu"])
    assert 10_000 < on_cpu < 120_000
    assert readable_tokens(config, 2, 64 * 2**30, FLOPS_PER_SECOND["cuda"]) > on_cpu
    assert readable_tokens(config, 4, 2**20, FLOPS_PER_SECOND["cpu"]) == 256  # 1 MiB: the window, at least
    assert readable_tokens(config, 4, 2**28, FLOPS_PER_SECOND["cpu"]) == 2**27 // kv_bytes_per_token(config, 4)



def test_a_jobs_time_left_comes_from_the_parts_done_weighted_by_their_kind_and_size(monkeypatch):
    """gali eval's answers: a part of a kind already seen takes what that kind took; another kind the seconds per
    token so far times its tokens; the part under way counts with its share done."""
    now = [0.0]
    monkeypatch.setattr(estimate.time, "perf_counter", lambda: now[0])
    job = estimate.JobClock([("a", 100), ("a", 100), ("b", 400), ("c", 100)])
    assert job.seconds_left() is None  # nothing to project from yet
    now[0] = 10.0
    assert job.seconds_left(within=0.5) == pytest.approx(10 + 20 + 80 + 20)  # its own pace: 0.2 s a token
    job.finish()
    assert (job.done, job.total) == (1, 4)
    assert job.seconds_left() == pytest.approx(10 + 40 + 10)  # a: 10 s; b and c: 0.1 s a token
    now[0] = 15.0
    assert job.seconds_left(within=0.25) == pytest.approx(7.5 + 40 + 10)  # a's 10 s, 5 spent, a quarter done
    for _ in range(3):
        job.finish()
    assert job.seconds_left() == 0.0
