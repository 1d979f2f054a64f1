"""Batch mode: which documents, resuming, failures, corpus perplexity, and two processes under torchrun."""

import functools
import json
import math
import operator
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.timing import scaled
from typer.testing import CliRunner

import gali_cli.cli as cli
import gali_cli.conversation as conversation
from gali_cli import display
from gali_cli.display import short_path
from gali_cli.errors import ConfigError, InputError
from gali_cli.runs.batch_inputs import expand_documents
from gali_cli.runs.batch_run import run_batch
from gali_cli.runs.launcher import Rank
from gali_cli.runs.results_file import ResultsFile, corpus_perplexities, job_hash

TEXT = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof.\n"


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for index, name in enumerate(["a.txt", "b.md", "sub/c.txt"]):
        (tmp_path / "docs" / name).write_text(TEXT * (4 + 2 * index))
    (tmp_path / "docs" / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "docs" / ".hidden.txt").write_text(TEXT)
    return tmp_path


def test_documents_from_files_directories_globs_and_manifests(folder, monkeypatch):
    monkeypatch.chdir(folder)
    docs = folder / "docs"
    expected = [docs / "a.txt", docs / "b.md", docs / "sub" / "c.txt"]
    assert expand_documents(["docs"]) == expected  # recursive, documents only, hidden skipped
    assert expand_documents(["docs/**/*.txt"]) == [docs / "a.txt", docs / "sub" / "c.txt"]
    assert expand_documents(["docs/b.md", "docs", "docs/a.txt"]) == [docs / "b.md", docs / "a.txt",
                                                                     docs / "sub" / "c.txt"]  # each once
    (folder / "lists").mkdir()
    (folder / "lists" / "inner.txt").write_text("../docs/sub\n")
    (folder / "lists" / "all.txt").write_text("# the corpus\n\n../docs/a.txt\n@inner.txt\n")
    assert expand_documents(["@lists/all.txt"]) == [docs / "a.txt", docs / "sub" / "c.txt"]


@pytest.mark.parametrize("specs, error, message", [
    (["missing.txt"], InputError, "missing.txt: no such file or directory"),
    (["cycle.txt"], InputError, "cycle.txt: a symbolic link loop"),
    (["docs/*.pdf"], InputError, "no file matches"),
    (["@nowhere.txt"], InputError, "cannot read manifest"),
    (["-"], ConfigError, "not from standard input"),
    (["empty"], InputError, "no documents"),
])
def test_documents_that_are_not_there(folder, monkeypatch, specs, error, message):
    monkeypatch.chdir(folder)
    (folder / "empty").mkdir()
    (folder / "cycle.txt").symlink_to(folder / "cycle.txt")
    with pytest.raises(error, match=message):
        expand_documents(specs)
    (folder / "loop.txt").write_text("@loop.txt\n")
    with pytest.raises(InputError, match="includes itself"):
        expand_documents(["@loop.txt"])


def test_a_deep_manifest_chain_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for depth in range(3000):
        (tmp_path / f"m{depth}.txt").write_text(f"@m{depth + 1}.txt\n")
    with pytest.raises(InputError, match="@manifests nested more than 16 deep"):
        expand_documents(["@m0.txt"])


