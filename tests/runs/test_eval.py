"""gali eval end to end on a tiny random Llama: the table, --json and --csv, the results file and resuming it, and
the usage errors (gali_cli.runs.evaluate and the eval command)."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import paths
from helpers.timing import scaled
from transformers import AutoTokenizer
from typer.testing import CliRunner

import gali_cli.cli as cli
import gali_cli.runs.evaluate as evaluate
from gali_cli.evaluation import tasks
from gali_cli.evaluation.sample import Request, Sample
from gali_cli.evaluation.tasks import build_samples
from gali_cli.prompts import ASK_STYLE, ask_instruction
from gali_cli.runs.evaluate import prompt_ids, styled

TIMING = {"seconds", "cpu_seconds", "prefill_tokens_per_second", "decode_tokens_per_second", "peak_memory_mib"}


@pytest.fixture(autouse=True)
def _short_answers(monkeypatch):
    """Answers of 8 tokens, not RULER's 128: the tiny model never stops early, and each token costs a forward."""
    real = evaluate.answer_sample
    monkeypatch.setattr(evaluate, "answer_sample", lambda loaded, method, choice, sample, cache, system=None,
                        max_prompt_tokens=None: real(loaded, method, choice, replace(sample, max_new_tokens=8), cache,
                                                     system, max_prompt_tokens))


@pytest.fixture
def gali(tiny_model_dir):
    def run(*args: str):
        return CliRunner().invoke(cli.app, ["eval", *args, "-m", str(tiny_model_dir), "--no-cache"],
                                  env={"COLUMNS": "200"})
    return run


ARGS = ("niah_single_1", "--lengths", "512", "--samples", "2", "--method", "gali,original")


def _answers(path) -> list[dict]:
    return [{key: value for key, value in json.loads(line).items() if key not in TIMING}
            for line in path.read_text().splitlines()]


