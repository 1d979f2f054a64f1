"""Issue 25's data edges, end to end through the `gali` command: a full disk, a kill mid-write, huge sizes and
names that are not UTF-8 never lose what the user had, never leak disk space, and are never "unexpected"."""

import errno
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import helpers.commands as commands
import pytest
import torch
from helpers.caches import backdate, killed_workspace
from helpers.timing import scaled

import gali_cli.doc_cache as doc_cache
import gali_cli.documents as documents
import gali_cli.model.companions as companions
from gali_cli.config import parse_size
from gali_cli.doc_cache import DocumentCache
from gali_cli.documents import read_document
from gali_cli.errors import GaliError, InputError
from gali_cli.file_locks import left_behind
from gali_cli.model.companions import GgufCompanions
from gali_cli.model.gguf import GgufFile
from gali_cli.runs.launcher import Rank
from gali_cli.runs.results_file import ResultsFile

DOCUMENT = commands.DOCUMENT
run, doc = commands.run, commands.doc  # fixtures: a `gali` run in-process, a document

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


def line(path: str) -> str:
    return json.dumps({"path": path, "status": "ok", "sha256": "1", "job": "j"}) + "\n"


def test_a_cut_last_line_is_dropped_before_the_next_never_left_in_the_middle(tmp_path):
    path = tmp_path / "out.jsonl"
    results = ResultsFile(path, Rank())
    results.append([json.loads(line("a"))])
    with open(path, "a") as file:
        file.write('{"path": "b", "status": "ok", "sha')  # a kill or a full disk mid-line
    results.prepare()  # still ours
    results.append([json.loads(line("c"))])
    assert path.read_text() == line("a") + line("c")
    results.prepare()
    assert [record["path"] for record in results.records()] == ["a", "c"]


def test_a_last_line_cut_just_before_its_newline_is_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(line("a") + line("b").rstrip("\n"))  # the record is whole: only its newline is missing
    ResultsFile(path, Rank()).append([json.loads(line("c"))])
    assert path.read_text() == line("a") + line("b") + line("c")


@pytest.mark.parametrize("cut", ['{"pa', '{"path": "b", "status": "ok", "sha', '\0\0\0\0'],
                         ids=["cut early", "cut late", "zeros a crash left"])
def test_a_file_an_earlier_gali_left_with_a_cut_line_in_the_middle_is_still_resumable(tmp_path, cut):
    """What gali before issue 25 made of a cut line (it closed it with a newline), and a shorter cut at the end."""
    path = tmp_path / "out.jsonl"
    path.write_text(line("a") + cut + "\n" + line("c") + cut[:3])
    results = ResultsFile(path, Rank())
    results.prepare()
    assert [record["path"] for record in results.records()] == ["a", "c"]


@pytest.fixture
def two(tmp_path) -> list[Path]:
    paths = [tmp_path / "docs" / name for name in ("a.txt", "b.txt")]
    paths[0].parent.mkdir()
    for path in paths:
        path.write_text(DOCUMENT)
    return paths