@pytest.mark.parametrize("make, message", [
    (lambda path: path.write_text("a.txt\nb\0c.txt\n"), r"list.txt, line 2: b\x00c.txt: a path cannot hold a NUL"),
    (lambda path: os.mkfifo(path.parent / "pipe") or path.write_text("pipe\n"),
     "pipe: a named pipe or process substitution, which can be read only once"),
    (lambda path: path.write_text("/dev/zero\n"), "/dev/zero: a device, not a document"),
    (lambda path: path.write_bytes(b"#" * (65 * 2**20)), "larger than 64M: not a list of paths"),
])
def test_what_a_manifest_line_names_is_said(tmp_path, monkeypatch, make, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(TEXT)
    make(tmp_path / "list.txt")
    with pytest.raises(InputError, match=message):
        expand_documents(["@list.txt"])


def test_a_manifest_may_be_a_named_pipe(tmp_path, monkeypatch):
    """What `@<(ls *.txt)` gives: a pipe, read once."""
    import threading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(TEXT)
    os.mkfifo(tmp_path / "list")
    writer = threading.Thread(target=lambda: (tmp_path / "list").write_text(f"{tmp_path / 'a.txt'}\n"))
    writer.start()
    assert expand_documents(["@list"]) == [tmp_path / "a.txt"]
    writer.join()


def test_a_results_file_with_a_huge_line_is_read_within_bounds(tmp_path, monkeypatch):
    """A line far longer than any gali writes (here past 1M): refused as not ours without holding it (a 2.5 GB line
    took 3.4 times its size), and skipped when the records are read."""
    import tracemalloc

    from gali_cli.runs import results_file

    monkeypatch.setattr(results_file, "_LONGEST_LINE", 2**20)
    path = tmp_path / "out.jsonl"
    line = b'{"path": "a", "job": "j", "status": "ok", "pad": "' + b"x" * (20 * 2**20) + b'"}\n'
    path.write_bytes(line + b'{"path": "b", "job": "j", "status": "ok"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"not a gali results file \(line 1, longer than 1M\)"):
            ResultsFile(path, Rank()).prepare()
        assert [record["path"] for record in ResultsFile(path, Rank()).records()] == ["b"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20 and path.read_bytes().startswith(line)


def test_ranks_split_the_documents_deterministically(monkeypatch):
    documents = [Path(f"{index}.txt") for index in range(7)]
    shares = [Rank(rank, 3).shard(documents) for rank in range(3)]
    assert sorted(functools.reduce(operator.iadd, shares, [])) == sorted(documents)
    assert [len(share) for share in shares] == [3, 2, 2]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Rank.from_environment() == Rank(1, 2, 0)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="not within WORLD_SIZE"):
        Rank.from_environment()


def test_a_batch_resumes_retries_failures_and_redoes_changed_documents(folder):
    documents = expand_documents([str(folder / "docs")])
    results = ResultsFile(folder / "out.jsonl", Rank())
    calls = []

    def work(path: Path) -> list[dict]:
        calls.append(path.name)
        if path.name == "b.md" and calls.count("b.md") == 1:
            raise RuntimeError("flaky")
        return [{"output": path.read_text()[:10], "tokens": 5}]

    first = run_batch(documents, results, {"command": "test"}, work, Rank())
    assert (first.done, first.failed, first.skipped, first.tokens) == (2, 1, 0, 10)
    error, = [record for record in results.records() if record["status"] == "error"]
    assert error["path"].endswith("b.md") and error["error"] == "RuntimeError: flaky"
    again = run_batch(documents, results, {"command": "test"}, work, Rank())
    assert (again.done, again.skipped, again.failed) == (1, 2, 0) and calls[-1] == "b.md"
    (folder / "docs" / "a.txt").write_text("edited")
    edited = run_batch(documents, results, {"command": "test"}, work, Rank())
    assert (edited.done, edited.skipped) == (1, 2)
    other = run_batch(documents, results, {"command": "test", "seed": 1}, work, Rank())
    assert other.done == 3  # other settings: everything again
    assert all(record["job"] in (job_hash({"command": "test"}), job_hash({"command": "test", "seed": 1}))
               for record in results.records())


def test_a_line_cut_by_a_kill_is_skipped_then_dropped_and_parts_merge(folder):
    path = folder / "out.jsonl"
    results = ResultsFile(path, Rank())
    results.append([{"path": "a", "status": "ok", "sha256": "1", "job": "j"}])
    with open(path, "a") as file:
        file.write('{"path": "b", "status": "ok", "sha')  # killed mid-line
    results.prepare()  # still ours
    assert [record["path"] for record in results.records()] == ["a"]
    results.append([{"path": "c", "status": "ok", "sha256": "3", "job": "j"},
                    {"path": "c2", "status": "ok", "sha256": "3", "job": "j"}])  # one document's lines, one write
    assert [record["path"] for record in results.records()] == ["a", "c", "c2"]
    assert '"b"' not in path.read_text()  # the cut line is dropped, never left in the middle
    for rank in range(2):
        ResultsFile(path, Rank(rank, 2)).append([{"path": f"part{rank}", "status": "ok", "sha256": "x", "job": "j"}])
    assert {done[0] for done in ResultsFile(path, Rank(0, 2)).finished()} == {"a", "c", "c2", "part0", "part1"}
    ResultsFile(path, Rank()).merge()  # a plain run takes over what an interrupted distributed run left
    assert [record["path"] for record in results.records()] == ["a", "c", "c2", "part0", "part1"]
    assert not list(folder.glob("*.part"))


def test_a_document_with_some_of_its_lines_lost_is_done_again(folder):
    """A power cut may keep the first of a document's lines (one per method for ppl) and lose the rest: the
    document is not done until every line is there."""
    (folder / "doc.txt").write_text("text")
    path, calls = folder / "out.jsonl", []

    def work(document: Path) -> list[dict]:
        calls.append(document.name)
        return [{"method": "gali"}, {"method": "yarn"}, {"method": "original"}]

    run_batch([folder / "doc.txt"], ResultsFile(path, Rank()), {"command": "ppl"}, work, Rank())
    lines = path.read_text().splitlines()
    assert [json.loads(line)["line"] for line in lines] == [[0, 3], [1, 3], [2, 3]]
    path.write_text("\n".join(lines[:2]) + "\n")  # the last line lost
    again = run_batch([folder / "doc.txt"], ResultsFile(path, Rank()), {"command": "ppl"}, work, Rank())
    assert (again.done, again.skipped, calls) == (1, 0, ["doc.txt", "doc.txt"])
    third = run_batch([folder / "doc.txt"], ResultsFile(path, Rank()), {"command": "ppl"}, work, Rank())
    assert (third.done, third.skipped) == (0, 1)
    old = folder / "old.jsonl"  # lines of an older gali carry no mark: each is a whole document
    old.write_text(json.dumps({"path": "x", "status": "ok", "sha256": "1", "job": "j"}) + "\n")
    assert ResultsFile(old, Rank()).finished() == {("x", "1", "j")}


def test_a_file_that_is_not_ours_is_refused_and_left_alone(folder):
    notes = folder / "notes.txt"
    notes.write_text("my important notes")
    with pytest.raises(ConfigError, match="not a gali results file"):
        ResultsFile(notes, Rank()).prepare()
    assert notes.read_text() == "my important notes"
    with pytest.raises(ConfigError, match="cannot write there"):
        ResultsFile(notes / "out.jsonl", Rank()).prepare()


def test_one_run_at_a_time_holds_the_results_file(folder):
    first, second = (ResultsFile(folder / "out.jsonl", Rank()) for _ in range(2))
    assert first.lock() is None and first.lock_path.read_text().startswith(f"gali run {os.getpid()} on ")
    assert second.lock() == first.lock_path.read_text()  # who holds it, to tell the user
    assert first.is_output(first.lock_path)
    first.unlock()
    assert not first.lock_path.exists() and second.lock() is None
    second.unlock()


def test_results_file_is_never_a_document(folder, monkeypatch):
    monkeypatch.chdir(folder)
    results = ResultsFile(Path("docs/out.txt"), Rank(0, 2))
    assert results.is_output(folder / "docs" / "out.txt")
    assert results.is_output(folder / "docs" / "out.txt.rank1-of-2.part")
    assert not results.is_output(folder / "docs" / "a.txt")


def test_globs_inside_folders_with_brackets(tmp_path, monkeypatch):
    odd = tmp_path / "br[1]"
    odd.mkdir()
    (odd / "a.txt").write_text(TEXT)
    monkeypatch.chdir(odd)
    assert expand_documents(["*.txt"]) == [odd / "a.txt"]
    (odd / "list.txt").write_text("*.txt\n")
    assert expand_documents(["@list.txt"]) == [odd / "a.txt", odd / "list.txt"]


def test_corpus_perplexity_weighs_documents_by_tokens():
    job = {"command": "ppl"}
    records = [{"job": job_hash(job), "status": "ok", "path": path, "method": "gali",
                "results": [{"length": length, "ppl": math.exp(nll), "mean_nll": nll}]}
               for path, length, nll in [("a", 11, 1.0), ("b", 31, 2.0), ("old", 5, 9.0)]]
    rows = corpus_perplexities(records, job, [Path("a"), Path("b")], by_length=False)
    assert rows == [{"method": "gali", "length": "document", "ppl": pytest.approx(math.exp((10 + 60) / 40)),
                     "documents": 2, "tokens": 42}]


@pytest.fixture
def gali(tiny_model_dir):
    def run(*args: str, env: dict | None = None):
        return CliRunner().invoke(cli.app, [*args, "-m", str(tiny_model_dir)], env={"COLUMNS": "200", **(env or {})})

    return run


def test_summarize_a_folder_then_resume(gali, folder):
    out = folder / "summaries.jsonl"
    first = gali("summarize", str(folder / "docs"), "--out", str(out), "--max-new-tokens", "4")
    assert first.exit_code == 0, first.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(record["path"]).name for record in records] == ["a.txt", "b.md", "c.txt"]
    assert all(record["status"] == "ok" and record["output"] and record["generated_tokens"] == 4
               and record["settings"]["train_len"] == 32 and len(record["sha256"]) == 64 for record in records)
    assert all(record["seconds"] > 0 and record["cpu_seconds"] > 0 for record in records)  # a model's forwards
    assert first.stdout == "" and "3 documents: 3 done" in first.stderr
    lines = [line for line in first.stderr.splitlines() if line.startswith("[")]  # one per document, in order
    assert [line.split()[1].rsplit("/", 1)[-1] for line in lines] == ["a.txt:", "b.md:", "c.txt:"]
    assert lines[0].startswith("[1/3] ") and "tokens read, 4 written (length)" in lines[0]
    again = gali("summarize", str(folder / "docs"), "--out", str(out), "--max-new-tokens", "4", "--json")
    assert json.loads(again.stdout) == {"out": str(out), "documents": 3, "ok": 3, "failed": 0, "missing": 0}
    assert "3 already done" in again.stderr and len(out.read_text().splitlines()) == 3
    assert "3 documents: already done in" in again.stderr  # one line for the documents skipped, not one each
    assert "3 documents: 0 done, 3 already done, 0 failed -> " in again.stderr  # no "(0 tokens/s)": none were read
    one = gali("summarize", str(folder / "docs" / "a.txt"), "--out", str(folder / "one.jsonl"), "--max-new-tokens", "4")
    assert "\n1 document: 1 done (" in one.stderr, one.stderr  # not "1 documents"
    single = gali("summarize", str(folder / "docs" / "a.txt"), "--max-new-tokens", "4")
    assert single.stdout.strip() == records[0]["output"]  # the same answer as one document alone


def test_ask_many_records_failures_and_exits_1(gali, folder):
    (folder / "docs" / "broken.txt").write_bytes(b"\x00\x01\x02" * 100)
    out = folder / "answers.jsonl"
    result = gali("ask", str(folder / "docs"), "When?", "--out", str(out), "--max-new-tokens", "3")
    assert result.exit_code == 1
    records = {Path(record["path"]).name: record for record in map(json.loads, out.read_text().splitlines())}
    assert records["broken.txt"]["status"] == "error" and "binary" in records["broken.txt"]["error"]
    assert records["a.txt"]["status"] == "ok" and records["a.txt"]["question"] == "When?"
    assert any(line.endswith("broken.txt: failed: " + records["broken.txt"]["error"])
               for line in result.stderr.splitlines())
    assert gali("ask", str(folder / "docs" / "a.txt"), str(folder / "docs" / "b.md"), "When?").exit_code == 2


def test_corpus_perplexity_from_a_batch(gali, folder):
    out = folder / "ppl.jsonl"
    result = gali("ppl", str(folder / "docs"), "--out", str(out), "--method", "gali,original", "--json")
    assert result.exit_code == 0, result.stderr
    corpus = {row["method"]: row for row in json.loads(result.stdout)["corpus"]}
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for method in ("gali", "original"):
        mine = [record for record in records if record["method"] == method]
        nll = sum(record["results"][0]["mean_nll"] * (record["tokens"] - 1) for record in mine)
        predicted = sum(record["tokens"] - 1 for record in mine)
        assert corpus[method]["ppl"] == pytest.approx(math.exp(nll / predicted))
        assert corpus[method]["documents"] == 3
    first_line = next(line for line in result.stderr.splitlines() if line.startswith("[1/3]"))
    assert f"ppl gali {records[0]['results'][0]['ppl']:.3f}, original " in first_line
    alone = json.loads(gali("ppl", str(folder / "docs" / "a.txt"), "--json").stdout)["ppl"]
    first_gali = next(record for record in records if record["method"] == "gali")
    assert first_gali["results"][0]["ppl"] == pytest.approx(alone)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_two_processes_under_torchrun_share_the_work(tiny_model_dir, folder):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    gali_command = str(Path(sys.executable).with_name("gali"))
    out = folder / "ppl.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", gali_command, "ppl",
               str(folder / "docs"), "--out", str(out), "-m", str(tiny_model_dir), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[rank 0/2]" in result.stderr and "[rank 1/2]" in result.stderr
    assert sorted(Path(json.loads(line)["path"]).name for line in out.read_text().splitlines()) == \
        ["a.txt", "b.md", "c.txt"]
    assert not list(folder.glob("*.part"))
    corpus = json.loads(result.stdout.strip().splitlines()[-1])["corpus"]  # rank 0 prints it, once merged
    assert corpus[0]["documents"] == 3
    (folder / "docs" / "broken.txt").write_bytes(b"\x00\x01\x02" * 100)  # 3rd of 4: rank 0's, and it fails
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(300))
    assert again.returncode != 0  # every process knows a document failed, after the merge
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and [line["status"] for line in lines].count("error") == 1
    assert not list(folder.glob("*.part"))
    assert "[rank 0/2] 2 documents: 0 done" in again.stderr and "1 already done, 1 failed" in again.stderr
    assert "[rank 1/2] 2 documents: 0 done" in again.stderr and "2 already done, 0 failed" in again.stderr


def test_a_killed_batch_leaves_a_line_per_finished_document(gali, folder, monkeypatch):
    """The lines come as documents finish, not at the end: an interrupted run's log says what was done."""
    real, calls = conversation.stream_generate, []

    def interrupted_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        yield from real(*args, **kwargs)

    monkeypatch.setattr(conversation, "stream_generate", interrupted_at_the_second)
    out = folder / "out.jsonl"
    result = gali("summarize", str(folder / "docs"), "--out", str(out), "--max-new-tokens", "2")
    assert result.exit_code == 130
    done = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(done) == 1 and done[0].startswith("[1/3] ") and "a.txt: " in done[0]
    # Ctrl-C says what is safe and how to go on, not just "interrupted" (issue 50)
    assert result.stderr.splitlines()[-1] == (f"interrupted: 1 of 3 documents done and kept in {short_path(str(out))}; "
                                              "the same command resumes with the other 2")


def test_the_bar_follows_a_long_document_as_it_is_read(gali, folder, monkeypatch):
    """The bar moved only from one document to the next, nothing while a long one was read (issue 50): its line
    now says how many of the document's tokens are read, forward by forward, in both kinds of batch."""
    described: list[str] = []

    class Bar:
        def __call__(self, done: int, total: int) -> None:
            pass

        def describe(self, label: str) -> None:
            described.append(label)

    @contextmanager
    def progress_bar(label: str):
        yield Bar()

    monkeypatch.setattr(display, "progress_bar", progress_bar)
    (folder / "long").mkdir()
    (folder / "long" / "a-long.txt").write_text(TEXT * 80)  # about 1,800 tokens: forwards of the ppl pass too
    (folder / "long" / "b-short.txt").write_text(TEXT)
    for command in ("summarize", "ppl"):
        described.clear()
        assert gali(command, str(folder / "long"), "--out", str(folder / f"{command}.jsonl")).exit_code == 0
        reads = [label for label in described if label.startswith("documents: [1/2] ") and "tokens read" in label]
        counts = [tuple(map(int, label.split(", ")[-1].split()[0].replace(",", "").split("/"))) for label in reads]
        assert "long/a-long.txt, " in reads[0] and len(counts) >= 3, described  # several forwards, each said
        assert counts[0][0] < counts[-1][0] == counts[-1][1], counts  # counting up to the whole document


