"""An answer caught in a loop ends there ("repetition"), said on stderr; lists, tables and prose never trip it."""

import pytest
from conftest import CORPUS
from transformers import AutoTokenizer, LlamaForCausalLM
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli import generate
from gali_cli.generate import RepetitionGuard, stream_generate
from gali_cli.server.schemas import Reply, Usage


def first_trip(tokens: list[int]) -> int | None:
    """How many tokens the guard takes before it says "loop", or None."""
    guard = RepetitionGuard()
    return next((count for count, token in enumerate(tokens, 1) if guard.looping(token)), None)


@pytest.mark.parametrize("period, trips_at", [(1, 48), (3, 48), (12, 48), (20, 80), (64, 256)])
def test_a_block_repeated_back_to_back_trips_at_four_copies_and_48_tokens(period, trips_at):
    block = list(range(100, 100 + period))
    assert first_trip([7, 8, 9] + block * (300 // period)) == 3 + trips_at


def test_what_varies_never_trips():
    numbered = [token for item in range(200) for token in (10, 11 + item % 150, 12, 13, 14)]  # "3. the item\n" ...
    table = [token for row in range(100) for token in (50, 51 + row, 50, 52 + row * 2, 50, 9)]
    assert first_trip(numbered) is None and first_trip(table) is None
    assert first_trip(list(range(1000))) is None
    assert first_trip(list(range(100, 130)) * 3 + list(range(200, 260))) is None  # said three times: not yet a loop
    assert first_trip([5] * 47) is None  # a run of 47: below the floor


def test_stream_generate_ends_a_loop_and_says_why(tiny_model_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cycle = iter([300, 301, 302] * 1000)
    events = list(stream_generate(model, tokenizer, [0, 5, 6], lambda logits: next(cycle), 500, set(), [(0, 3)]))
    finished = events[-1]
    assert finished.reason == "repetition" and finished.generated_tokens == 48
    assert finished.answer_ids == (300, 301, 302) * 16


def test_the_cli_says_it_stopped_a_loop(tiny_model_dir, tmp_path, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS)
    monkeypatch.setattr(generate.RepetitionGuard, "looping", lambda self, token: True)
    result = CliRunner().invoke(cli.app, ["ask", str(doc), "When?", "-m", str(tiny_model_dir), "--no-cache"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert "(stopped: the answer was repeating itself)" in result.stderr and "max-new-tokens" not in result.stderr


def test_the_server_calls_a_stopped_loop_a_stop():
    reply = Reply(chat=True, model="demo")
    assert reply.whole("la la", "repetition", Usage(3, 0, 2))["choices"][0]["finish_reason"] == "stop"
    assert reply.chunk("", "repetition")["choices"][0]["finish_reason"] == "stop"
    assert reply.chunk("la")["choices"][0]["finish_reason"] is None
    assert reply.chunk("", "length")["choices"][0]["finish_reason"] == "length"
