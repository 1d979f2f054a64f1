"""gali eval's RULER tasks: deterministic by seed, fitted to their lengths, needles at their depths, scored as RULER
scores (gali_cli.evaluation: ruler.py, haystack.py, scoring.py, tasks.py)."""

import re
from dataclasses import replace

import pytest
from helpers.tiny_models import tiny_tokenizer

from gali_cli.errors import ConfigError
from gali_cli.evaluation import haystack
from gali_cli.evaluation.ruler import NEEDLE, NOISE
from gali_cli.evaluation.sample import Request, Sample
from gali_cli.evaluation.scoring import postprocess, string_match_all, string_match_part
from gali_cli.evaluation.tasks import TASKS, build_samples, check_tasks
from gali_cli.runs.evaluate import prompt_ids

TOKENIZER = tiny_tokenizer()


def request(lengths=(2048,), samples=2, seed=42, text=None) -> Request:
    return Request(lengths, samples, seed, lambda sample: len(prompt_ids(TOKENIZER, sample)), text)


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_deterministic_and_fit_their_length(task):
    first = build_samples([task], request())
    assert first == build_samples([task], request())  # Sample's equality leaves out the scorer
    assert first != build_samples([task], request(seed=43))
    for sample in first:
        used = len(prompt_ids(TOKENIZER, sample)) + sample.max_new_tokens
        assert 0.9 * 2048 <= used <= 2048, (sample.id, used)
        assert sample.score(" ".join(sample.references)) == 1.0 and sample.score("") == 0.0


def test_niah_follows_ruler_formats():
    single, = build_samples(["niah_single_1"], request(samples=1))
    assert single.context.startswith("A special magic number is hidden within the following text. Make sure to "
                                     "memorize it. I will quiz you about the number afterwards.\n")
    key = re.search(r"One of the special magic numbers for (\S+-\S+) is: (\d{7})\.", single.context)
    assert key and single.references == (key.group(2),)
    assert single.question == f"What is the special magic number for {key.group(1)} mentioned in the provided text?"
    assert single.answer_prefix == f" The special magic number for {key.group(1)} mentioned in the provided text is"
    assert single.max_new_tokens == 128 and NOISE in single.context
    query, = build_samples(["niah_multiquery"], request(samples=1))
    assert len(query.references) == 4 and query.question.startswith("What are all the special magic numbers for ")
    assert query.question.count(",") == 3 and ", and " in query.question
    uuids, = build_samples(["niah_multikey_3"], request(samples=1))
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuids.references[0])
    assert uuids.context.count("One of the special magic uuids for ") > 10  # the distractors
    vt, = build_samples(["vt"], request(samples=1))
    assert vt.context.count("Memorize and track the chain(s) of variable assignment") == 2  # the worked example
    assert len(vt.references) == 5 and all(re.fullmatch("[A-Z]{5}", name) for name in vt.references)
    assert f"VAR {vt.references[1]} = VAR {vt.references[0]} \n" in vt.context


@pytest.mark.parametrize("task, kind", [("niah_single_1", "noise"), ("niah_single_2", "essay")])
def test_needles_land_at_evenly_spread_depths(task, kind):
    samples = build_samples([task], request(lengths=(8192,), samples=5))
    for index, sample in enumerate(samples):
        body = sample.context.split("\n", 1)[1]
        needle = re.search(NEEDLE.format(type_needle_v="numbers", key=r"\S+", value=r"\d+"), body)
        before, after = body[:needle.start()], body[needle.end():]
        if kind == "noise":
            placed, units = before.count(NOISE), body.count(NOISE)
        else:
            placed, rest = (len(haystack.sentences(part)) if part.strip() else 0 for part in (before, after))
            units = placed + rest
        assert units > 20 and abs(placed / units - index / 4) <= 1 / units, (index, placed, units)


def test_a_haystack_of_ones_own():
    text = "The lease ends in March. The tenant pays rent monthly! Does the landlord repair the roof? Yes."
    sample, = build_samples(["niah_single_1"], request(samples=1, text=text))
    assert "The tenant pays rent monthly!" in sample.context and NOISE not in sample.context
    assert haystack.sentences(text) == ("The lease ends in March.", "The tenant pays rent monthly!",
                                        "Does the landlord repair the roof?", "Yes.")
    with pytest.raises(ConfigError, match="no text"):
        haystack.sentences("   ")


def test_a_length_too_short_for_the_prompt_is_a_usage_error():
    with pytest.raises(ConfigError, match="--lengths 300: too short for niah_single_1"):
        build_samples(["niah_single_1"], request(lengths=(300,)))


def test_unknown_tasks_are_named():
    with pytest.raises(ConfigError, match="unknown task niah_single_9: gali eval knows niah_single_1"):
        check_tasks(["vt", "niah_single_9"])
    assert check_tasks(["vt", "cwe", "vt"]) == ["vt", "cwe"]


@pytest.mark.parametrize("prediction, references, match_all, match_part", [
    ("The special magic numbers are 123 and 456.", ("123", "456", "789"), 2 / 3, 1.0),
    ("  NEVER-Ending\tstory  ", ("never-ending",), 1.0, 1.0),
    ("nothing here", ("123", "456"), 0.0, 0.0),
    ("VAR ABCDE, VAR FGHIJ", ("abcde", "fghij", "klmno", "pqrst"), 0.5, 1.0),
])
def test_scores_match_rulers_definitions(prediction, references, match_all, match_part):
    # RULER: string_match_all = sum(r.lower() in pred.lower() for r in ref) / len(ref); part = max of the same
    assert string_match_all(prediction, references) == pytest.approx(match_all)
    assert string_match_part(prediction, references) == match_part


def test_predictions_are_cleaned_as_ruler_cleans_them():
    assert postprocess("  a\tb\x00c\n ") == "a\nb\nc"


def test_a_raw_prompt_leaves_the_chat_template_out():
    """LongBench's trec, samsum, lcc...: BOS, the context and the question exactly as given (the question carries
    its own separator), nothing between and nothing after."""
    sample = Sample(task="raw", id="0", context="Text: a b c\n", question="\nType:", references=("x",),
                    score=lambda answer: 0.0, chat=False)
    assert prompt_ids(TOKENIZER, sample) == TOKENIZER("Text: a b c\n\nType:").input_ids
    chat = prompt_ids(TOKENIZER, replace(sample, chat=True))
    assert TOKENIZER.decode(chat).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nText:")
