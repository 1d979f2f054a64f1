"""DPE (methods/dpe.py) against its float64 restatement of the paper, and its authors' settings for their models."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards, llama3_config
from helpers.tiny_models import prompt

from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveDPE,
)
from gali_cli.methods.dpe import published_settings
from gali_cli.methods.resolving import preview_method
from gali_cli.patching import apply_method

DPE = [  # heads, kv_heads, train_len, scales (one per group of frequencies), window, prompt_len
    (4, 2, 16, (4, 4, 4, 4), 2, 50),  # the defaults: W = L/8, every group the smallest scale reaching N
    (4, 1, 32, (2, 7), 8, 70),
    (4, 4, 16, (1, 2, 3, 16), 5, 45),  # a group with scale 1: plain RoPE beyond the window
    (4, 2, 16, (3,), 3, 16),  # inside train_len, past the window
]


@pytest.mark.parametrize("heads, kv_heads, train_len, scales, window, length", DPE)
def test_dpe_matches_its_paper(make_llama, heads, kv_heads, train_len, scales, window, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=3)
    expected = NaiveDPE(model, scales, window).prefill(ids[0].tolist())
    naive_tokens, _ = NaiveDPE(model, scales, window).greedy(ids[0].tolist(), 4)
    settings = apply_method(model, "dpe", MethodSettings(neighbor_window=window, dpe_scales=scales), length)
    assert settings["dpe_scales"] == list(scales) and settings["dpe_published"] is None
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forwards(model, ids, [1, window, length - 6, length]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens


@pytest.mark.parametrize("version, name, scales", [
    ("3", "Meta-Llama-3-8B-Instruct", [2, 8, 2, 8, 32, 32, 32, 4]),
    ("3.1", "Meta-Llama-3.1-8B-Instruct", [2, 32, 32, 2, 2, 2, 2, 1]),
])
def test_dpe_takes_its_authors_settings_for_their_models(version, name, scales):
    config = llama3_config(version)
    assert preview_method(config, "dpe", MethodSettings()) == {
        "train_len": config.max_position_embeddings, "neighbor_window": 1024, "dpe_scales": scales,
        "dpe_published": name}
    # A narrower window, or scales of one's own, are not what the authors searched: the documented defaults.
    narrower = preview_method(config, "dpe", MethodSettings(train_len=4096))
    assert narrower["dpe_published"] is None and narrower["neighbor_window"] == 512
    given = preview_method(config, "dpe", MethodSettings(dpe_scales=(4, 4)))
    assert given["dpe_scales"] == [4, 4] and given["dpe_published"] is None and given["neighbor_window"] == 1024
    other = llama3_config(version)
    other.vocab_size = 32000
    assert published_settings(other) is None
