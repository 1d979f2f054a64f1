"""LaMPE (methods/lampe.py) against its official positions, its defaults and its rounding."""


import pytest
import torch
from helpers.methods import engine_greedy, forwards, llama3_config
from helpers.tiny_models import prompt

from gali_cli import ConfigError
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveLaMPE,
)
from gali_cli.methods.registry import REGISTRY
from gali_cli.methods.resolving import preview_method
from gali_cli.patching import apply_method

LAMPE = [  # heads, kv_heads, train_len, head, tail, mapping length, prompt_len
    (4, 2, 32, 8, 3, 12, 90),
    (4, 1, 32, 6, 2, 20, 70),
    (4, 4, 16, 4, 2, 5, 60),  # runs of ~12 equal m: the tail reaches past the head window; 6 tokens decoded past H
    (4, 2, 32, 16, 3, 12, 30),  # shorter than 2H: true distances, scaled logits
]


@pytest.mark.parametrize("heads, kv_heads, train_len, head, tail, length, prompt_len", LAMPE)
def test_lampe_matches_its_official_positions(make_llama, heads, kv_heads, train_len, head, tail, length, prompt_len):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(prompt_len, seed=5)
    expected = NaiveLaMPE(model, head, tail, length, prompt_len).prefill(ids[0].tolist())
    naive_tokens, _ = NaiveLaMPE(model, head, tail, length, prompt_len).greedy(ids[0].tolist(), 6)
    settings = apply_method(model, "lampe", MethodSettings(neighbor_window=head, lampe_tail=tail, lampe_length=length),
                            prompt_len)
    assert settings["lampe_length"] == min(length, prompt_len) and settings["tokens"] == prompt_len
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forwards(model, ids, [1, head, prompt_len - 7, prompt_len]), model(ids).logits,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 6) == naive_tokens


def test_lampe_defaults_follow_train_len_and_the_authors_model(make_llama):
    model = make_llama(train_len=64)
    settings = apply_method(model, "lampe", MethodSettings(), 300)
    assert (settings["neighbor_window"], settings["lampe_tail"], settings["lampe_length"]) == (4, 2, 12)
    assert not REGISTRY["lampe"].prefix_reusable  # its map follows the input's length
    preview = preview_method(llama3_config("3"), "lampe", MethodSettings())
    assert (preview["neighbor_window"], preview["lampe_tail"], preview["lampe_length"]) == (512, 200, 1536)
    assert preview["lampe_published"] == "Meta-Llama-3-8B-Instruct"
    with pytest.raises(ConfigError, match="--lampe-tail"):
        preview_method(llama3_config("3"), "lampe", MethodSettings(lampe_tail=600))


def test_lampe_rounds_its_map_as_the_official_code():
    """24 / 149 as torch divides an int by a long tensor puts m(149) at 24 (a correctly rounded float32 quotient
    gives 23.999998, so 23): the regions below are those the official llama_cache1.py printed for this input."""
    from gali_cli.methods.lampe import Layout, mapping

    assert int(mapping(torch.arange(150), 150, 24)[149]) == 24
    layout = Layout.of(8, 3, 24, 150)
    assert (layout.tail_end, layout.head_shift, layout.tail_shift) == (6, 6, 114)
