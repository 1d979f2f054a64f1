"""The native noise kernel (kernels/native_noise.py) against the PyTorch path: the same noise, the same attention."""

import pytest
import torch
from helpers.attention import qkv
from helpers.tiny_models import prompt
from transformers import DynamicCache

import gali_cli.engine.attention.noisy_attention as noisy_attention
import gali_cli.engine.kernels.native_noise as native_noise
from gali_cli import GaliConfig, apply_gali
from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.noisy_attention import (
    explicit_noisy_partial,
    native_noisy_attention,
    tiled_noisy_attention,
)
from gali_cli.engine.math.noise import Noise
from gali_cli.engine.math.positions import grouping
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.errors import ConfigError, GaliWarning

# (heads, kv_heads, keys, queries, train_len, local_window): GQA and MHA, odd and even key counts, one query (decode
# shapes), a grouped span of odd length, chunks longer than the window's tail.
CASES = [(4, 2, 300, 20, 64, 32), (9, 3, 1000, 64, 256, 128), (4, 4, 201, 1, 64, 0), (8, 1, 517, 7, 100, 51),
         (4, 2, 90, 16, 16, 5), (3, 3, 64, 64, 16, 4)]


@pytest.mark.parametrize("heads, kv_heads, keys, queries, train_len, local_window", CASES)
def test_native_path_equals_the_pytorch_path(heads, kv_heads, keys, queries, train_len, local_window):
    group, grouped = grouping(keys, train_len, local_window)
    query, key, value = qkv(2, heads, kv_heads, queries, keys, seed=keys)
    noise = Noise(seed=3, layer=1, scale=2.0)
    expected = tiled_noisy_attention(query, key, value, group, grouped, 0.3, noise)
    with torch.inference_mode():
        got = native_noisy_attention(query, key, value, group, grouped, 0.3, noise)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    clean = tiled_noisy_attention(query, key, value, group, grouped, 0.3, Noise(seed=3, layer=1, scale=0.0))
    assert (got - clean).abs().max() > 1e-3  # the noise is there


@pytest.mark.parametrize("keys, grouped", [(75, 74), (40, 39), (301, 300), (129, 64)])
def test_native_partial_equals_explicit_logits(keys, grouped):
    """The part decoding and chunks use: every query sees every key; its output and log-sum-exp."""
    query, key, value = qkv(1, 6, 2, 5, keys, seed=7)
    arguments = (query, key, value, 0.25, Noise(seed=9, layer=4, scale=3.0), keys, 3,
                 grouped, keys + 5)
    with torch.inference_mode():
        got = native_noise.noisy_partial(*arguments)
    expected = explicit_noisy_partial(*arguments)
    torch.testing.assert_close(got.output, expected.output, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got.lse, expected.lse, rtol=1e-5, atol=2e-5)


def test_noisy_gali_model_is_the_same_on_either_cpu_path(make_llama, monkeypatch):
    """Prefill chunk by chunk and decoding, native kernel vs GALI_KERNEL=torch: the same logits."""
    ids = prompt(70, batch=2)
    results = []
    for choice in ("native", "torch"):
        monkeypatch.setenv("GALI_KERNEL", choice)
        model = apply_gali(make_llama(train_len=16, heads=4, kv_heads=2),
                           GaliConfig(chunk_size=5, local_window=3, noise=True, noise_scale=2.0))
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            prefill = model(ids[:, :-1], **with_cache(model, cache), use_cache=True)
            step = model(ids[:, -1:], **with_cache(model, cache), use_cache=True)
        results.append((prefill.logits, step.logits))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_kernel_that_disagrees_is_not_used(fresh_kernel, monkeypatch):
    def wrong(*arguments):
        right = explicit_noisy_partial(*arguments)
        return right._replace(output=right.output + 0.01)

    monkeypatch.setattr(native_noise, "noisy_partial", wrong)
    with pytest.warns(GaliWarning, match="disagrees with the PyTorch path"):
        assert not noisy_attention.native_verified()


def test_forced_native_kernel_off_the_cpu_is_a_config_error(monkeypatch):
    monkeypatch.setenv("GALI_KERNEL", "native")
    query = torch.empty(1, 1, 1, 8, device="meta")
    with pytest.raises(ConfigError, match="GALI_KERNEL=native runs on the CPU"):
        plan_for(query, query, query, noise=True)