def test_a_resumed_run_gives_what_an_uninterrupted_one_gives(gali, tmp_path, monkeypatch, tiny_model_dir):
    whole = gali(*ARGS, "--out", str(tmp_path / "whole.jsonl"))
    assert whole.exit_code == 0, whole.stderr
    records = _answers(tmp_path / "whole.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = build_samples(["niah_single_1"], Request((512,), 2, 42, lambda s: len(prompt_ids(tokenizer, s))))
    fed = {sample.id: len(prompt_ids(tokenizer, sample)) for sample in samples}
    assert all(record["prompt_tokens"] == fed[record["sample"]] for record in records)  # answer prefix included
    assert len(records) == 4 and {record["method"] for record in records} == {"gali", "original"}
    assert all(record["status"] == "ok" and 0 <= record["score"] <= 1 and record["decoding"] == "greedy"
               and record["length"] == 512 and record["prompt_tokens"] + 128 <= 512 for record in records)
    gali_settings = next(record["settings"] for record in records if record["method"] == "gali")
    assert gali_settings["train_len"] == 32 and "chunk_size" in gali_settings  # the settings as applied
    timed = [json.loads(line) for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    assert all(line["seconds"] > 0 and line["cpu_seconds"] > 0 for line in timed)
    assert "niah_single_1" in whole.stdout and "gali" in whole.stdout and "original" in whole.stdout
    lines = [line for line in whole.stderr.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] + "]" for line in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert all(" left" in line or "almost done" in line for line in lines[:3]) and "left" not in lines[3]
    assert all(" s of CPU)" in line for line in lines) and " s of CPU time)" in whole.stderr.splitlines()[-1]

    answered, real = [], evaluate.answer_sample

    def killed_on_the_third(*args, **kwargs):
        if len(answered) == 2:
            raise KeyboardInterrupt
        answered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "answer_sample", killed_on_the_third)
    cut = gali(*ARGS, "--out", str(tmp_path / "resumed.jsonl"))
    assert cut.exit_code == 130 and len(_answers(tmp_path / "resumed.jsonl")) == 2
    monkeypatch.setattr(evaluate, "answer_sample", real)
    resumed = gali(*ARGS, "--out", str(tmp_path / "resumed.jsonl"))
    assert resumed.exit_code == 0, resumed.stderr
    assert "2 answers already in" in resumed.stderr
    assert _answers(tmp_path / "resumed.jsonl") == records and resumed.stdout == whole.stdout
    again = gali(*ARGS, "--out", str(tmp_path / "whole.jsonl"), "--json")
    assert "4 answers already in" in again.stderr and len(_answers(tmp_path / "whole.jsonl")) == 4
    table = json.loads(again.stdout)
    assert table["out"] == str(tmp_path / "whole.jsonl") and len(table["results"]) == 2
    row = table["results"][0]
    assert set(row) == {"task", "length", "method", "score", "samples", "seconds_per_sample"}
    assert (row["task"], row["length"], row["method"], row["samples"]) == ("niah_single_1", 512, "gali", 2)
    mean = 100 * sum(r["score"] for r in records if r["method"] == "gali" and r["task"] == "niah_single_1") / 2
    assert row["score"] == pytest.approx(mean)
    csv = gali(*ARGS, "--out", str(tmp_path / "whole.jsonl"), "--csv")
    lines = csv.stdout.splitlines()
    assert lines[0] == "task,length,method,score,samples,seconds_per_sample" and len(lines) == 3
    assert lines[1].startswith(f"niah_single_1,512,gali,{row['score']:.2f},2,")


@pytest.mark.parametrize("args, message", [
    (["niah_single_9"], "unknown task niah_single_9"),
    (["vt", "--lengths", "x"], "--lengths: 'x' is not a length"),
    (["vt", "--json", "--csv"], "--json and --csv both print on stdout"),
    (["unscorable"], "has no reference answer: it cannot be scored"),
    (["vt", "--lengths", "1000000000000"], "'1000000000000' is past 16384k tokens, the longest prompt gali eval"),
    (["vt", "--lengths", "99999999999999999999999999k"], "is past 16384k tokens"),
    (["vt", "--lengths", "0"], "'0' is too short, a prompt needs at least 1 token"),
    (["vt", "--lengths", "-1"], "'-1' is too short, a prompt needs at least 1 token"),
    (["vt", "--prompt-style", "chatty"], "--prompt-style must be one of task, plain, wrapped, brief; got 'chatty'"),
])
def test_usage_errors_exit_2(gali, monkeypatch, args, message):
    def unscorable(name, request):
        return [Sample(task=name, id="0", context="text", question="?", references=(), score=lambda answer: 0.0)]

    monkeypatch.setitem(tasks.TASKS, "unscorable", unscorable)
    result = gali(*args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "perplexity" not in result.stderr


def test_a_results_line_whose_score_is_not_a_number_is_a_one_line_error(gali, tmp_path):
    out = tmp_path / "eval.jsonl"
    args = ("niah_single_1", "--lengths", "512", "--samples", "1", "--method", "gali", "--out", str(out))
    assert gali(*args).exit_code == 0
    out.write_text(out.read_text().replace('"score": ', '"score": "abc", "was": '))
    result = gali(*args)
    assert result.exit_code == 3 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].endswith("(gali) has score 'abc', not a number: delete that line "
                                                           "and gali eval answers the sample again")


def test_without_out_with_ones_own_haystack_and_a_plot(gali, tmp_path):
    (tmp_path / "report.txt").write_text("The lease ends in March. The tenant pays rent monthly. " * 40)
    result = gali("niah_single_1", "--lengths", "512", "--samples", "1", "--haystack", str(tmp_path / "report.txt"),
                  "--json", "--plot", str(tmp_path / "eval.png"))
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["out"] is None and [(row["task"], row["method"], row["samples"]) for row in found["results"]] == \
        [("niah_single_1", "gali", 1)]
    assert (tmp_path / "eval.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_two_processes_under_torchrun_share_the_answers(tiny_model_dir, tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    out = tmp_path / "eval.jsonl"
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", str(Path(sys.executable)
               .with_name("gali")), "eval", "niah_single_1", "--lengths", "512", "--samples", "2", "--out", str(out),
               "-m", str(tiny_model_dir), "--no-cache", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=scaled(600),
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[rank 0/2]" in result.stderr and "[rank 1/2]" in result.stderr
    assert sorted(json.loads(line)["sample"] for line in out.read_text().splitlines()) == ["512-0", "512-1"]
    assert not list(tmp_path.glob("*.part"))
    assert json.loads(result.stdout.strip().splitlines()[-1])["results"][0]["samples"] == 2  # rank 0, once merged


def test_a_raw_task_is_answered_without_the_chat_template(gali, monkeypatch, tiny_model_dir, tmp_path):
    """A task whose samples set chat=False (LongBench's trec, samsum, lcc...) is read as raw text."""
    def raw(name, request):
        return [Sample(task=name, id="0", context="Text: the lease ends in March.", question="\nType:",
                       references=("month",), score=lambda answer: 1.0, chat=False)]

    monkeypatch.setitem(tasks.TASKS, "raw", raw)
    result = gali("raw", "--json", "--out", str(tmp_path / "raw.jsonl"))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["results"][0]["score"] == 100.0
    raw_ids = AutoTokenizer.from_pretrained(tiny_model_dir)("Text: the lease ends in March.\nType:").input_ids
    assert _answers(tmp_path / "raw.jsonl")[0]["prompt_tokens"] == len(raw_ids)


def test_a_system_message_goes_before_chat_samples_only_and_is_part_of_the_job(gali, monkeypatch, tiny_model_dir,
                                                                             tmp_path):
    """--system (the GALI authors' LongBench runs wrapped every chat prompt in one): in the chat samples' prompts,
    not in the raw ones, recorded with each answer, and a rerun with another message answers again."""
    def mixed(name, request):
        return [Sample(task=name, id="chat", context="The lease ends in March.", question="When does it end?",
                       references=("March",), score=lambda answer: 1.0),
                Sample(task=name, id="raw", context="Text: the lease ends in March.", question="\nType:",
                       references=("month",), score=lambda answer: 1.0, chat=False)]

    monkeypatch.setitem(tasks.TASKS, "mixed", mixed)
    out = tmp_path / "mixed.jsonl"
    assert gali("mixed", "--method", "original", "--out", str(out)).exit_code == 0
    pirate = "You are a pirate chatbot who always responds in pirate speak!"
    result = gali("mixed", "--method", "original", "--out", str(out), "--system", pirate)
    assert result.exit_code == 0, result.stderr
    plain, wrapped = _answers(out)[:2], _answers(out)[2:]
    assert len(wrapped) == 2 and all(record["system"] == pirate for record in wrapped)
    assert all("system" not in record for record in plain)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_id = {record["sample"]: record["prompt_tokens"] for record in wrapped}
    chat, raw = mixed("mixed", None)
    assert by_id["chat"] == len(prompt_ids(tokenizer, chat, pirate)) > len(prompt_ids(tokenizer, chat))
    assert by_id["raw"] == len(prompt_ids(tokenizer, raw, pirate)) == len(prompt_ids(tokenizer, raw))
    assert pirate in tokenizer.decode(prompt_ids(tokenizer, chat, pirate))
    again = gali("mixed", "--method", "original", "--out", str(out))  # the first job's answers are still there
    assert again.exit_code == 0 and "2 answers already in" in again.stderr and len(_answers(out)) == 4


LONGBENCH_DATA = paths.DATA / "longbench"


def test_longbench_runs_from_local_data_with_its_official_rules(gali, tmp_path, tiny_model_dir):
    result = gali("longbench/trec", "longbench/qasper", "--longbench-data", str(LONGBENCH_DATA), "--lengths", "300",
                  "--samples", "2", "--method", "original", "--truncation", "paper", "--json", "--out",
                  str(tmp_path / "lb.jsonl"))
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    assert [row["task"] for row in rows] == ["longbench/trec", "longbench/qasper"]
    assert all(row["length"] == 300 and 0 <= row["score"] <= 100 and "paper" not in row for row in rows)
    records = _answers(tmp_path / "lb.jsonl")
    assert {record["truncation"] for record in records} == {"paper"}
    trec = [record for record in records if record["task"] == "longbench/trec"]
    assert all(record["prompt_tokens"] <= 300 - 64 - 50 + 2 for record in trec)  # trec's 64 answer tokens, margin 50


@pytest.mark.parametrize(("args", "message"), [
    (("longbench/trec",), "give its folder with --longbench-data DIR"),
    (("longbench/dureader", "--longbench-data", str(LONGBENCH_DATA)), "jieba"),
    (("longbench/nosuch", "--longbench-data", str(LONGBENCH_DATA)), "unknown LongBench dataset 'nosuch'"),
    (("longbench/trec", "--longbench-data", str(LONGBENCH_DATA), "--truncation", "left"),
     "--truncation must be one of official, paper"),
])
def test_longbench_usage_errors(gali, args, message):
    result = gali(*args, "--lengths", "300")
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_longbench_stands_for_the_papers_sixteen_datasets():
    from gali_cli.evaluation.longbench import PAPER_DATASETS

    names = tasks.check_tasks(["niah_single_1", "longbench", "longbench/trec"])
    assert names == ["niah_single_1", *(f"longbench/{name}" for name in PAPER_DATASETS)] and len(PAPER_DATASETS) == 16


def test_the_papers_scores_are_shown_beside_ours_for_its_model():
    from gali_cli.tables import eval_table

    rows = [{"task": "longbench/trec", "length": 16384, "method": "gali", "score": 70.0, "samples": 5,
             "seconds_per_sample": 1.0},
            {"task": "niah_single_1", "length": 16384, "method": "gali", "score": 90.0, "samples": 5,
             "seconds_per_sample": 1.0}]
    found = evaluate.with_paper_scores(rows, 8192)
    assert found[0]["paper"] == 77.0 and "paper" not in found[1]  # the paper's trec for GALI at 8k -> 16k
    assert "paper" not in evaluate.with_paper_scores(rows, 2048)[0]  # no such backbone in the paper
    table = eval_table(found)
    assert table.caption and "GALI paper" in table.caption
    assert [str(cell) for cell in table.columns[2]._cells] == ["[bold]70.0[/] (77.0)", "[bold]90.0[/]", "[bold]80.0[/]"]


def test_original_under_a_lowered_train_len_is_named_with_its_own_window():
    from gali_cli.runs.common import with_windows
    from gali_cli.tables import eval_table

    rows = [{"task": "vt", "length": 16384, "method": method, "score": 50.0, "samples": 1, "seconds_per_sample": 1.0}
            for method in ("gali", "original")]
    labelled = with_windows(rows, 4096, 8192)
    assert [row.get("window") for row in labelled] == [None, 8192]
    assert [column.header for column in eval_table(labelled).columns] == ["task", "length", "gali",
                                                                         "original (8k window)"]
    assert with_windows(rows, None, 8192) == rows == with_windows(rows, 8192, 8192)


def test_a_prompt_style_asks_the_question_as_gali_ask_does(tiny_model_dir):
    """--prompt-style: the question alone in gali ask's wrapper, without the task's answer prefix; `task` and raw
    prompts keep the task's wording."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    request = Request((512,), 1, 42, lambda sample: len(prompt_ids(tokenizer, sample)))
    sample = build_samples(["niah_single_1"], request)[0]
    assert sample.question.startswith("What is the special magic number for ") and sample.answer_prefix
    asked = styled(sample, ASK_STYLE)
    assert asked.question == ask_instruction(sample.query) and asked.question.endswith(sample.question)
    assert asked.answer_prefix == "" and asked.context == sample.context and asked.references == sample.references
    assert styled(sample, "plain").question == sample.question
    assert styled(sample, "task") == sample
    raw = replace(sample, chat=False)
    assert styled(raw, "brief") == raw
