"""The seam with transformers: the cache found whichever way it is handed over, a release that hands it over in a way
gali does not know refused (never computed on), and a release outside the tested range said once."""

import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import tomllib
import torch
from helpers.paths import ROOT
from helpers.timing import scaled
from transformers import DynamicCache

import gali_cli.compat as compat
import gali_cli.engine.seam.hooks as hooks
from gali_cli import GaliConfig, GaliError, apply_gali
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import NaiveGali
from gali_cli.engine.seam.cache_argument import CACHE_NAMES, SeamError, cache_parameter, forward_arguments, with_cache
from gali_cli.errors import GaliWarning
from gali_cli.generate import decode, prefill
from gali_cli.methods.registry import get_method
from gali_cli.model.families import FAMILIES
from gali_cli.patching import apply_method
from gali_cli.perplexity import perplexities
from gali_cli.seam_check import VOCAB, family_cases, seam_checks


def prompt(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(5))


def test_the_tested_range_is_the_one_pyproject_admits():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{compat.TESTED_TRANSFORMERS}" in dependencies
    assert compat.untested_release(compat.installed_transformers()) is None  # the suite runs on a tested release


@pytest.mark.parametrize("version, tested", [("5.6.0", True), ("5.24.0", True), ("5.25.0", True), ("5.5.4", False),
                                             ("5.26.0", False), ("6.0.0", False), ("5.26.0.dev0", False),
                                             ("not-a-version", False)])
def test_which_releases_are_tested(version, tested):
    message = compat.untested_release(version)
    assert (message is None) == tested
    if message:
        assert message.startswith(f"transformers {version} is outside the releases gali is tested with (>=5.6,")
        assert "gali info --check" in message


def test_a_release_outside_the_range_is_said_once(make_llama, monkeypatch):
    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.99.0")
    monkeypatch.setattr(compat, "_warned", False)
    model = make_llama(train_len=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_method(model, "gali", MethodSettings(chunk_size=4, local_window=2), 40)
        apply_method(model, "self-extend", MethodSettings(), 40)
        apply_gali(model, GaliConfig(chunk_size=4, local_window=2))
    said = [str(warning.message) for warning in caught if issubclass(warning.category, GaliWarning)]
    assert len(said) == 1 and said[0].startswith("transformers 5.99.0 is outside the releases gali is tested with")


def greedy_through_gali(model, ids: torch.Tensor, cuts: list[int], steps: int, pass_cache) -> tuple[list, list]:
    """Prefill along `cuts`, then decode `steps` tokens greedily; `pass_cache(model, ids, cache)` calls the model."""
    cache, start, logits = DynamicCache(config=model.config), 0, None
    for stop in cuts:
        logits = pass_cache(model, ids[:, start:stop], cache).logits[0, -1]
        start = stop
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(logits.double())
        tokens.append(int(logits.argmax()))
        logits = pass_cache(model, torch.tensor([[tokens[-1]]]), cache).logits[0, -1]
    return tokens, seen


def lm_head(model, hidden_states) -> SimpleNamespace:
    """The causal LM's output for the LlamaModel's hidden states (the tests below call the LlamaModel directly)."""
    return SimpleNamespace(logits=model.lm_head(hidden_states))


WAYS = {  # how a caller can hand the cache over
    "the name this release declares": lambda model, ids, cache: model(ids, **with_cache(model, cache)),
    "the name this release declares, to the LlamaModel": lambda model, ids, cache: lm_head(
        model, model.model(input_ids=ids, **with_cache(model.model, cache)).last_hidden_state),
    "by position, to the LlamaModel": lambda model, ids, cache: lm_head(
        model, model.model(ids, None, None, cache).last_hidden_state),
}


@pytest.mark.parametrize("way", WAYS)
def test_the_cache_is_found_whichever_way_it_is_handed_over(make_llama, way):
    """Prefilled in three forwards and decoded through one cache: the authors' GALI as restated in float64."""
    model = make_llama(train_len=16)
    ids = prompt(41)
    expected_tokens, expected = NaiveGali(model, 16, 4, 2).greedy(ids[0].tolist(), 5)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2))
    tokens, seen = greedy_through_gali(model, ids, [16, 28, 41], 5, WAYS[way])
    assert tokens == expected_tokens
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_either_name_by_keyword_works_or_fails_loudly(make_llama, name):
    """transformers 5.24 declares `cache` and still takes `past_key_values` (deprecated until 5.40); earlier releases
    take only `past_key_values`, and a `cache=` keyword there must not be computed on at position 0."""
    model = make_llama(train_len=16)
    ids = prompt(41)
    expected_tokens, _ = NaiveGali(model, 16, 4, 2).greedy(ids[0].tolist(), 3)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2))
    declared = cache_parameter(type(model.model))
    taken = name == declared or (name, declared) == ("past_key_values", "cache")

    def by_name(model, ids, cache):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias says so
            return lm_head(model, model.model(input_ids=ids, **{name: cache}).last_hidden_state)

    if taken:
        assert greedy_through_gali(model, ids, [16, 28, 41], 3, by_name)[0] == expected_tokens
    else:
        with pytest.raises(SeamError, match="the forward did not fill it"):
            greedy_through_gali(model, ids, [16, 28, 41], 3, by_name)


def test_the_cache_given_under_both_names_is_refused(make_llama):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    with pytest.raises(GaliError, match="given twice"):
        forward_arguments(model.model, (), {"input_ids": prompt(4), "cache": DynamicCache(),
                                            "past_key_values": DynamicCache()})


def test_a_hook_that_does_not_see_the_cache_stops_instead_of_computing(make_llama, monkeypatch):
    """transformers 5.24's break as it was: the hook read no cache, so every forward after the first seemed to start
    at token 0. The prefill's first forward is still right; the next one must raise, not answer."""
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    monkeypatch.setattr(hooks, "forward_arguments",
                        lambda module, args, kwargs: {**forward_arguments(module, args, kwargs), "cache": None})
    cache = DynamicCache(config=model.config)
    ids = prompt(30)
    model(ids[:, :20], **with_cache(model, cache))
    with pytest.raises(SeamError, match=r"transformers \S+: layer 0 received 10 queries over 30 keys, expected 10 "
                                        r"over 10 \(tokens 0\.\.10\)"):
        model(ids[:, 20:], **with_cache(model, cache))


def test_a_release_that_renames_the_cache_again_is_refused(make_llama, cache_argument_renamed):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    with pytest.raises(SeamError, match=r"^transformers \S+: LlamaModel.forward takes its KV cache under none of the "
                                        r"names gali knows \(cache, past_key_values\); gali is tested with"):
        model(prompt(20), kv_cache=DynamicCache(config=model.config))
    checks = list(seam_checks())
    assert checks and not any(check.ok for check in checks)  # the original model too: gali's own calls
    assert all("SeamError: transformers" in check.name for check in checks)


@pytest.mark.slow  # the seam check passing: gali info --check's tests (test_cli.py), in the default tier
def test_the_seam_check_passes_here_and_fails_on_a_wrong_position(monkeypatch):
    planned = [case for family in FAMILIES for case in family_cases(family.model_type)]
    checks = list(seam_checks())
    assert len(checks) == len(planned) and all(check.ok and check.seam for check in checks)
    assert sum(" + 4 decoded tokens vs its float64 restatement" in check.name for check in checks) == sum(
        case.decoded > 0 for case in planned)
    right = hooks.Forward.__init__

    def one_late(self, installed, start, stop, cache=None):  # every forward's positions off by one
        right(self, installed, start + 1, stop + 1, cache)

    monkeypatch.setattr(hooks.Forward, "__init__", one_late)
    failed = [check for check in seam_checks() if not check.ok]
    # every method installed through the hooks (GALI on each family) fails; original, ntk, yarn, dynamic-ntk pass
    assert len(failed) == sum(get_method(case.method).attention is not None for case in planned) > 0


def test_gali_calls_transformers_without_deprecated_arguments(make_llama):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    ids = prompt(40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        cache = DynamicCache(config=model.config)
        logits = prefill(model, ids, cache, [(0, 16), (16, 40)])
        assert len(list(decode(model, cache, logits, lambda logits: int(logits.argmax()), 3, set()))) == 3
        assert perplexities(model, ids, [40], [(0, 16), (16, 40)])[0].length == 40


def test_a_model_built_before_the_check_is_unaffected_by_it(make_llama):
    """The seam check patches its own model; the global random generator is as it was (the tiny Llama forks it)."""
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    make_llama(train_len=16)
    assert torch.equal(torch.rand(3), expected)


def test_gali_and_its_command_line_start_without_hub_kernels():
    """transformers 5.25 depends on the `kernels` package, which fetches and runs code from the Hub. Importing gali,
    and its command line up to a command that loads a model, imports neither it nor transformers (which imports it
    wherever it is installed)."""
    code = ("import sys, gali_cli, gali_cli.cli; gali_cli.cli.main(['--help']); "
            "print(sorted({'kernels', 'transformers', 'torch'} & set(sys.modules)))")
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                             check=True)
    assert started.stdout.strip().splitlines()[-1] == "[]"