@pytest.mark.slow
def test_a_second_run_on_the_same_results_file_refuses(tiny_model_dir, folder):
    """Two real processes on one --out: the second says who holds it and leaves; the first does every document
    once (before the lock, both did them all: 14 lines for 8 documents). The first is paused (SIGSTOP) while the
    second tries, so that however slowly the second starts, the first still holds the file."""
    for index in range(12):
        (folder / "docs" / f"more-{index:02}.txt").write_text(TEXT * 3)
    out = folder / "summaries.jsonl"
    command = [sys.executable, "-m", "gali_cli", "summarize", str(folder / "docs"), "--out", str(out),
               "-m", str(tiny_model_dir), "--max-new-tokens", "48"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + scaled(120)
        while not (out.exists() and out.read_text().count("\n") >= 1):  # the first is at work, lock held
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        assert first.poll() is None, "the first run ended before it could be paused"
        try:
            second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(120))
        finally:
            first.send_signal(signal.SIGCONT)
    finally:
        _, errors = first.communicate(timeout=scaled(300))
    assert second.returncode == 2 and not second.stdout
    assert second.stderr.strip() == (f"gali: --out {out} is being written by gali run {first.pid} on "
                                     f"{socket.gethostname()}: wait for it to finish, or choose another --out")
    assert first.returncode == 0, errors
    paths = [json.loads(line)["path"] for line in out.read_text().splitlines()]
    assert len(paths) == len(set(paths)) == 15
    assert not (folder / ".summaries.jsonl.lock").exists()
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=scaled(120))
    assert again.returncode == 0 and "15 already done" in again.stderr  # the lock is free again


def test_batch_usage_errors_come_before_the_model(gali, folder):
    notes = folder / "notes.txt"
    notes.write_text("keep me")
    refused = gali("summarize", str(folder / "docs" / "a.txt"), "--out", str(notes))
    assert refused.exit_code == 2 and "not a gali results file" in refused.stderr and notes.read_text() == "keep me"
    assert gali("summarize", str(folder / "docs"), "--out", str(notes / "x.jsonl")).exit_code == 2


def test_documents_shorter_than_every_length_do_not_make_a_column(gali, folder):
    (folder / "docs" / "tiny.txt").write_text("Short.")
    out = folder / "ppl.jsonl"
    result = gali("ppl", str(folder / "docs"), "--out", str(out), "--lengths", "40,60", "--json")
    assert result.exit_code == 0, result.stderr
    corpus = json.loads(result.stdout)["corpus"]
    assert sorted(row["length"] for row in corpus) == [40, 60]
    tiny = next(json.loads(line) for line in out.read_text().splitlines() if "tiny.txt" in line)
    assert tiny["results"] == [] and "shorter than every --lengths value" in tiny["warnings"][0]
