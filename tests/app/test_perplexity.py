import math

import pytest
import torch
import torch.nn.functional as F
from helpers.decoding import rounded_cache

import gali_cli.perplexity as perplexity_module
from gali_cli import ConfigError
from gali_cli.config import MethodSettings
from gali_cli.generate import forward_spans
from gali_cli.patching import apply_method, forward_ends
from gali_cli.perplexity import perplexities


def reference_ppl(logits: torch.Tensor, ids: torch.Tensor, length: int) -> float:
    """exp(mean NLL of tokens 2..length) from full logits (1, N, V)."""
    return math.exp(F.cross_entropy(logits[0, : length - 1].double(), ids[0, 1:length]).item())


@pytest.mark.parametrize("method", ["original", "gali"])
def test_one_pass_matches_full_logits(make_llama, monkeypatch, method):
    model = make_llama(train_len=16)
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(1))
    apply_method(model, method, MethodSettings(chunk_size=5, local_window=2), 90)
    logits = model(ids).logits  # GALI: one forward over all 90 tokens equals any plan-aligned split
    boundaries = forward_ends(model, method, 0, 90)
    spans = forward_spans(0, 90, 24, boundaries)
    monkeypatch.setattr(perplexity_module, "_LOGIT_SLICE", 7)  # several head slices per forward
    seen = []
    results = perplexities(model, ids, [2, 16, 17, 50, 90], spans, lambda *update: seen.append(update), boundaries)
    for result in results:
        assert result.ppl == pytest.approx(reference_ppl(logits, ids, result.length), rel=1e-5)
        assert result.mean_nll == pytest.approx(math.log(result.ppl))
    # Progress after every forward (its chunks' logits all come after it: a bar gains nothing from more calls, and
    # the prefill's time estimate times forwards), with the perplexity of exactly the tokens done so far.
    assert [done for done, _, _ in seen] == [last for _, last in spans]
    for done, _, figure in seen:
        assert figure == pytest.approx(reference_ppl(logits, ids, done), rel=1e-5)


def test_lengths_must_fit_the_document(make_llama):
    model = make_llama(train_len=16)
    ids = torch.randint(0, 64, (1, 20))
    with pytest.raises(ConfigError, match="21 tokens asked, the document has 20"):
        perplexities(model, ids, [21], [(0, 20)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_scores_as_a_float32_cache_of_rounded_rows(make_llama, monkeypatch, dtype):
    """`gali ppl --kv-dtype` (runs/ppl.py passes it here): the pass over a 16-bit cache gives the perplexity of a
    float32 cache whose rows are rounded as they are stored, not the float32 cache's own."""
    model = make_llama(train_len=16)
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(1))
    apply_method(model, "gali", MethodSettings(chunk_size=5, local_window=2), 60)
    spans = forward_spans(0, 60, 24, forward_ends(model, "gali", 0, 60))
    half, plain = (perplexities(model, ids, [60], spans, kv_dtype=kv)[0].mean_nll for kv in (dtype, None))
    monkeypatch.setattr(perplexity_module, "new_cache", lambda model, kv_dtype: rounded_cache(model, dtype))
    rounded = perplexities(model, ids, [60], spans)[0].mean_nll
    assert half == pytest.approx(rounded, rel=1e-6, abs=0) and half != plain
