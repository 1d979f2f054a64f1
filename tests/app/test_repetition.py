"""An answer caught in a loop ends there ("repetition"), said on stderr; lists, tables and prose never trip it."""

import json

import pytest
from helpers import paths
from helpers.tiny_models import CORPUS
from transformers import AutoTokenizer, LlamaForCausalLM
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli import generate, repetition
from gali_cli.generate import stream_generate
from gali_cli.model.config import demo_model_path
from gali_cli.repetition import RepetitionGuard
from gali_cli.server.schemas import Reply, Usage

EXAMPLES = paths.ROOT / "examples"
DATA = paths.DATA / "repetition"  # token streams models wrote, with how


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


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled demo model's tokenizer (a 4,096-token BPE): a loop's text as a model's tokens."""
    return AutoTokenizer.from_pretrained(demo_model_path())


def numbered_loop(copies: int, first: int = 1) -> str:
    """The loop issue 50 met (SmolLM2 summarizing a MIME specification, 35 times up to --max-new-tokens 1024): a
    numbered heading counting up, the same sentence under it, and a blank line in every third copy only."""
    return "".join(f"2.{number}. The file\n{chr(10) if number % 3 == 0 else ''}The file is a list of lines "
                   "containing a MIME type and a file name, separated by a colon.\n"
                   for number in range(first, first + copies))


def test_a_numbered_loop_whose_line_breaks_drift_trips_at_eight_copies(tokenizer):
    """The exact guard never saw it: the number changes a token a copy, and a blank line more or less shifts the
    copies against each other. Near copies (a token of slack either side, one token in twelve different) are
    caught once there are eight of them."""
    ids = tokenizer(numbered_loop(35), add_special_tokens=False).input_ids
    stop = first_trip(ids)
    assert stop is not None and stop < len(ids) // 4, (stop, len(ids))
    assert tokenizer.decode(ids[:stop]).count("The file is a list") == 8
    counted_from_ten = tokenizer(numbered_loop(35, first=10), add_special_tokens=False).input_ids  # 2-digit numbers
    assert first_trip(counted_from_ten) is not None
    llm_items = "".join(f"{n}. The summary of the document is a list of the sections of the document.\n"
                        for n in range(1, 55))  # the 54-item loop `llm` got through gali serve
    assert first_trip(tokenizer(llm_items, add_special_tokens=False).input_ids) is not None


def test_a_loop_smollm2_wrote_is_stopped_after_eight_of_its_twenty_lines():
    """Recorded: SmolLM2 answering "What files does the database hold?" about a MIME specification numbered its
    lines "1. The MIME_TYPE_INFO_DOCUMENT", "2. ...", up to --max-new-tokens (the file says how it was recorded).
    The exact guard let all 320 tokens through; this one stops at token 128, the end of line 8."""
    recorded = json.loads((DATA / "smollm2-numbered-loop.json").read_text())
    stop = first_trip(recorded["ids"])
    assert stop == 128, stop
    assert recorded["text"].count("The MIME_TYPE_INFO_DOCUMENT") == 20  # what the loop would have cost


def test_prose_lists_and_tables_that_say_something_never_trip(tokenizer):
    """A real document read as an answer, a page at a time (the Declaration's 27 grievances, "He has ...", are
    one template whose words change), a numbered list of different items, and a table whose cells change."""
    declaration = tokenizer((EXAMPLES / "declaration-of-independence.txt").read_text(),
                            add_special_tokens=False).input_ids
    assert all(first_trip(declaration[start:start + 1024]) is None for start in range(0, len(declaration), 512))
    steps = "".join(f"{n}. {verb} the {thing} in section 2.{n}.\n" for n, (verb, thing) in enumerate(
        zip(["Read", "Check", "List", "Count", "Name", "Parse", "Sort", "Skip", "Merge", "Write"] * 3,
            ["globs", "magic rules", "aliases", "icons", "subclasses", "namespaces", "cache", "comments", "types",
             "headers", "weights"] * 3), 1))
    prices = "".join(f"| {item} | {n * 7 % 19 + 1} | {n * 3.25:.2f} |\n" for n, item in enumerate(
        ["apples", "bread", "cheese", "dates", "eggs", "flour", "grapes", "honey", "ink", "jam"] * 3, 1))
    for text in (steps, prices):
        assert first_trip(tokenizer(text, add_special_tokens=False).input_ids) is None, text


def test_a_table_of_rows_that_differ_in_a_number_alone_is_cut_after_eight(tokenizer):
    """Token by token such a table is the loop above: a few rows of it are kept, past eight it is cut (the
    trade-off repetition.NEAR_SPAN_FACTOR names)."""
    rows = [f"| 5.{minor}.0 | passed | 269 passed | 2026-11-26 | yes |\n" for minor in range(24, 4, -1)]
    assert first_trip(tokenizer("".join(rows[:7]), add_special_tokens=False).input_ids) is None
    stop = first_trip(tokenizer("".join(rows), add_special_tokens=False).input_ids)
    assert stop is not None and "".join(rows).count("passed |") > tokenizer.decode(
        tokenizer("".join(rows), add_special_tokens=False).input_ids[:stop]).count("passed |") >= 7


def test_the_guard_keeps_only_a_bounded_tail():
    """A server's client may ask for a million tokens: the guard's memory stays what its longest span needs."""
    guard = RepetitionGuard()
    for token in range(20_000):
        assert not guard.looping(token)
    assert len(guard.tokens) <= 2 * (guard.longest_period + 2)
    assert max(len(ring) for ring in guard.rings) <= repetition.NEAR_SPAN_FACTOR * 4 * 65


def test_stream_generate_stops_a_numbered_loop(tiny_model_dir, tokenizer):
    """What stream_generate decodes goes through this guard (generate.py takes it from gali_cli.repetition)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    tiny_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer(numbered_loop(100), add_special_tokens=False).input_ids
    vocabulary = {token: index + 3 for index, token in enumerate(dict.fromkeys(ids))}  # into the tiny model's ids
    assert len(vocabulary) + 3 < len(tiny_tokenizer)
    loop = iter([vocabulary[token] for token in ids])
    events = list(stream_generate(model, tiny_tokenizer, [0, 5, 6], lambda logits: next(loop), 3000, set(),
                                  [(0, 3)]))
    assert events[-1].reason == "repetition" and events[-1].generated_tokens < 400


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
