"""STRING (methods/string_rope.py) against its float64 restatement, its defaults and its authors' settings."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards, llama3_config
from helpers.tiny_models import prompt

from gali_cli import ConfigError
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveString,
)
from gali_cli.methods.resolving import preview_method
from gali_cli.patching import apply_method

STRING = [  # heads, kv_heads, train_len, shift S, local window W, logit scale, prompt_len
    (4, 2, 16, 5, 2, True, 16),  # the defaults: S = int(0.33 L), W = min(128, S / 2); the whole window
    (4, 1, 32, 10, 3, True, 40),  # within its reach, L + S - W = 39, and one past
    (4, 4, 16, 8, 0, False, 45),  # W = 0; past the reach, where distances run beyond L as the official code's do
    (4, 2, 32, 20, 12, False, 30),
    (4, 2, 16, 1, 0, True, 12),  # every other pair shifted
]


@pytest.mark.parametrize("heads, kv_heads, train_len, shift, window, scale, length", STRING)
def test_string_matches_its_shifted_positions(make_llama, heads, kv_heads, train_len, shift, window, scale, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=6)
    expected = NaiveString(model, shift, window, scale).prefill(ids[0].tolist())
    naive_tokens, _ = NaiveString(model, shift, window, scale).greedy(ids[0].tolist(), 4)
    settings = apply_method(model, "string", MethodSettings(shifted_offset=shift, local_window=window,
                                                            string_scale=scale), length)
    assert settings["shifted_offset"] == shift and settings["local_window"] == window
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forwards(model, ids, [1, shift + 2, length - 3, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens


def test_string_defaults_and_its_authors_settings(make_llama):
    assert apply_method(make_llama(train_len=16), "string", MethodSettings(), 100) == {
        "train_len": 16, "shifted_offset": 5, "local_window": 2, "string_scale": True, "reaches": 19,
        "string_published": None}
    config = llama3_config("3.1")
    assert preview_method(config, "string", MethodSettings()) == {
        "train_len": 131072, "shifted_offset": 43253, "local_window": 128, "string_scale": True,
        "reaches": 131072 + 43253 - 128,
        "string_published": "Meta-Llama-3.1-8B-Instruct"}  # the README's 0.33 * 131072 and its RULER runs' W
    assert preview_method(llama3_config("3"), "string", MethodSettings())["string_published"] == \
        "Meta-Llama-3-8B-Instruct"
    assert preview_method(config, "string", MethodSettings(train_len=4096))["string_published"] is None
    assert preview_method(config, "string", MethodSettings(local_window=256))["string_published"] is None
    for settings, message in [(MethodSettings(shifted_offset=200000), "--shifted-offset"),
                              (MethodSettings(shifted_offset=100, local_window=100), "--local-window")]:
        with pytest.raises(ConfigError, match=message):
            preview_method(config, "string", settings)
    with pytest.raises(ConfigError, match="--shifted-offset"):
        MethodSettings(shifted_offset=0)


def test_string_in_batches_and_half_precision(make_llama):
    """A batch gives each row's own logits (and decoding keeps each row's far keys); bf16 tracks fp32."""
    model = make_llama(train_len=16)
    ids = torch.cat((prompt(60, seed=4), prompt(60, seed=5)))
    apply_method(model, "string", MethodSettings(shifted_offset=6, local_window=2), 70)
    alone = [forwards(model, ids[row : row + 1], [40, 50, 51, 52, 60]) for row in range(2)]
    torch.testing.assert_close(forwards(model, ids, [40, 50, 51, 52, 60]), torch.cat(alone), rtol=1e-5, atol=1e-5)
    logits = model.to(torch.bfloat16)(ids[:1]).logits[0].float()
    assert (logits - alone[0][0]).norm() / alone[0][0].norm() < 0.05
