"""The KV cache gali generates with (engine/seam/kv_cache.py): appends in place, reads as transformers' DynamicCache."""

import pytest
import torch
from helpers.decoding import decoded_logits, rounded_cache
from helpers.tiers import slow_but
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gali_cli.config import MethodSettings
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import GrowingLayer, new_cache, reserve
from gali_cli.errors import UnsupportedModelError
from gali_cli.generate import decode, prefill, truncate_cache
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, prefill_spans
from gali_cli.seam_check import tiny_model


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


# A 16-bit cache (--kv-dtype): tiny models whose heads of 32 both kernels attend; Gemma 3's local layers attend a
# window of 6 tokens. 40 tokens prefilled in two forwards (past the 32-token window), 6 decoded eagerly, 14 by the
# static step. Through Triton's interpreter (slow): a Llama and a Gemma.
HEADS_OF_32 = {"heads": 4, "kv_heads": 2, "hidden": 128}
FAMILIES = {"llama": {}, "gemma3_text": {"sliding_window": 6}}
SIXTEEN_BITS = [*((family, method, dtype, route) for family in FAMILIES
                  for method in ("original", "gali", "self-extend") for dtype in (torch.float16, torch.bfloat16)
                  for route in ("native", "torch")),
                ("llama", "gali", torch.float16, "triton"), ("gemma3_text", "original", torch.bfloat16, "triton")]


def sixteen_bit_model(family: str, method: str):
    model = tiny_model(family, train_len=32, **HEADS_OF_32, **FAMILIES[family])
    apply_method(model, method, MethodSettings(train_len=32), 60)
    return model, torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("family, method, dtype, route", slow_but(
    SIXTEEN_BITS, ("llama", "gali", torch.float16, "native"), ("gemma3_text", "original", torch.bfloat16, "torch")))
def test_a_16_bit_cache_computes_as_a_float32_cache_of_rounded_rows(family, method, dtype, route):
    """Prefill, eager decoding and the static step (a kernel's or PyTorch's) on a cache stored in 16 bits give the
    logits of a float32 cache whose rows are rounded to 16 bits as they are stored, and not those of a float32 cache
    (so that the rounding is seen: a cache that kept float32 rows would fail)."""
    model, ids = sixteen_bit_model(family, method)
    with torch.inference_mode():
        caches = {"16-bit": new_cache(model, dtype), "rounded": rounded_cache(model, dtype),
                  "float32": new_cache(model)}
        logits = {name: decoded_logits(model, method, cache, ids, 40, 6, route) for name, cache in caches.items()}
    torch.testing.assert_close(logits["16-bit"], logits["rounded"], rtol=0, atol=1e-6)
    assert (logits["float32"] - logits["rounded"]).abs().max() > 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_holds_two_bytes_an_element_and_hands_out_float32(make_llama, dtype):
    model = make_llama(train_len=32)
    apply_method(model, "gali", MethodSettings(train_len=32), 50)
    ids = torch.randint(0, model.config.vocab_size, (1, 50))
    caches = {"float32": new_cache(model), "16-bit": new_cache(model, dtype)}
    with torch.inference_mode():
        for cache in caches.values():
            reserve(cache, 50)
            prefill(model, ids, cache, prefill_spans(model, "gali", 0, 50, step=24))
    stored = {name: [buffer for layer in cache.layers for buffer in (*layer.storage(), layer.keys, layer.values)]
              for name, cache in caches.items()}
    assert all(buffer.dtype == dtype and buffer.element_size() == 2 for buffer in stored["16-bit"])
    assert sum(b.untyped_storage().nbytes() for b in stored["16-bit"]) * 2 == sum(
        b.untyped_storage().nbytes() for b in stored["float32"])
    layer = caches["16-bit"].layers[0]
    keys, values = layer.update(*(x[:, :, :1].float() for x in layer.storage()))
    assert keys.dtype == values.dtype == torch.float32 and keys.shape[2] == 51 and layer.keys.dtype == dtype


def test_the_model_dtype_stores_as_before(make_llama):
    """--kv-dtype model (None) and the compute dtype named store the rows themselves: `update` hands out views of the
    buffers, no copy, and the logits are those of the cache as it always was, to the bit."""
    model = make_llama(train_len=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    logits = []
    with torch.inference_mode():
        for cache in (new_cache(model), new_cache(model, None), new_cache(model, torch.float32)):
            logits.append(prefill(model, ids, cache, [(0, 24), (24, 40)]))
            layer = cache.layers[0]
            handed = layer.update(layer.keys[:, :, -1:], layer.values[:, :, -1:])
            assert [x.data_ptr() for x in handed] == [x.data_ptr() for x in layer.storage()]
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def test_a_16_bit_cache_needs_gali_s_cache_layers():
    """A model whose cache transformers makes of sliding-window layers (Mistral's) keeps them, and --kv-dtype says it
    cannot apply there rather than storing in the compute dtype silently."""
    model = tiny_model("mistral", sliding_window=8)
    assert not isinstance(new_cache(model).layers[0], GrowingLayer)
    with pytest.raises(UnsupportedModelError, match="--kv-dtype float16"):
        new_cache(model, torch.float16)
