"""SELF, SelfExtend with logistic group sizes (methods/self_logistic.py, `--method self`): against its float64
restatement, its reach, its defaults and the settings it refuses."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards, llama3_config
from helpers.tiny_models import prompt

from gali_cli import ConfigError
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveSELF,
)
from gali_cli.methods.resolving import preview_method
from gali_cli.methods.self_logistic import LogisticSelfExtend, grouped_positions, smallest_capacity, smallest_rate
from gali_cli.methods.self_logistic import reach as self_reach
from gali_cli.patching import apply_method

SELF = [  # heads, kv_heads, train_len, capacity, rate, neighbor_window, prompt_len
    (4, 2, 16, 5, 0.5, 4, 40),  # exactly its reach: 4 + (1 + 1 + 2 + 2 + 3 + 3 + 4 * 6)
    (4, 4, 16, 7, 1.0, 3, 60),
    (4, 1, 32, 8, 0.2, 8, 100),
    (4, 2, 16, 3, 1.0, 5, 16),  # inside train_len, past the window
    (4, 2, 32, 2, 0.02, 8, 32),  # capacity 2: one token per position, plain RoPE
    (4, 2, 32, 12, 0.1, 12, 53),  # exactly its reach; sizes grow over tens of positions, as at the default rate
]


@pytest.mark.parametrize("heads, kv_heads, train_len, capacity, rate, window, length", SELF)
def test_self_matches_its_paper(make_llama, heads, kv_heads, train_len, capacity, rate, window, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=7)

    def naive():
        return NaiveSELF(model, capacity, rate, window)

    expected = naive().prefill(ids[0].tolist())
    naive_tokens, _ = naive().greedy(ids[0].tolist(), 4)
    settings = MethodSettings(group_size=capacity, neighbor_window=window, self_rate=rate)
    assert apply_method(model, "self", settings, length) == {
        "train_len": train_len, "neighbor_window": window, "self_rate": rate, "group_size": capacity}
    whole = model(ids).logits
    torch.testing.assert_close(whole[0].double(), expected, rtol=1e-4, atol=1e-4)
    # Positions depend on (i, j) only: any split of the input gives the same logits.
    torch.testing.assert_close(forwards(model, ids, [3, window + 1, length - 5, length]), whole, rtol=1e-5, atol=1e-5)
    # Decoding keeps the grouped keys rotated from token to token: the same logits as one forward.
    torch.testing.assert_close(forwards(model, ids, [length - 3, length - 2, length - 1, length]), whole,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens


@pytest.mark.parametrize("capacity, rate, window, train_len", [
    (5, 0.5, 4, 16), (33, 0.02, 512, 4096), (2, 0.02, 8, 32), (7, 3.0, 3, 16), (200, 0.01, 100, 1000)])
def test_self_positions_stay_within_train_len_up_to_its_reach(capacity, rate, window, train_len):
    """The last query of an input of `reach` tokens sits at train_len - 1 exactly, one token more passes it; the
    static step's offsets over a cache of that many rows keep to train_len - 1 too."""
    tokens = self_reach(capacity, rate, window, train_len)
    method = LogisticSelfExtend(capacity, rate, window, train_len)
    assert method.table_rows(0, tokens) <= max(train_len, 2 * window)
    grouped = grouped_positions(capacity, rate, tokens + 1)
    assert window + grouped[tokens - 1 - window] == train_len - 1 and window + grouped[tokens - window] == train_len
    keys = torch.arange(tokens)
    for query in (window, tokens // 2, tokens - 1):
        placement = method.decode_placement(torch.tensor(query), keys)
        offsets = placement.offset[: query + 1]
        assert placement.reach == train_len - 1 and -(train_len - 1) <= int(offsets.min()) and int(offsets.max()) == 0


def test_self_defaults_to_the_smallest_capacity_that_reaches_the_input(make_llama):
    model = make_llama(train_len=32)
    settings = apply_method(model, "self", MethodSettings(self_rate=0.3), 200)
    capacity = settings["group_size"]
    assert settings == {"train_len": 32, "neighbor_window": 4, "self_rate": 0.3, "group_size": capacity}
    assert self_reach(capacity - 1, 0.3, 4, 32) < 200 <= self_reach(capacity, 0.3, 4, 32)
    assert apply_method(model, "self", MethodSettings(), 30)["group_size"] == 2  # within train_len: plain RoPE
    # Llama-2's window with the official PG19 script's W = 512: 16k tokens take groups of up to 5, at r = 0.02.
    assert smallest_capacity(0.02, 512, 4096, 16384) == 6
    assert smallest_rate(512, 4096, 16384) == 0.02
    assert preview_method(llama3_config("3"), "self", MethodSettings()) == {
        "train_len": 8192, "neighbor_window": 1024, "self_rate": 0.02,
        "group_size": "the smallest that reaches the input"}
    assert preview_method(llama3_config("3"), "self", MethodSettings(group_size=33))["reaches"] == \
        self_reach(33, 0.02, 1024, 8192)


def test_self_raises_its_rate_where_the_official_one_cannot_reach_the_input(make_llama):
    """Within 28 grouped positions (L = 32, W = 4) r = 0.02 keeps every group at one token: the rate is raised, in
    hundredths, to the first with which some capacity reaches the input."""
    settings = apply_method(make_llama(train_len=32), "self", MethodSettings(), 200)
    rate, capacity = settings["self_rate"], settings["group_size"]
    assert rate > 0.02 and rate == round(rate, 2)
    assert smallest_capacity(rate - 0.01, 4, 32, 200) is None and smallest_capacity(rate, 4, 32, 200) == capacity
    assert apply_method(make_llama(train_len=32), "self", MethodSettings(group_size=capacity), 30)["self_rate"] == 0.02


@pytest.mark.parametrize("settings, message", [
    (MethodSettings(group_size=1), "--group-size must be a whole number >= 2 for self"),
    (MethodSettings(group_size=3, self_rate=0.5, neighbor_window=4), "raise --group-size"),
    (MethodSettings(neighbor_window=4, self_rate=0.02), "raise --self-rate"),  # 12 positions of one token each
    (MethodSettings(neighbor_window=16), "--neighbor-window"),
    (MethodSettings(neighbor_window=15), "too few for self to reach the input's 100 tokens at any --self-rate: lower "
                                         "--neighbor-window"),
])
def test_self_refuses_settings_that_make_no_sense_in_one_line(make_llama, settings, message):
    with pytest.raises(ConfigError, match=message) as refused:
        apply_method(make_llama(train_len=16), "self", settings, 100)
    assert "\n" not in str(refused.value)
    for rate in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="--self-rate must be a number > 0") as refused:
            MethodSettings(self_rate=rate)
        assert "\n" not in str(refused.value)
