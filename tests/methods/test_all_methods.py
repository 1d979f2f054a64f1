"""Every method at once, or the same property of several: what each promises to leave exact, its defaults, the
settings refused, the registry the command line knows them by, and decoding with kept keys in batches and half
precision. (One method's own tests: its file here, test_<module>.py.)"""

import itertools
import math

import pytest
import torch
from helpers.methods import forwards, llama3_config
from helpers.tiny_models import prompt
from transformers import DynamicCache

from gali_cli import ConfigError, GaliConfig
from gali_cli.config import MethodSettings
from gali_cli.engine.contract import PositionalAttention
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.hooks import installed_method
from gali_cli.generate import truncate_cache
from gali_cli.methods.registry import NAMES, PREVIEWED, REGISTRY, all_methods, get_method, parse_methods
from gali_cli.methods.resolving import preview_method
from gali_cli.patching import apply_method, forward_ends, prefill_spans, remove_method


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


def test_the_registry_says_which_methods_the_static_step_serves(make_llama):
    """`static_step` (what `gali info -v` and the static-step tests read before torch loads) is False exactly where
    the installed attention gives no placement, and for dynamic NTK (whose frequencies follow the length)."""
    model = make_llama(train_len=16)
    for name in NAMES:
        apply_method(model, name, MethodSettings(), 50)
        attention = installed_method(model)
        places = name != "dynamic-ntk" and (attention is None or type(attention).decode_placement
                                             is not PositionalAttention.decode_placement)
        assert REGISTRY[name].static_step == places, name
