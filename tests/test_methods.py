import itertools
import math

import pytest
import torch
from conftest import VOCAB
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import gali_cli.methods.gali as gali_module
from gali_cli import ConfigError, GaliConfig
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import (
    NaiveDPE,
    NaiveDualChunk,
    NaiveLaMPE,
    NaiveReRoPE,
    NaiveSELF,
    NaiveSelfExtend,
    NaiveString,
)
from gali_cli.engine.math.positions import chunk_plan
from gali_cli.engine.seam import with_cache
from gali_cli.engine.seam.hooks import installed_method
from gali_cli.generate import truncate_cache
from gali_cli.methods.dpe import published_settings
from gali_cli.methods.registry import NAMES, PREVIEWED, REGISTRY, all_methods, get_method, parse_methods
from gali_cli.methods.resolving import preview_method
from gali_cli.methods.rope_scaling import ntk_theta
from gali_cli.methods.self_logistic import LogisticSelfExtend, grouped_positions, smallest_capacity, smallest_rate
from gali_cli.methods.self_logistic import reach as self_reach
from gali_cli.patching import apply_method, forward_ends, prefill_spans, remove_method


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def forwards(model, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """Logits of `ids` fed in forwards ending at `cuts`, through one cache."""
    cache, outputs, start = DynamicCache(config=model.config), [], 0
    for stop in cuts:
        outputs.append(model(ids[:, start:stop], **with_cache(model, cache), use_cache=True).logits)
        start = stop
    return torch.cat(outputs, dim=1)


def engine_greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    cache = DynamicCache(config=model.config)
    logits, tokens = model(ids, **with_cache(model, cache), use_cache=True).logits[0, -1], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
    return tokens


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


SELF = [  # heads, kv_heads, train_len, capacity, rate, neighbor_window, prompt_len
    (4, 2, 16, 5, 0.5, 4, 40),  # exactly its reach: 4 + (1 + 1 + 2 + 2 + 3 + 3 + 4 * 6)
    (4, 4, 16, 7, 1.0, 3, 60),
    (4, 1, 32, 8, 0.2, 8, 100),
    (4, 2, 16, 3, 1.0, 5, 16),  # inside train_len, past the window
    (4, 2, 32, 2, 0.02, 8, 32),  # capacity 2: one token per position, plain RoPE
    (4, 2, 32, 12, 0.1, 12, 53),  # exactly its reach; sizes grow over tens of positions, as at the default rate
]


@pytest.mark.parametrize("heads, kv_heads, train_len, capacity, rate, window, length", SELF)
def test_self_matches_its_paper(make_llama, heads, kv_heads, train_len, capacity, rate, window, length):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    ids = prompt(length, seed=7)

    def naive():
        return NaiveSELF(model, capacity, rate, window)

    expected = naive().prefill(ids[0].tolist())
    naive_tokens, _ = naive().greedy(ids[0].tolist(), 4)
    settings = MethodSettings(group_size=capacity, neighbor_window=window, self_rate=rate)
    assert apply_method(model, "self", settings, length) == {
        "train_len": train_len, "neighbor_window": window, "self_rate": rate, "group_size": capacity}
    whole = model(ids).logits
    torch.testing.assert_close(whole[0].double(), expected, rtol=1e-4, atol=1e-4)
    # Positions depend on (i, j) only: any split of the input gives the same logits.
    torch.testing.assert_close(forwards(model, ids, [3, window + 1, length - 5, length]), whole, rtol=1e-5, atol=1e-5)
    # Decoding keeps the grouped keys rotated from token to token: the same logits as one forward.
    torch.testing.assert_close(forwards(model, ids, [length - 3, length - 2, length - 1, length]), whole,
                               rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive_tokens


@pytest.mark.parametrize("capacity, rate, window, train_len", [
    (5, 0.5, 4, 16), (33, 0.02, 512, 4096), (2, 0.02, 8, 32), (7, 3.0, 3, 16), (200, 0.01, 100, 1000)])
def test_self_positions_stay_within_train_len_up_to_its_reach(capacity, rate, window, train_len):
    """The last query of an input of `reach` tokens sits at train_len - 1 exactly, one token more passes it; the
    static step's offsets over a cache of that many rows keep to train_len - 1 too."""
    tokens = self_reach(capacity, rate, window, train_len)
    method = LogisticSelfExtend(capacity, rate, window, train_len)
    assert method.table_rows(0, tokens) <= max(train_len, 2 * window)
    grouped = grouped_positions(capacity, rate, tokens + 1)
    assert window + grouped[tokens - 1 - window] == train_len - 1 and window + grouped[tokens - window] == train_len
    keys = torch.arange(tokens)
    for query in (window, tokens // 2, tokens - 1):
        placement = method.decode_placement(torch.tensor(query), keys)
        offsets = placement.offset[: query + 1]
        assert placement.reach == train_len - 1 and -(train_len - 1) <= int(offsets.min()) and int(offsets.max()) == 0


def test_self_defaults_to_the_smallest_capacity_that_reaches_the_input(make_llama):
    model = make_llama(train_len=32)
    settings = apply_method(model, "self", MethodSettings(self_rate=0.3), 200)
    capacity = settings["group_size"]
    assert settings == {"train_len": 32, "neighbor_window": 4, "self_rate": 0.3, "group_size": capacity}
    assert self_reach(capacity - 1, 0.3, 4, 32) < 200 <= self_reach(capacity, 0.3, 4, 32)
    assert apply_method(model, "self", MethodSettings(), 30)["group_size"] == 2  # within train_len: plain RoPE
    # Llama-2's window with the official PG19 script's W = 512: 16k tokens take groups of up to 5, at r = 0.02.
    assert smallest_capacity(0.02, 512, 4096, 16384) == 6
    assert smallest_rate(512, 4096, 16384) == 0.02
    assert preview_method(llama3_config("3"), "self", MethodSettings()) == {
        "train_len": 8192, "neighbor_window": 1024, "self_rate": 0.02,
        "group_size": "the smallest that reaches the input"}
    assert preview_method(llama3_config("3"), "self", MethodSettings(group_size=33))["reaches"] == \
        self_reach(33, 0.02, 1024, 8192)


def test_self_raises_its_rate_where_the_official_one_cannot_reach_the_input(make_llama):
    """Within 28 grouped positions (L = 32, W = 4) r = 0.02 keeps every group at one token: the rate is raised, in
    hundredths, to the first with which some capacity reaches the input."""
    settings = apply_method(make_llama(train_len=32), "self", MethodSettings(), 200)
    rate, capacity = settings["self_rate"], settings["group_size"]
    assert rate > 0.02 and rate == round(rate, 2)
    assert smallest_capacity(rate - 0.01, 4, 32, 200) is None and smallest_capacity(rate, 4, 32, 200) == capacity
    assert apply_method(make_llama(train_len=32), "self", MethodSettings(group_size=capacity), 30)["self_rate"] == 0.02


@pytest.mark.parametrize("settings, message", [
    (MethodSettings(group_size=1), "--group-size must be a whole number >= 2 for self"),
    (MethodSettings(group_size=3, self_rate=0.5, neighbor_window=4), "raise --group-size"),
    (MethodSettings(neighbor_window=4, self_rate=0.02), "raise --self-rate"),  # 12 positions of one token each
    (MethodSettings(neighbor_window=16), "--neighbor-window"),
    (MethodSettings(neighbor_window=15), "too few for self to reach the input's 100 tokens at any --self-rate: lower "
                                         "--neighbor-window"),
])
def test_self_refuses_settings_that_make_no_sense_in_one_line(make_llama, settings, message):
    with pytest.raises(ConfigError, match=message) as refused:
        apply_method(make_llama(train_len=16), "self", settings, 100)
    assert "\n" not in str(refused.value)
    for rate in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="--self-rate must be a number > 0") as refused:
            MethodSettings(self_rate=rate)
        assert "\n" not in str(refused.value)


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


def test_figure_2_of_the_dca_paper():
    """s = 6, c = 10, w = 4: the successive-chunk query positions are [6, 7, 8, 9, 9, 9] in every chunk."""
    model_free = NaiveDualChunk.__new__(NaiveDualChunk)
    model_free.s, model_free.w, model_free.c = 6, 4, 10
    positions = [model_free.s + k if k < model_free.w else model_free.c - 1 for k in range(6)]
    assert positions == [6, 7, 8, 9, 9, 9]


@pytest.mark.parametrize("method, settings, exact", [
    ("self-extend", MethodSettings(group_size=7, neighbor_window=8), 8),
    ("chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4), 12),
    ("dynamic-ntk", MethodSettings(factor=4), 16),
    ("gali", MethodSettings(chunk_size=4, local_window=2), 16),
    ("rerope", MethodSettings(neighbor_window=6), 6),
    ("leaky-rerope", MethodSettings(neighbor_window=6, leaky_factor=7.0), 6),
    ("dpe", MethodSettings(neighbor_window=6, dpe_scales=(2, 3)), 6),
    ("string", MethodSettings(shifted_offset=6, local_window=2, string_scale=False), 6),
    ("self", MethodSettings(group_size=20, neighbor_window=6, self_rate=0.5), 8),  # positions 0, 1 hold one each
])
def test_exact_where_the_method_promises_it(make_llama, method, settings, exact):
    model = make_llama(train_len=16)
    ids = prompt(exact)
    unpatched = model(ids).logits
    apply_method(model, method, settings, 64)
    assert torch.equal(model(ids).logits, unpatched)


def test_static_ntk_follows_its_formula(make_llama):
    model = make_llama(train_len=16)
    apply_method(model, "ntk", MethodSettings(factor=4), 64)
    head_dim = 8
    theta = ntk_theta(10000.0, 4, head_dim)
    assert theta == pytest.approx(10000.0 * 4 ** (8 / 6))
    expected = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.rescaled.inv_freq, expected)


@pytest.mark.parametrize("kind, parameters, window", [
    ("dynamic-ntk", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}, 16),
    ("yarn", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 3.0, "original_max_position_embeddings": 16}, 16),
])
def test_dynamic_ntk_and_yarn_are_transformers_own(make_llama, tmp_path, kind, parameters, window):
    model = make_llama(train_len=16)
    ids = prompt(40)
    model.save_pretrained(tmp_path)
    reference = LlamaForCausalLM.from_pretrained(tmp_path, rope_parameters=parameters,
                                                 max_position_embeddings=window).eval()
    apply_method(model, kind, MethodSettings(factor=3), 40)
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_default_factors_and_windows(make_llama):
    model = make_llama(train_len=16)
    assert apply_method(model, "yarn", MethodSettings(), 40)["factor"] == 3.0  # ceil(40 / 16)
    assert apply_method(model, "ntk", MethodSettings(), 10)["rope_theta"] == 10000.0  # factor 1: unchanged
    assert apply_method(model, "self-extend", MethodSettings(), 100) == {
        "train_len": 16, "neighbor_window": 4, "group_size": 8}  # (16 - 4) * 8 + 4 = 100
    assert apply_method(model, "chunk-llama", MethodSettings(), 100) == {
        "train_len": 16, "dca_chunk_size": 12, "local_window": 4}
    assert apply_method(model, "gali", MethodSettings(), 100)["chunk_size"] == 4  # train_len / 4
    assert apply_method(model, "rerope", MethodSettings(), 100) == {
        "train_len": 16, "neighbor_window": 4, "logn": True}
    assert apply_method(model, "leaky-rerope", MethodSettings(), 100)["leaky_factor"] == 16  # the official k
    assert apply_method(model, "leaky-rerope", MethodSettings(), 500)["leaky_factor"] == 45  # 4 + 45 * 11 = 499
    assert apply_method(model, "dpe", MethodSettings(), 100) == {
        "train_len": 16, "neighbor_window": 2, "dpe_scales": [7, 7, 7, 7], "dpe_published": None}  # 14 * 7 + 2
    assert apply_method(model, "gali", MethodSettings(train_len=8), 100)["train_len"] == 8


@pytest.mark.parametrize("method, settings, message", [
    ("self-extend", MethodSettings(group_size=2, neighbor_window=4), "raise --group-size"),
    ("self-extend", MethodSettings(neighbor_window=16), "--neighbor-window"),
    ("chunk-llama", MethodSettings(dca_chunk_size=16), "--dca-chunk-size"),
    ("chunk-llama", MethodSettings(dca_chunk_size=12, local_window=5), "--local-window"),
    ("gali", MethodSettings(train_len=32), "--train-len"),
    ("rerope", MethodSettings(neighbor_window=16), "--neighbor-window"),
    ("leaky-rerope", MethodSettings(neighbor_window=4, leaky_factor=2.0), "raise --leaky-factor"),
    ("dpe", MethodSettings(dpe_scales=(2, 2, 2)), "--dpe-scales gives 3 groups"),
    ("dpe", MethodSettings(neighbor_window=20), "--neighbor-window"),
    ("magic", MethodSettings(), "--method"),
])
def test_settings_that_make_no_sense(make_llama, method, settings, message):
    with pytest.raises(ConfigError, match=message):
        apply_method(make_llama(train_len=16), method, settings, 100)


def test_rope_scaling_refuses_models_with_their_own_scaling(make_llama):
    llama31 = make_llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8})
    with pytest.raises(ConfigError, match="'llama3'"):
        apply_method(llama31, "yarn", MethodSettings(), 100)


