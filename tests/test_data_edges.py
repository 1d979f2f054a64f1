"""Issue 25's data edges, end to end through the `gali` command: a full disk, a kill mid-write, huge sizes and
names that are not UTF-8 never lose what the user had, never leak disk space, and are never "unexpected"."""

import json
import os
from pathlib import Path

import pytest

from test_hostile_inputs import DOCUMENT, doc, run  # noqa: F401 - fixtures

ODD_NAME = os.fsdecode(b"report-\xff.txt")  # a byte that is not UTF-8: Python sees the surrogate \udcff


@pytest.fixture
def odd(tmp_path) -> Path:
    path = tmp_path / ODD_NAME
    path.write_text(DOCUMENT)
    return path


@pytest.mark.parametrize("extra", [[], ["--json"], ["--verbose"]], ids=["plain", "json", "verbose"])
def test_a_name_that_is_not_utf8_is_answered_and_shown_escaped(extra, run, odd, tiny_model_dir, tmp_path):
    result = run("summarize", str(odd), "--max-new-tokens", "3", "--cache-dir", str(tmp_path / "states"), "-m",
                 str(tiny_model_dir), *extra)
    assert result.exit_code == 0, result.stderr
    assert "unexpected" not in result.stderr and "\udcff" not in result.stderr + result.stdout
    if extra == ["--json"]:
        assert json.loads(result.stdout)["document"]["name"] == str(odd)
    listing = run("cache", "list", "--cache-dir", str(tmp_path / "states"))
    assert listing.exit_code == 0 and "report-\\udcff.txt" in listing.stdout + listing.stderr, listing


def test_a_name_that_is_not_utf8_in_a_batch(run, odd, doc, tiny_model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    arguments = ["summarize", str(odd), str(doc), "--max-new-tokens", "2", "--out", str(out), "-m",
                 str(tiny_model_dir)]
    first = run(*arguments, "--json")
    assert first.exit_code == 0 and "unexpected" not in first.stderr, first.stderr
    assert "\udcff" not in first.stderr + first.stdout and json.loads(first.stdout)["ok"] == 2
    again = run(*arguments)
    assert again.exit_code == 0 and "2 already done" in again.stderr, again.stderr
