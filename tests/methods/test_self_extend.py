"""SelfExtend (methods/self_extend.py) against its float64 restatement of the paper."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards
from helpers.tiny_models import prompt

from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveSelfExtend,
)
from gali_cli.patching import apply_method

SELF_EXTEND = [  # heads, kv_heads, train_len, group_size, neighbor_window, prompt_len
    (4, 2, 16, 3, 4, 40),
    (4, 4, 16, 5, 8, 48),  # exactly its reach: (16 - 8) * 5 + 8
    (4, 1, 32, 2, 8, 50),
    (4, 2, 16, 7, 5, 16),  # inside train_len, past the window
    (4, 2, 32, 5, 12, 100),
]


@pytest.mark.parametrize("heads, kv_heads, train_len, size, window, length", SELF_EXTEND)
def test_self_extend_matches_its_paper(make_llama, heads, kv_heads, train_len, size, window, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length)
    expected = NaiveSelfExtend(model, size, window).prefill(ids[0].tolist())
    naive_tokens, _ = NaiveSelfExtend(model, size, window).greedy(ids[0].tolist(), 4)
    apply_method(model, "self-extend", MethodSettings(group_size=size, neighbor_window=window), length)
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    # Positions depend on (i, j) only: any split of the input gives the same logits.
    torch.testing.assert_close(forwards(model, ids, [3, window + 1, length - 5, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    # Decoding keeps the grouped keys rotated from token to token: the same logits as one forward.
    torch.testing.assert_close(forwards(model, ids, [length - 3, length - 2, length - 1, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens
