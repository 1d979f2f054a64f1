"""GALI's method (methods/gali.py): a prefill planned once. (GALI's attention against Alg. 3 and the naive model:
tests/engine/; against the authors' code: test_authors_gali.py here.)"""


import pytest

import gali_cli.methods.gali as gali_module
from gali_cli.config import MethodSettings
from gali_cli.engine.math.positions import chunk_plan
from gali_cli.engine.seam.hooks import installed_method
from gali_cli.patching import apply_method, prefill_spans


def test_gali_plans_a_prefill_once_and_its_forwards_take_their_chunks_from_the_plan(make_llama, monkeypatch):
    model = make_llama(train_len=16)
    apply_method(model, "gali", MethodSettings(chunk_size=5), 300)
    spans = prefill_spans(model, "gali", 0, 300, [50, 203], step=40)
    expected = {span: chunk_plan(*span, 16, 5) for span in spans}
    monkeypatch.setattr(gali_module, "chunk_plan", lambda *args: pytest.fail("planned again"))
    assert {span: installed_method(model).chunks(*span) for span in spans} == expected
