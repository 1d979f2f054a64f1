"""LongBench v1: the official metrics on cases where normalization and tokenization matter (expected values worked out
from THUDM/LongBench's metrics.py definitions and the `rouge` package's, by hand in the comments), the prompts filled
from tiny fixture records (tests/data/longbench, written for these tests), pred.py's middle truncation, and the errors
a user meets."""

import json
import sys
from types import SimpleNamespace

import pytest
from helpers import paths
from helpers.tiny_models import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from gali_cli.errors import ConfigError, InputError
from gali_cli.evaluation import longbench, longbench_metrics
from gali_cli.evaluation.longbench_metrics import best_score, fuzz_ratio
from gali_cli.evaluation.longbench_paper import PAPER_DATASETS, ROWS, is_paper_model, paper_scores

DATA = paths.DATA / "longbench"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (a byte-level BPE with no merges) and a BOS: truncation is then countable in characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=257, special_tokens=["<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["x"], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>")


@pytest.mark.parametrize(("prediction", "reference", "expected"), [
    # "eiffel tower in paris" vs "eiffel tower": P 2/4, R 1
    ("The Eiffel Tower, in Paris!", "eiffel tower", 2 / 3),
    ("Anthem", "an anthem", 1.0),  # "an" is an article, the "an" inside "anthem" is not
    ("state-of-the-art", "state of the art", 0.0),  # punctuation is deleted, not spaced: "stateoftheart"
    ("yes yes no", "yes", 0.5),  # multisets: one "yes" in common, P 1/3, R 1
])
def test_qa_f1_normalizes_as_the_official_code(prediction, reference, expected):
    assert longbench_metrics.qa_f1(prediction, reference) == pytest.approx(expected)


@pytest.mark.parametrize(("prediction", "reference", "expected"), [
    # distinct words: reference {the, cat, sat, on, mat} = 5, LCS 3: R 3/5, P 1, F 0.75 (rouge-score: 0.667)
    ("the cat sat", "the cat sat on the mat", 0.75),
    ("The cat", "the cat", 0.5),  # case-sensitive: only "cat" in common (rouge-score: 1.0)
    ("c d. a b", "a b c d", 1.0),  # union LCS over the prediction's sentences (rouge-score: 0.5)
    ("", "a b", 0.0),  # the package raises on an empty text: the official except scores 0
])
def test_rouge_l_is_the_rouge_package_called_as_the_official_code(prediction, reference, expected):
    pytest.importorskip("rouge")
    assert longbench_metrics.rouge_l(prediction, reference) == pytest.approx(expected, abs=1e-7)


def test_classification_keeps_the_official_skip_after_a_dropped_class():
    # "city" is dropped (part of the reference's name); the loop then skips "capital", which stays: 1 / 2.
    classes = ("city", "capital", "capital city")
    assert longbench_metrics.classification("capital city", "capital city", classes) == 0.5
    assert longbench_metrics.classification("city or country", "city", ("city", "country", "food")) == 0.5
    assert longbench_metrics.classification("a food", "city", ("city", "country", "food")) == 0.0


@pytest.mark.parametrize(("metric", "prediction", "reference", "expected"), [
    ("count", "There are 12 unique paragraphs out of 30", "12", 0.5),  # one of the two numbers
    ("count", "none", "3", 0.0),
    ("retrieval", "Paragraph 17, or Paragraph 7", "Paragraph 7", 0.5),  # "17" is not "7"
    ("retrieval_zh", "答案是：段落3", "段落3", 1.0),
    ("code_sim", "\n# comment\n    return x + 1\n", "    return x + 1", 1.0),  # the comment line is skipped
    # the fence is skipped; difflib matches "x = compute(a, b" and ")": 2 * 17 / 37 = 0.9189, 92 as a whole percent
    ("code_sim", "```python\nx = compute(a, b)\n```", "x = compute(a, b, c)", 0.92),
])
def test_count_retrieval_and_code_similarity(metric, prediction, reference, expected):
    assert longbench_metrics.METRICS[metric](prediction, reference) == pytest.approx(expected)