def test_a_full_disk_mid_line_leaves_whole_lines_and_the_run_resumes(run, two, tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    out = tmp_path / "out.jsonl"
    arguments = ["summarize", *map(str, two), "--max-new-tokens", "2", "--out", str(out), "-m", str(tiny_model_dir)]
    real_write, lines = os.write, []

    def full_disk(descriptor: int, data: bytes) -> int:
        if not out.exists() or os.fstat(descriptor).st_ino != out.stat().st_ino:
            return real_write(descriptor, data)
        lines.append(bytes(data))
        if len(lines) == 1:
            return real_write(descriptor, data)
        if len(lines) == 2:  # the disk fills: part of the line is written, then nothing more
            return real_write(descriptor, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    full = run(*arguments)
    monkeypatch.setattr(os, "write", real_write)
    assert full.exit_code == 1 and "No space left on device" in full.stderr, full.stderr
    assert "unexpected" not in full.stderr and len(out.read_text().splitlines()) == 1
    assert out.read_text().endswith("\n")  # whole lines only: the cut one is gone
    resumed = run(*arguments)
    assert resumed.exit_code == 0 and "1 done" in resumed.stderr and "1 already done" in resumed.stderr, resumed
    again = run(*arguments)
    assert again.exit_code == 0 and "2 already done" in again.stderr, again.stderr


@pytest.mark.parametrize("call", ["open", "ftruncate", "pwrite"])
def test_a_full_disk_while_taking_the_lock_is_a_usage_error(call, run, two, tiny_model_dir, tmp_path,
                                                            monkeypatch):
    out = tmp_path / "out.jsonl"
    real = getattr(os, call)

    def full_disk(*args, **kwargs):
        if call != "open" or str(args[0]).endswith(".out.jsonl.lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, full_disk)
    result = run("summarize", *map(str, two), "--max-new-tokens", "2", "--out", str(out), "-m", str(tiny_model_dir))
    assert result.exit_code == 2, result.stderr
    assert result.stderr == f"gali: --out {out}: cannot take its lock (.out.jsonl.lock): No space left on device\n"
    assert not (tmp_path / ".out.jsonl.lock").exists() or call == "open"


def test_a_part_file_that_cannot_be_removed_after_merging_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    ResultsFile(path, Rank(1, 2)).append([json.loads(line("a"))])

    def read_only(self, missing_ok=False):
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(GaliError, match=r"cannot remove .*out\.jsonl\.rank1-of-2\.part after merging it: Read-only"):
        ResultsFile(path, Rank()).merge()
    monkeypatch.undo()
    ResultsFile(path, Rank()).merge()  # later, once it can: the line is not doubled
    assert path.read_text() == line("a") and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("size", ["40G", "99999999999999999999999T"], ids=["tens of GB", "past 64 bits"])
def test_a_huge_max_input_size_is_no_practical_limit(size, run, doc, tiny_model_dir):
    result = run("summarize", str(doc), "--max-new-tokens", "2", "--max-input-size", size, "-m", str(tiny_model_dir))
    assert result.exit_code == 0 and result.stdout and "unexpected" not in result.stderr, result.stderr
    piped = read_document("-", stdin=io.BytesIO(DOCUMENT.encode()), max_bytes=parse_size(size, "--max-input-size"))
    assert piped.text == DOCUMENT


def test_the_input_limit_still_holds_when_read_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "_PIECE", 2**20)
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * (3 * 2**20 + 5))
    with pytest.raises(InputError, match="larger than the input limit of 3M"):
        read_document("-", stdin=io.BytesIO(path.read_bytes()), max_bytes=3 * 2**20)
    assert read_document(str(path), max_bytes=3 * 2**20 + 5).text == "x" * (3 * 2**20 + 5)


KILLED_WRITER = """
import os, signal, sys, types, torch
import gali_cli.doc_cache as doc_cache

def killed(tensors, filename, metadata):  # kill -9 once a MiB of the state is on disk, as safetensors writes it
    with open(os.path.join(os.path.dirname(filename), ".tmpWRITING"), "wb") as file:
        file.write(bytes(2**20))
        file.flush()
    os.kill(os.getpid(), signal.SIGKILL)

doc_cache.save_file = killed
layer = types.SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2))
doc_cache.DocumentCache(doc_cache.Path(sys.argv[1]), 2**30, print).save("k", [1, 2, 3, 4],
                                                                         types.SimpleNamespace(layers=[layer]), {})
"""


def not_gali_s(directory: Path) -> list[Path]:
    """What a user may keep in a cache's folder, named as gali names its temporaries: a folder holding only
    safetensors files, a file named like an earlier release's temporary, and an empty folder just made."""
    directory.mkdir(parents=True, exist_ok=True)
    folder = directory / ".partial-mine"
    folder.mkdir()
    (folder / "weights.safetensors").write_bytes(b"mine")
    (directory / ".partial-notes.safetensors").write_bytes(b"mine")
    (directory / ".partial-empty-but-fresh").mkdir()
    backdate(folder, directory / ".partial-notes.safetensors")
    return [folder, folder / "weights.safetensors", directory / ".partial-notes.safetensors",
            directory / ".partial-empty-but-fresh"]


def test_a_killed_cache_writers_leftover_is_listed_and_cleared_a_live_ones_is_not(run, tmp_path,
                                                                                   running_workspace):
    states = tmp_path / "states"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(states)], timeout=scaled(300),
                            capture_output=True)
    assert killed.returncode == -9, killed.stderr
    leftover, = (path for path in states.iterdir() if path.name.startswith(".partial-"))
    assert {path.name for path in leftover.iterdir()} == {".tmpWRITING", ".gali-writer"}  # not an entry's name
    live = running_workspace(states, "documents", 5000)
    mine = not_gali_s(states)
    backdate(leftover)
    listing = run("cache", "list", "--cache-dir", str(states), "--json")
    assert listing.exit_code == 0, listing.stderr
    listed, = json.loads(listing.stdout)["entries"]
    assert listed["path"] == str(leftover) and 2**20 <= listed["bytes"] < 2**20 + 100
    assert "unfinished" in listed["document"]
    cleared = run("cache", "clear", "--cache-dir", str(states))
    assert cleared.exit_code == 0 and "Removed 1 cached document state (1.0 MiB)" in cleared.stderr, cleared.stderr
    assert ".partial-mine" in cleared.stderr and "which gali did not write" in cleared.stderr
    assert not leftover.exists() and live.exists() and all(path.exists() for path in mine)


def test_the_size_limit_counts_a_live_writers_temporary_and_drops_a_killed_ones(tmp_path, running_workspace):
    layer = types.SimpleNamespace(keys=torch.zeros(1, 1, 64, 8), values=torch.zeros(1, 1, 64, 8))
    state, ids = types.SimpleNamespace(layers=[layer]), list(range(64))
    tensors = 2 * layer.keys.numel() * layer.keys.element_size()
    probe = DocumentCache(tmp_path / "probe", 2**30, print)
    probe.save("probe", ids, state, {})
    entry = probe.path("probe").stat().st_size
    store = DocumentCache(tmp_path / "states", int(1.5 * entry) + tensors, print)
    store.save("old", ids, state, {})
    leftover = killed_workspace(tmp_path / "states", "documents", 10 * entry)
    live = running_workspace(tmp_path / "states", "documents", entry)
    mine = not_gali_s(tmp_path / "states")
    store.save("new", ids, state, {})  # the old entry and the live temporary would pass the limit: the old one goes
    assert not leftover.exists() and live.exists() and all(path.exists() for path in mine)
    assert [found.path for found in store.entries()] == [store.path("new")]


def test_another_caches_workspace_is_not_the_document_caches(tmp_path):
    """Two caches in one folder (GALI_CACHE_DIR and GALI_MODEL_CACHE alike): each deletes only its own leftovers."""
    states = tmp_path / "states"
    models = killed_workspace(states, "models", 100)
    documents = killed_workspace(states, "documents", 100)
    cleared = DocumentCache(states, 2**30, print).clear()
    assert [path for path, _ in cleared.removed] == [documents] and models.exists()


@pytest.mark.parametrize("command", ["clear", "prune"])
def test_a_killed_builds_leftover_is_listed_and_removed_a_live_ones_is_not(command, run, tmp_path,
                                                                                  running_workspace, monkeypatch):
    models = tmp_path / "models"
    monkeypatch.setenv("GALI_MODEL_CACHE", str(models))
    leftover = killed_workspace(models, "models", 2**20)  # what a kill -9 mid-build leaves
    live = running_workspace(models, "models", 0)
    mine = not_gali_s(models)
    listing = run("cache", "list", "--json")
    listed, = json.loads(listing.stdout)["models"]
    assert listed["path"] == str(leftover) and 2**20 <= listed["bytes"] < 2**20 + 100 and not listed["usable"]
    assert "unfinished" in listed["unusable_because"]
    removed = run("cache", command, *(["--models"] if command == "clear" else []))
    assert removed.exit_code == 0 and "Removed 1 model cache entry (1.0 MiB)" in removed.stderr, removed.stderr
    assert not leftover.exists() and live.exists() and all(path.exists() for path in mine)