def test_bad_settings_are_refused_early():
    with pytest.raises(ConfigError, match="--factor"):
        MethodSettings(factor=0.5)
    with pytest.raises(ConfigError, match="--group-size"):
        MethodSettings(group_size=0)
    with pytest.raises(ConfigError, match="--leaky-factor"):
        MethodSettings(leaky_factor=1)
    with pytest.raises(ConfigError, match="--dpe-scales"):
        MethodSettings(dpe_scales=(2, 0))


def test_one_model_runs_every_method_in_turn(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(50)
    unpatched = model(ids).logits
    outputs = {}
    for name in NAMES:
        apply_method(model, name, MethodSettings(), 50)
        outputs[name] = model(ids).logits
    remove_method(model)
    assert torch.equal(model(ids).logits, unpatched) and torch.equal(outputs["original"], unpatched)
    changed = [name for name in NAMES if name != "original" and not torch.equal(outputs[name], unpatched)]
    assert sorted(changed) == sorted(set(NAMES) - {"original"})
    apply_method(model, "gali", MethodSettings(noise=False), 50)
    again = model(ids).logits
    apply_method(model, "gali", MethodSettings(noise=False), 50)
    assert torch.equal(model(ids).logits, again)


def test_dynamic_ntk_prefills_in_one_forward(make_llama):
    assert get_method("dynamic-ntk").boundaries(None, 0, 100, []) == [100]
    assert get_method("self-extend").boundaries is None and get_method("yarn").boundaries is None
    model = make_llama(train_len=16)
    apply_method(model, "gali", MethodSettings(chunk_size=5), 40)
    assert forward_ends(model, "gali", 0, 40) == [16, 21, 26, 31, 36, 40]
    assert math.isfinite(float(model(prompt(40)).logits.sum()))
    assert GaliConfig  # the public config still imports


@pytest.mark.parametrize("method, ends", [("gali", None), ("dynamic-ntk", [(0, 300)]), ("yarn", None)])
def test_one_prefill_plan_per_method(make_llama, method, ends):
    """prefill_spans: forwards of about `step` tokens, ending at every cut, and elsewhere only where the method
    allows (GALI's chunk boundaries; one forward for dynamic NTK)."""
    model = make_llama(train_len=16)
    apply_method(model, method, MethodSettings(chunk_size=5), 300)
    spans = prefill_spans(model, method, 0, 300, [50, 203], step=40)
    assert spans[0][0] == 0 and spans[-1][1] == 300 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    if ends is not None:
        assert spans == ends
        return
    allowed = forward_ends(model, method, 0, 300)
    assert {50, 203} <= {last for _, last in spans} <= {50, 203, *(allowed or range(301))}
    assert all(last - first <= 40 for first, last in spans)


def test_gali_plans_a_prefill_once_and_its_forwards_take_their_chunks_from_the_plan(make_llama, monkeypatch):
    model = make_llama(train_len=16)
    apply_method(model, "gali", MethodSettings(chunk_size=5), 300)
    spans = prefill_spans(model, "gali", 0, 300, [50, 203], step=40)
    expected = {span: chunk_plan(*span, 16, 5) for span in spans}
    monkeypatch.setattr(gali_module, "chunk_plan", lambda *args: pytest.fail("planned again"))
    assert {span: installed_method(model).chunks(*span) for span in spans} == expected


def test_the_command_line_knows_every_method_by_name():
    """The registry names every method without importing one: the command line refuses a name before torch loads,
    and each name leads to its module's Method of that name."""
    import subprocess
    import sys

    light = subprocess.run([sys.executable, "-c", "import sys, gali_cli.options, gali_cli.methods.registry as r; "
                            "r.parse_methods('all'); print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                           capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"
    assert {name: method.name for name, method in all_methods().items()} == {name: name for name in NAMES}
    assert tuple(name for name in NAMES if REGISTRY[name].previewable) == PREVIEWED and "gali" not in PREVIEWED
    assert parse_methods("all") == NAMES and parse_methods(" yarn, gali,yarn ") == ("yarn", "gali")
    for bad in ("magic", "gali,magic", ",", ""):
        with pytest.raises(ConfigError, match="--method must be one of"):
            parse_methods(bad)


def llama3_config(version: str) -> LlamaConfig:
    """The architecture of Llama-3-8B(-Instruct) or Llama-3.1-8B(-Instruct), without weights."""
    rope = {"rope_type": "default", "rope_theta": 500000.0} if version == "3" else {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_parameters=rope,
                       max_position_embeddings=8192 if version == "3" else 131072)


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


def test_previews_refuse_what_apply_would_refuse():
    config = llama3_config("3")
    assert preview_method(config, "rerope", MethodSettings()) == {"train_len": 8192, "neighbor_window": 2048,
                                                                  "logn": True}
    assert preview_method(config, "leaky-rerope", MethodSettings())["reaches"] == 2048 + 16 * 6143 + 1
    assert preview_method(config, "gali", MethodSettings()) is None
    for name, settings in [("rerope", MethodSettings(neighbor_window=8192)),
                           ("dpe", MethodSettings(dpe_scales=(2, 2, 2))), ("dpe", MethodSettings(train_len=9000))]:
        with pytest.raises(ConfigError):
            preview_method(config, name, settings)


@pytest.mark.parametrize("method, settings", [
    ("rerope", MethodSettings(neighbor_window=5)),
    ("leaky-rerope", MethodSettings(neighbor_window=5, leaky_factor=8.0)),
    ("dpe", MethodSettings(neighbor_window=5, dpe_scales=(2, 6))),
    ("lampe", MethodSettings(neighbor_window=5, lampe_tail=2, lampe_length=9)),
    ("self", MethodSettings(group_size=9, neighbor_window=4, self_rate=1.0)),
])
def test_windowed_methods_in_batches_and_half_precision(make_llama, method, settings):
    """A batch gives each row's own logits (and decoding keeps each row's far keys); bf16 and fp16 models track the
    fp32 one."""
    model = make_llama(train_len=16)
    ids = torch.cat((prompt(60, seed=4), prompt(60, seed=5)))
    apply_method(model, method, settings, 70)
    alone = [forwards(model, ids[row : row + 1], [40, 50, 51, 52, 60]) for row in range(2)]
    torch.testing.assert_close(forwards(model, ids, [40, 50, 51, 52, 60]), torch.cat(alone), rtol=1e-5, atol=1e-5)
    reference = alone[0][0]
    for dtype in (torch.bfloat16, torch.float16):
        logits = model.to(dtype)(ids[:1]).logits[0].float()
        assert (logits - reference).norm() / reference.norm() < 0.05, dtype
        model.float()


@pytest.mark.parametrize("method, settings", [("self-extend", MethodSettings(group_size=5, neighbor_window=4)),
                                              ("chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4)),
                                              ("string", MethodSettings(shifted_offset=6, local_window=2)),
                                              ("lampe", MethodSettings(neighbor_window=5, lampe_tail=2,
                                                                       lampe_length=9)),
                                              ("self", MethodSettings(group_size=9, neighbor_window=4, self_rate=1.0))])
def test_kept_keys_do_not_outlive_a_cache_cut_back_and_refilled(make_llama, method, settings):
    """Decoding keeps rotated keys; a cache cut back and refilled by a longer forward to the same length must not
    find the old tokens' keys there."""
    model = make_llama(train_len=16, heads=4, kv_heads=2)
    apply_method(model, method, settings, 60)
    ids, other = prompt(44, seed=2), prompt(44, seed=3)
    cache = DynamicCache(config=model.config)
    model(ids[:, :30], **with_cache(model, cache), use_cache=True)
    for stop in range(31, 43):  # decoded one token at a time: the keys are kept up to 42
        model(ids[:, stop - 1 : stop], **with_cache(model, cache), use_cache=True)
    truncate_cache(cache, 30)
    model(other[:, 30:42], **with_cache(model, cache), use_cache=True)  # other tokens, the cache at 42 again
    step = model(other[:, 42:43], **with_cache(model, cache), use_cache=True).logits[0, -1]
    refilled = torch.cat((ids[:, :30], other[:, 30:43]), dim=1)
    torch.testing.assert_close(step, model(refilled).logits[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, settings", [
    ("self-extend", MethodSettings(group_size=5, neighbor_window=4)),
    ("leaky-rerope", MethodSettings(neighbor_window=6, leaky_factor=7.0)),
    ("dpe", MethodSettings(neighbor_window=6, dpe_scales=(2, 3))),
    ("string", MethodSettings(shifted_offset=6, local_window=2)),
    ("self", MethodSettings(group_size=9, neighbor_window=4, self_rate=1.0)),
])
def test_a_longer_forward_after_decoding_continues_the_kept_keys(make_llama, method, settings):
    """While decoding, the window's keys are kept at their token indices beside the far keys (KeptKeys.split); a
    longer forward that continues the cache where decoding left it (a chat's next question) must rotate those as far
    keys, not take them as they are."""
    model = make_llama(train_len=16, heads=4, kv_heads=2)
    apply_method(model, method, settings, 60)
    ids = prompt(50, seed=4)
    ends = [30, 31, 32, 33, 34, 45, 46, 47, 50]  # a prefill, 4 decoded tokens, a question, 2 decoded, another
    torch.testing.assert_close(forwards(model, ids, ends), model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, settings", [
    ("self-extend", MethodSettings(group_size=5, neighbor_window=4)),
    ("leaky-rerope", MethodSettings(neighbor_window=6, leaky_factor=7.0)),
    ("dpe", MethodSettings(neighbor_window=6, dpe_scales=(2, 3))),
    ("string", MethodSettings(shifted_offset=6, local_window=2)),
    ("chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4)),
    ("self", MethodSettings(group_size=9, neighbor_window=4, self_rate=1.0)),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoding_in_half_precision_stays_close_to_float32(make_llama, method, settings, dtype):
    """Decoded token by token in the model's half precision (kept keys in it, the window's at their token indices),
    the logits stay within rounding of one float32 forward's (a query one position off is 0.07 away here)."""
    model = make_llama(train_len=16, heads=4, kv_heads=2)
    apply_method(model, method, settings, 60)
    ids = prompt(44, seed=6)
    reference = model(ids).logits[0].double()
    logits = forwards(model.to(dtype), ids, [30, *range(31, 45)])[0].double()
    assert (logits - reference).norm() / reference.norm() < 0.03


def test_chunk_llama_decodes_every_place_in_a_chunk_as_one_forward(make_llama):
    """A decoded token past the local window attends the previous chunk and the older ones in one call; within it,
    in two: decoding a whole chunk token by token (every i mod s) gives the logits of one forward."""
    model = make_llama(train_len=16, heads=4, kv_heads=2)
    apply_method(model, "chunk-llama", MethodSettings(dca_chunk_size=12, local_window=4), 60)
    ids = prompt(52, seed=5)
    torch.testing.assert_close(forwards(model, ids, list(range(36, 53))), model(ids).logits, rtol=1e-5, atol=1e-5)


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