@pytest.mark.parametrize(("first", "second", "expected"), [
    # fuzzywuzzy 0.18's fuzz.ratio without python-Levenshtein (rapidfuzz gives 76.47 -> 76, 88.89 -> 89)
    ("self.assertEqual(result, expected)", "self.assertEqual(expected, result)", 76),
    ("for i in range(n):", "for j in range(m):", 89),
    ("", "", 100),
    ("", "x", 0),
])
def test_fuzz_ratio_is_fuzzywuzzys(first, second, expected):
    assert fuzz_ratio(first, second) == expected


def test_best_score_takes_the_best_reference_and_the_first_line_where_asked():
    assert best_score("qa_f1", "the Harbor corpus", ("Harbor corpus of ferry timetables", "Harbor corpus")) == 1.0
    assert best_score("qa_f1", "\nParis\nLondon", ("London",), first_line=True) == 0.0
    assert best_score("qa_f1", "\nParis\nLondon", ("London",)) == pytest.approx(2 / 3)


def test_prompts_fill_the_official_templates_and_split_before_the_question():
    tokenizer = tiny_tokenizer()
    record = json.loads((DATA / "data" / "qasper.jsonl").read_text().splitlines()[0])
    sample = longbench.samples(DATA, "qasper", tokenizer, 100_000)[0]
    template = longbench.DATASETS["qasper"].template
    assert longbench.prompt(sample) == template.format(context=record["context"], input=record["input"])
    assert sample.question.startswith(" Answer the question based on the above article")  # qasper's own space
    assert sample.question.endswith(f"Question: {record['input']}\n\nAnswer:")
    assert (sample.task, sample.id, sample.chat, sample.max_new_tokens) == ("longbench/qasper", "qasper-fixture-1",
                                                                            True, 128)
    assert sample.references == ("the Harbor corpus", "Harbor corpus of ferry timetables")
    assert sample.score("Harbor corpus.") == 1.0


@pytest.mark.parametrize(("name", "chat", "stop", "max_new_tokens", "answer", "score"), [
    ("trec", False, (), 64, "Other location\nDate", 1.0),  # first line only
    ("samsum", False, ("\n",), 128, "The ferry is ten minutes late, as usual.\nDialogue: Ann:", 1.0),
    ("passage_retrieval_en", True, (), 32, "Paragraph 2", 1.0),
    ("lcc", False, (), 64, "        count += 1", 1.0),
])
def test_each_dataset_feeds_scores_and_stops_as_pred_py(name, chat, stop, max_new_tokens, answer, score):
    sample = longbench.samples(DATA, name, tiny_tokenizer(), 100_000)[0]
    record = json.loads((DATA / "data" / f"{name}.jsonl").read_text().splitlines()[0])
    assert longbench.prompt(sample) == longbench.DATASETS[name].template.format(**record)
    assert (sample.chat, sample.stop, sample.max_new_tokens) == (chat, stop, max_new_tokens)
    assert sample.score(answer) == pytest.approx(score)


def test_every_chat_template_asks_its_question_after_a_blank_line():
    for name, spec in longbench.DATASETS.items():
        after = spec.template.split("{context}", 1)[1]
        assert not spec.chat or after.startswith("\n\n"), name
    assert [name for name, spec in longbench.DATASETS.items() if not spec.chat] == [
        "trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"]


@pytest.mark.parametrize(("truncation", "budget"), [("official", 300), ("paper", 300 - 128 - 50)])
def test_truncation_keeps_the_first_and_last_halves_of_the_budget(tmp_path, truncation, budget):
    tokenizer = byte_tokenizer()
    context = "".join(f"{i:04d}." for i in range(200))  # 1000 characters, one token each
    (tmp_path / "qasper.jsonl").write_text(json.dumps({"input": "Why?", "context": context, "answers": ["x"]}))
    sample = longbench.samples(tmp_path, "qasper", tokenizer, 300, truncation=truncation)[0]
    whole = longbench.DATASETS["qasper"].template.format(context=context, input="Why?")
    half = budget // 2
    # the BOS is the first token of the first half: half - 1 characters of text, then the last half
    assert longbench.prompt(sample) == whole[:half - 1] + whole[-half:]
    assert len(tokenizer(longbench.prompt(sample))["input_ids"]) == budget