def lookalike_entries(models: Path) -> None:
    """Folders a user may keep in a model cache's folder that look like gali's entries: one named exactly as gali
    names one, one holding a file named like its manifest (garbage, and a whole format-2 manifest that names
    another folder), one named like a build."""
    named = models / "notes-0123456789abcdef.tokenizer.transformers-5.24.0"
    manifests = {"garbage": "not json", "copied": json.dumps({
        "format": "2", "key": "0" * 64, "dtype": "tokenizer", "transformers": "5.24.0",
        "gguf": {"path": "/elsewhere/notes.gguf", "size": 1, "mtime_ns": 1}, "files": {"config.json": {
            "size": 2, "crc32": 0}}})}
    for folder in (named, models / "manifest-garbage", models / "manifest-copied", models / ".partial-build"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    for kind, text in manifests.items():
        (models / f"manifest-{kind}" / "gali-gguf.json").write_text(text)
    backdate(models / ".partial-build")


@pytest.mark.parametrize("command", ["clear", "prune"])
def test_a_folder_of_models_used_as_the_model_cache_loses_nothing(command, run, tmp_path, monkeypatch):
    """GALI_MODEL_CACHE pointed at a folder of models: clear and prune touch none of them, and say so once."""
    import shutil

    from gali_cli.model.config import demo_model_path

    models = tmp_path / "models"
    shutil.copytree(demo_model_path(), models / "demo")
    lookalike = models / "notes.float32.transformers-5.0.0"  # named almost as gali names entries, no manifest
    lookalike.mkdir()
    (lookalike / "model.safetensors").write_bytes(b"mine")
    (models / "llama.gguf").write_bytes(b"GGUF")
    lookalike_entries(models)
    before = sorted(str(path.relative_to(models)) for path in models.rglob("*"))
    monkeypatch.setenv("GALI_MODEL_CACHE", str(models))
    listing = run("cache", "list", "--json")
    assert listing.exit_code == 0 and json.loads(listing.stdout)["models"] == [], listing.stdout
    removed = run("cache", command, *(["--models"] if command == "clear" else []))
    assert removed.exit_code == 0 and "Removed 0 model cache entries" in removed.stderr, removed.stderr
    assert "which gali did not write" in removed.stderr and "demo" in removed.stderr
    assert sorted(str(path.relative_to(models)) for path in models.rglob("*")) == before


class FullDisk:
    """Standard output redirected to a file on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["streamed", "json"])
def test_a_full_disk_under_standard_output_is_one_line(extra, run, doc, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(sys, "stdout", FullDisk())
    result = run("summarize", str(doc), "--max-new-tokens", "2", "-m", str(tiny_model_dir), *extra)
    assert result.exit_code == 1, result.stderr
    assert result.stderr.splitlines()[-1] == "gali: cannot write to standard output: No space left on device"


def forbid(monkeypatch, secret: Path) -> None:
    """Looking at `secret` is EACCES, as for a path through a folder that gali may not enter."""
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if self == secret:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)


@pytest.mark.parametrize("batch", [False, True], ids=["one document", "a batch"])
def test_a_document_gali_may_not_look_at_is_one_line(batch, run, two, tiny_model_dir, tmp_path, monkeypatch):
    secret = two[0]
    forbid(monkeypatch, secret)
    extra = [str(two[1]), "--out", str(tmp_path / "out.jsonl")] if batch else []
    result = run("summarize", str(secret), *extra, "--max-new-tokens", "2", "-m", str(tiny_model_dir))
    assert result.exit_code == 3, result.stderr
    assert result.stderr == f"gali: {secret}: Permission denied\n"


@pytest.mark.parametrize("flag", ["--out", "--cache-dir"])
def test_an_out_file_or_cache_gali_may_not_look_at_is_a_usage_error(flag, run, two, tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    secret = tmp_path / "secret"
    forbid(monkeypatch, secret)
    extra = ["--out", str(secret)] if flag == "--out" else ["--cache-dir", str(secret)]
    documents = map(str, two) if flag == "--out" else [str(two[0])]
    result = run("summarize", *documents, *extra, "--max-new-tokens", "2", "-m", str(tiny_model_dir))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"gali: {flag} {secret}: ") and "Permission denied" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_a_document_cache_writer_holds_its_temporary_while_it_writes(tmp_path, monkeypatch):
    """What keeps another gali's clear or eviction off a write under way, however long it takes."""
    real_save, judged = doc_cache.save_file, []

    def watched(tensors, filename, metadata):
        real_save(tensors, filename, metadata)
        backdate(Path(filename).parent)
        judged.append(left_behind(Path(filename).parent))

    monkeypatch.setattr(doc_cache, "save_file", watched)
    layer = types.SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2))
    store = DocumentCache(tmp_path / "states", 2**30, print)
    store.save("key", [1, 2, 3, 4], types.SimpleNamespace(layers=[layer]), {})
    assert judged == [False] and [entry.path for entry in store.entries()] == [store.path("key")]


def test_a_build_holds_its_temporary_while_it_builds(tiny_gguf, tmp_path, monkeypatch):
    real_build, judged = companions._read_into, []

    def watched(gguf, directory):
        real_build(gguf, directory)
        backdate(directory)
        judged.append(left_behind(directory))

    monkeypatch.setattr(companions, "_read_into", watched)
    models = GgufCompanions(tmp_path / "models")
    entry = models.directory_for(GgufFile.at(tiny_gguf))
    assert judged == [False] and [found.path for found in models.entries()] == [entry]
