"""ReAttention (methods/reattention.py) against its float64 restatement: its selection, its chunks, its settings."""

import json

import pytest
import torch
from helpers.methods import engine_greedy, forwards
from helpers.tiny_models import CORPUS, prompt
from typer.testing import CliRunner

import gali_cli.methods.reattention as reattention
from gali_cli import ConfigError, cli
from gali_cli.config import MethodSettings
from gali_cli.engine.checks.reference_model import NaiveReAttention
from gali_cli.methods.reattention import TIE, select
from gali_cli.methods.resolving import preview_method
from gali_cli.patching import apply_method, forward_ends, prefill_spans
from gali_cli.seam_check import tiny_llama

REATTENTION = [  # heads, kv_heads, train_len, sink, local window, top keys, span, clip (None: all that fit), chunk, N
    (4, 2, 16, 2, 6, 2, 2, None, 4, 40),  # the seam check's
    (4, 4, 32, 0, 16, 4, 3, None, 8, 100),  # no sink, an odd span
    (4, 1, 16, 1, 8, 1, 1, 3, 8, 60),  # the clip binds: 4 heads x 8 queries vote
    (4, 2, 16, 3, 4, 3, 4, 2, 3, 30),  # spans of 4 overlapping, chunks of 3
    (4, 2, 16, 2, 6, 2, 2, None, 4, 14),  # inside the window: the unpatched model
]


def settings_of(sink, local, top, span, clip, chunk) -> MethodSettings:
    return MethodSettings(sink_tokens=sink, local_window=local, top_keys=top, span_size=span, recall_clip=clip,
                          chunk_size=chunk)


@pytest.mark.parametrize("heads, kv_heads, train_len, sink, local, top, span, clip, chunk, length", REATTENTION)
def test_reattention_matches_its_restatement(heads, kv_heads, train_len, sink, local, top, span, clip, chunk,
                                             length):
    """Prefill in its chunks and greedy decoding, one selection a chunk and a token, as the restatement reads it;
    several forwards ending at its chunks' ends equal one."""
    model = tiny_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    resolved = apply_method(model, "reattention", settings_of(sink, local, top, span, clip, chunk), length)
    clip = resolved["recall_clip"]

    def naive() -> NaiveReAttention:
        return NaiveReAttention(model, train_len, sink, local, top, span, clip, chunk, TIE)

    ids = prompt(length, seed=1)
    expected = naive().prefill(ids[0].tolist())
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    ends = forward_ends(model, "reattention", 0, length)
    assert ends == sorted({min(end, length) for end in [*range(train_len, length, chunk), length]})
    torch.testing.assert_close(forwards(model, ids, ends), model(ids).logits, rtol=1e-5, atol=1e-5)
    assert engine_greedy(model, ids, 4) == naive().greedy(ids[0].tolist(), 4)[0]


def test_inside_the_window_it_is_the_unpatched_model():
    model = tiny_llama(train_len=16)
    ids = prompt(16)
    unpatched = model(ids).logits
    apply_method(model, "reattention", MethodSettings(), 64)
    assert torch.equal(model(ids).logits, unpatched)
    assert not torch.equal(model(prompt(17)).logits[:, -1], unpatched[:, -1])