def test_a_huge_record_has_only_its_ends_tokenized(tmp_path, monkeypatch):
    """A 300 MB LongBench record made the Rust tokenizer abort gali eval (exit 134, 5.9 GB): a prompt past what the
    budget's tokens can span in characters is cut by characters first, with the same result."""
    tokenizer = byte_tokenizer()
    context = "".join(f"{i:06d}." for i in range(20_000))  # 140,000 characters, one token each
    (tmp_path / "qasper.jsonl").write_text(json.dumps({"input": "Why?", "context": context, "answers": ["x"]}))
    longest, tokenized = type(tokenizer).__call__, []

    def counting(self, text, *args, **kwargs):
        tokenized.append(len(text))
        return longest(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    sample = longbench.samples(tmp_path, "qasper", tokenizer, 300)[0]
    whole = longbench.DATASETS["qasper"].template.format(context=context, input="Why?")
    assert longbench.prompt(sample) == whole[:149] + whole[-150:]  # as test_truncation_keeps_... works it out
    assert max(tokenized) <= 150 * 3 + 4096  # half the budget times the longest token ("<s>"), and the margin


def test_a_question_cut_by_truncation_leaves_the_whole_prompt_as_the_document(tmp_path):
    (tmp_path / "qasper.jsonl").write_text(json.dumps({"input": "Why?", "context": "x" * 500, "answers": ["x"]}))
    sample = longbench.samples(tmp_path, "qasper", byte_tokenizer(), 100)[0]
    assert sample.question == "" and len(sample.context) == 99


def test_the_parquet_copy_reads_as_the_jsonl_release(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.parquet

    rows = [json.loads(line) for line in (DATA / "data" / "qasper.jsonl").read_text().splitlines()]
    renamed = [{("question" if key == "input" else key): value for key, value in row.items()} for row in rows]
    (tmp_path / "qasper" / "test").mkdir(parents=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(renamed), tmp_path / "qasper" / "test" / "0000.parquet")
    tokenizer = tiny_tokenizer()
    from_parquet = longbench.samples(tmp_path, "qasper", tokenizer, 100_000)
    from_jsonl = longbench.samples(DATA, "qasper", tokenizer, 100_000)
    assert [(s.id, s.context, s.question, s.references) for s in from_parquet] == [
        (s.id, s.context, s.question, s.references) for s in from_jsonl]


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "qasper").mkdir()
    (tmp_path / "qasper" / "0000.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r'needs pyarrow: pip install -e "\.\[eval\]" in '):
        longbench.samples(tmp_path, "qasper", tiny_tokenizer(), 1000)


def test_a_corrupt_parquet_file_is_an_input_error(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "qasper").mkdir()
    (tmp_path / "qasper" / "0000.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match="cannot be read as parquet"):
        longbench.samples(tmp_path, "qasper", tiny_tokenizer(), 1000)


def test_longbench_e_names_use_their_datasets_prompts(tmp_path):
    (tmp_path / "qasper_e.jsonl").write_text((DATA / "data" / "qasper.jsonl").read_text())
    sample = longbench.samples(tmp_path, "qasper_e", tiny_tokenizer(), 100_000, limit=1)
    assert len(sample) == 1 and sample[0].task == "longbench/qasper_e" and sample[0].max_new_tokens == 128


@pytest.mark.parametrize(("setup", "name", "error", "message"), [
    (None, "qasper", InputError, "is not a directory"),
    ("", "qasper", InputError, r"no LongBench qasper under .*: looked for qasper.jsonl"),
    ("not json\n", "qasper", InputError, r"qasper.jsonl:1 is not JSON"),
    ("\n", "qasper", InputError, r"qasper.jsonl holds no LongBench records"),
    ('{"input": "q", "context": "c", "answers": []}\n', "qasper", InputError, "needs a list of answers"),
    ('{"context": "c", "answers": ["a"]}\n', "qasper", InputError, "needs text under context and input"),
    ('{"input": "q", "context": "c", "answers": ["the second"]}\n', "passage_retrieval_en", ConfigError,
     "names no paragraph: it cannot be scored"),
    ('{"input": "q", "context": "c", "answers": ["City"]}\n', "trec", ConfigError, "without all_classes"),
    ("\udcff", "qasper", InputError, "is not UTF-8 text"),
    # all_classes of a wrong type or a string (which was split into one-letter classes, silently), JSON nested past
    # the parser's depth and lone surrogates were "unexpected" errors
    ('{"input": "q", "context": "c", "answers": ["City"], "all_classes": "City"}\n', "trec", InputError,
     r"trec.jsonl:1: a LongBench record's all_classes is a list of class names \(or null\), got str"),
    ('{"input": "q", "context": "c", "answers": ["City"], "all_classes": 5}\n', "trec", InputError, "got int"),
    ('{"input": "q", "context": "c", "answers": ["City"], "all_classes": ["City", 5]}\n', "trec", InputError,
     "got a list holding non-text"),
    ("[" * 100_000 + "]" * 100_000 + "\n", "qasper", InputError, r"qasper.jsonl:1 is JSON nested deeper than Python "
                                                                 "reads"),
    ('{"input": "q", "context": "a \\ud800 b", "answers": ["a"]}\n', "qasper", InputError,
     r"qasper.jsonl:1: a LongBench record's context holds a lone surrogate"),
    ('{"input": "q", "context": "c", "answers": ["\\udfff"]}\n', "qasper", InputError,
     "answers holds a lone surrogate"),
    ("", "dureader", ConfigError, "jieba's Chinese word segmentation"),
    ("", "vcsum", ConfigError, "jieba"),
    ("", "squad", ConfigError, "unknown LongBench dataset 'squad'"),
])
def test_missing_or_unscorable_data_is_a_clear_error(tmp_path, setup, name, error, message):
    data = tmp_path / "lb"
    if setup is not None:
        data.mkdir()
        if setup:
            (data / f"{name}.jsonl").write_bytes(setup.encode("utf-8", "surrogateescape"))
    with pytest.raises(error, match=message):
        longbench.samples(data, name, tiny_tokenizer(), 1000)


@pytest.mark.parametrize(("truncation", "length", "message"), [
    ("middle", 1000, "--truncation must be one of official, paper"),
    ("paper", 128 + 50 + 1, "cannot hold its first and last halves"),
])
def test_bad_truncation_settings_are_config_errors(truncation, length, message):
    with pytest.raises(ConfigError, match=message):
        longbench.samples(DATA, "qasper", tiny_tokenizer(), length, truncation=truncation)


def test_the_papers_rows_average_their_datasets_and_are_found_by_setting():
    for row in ROWS:
        assert len(row.scores) == len(PAPER_DATASETS) == 16
        assert sum(row.scores) / 16 == pytest.approx(row.average, abs=0.011), row
    assert paper_scores(8192, 16384, "gali")["average"] == 45.17  # the headline
    assert paper_scores(8192, 16384, "chunk-llama")["narrativeqa"] == 23.87
    assert paper_scores(8192, 32768, "self-extend")["average"] == 45.28  # the authors' run, not the reported 24.71
    assert paper_scores(4096, 16384, "gali")["passage_retrieval_en"] == 95.5
    assert paper_scores(8192, 16384, "rerope") is None and paper_scores(2048, 16384, "gali") is None


LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192}


@pytest.mark.parametrize(("changes", "name", "expected"), [
    ({}, "meta-llama/Meta-Llama-3-8B-Instruct", True),
    ({}, "Meta-Llama-3-8B-Instruct.Q8_0.gguf", True),
    ({}, "meta-llama/Meta-Llama-3-8B", False),  # the base model has the same shape
    ({"max_position_embeddings": 131072}, "meta-llama/Llama-3.1-8B-Instruct", False),
    ({"hidden_size": 576, "num_hidden_layers": 30}, "HuggingFaceTB/SmolLM2-135M-Instruct", False),
])
def test_the_papers_model_is_llama_3_8b_instruct(changes, name, expected):
    assert is_paper_model(SimpleNamespace(**{**LLAMA3_8B, **changes}), name) is expected
