"""The KV cache gali generates with (engine/seam/kv_cache.py): appends in place, reads as transformers' DynamicCache."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gali_cli.config import MethodSettings
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import GrowingLayer, new_cache, reserve
from gali_cli.generate import decode, prefill, truncate_cache
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, prefill_spans


def states(batch: int = 1, tokens: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, tokens, 4, generator=generator) for _ in range(2))


def test_appends_in_place_and_reads_as_the_concatenation():
    layer, plain = GrowingLayer(), DynamicLayer()
    for step, tokens in enumerate([5, 1, 1, 3, 1]):
        keys, values = layer.update(*states(tokens=tokens, seed=step))
        expected = plain.update(*states(tokens=tokens, seed=step))
        assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
        if step == 1:
            buffer = keys.data_ptr()
    assert keys.data_ptr() == buffer  # 5 tokens left room for 64 more: no copy since
    assert layer.get_seq_length() == 11


def test_reserve_allocates_exactly_the_room_asked_for():
    cache = DynamicCache()
    cache.layers = [GrowingLayer()]
    reserve(cache, 40)
    keys, _ = cache.update(*states(tokens=30), 0)
    assert keys.untyped_storage().nbytes() == 40 * 2 * 4 * 4  # 40 rows, 2 heads, head dim 4, float32
    first = keys.data_ptr()
    for step in range(10):
        keys, _ = cache.update(*states(tokens=1, seed=step + 1), 0)
    assert keys.data_ptr() == first and keys.shape[2] == 40
    keys, _ = cache.update(*states(tokens=1, seed=99), 0)  # past the reservation: grows, by a quarter at least
    assert keys.data_ptr() != first and keys.untyped_storage().nbytes() >= (41 + 64) * 2 * 4 * 4


def test_a_cut_cache_continues_in_place_with_the_right_rows():
    cache, plain = new_cache_like(), DynamicCache()
    for step, tokens in enumerate([6, 1, 1]):
        cache.update(*states(tokens=tokens, seed=step), 0)
        plain.update(*states(tokens=tokens, seed=step), 0)
    truncate_cache(cache, 5)
    truncate_cache(plain, 5)
    before = cache.layers[0].keys.data_ptr()
    keys, values = cache.update(*states(tokens=2, seed=7), 0)
    expected = plain.update(*states(tokens=2, seed=7), 0)
    assert keys.data_ptr() == before
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


def test_keys_replaced_by_another_tensor_are_copied_not_written_through():
    layer = GrowingLayer()
    layer.update(*states(batch=2, tokens=4))
    layer.batch_select_indices(torch.tensor([1]))  # a new tensor, not a view of the buffer
    chosen = layer.keys.clone()
    keys, _ = layer.update(*states(batch=1, tokens=1, seed=5))
    assert keys.shape == (1, 2, 5, 4) and torch.equal(keys[:, :, :4], chosen)


def test_a_buffer_made_in_inference_mode_is_not_written_outside_it():
    layer = GrowingLayer()
    with torch.inference_mode():
        layer.update(*states(tokens=3))
    keys, _ = layer.update(*states(tokens=1, seed=1))  # would raise if it wrote into the inference tensor
    assert keys.shape[2] == 4 and not keys.is_inference()


@torch.enable_grad()
def test_under_autograd_it_appends_as_transformers_does():
    layer = GrowingLayer()
    key, value = (tensor.requires_grad_() for tensor in states(tokens=3))
    keys, values = layer.update(key, value)
    more = states(tokens=1, seed=1)
    keys, values = layer.update(more[0].requires_grad_(), more[1])
    (keys.sum() + values.sum()).backward()
    assert torch.equal(key.grad, torch.ones_like(key))


@pytest.mark.parametrize("method", sorted(NAMES))
def test_every_method_generates_the_same_with_it(make_llama, method):
    """Prefill in the method's forwards, then greedy decoding: logits equal to transformers' own DynamicCache."""
    torch.manual_seed(0)
    model = make_llama(train_len=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 70))
    seen = {}
    for name, cache in (("dynamic", DynamicCache(config=model.config)), ("growing", new_cache(model))):
        apply_method(model, method, MethodSettings(train_len=32), 90)  # afresh: dynamic-ntk's rotary keeps state
        spans = prefill_spans(model, method, 0, 70, step=24)
        logits_seen = []

        def greedy(logits: torch.Tensor, logits_seen=logits_seen) -> int:
            logits_seen.append(logits)
            return int(logits.argmax())

        with torch.inference_mode():
            logits = prefill(model, ids, cache, spans)
            tokens = list(decode(model, cache, logits, greedy, 6, stop_ids=set()))
        seen[name] = (tokens, torch.stack(logits_seen))
    assert seen["growing"][0] == seen["dynamic"][0]
    torch.testing.assert_close(seen["growing"][1], seen["dynamic"][1], rtol=1e-5, atol=1e-5)


def test_the_seam_takes_it_as_a_dynamic_cache(make_llama):
    model = make_llama()
    cache = new_cache(model)
    assert isinstance(cache, DynamicCache) and all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert "past_key_values" in with_cache(model, cache) or "cache" in with_cache(model, cache)


def new_cache_like() -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [GrowingLayer()]
    return cache