def test_rows_of_a_batch_select_apart():
    model = tiny_llama(train_len=16)
    apply_method(model, "reattention", settings_of(2, 6, 2, 2, None, 4), 40)
    ids = torch.cat((prompt(40, seed=2), prompt(40, seed=3)))
    together = model(ids).logits
    torch.testing.assert_close(together, torch.cat((model(ids[:1]).logits, model(ids[1:]).logits)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_selects_and_decodes_as_float32(dtype):
    """Scores are float32 whatever the model's dtype: a half-precision model picks the keys float32 picks."""
    model = tiny_llama(train_len=16)
    apply_method(model, "reattention", settings_of(2, 6, 2, 2, None, 4), 40)
    ids = prompt(40, seed=1)
    expected, tokens = model(ids).logits, engine_greedy(model, ids, 4)
    model.to(dtype)
    torch.testing.assert_close(model(ids).logits.float(), expected, rtol=0.1, atol=0.1)
    assert engine_greedy(model, ids, 4) == tokens


def test_a_prefill_ends_its_forwards_at_its_chunks_and_at_every_cut():
    model = tiny_llama(train_len=16)
    apply_method(model, "reattention", settings_of(2, 6, 2, 2, None, 4), 40)
    spans = prefill_spans(model, "reattention", 0, 40, cuts=[22], step=12)
    chunk_ends = [16, 20, 22, 24, 28, 32, 36, 40]  # the window, then chunks of 4, begun again at the cut
    assert [stop for _, stop in spans] == [16, 22, 32, 40]
    ids = prompt(40, seed=4)
    # A document read up to the cut and a question after it: the same logits as one chunk a forward.
    torch.testing.assert_close(forwards(model, ids, [stop for _, stop in spans]), forwards(model, ids, chunk_ends),
                               rtol=1e-5, atol=1e-5)


def test_the_selection_scores_keys_a_block_at_a_time_as_all_at_once(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    query, middle = torch.randn(8, 5, 16, generator=generator), torch.randn(2, 300, 16, generator=generator)
    whole = select(query, middle, 4, 8, 12)
    monkeypatch.setattr(reattention, "SCORES_PER_BLOCK", 8 * 5 * 7)  # blocks of 7 keys
    assert torch.equal(select(query, middle, 4, 8, 12), whole)
    assert len(whole) <= 12 * 8 and torch.equal(whole, whole.unique())


@pytest.mark.parametrize("keys_a_block", [None, 50, 7])
def test_copies_of_a_key_tie_and_the_earliest_wins(monkeypatch, keys_a_block):
    """A repeated token has one un-rotated key in the first layer; a matrix product may round its copies apart.
    The copies may fall in different blocks of scores, or several in one."""
    if keys_a_block:
        monkeypatch.setattr(reattention, "SCORES_PER_BLOCK", keys_a_block)  # one query row: keys_a_block keys
    generator = torch.Generator().manual_seed(1)
    middle = torch.randn(1, 500, 64, generator=generator)
    middle[0, [40, 120, 333, 499]] = middle[0, 77].clone()
    query = middle[:, 77:78] * 3  # its best key is that one, in five places
    assert select(query, middle, 1, 1, 10).tolist() == [40]
    assert select(query, middle, 3, 1, 10).tolist() == [40, 77, 120]


def test_the_clip_keeps_the_most_voted_and_spans_stay_in_the_middle():
    # Three query heads on one key head; keys along axes, each query picking the keys it points at.
    middle = torch.eye(10)[None]
    query = torch.stack([torch.eye(10)[[0, 9]], torch.eye(10)[[9, 5]], torch.eye(10)[[9, 0]]])  # (3, 2, 10)
    assert select(query, middle, 1, 1, 10).tolist() == [0, 5, 9]
    assert select(query, middle, 1, 1, 2).tolist() == [0, 9]  # 9: three votes, 0: two, 5: one
    assert select(query, middle, 1, 1, 1).tolist() == [9]
    assert select(query, middle, 1, 4, 1).tolist() == [7, 8, 9]  # 7..10, inside the middle
    assert select(query, middle, 1, 5, 2).tolist() == [0, 1, 2, 7, 8, 9]


def test_defaults_are_the_authors_on_an_8k_window_and_scale_down():
    model = tiny_llama(train_len=16)
    assert apply_method(model, "reattention", MethodSettings(), 100) == {
        "train_len": 16, "sink_tokens": 1, "local_window": 8, "top_keys": 4, "span_size": 1, "recall_clip": 7,
        "chunk_size": 2}
    window = 8192
    big = tiny_llama(train_len=window)
    # Their Llama-3-8B run: 32 + 127 * 32 + 4096 = 8192.
    assert preview_method(big.config, "reattention", MethodSettings()) == {
        "train_len": window, "sink_tokens": 32, "local_window": 4096, "top_keys": 4, "span_size": 32,
        "recall_clip": 127, "chunk_size": 1024}
    assert preview_method(big.config, "reattention", MethodSettings(train_len=256))["recall_clip"] == 7


@pytest.mark.parametrize("settings, message", [
    (MethodSettings(recall_clip=8), "--recall-clip 8 .* at most 7"),
    (MethodSettings(local_window=4, chunk_size=5), "--chunk-size \\(5\\) must be at most --local-window \\(4\\)"),
    (MethodSettings(sink_tokens=8, local_window=8), "within train_len \\(16\\)"),
    (MethodSettings(local_window=0), "within train_len"),
])
def test_settings_that_make_no_sense_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as refused:
        apply_method(tiny_llama(train_len=16), "reattention", settings, 100)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("field, flag", [("top_keys", "--top-keys"), ("span_size", "--span-size"),
                                         ("recall_clip", "--recall-clip"), ("sink_tokens", "--sink-tokens")])
def test_bad_values_are_refused_before_a_model_loads(field, flag):
    with pytest.raises(ConfigError, match=flag):
        MethodSettings(**{field: -1})


def test_gali_ask_reads_a_document_once_and_answers_from_its_cached_state(tiny_model_dir, tmp_path):
    """A document 40 times the tiny model's window, asked twice with the document cache and once without: the second
    question loads the first's state (its forwards ended where a fresh read's do) and answers as a fresh read."""
    document = tmp_path / "lease.txt"
    document.write_text(CORPUS * 7)

    def ask(question: str, *cache: str) -> dict:
        result = CliRunner().invoke(cli.app, ["ask", str(document), question, "-m", str(tiny_model_dir), "--method",
                                              "reattention", "--max-new-tokens", "6", "--json", "-v", *cache])
        assert result.exit_code == 0, result.stderr
        return {**json.loads(result.stdout), "stderr": result.stderr}

    first = ask("Who pays the rent?", "--cache-dir", str(tmp_path / "cache"))
    second = ask("When does the lease end?", "--cache-dir", str(tmp_path / "cache"))
    assert first["cached_tokens"] == 0 and second["cached_tokens"] > 1000
    assert "document state from the cache" in second["stderr"]
    assert second["answer"] == ask("When does the lease end?", "--no-cache")["answer"]


@pytest.mark.slow
def test_gali_ppl_on_the_demo_model_equals_it_inside_its_window_and_beats_it_at_16x_and_32x():
    """The demo model (a 256-token window) on a standard-library module it never saw."""
    import sysconfig
    from pathlib import Path

    text = Path(sysconfig.get_paths()["stdlib"]) / "difflib.py"
    result = CliRunner().invoke(cli.app, ["ppl", str(text), "-m", "demo", "--lengths", "256,4k,8k", "--method",
                                          "original,reattention", "--json"])
    assert result.exit_code == 0, result.stderr
    ppl = {(row["method"], row["length"]): row["ppl"] for row in json.loads(result.stdout)["results"]}
    assert ppl["reattention", 256] == ppl["original", 256]
    for length in (4096, 8192):
        assert ppl["reattention", length] < ppl["original", length]
        assert 1 < ppl["reattention", length] < float("inf")
