"""ChunkLlama's Dual Chunk Attention (methods/chunk_llama.py) against its float64 restatement of the paper."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards
from helpers.tiny_models import prompt

from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveDualChunk,
)
from gali_cli.patching import apply_method

DUAL_CHUNK = [  # heads, kv_heads, train_len, chunk_size, local_window, prompt_len
    (4, 2, 16, 12, 4, 50),  # the defaults: s = 3/4 L, w = L - s
    (4, 4, 16, 6, 2, 45),
    (4, 1, 32, 24, 8, 110),
    (4, 2, 16, 10, 0, 33),
    (4, 2, 16, 5, 3, 14),  # inside train_len, past one chunk
]


@pytest.mark.parametrize("heads, kv_heads, train_len, size, window, length", DUAL_CHUNK)
def test_dual_chunk_attention_matches_its_paper(make_llama, heads, kv_heads, train_len, size, window, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=1)
    expected = NaiveDualChunk(model, size, window, train_len).prefill(ids[0].tolist())
    naive_tokens, _ = NaiveDualChunk(model, size, window, train_len).greedy(ids[0].tolist(), 4)
    settings = MethodSettings(dca_chunk_size=size, local_window=window)
    apply_method(model, "chunk-llama", settings, length)
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forwards(model, ids, [2, size, length - 3, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    # Decoding keeps the keys rotated from token to token: the same logits as one forward.
    torch.testing.assert_close(forwards(model, ids, [length - 3, length - 2, length - 1, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens


def test_figure_2_of_the_dca_paper():
    """s = 6, c = 10, w = 4: the successive-chunk query positions are [6, 7, 8, 9, 9, 9] in every chunk."""
    model_free = NaiveDualChunk.__new__(NaiveDualChunk)
    model_free.s, model_free.w, model_free.c = 6, 4, 10
    positions = [model_free.s + k if k < model_free.w else model_free.c - 1 for k in range(6)]
    assert positions == [6, 7, 8, 9, 9, 9]


def test_chunk_llama_decodes_every_place_in_a_chunk_as_one_forward(make_llama):
    """A decoded token past the local window attends the previous chunk and the older ones in one call; within it,
    in two: decoding a whole chunk token by token (every i mod s) gives the logits of one forward."""
    model = make_llama(train_len=16, heads=4, kv_heads=2)
    apply_method(model, "chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4), 60)
    ids = prompt(52, seed=5)
    torch.testing.assert_close(forwards(model, ids, list(range(36, 53))), model(ids).logits, rtol=1e-5, atol=1e-5)
