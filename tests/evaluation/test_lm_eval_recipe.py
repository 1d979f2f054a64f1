"""docs/eval.md's recipe for lm-evaluation-harness, run as written on a tiny random Llama (window 32) in place of
Llama-3-8B-Instruct: lm-eval's requests must go through the method gali applied (slow tier: lm-eval imports in about
10 s, the test takes about 30 s)."""

import re

import pytest
from helpers.paths import ROOT

from gali_cli import remove_method

DOC = ROOT / "docs" / "eval.md"
LONG = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof. " * 4  # ~80 tokens


def recipe() -> str:
    """The Python block between <!-- lm-eval:begin --> and <!-- lm-eval:end --> in docs/eval.md."""
    block = re.search(r"<!-- lm-eval:begin -->\n```python\n(.*?)```\n<!-- lm-eval:end -->", DOC.read_text(), re.S)
    assert block, "docs/eval.md has no lm-eval recipe between <!-- lm-eval:begin --> and <!-- lm-eval:end -->"
    return block.group(1)


def loglikelihoods(lm, pairs: list[tuple[str, str]]) -> list[float]:
    from lm_eval.api.instance import Instance

    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    return [logprob for logprob, _greedy in lm.loglikelihood(requests)]


@pytest.mark.slow
def test_the_recipe_runs_lm_eval_through_the_applied_method(tiny_model_dir, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = recipe()
    assert 'name = "meta-llama/Meta-Llama-3-8B-Instruct"' in code and "window = 16384" in code
    namespace: dict = {}
    exec(code.replace('"meta-llama/Meta-Llama-3-8B-Instruct"', repr(str(tiny_model_dir)))
         .replace("window = 16384", "window = 128"), namespace)
    lm, model = namespace["lm"], namespace["model"]
    assert lm.max_length == 128 and namespace["resolved"]["train_len"] == 32

    pairs = [(LONG, " The landlord repairs the roof."), ("The lease ends", " in March.")]
    patched = loglikelihoods(lm, pairs)
    remove_method(model)
    original = loglikelihoods(lm, pairs)
    assert patched[0] != pytest.approx(original[0], rel=1e-3)  # past the window: GALI's attention answered
    assert patched[1] == pytest.approx(original[1], rel=1e-3)  # within it GALI is the model itself
