"""ReRoPE and Leaky ReRoPE (methods/rerope.py) against their float64 restatement."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards
from helpers.tiny_models import prompt

from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveReRoPE,
)
from gali_cli.patching import apply_method

REROPE = [  # heads, kv_heads, train_len, window, leaky factor (None: ReRoPE), log n, prompt_len
    (4, 2, 16, 4, None, True, 50),  # the default window, L/4
    (4, 1, 32, 8, None, False, 70),
    (4, 4, 16, 5, 4.0, True, 45),
    (4, 2, 16, 3, 16, False, 40),
    (4, 2, 32, 12, 2.5, True, 30),  # inside train_len, past the window
    (4, 2, 16, 1, None, True, 20),
]


@pytest.mark.parametrize("heads, kv_heads, train_len, window, factor, logn, length", REROPE)
def test_rerope_matches_its_relative_positions(make_llama, heads, kv_heads, train_len, window, factor, logn, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=2)

    def naive():
        return NaiveReRoPE(model, window, factor, train_len if logn else None)

    expected = naive().prefill(ids[0].tolist())
    naive_tokens, _ = naive().greedy(ids[0].tolist(), 4)
    name = "rerope" if factor is None else "leaky-rerope"
    apply_method(model, name, MethodSettings(neighbor_window=window, leaky_factor=factor, logn=logn), length)
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forwards(model, ids, [2, window + 3, length - 4, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens
