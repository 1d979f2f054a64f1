"""Strings from strangers are shown escaped: no forged log lines, no terminal control, no reversed text."""

import io
import json
import time
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli import display
from gali_cli.doc_cache import DocumentCache
from gali_cli.printable import json_text, printable


@pytest.mark.parametrize("text, shown", [
    ("plain text, ünïcödé, 漢字, emoji 🙂", "plain text, ünïcödé, 漢字, emoji 🙂"),
    ("/v1/x\nGET /forged 200", "/v1/x\\nGET /forged 200"),
    ("\x1b[2Jcleared", "\\x1b[2Jcleared"),
    ("tab\there\r", "tab\\there\\r"),
    ("abc\u202eevil", "abc\\u202eevil"),  # right-to-left override
    ("line\u2028sep", "line\\u2028sep"),
    ("bad \udcff byte", "bad \\udcff byte"),  # a lone surrogate (surrogateescape of a non-UTF-8 name)
    ("\x7f\x9b", "\\x7f\\x9b"),  # DEL and the 8-bit CSI
    ("back\\slash", "back\\slash"),
])
def test_unsafe_characters_are_escaped_and_nothing_else(text, shown):
    assert printable(text) == shown
    assert printable(text).isprintable()


def test_gali_cache_list_escapes_what_a_label_carries(tmp_path):
    """A document state's label is request text when the server stored it: `gali cache list` shows it escaped."""
    store = DocumentCache(tmp_path, 2**30, lambda message: None)
    kv = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2))])
    store.save("0" * 64, [1, 2, 3, 4], kv, {"document": "report\x1b[2J\nforged.txt", "model": "tiny",
                                             "method": "gali", "identity": json.dumps({})})
    result = CliRunner().invoke(cli.app, ["cache", "list", "--cache-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout and "report\\x1b[2J\\nforged.txt" in result.stdout


def test_json_escapes_unsafe_characters_and_loads_back_the_same():
    value = {"name": "a\u009b2Jb\u202ec\udcff\U000e0001\x7f", "plain": "ünïcödé 漢字 🙂\n\"q\""}
    text = json_text(value)
    assert text.isprintable() and "\\u009b" in text and "\\u202e" in text
    assert json.loads(text) == value


def test_gali_cache_list_json_escapes_c1_controls_and_bidi_overrides(tmp_path):
    """--json to a terminal (or anywhere): the 8-bit CSI and a right-to-left override as \\u escapes, valid JSON."""
    store = DocumentCache(tmp_path, 2**30, lambda message: None)
    kv = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 1, 4, 2), values=torch.zeros(1, 1, 4, 2))])
    label = "report\u009b2J\u202etxt.exe"
    store.save("0" * 64, [1, 2, 3, 4], kv, {"document": label, "model": "tiny", "method": "gali",
                                             "identity": json.dumps({})})
    result = CliRunner().invoke(cli.app, ["cache", "list", "--json", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert "\u009b" not in result.stdout and "\u202e" not in result.stdout and "\\u202etxt" in result.stdout
    assert label in json.dumps(json.loads(result.stdout), ensure_ascii=False)


def test_gali_serve_escapes_a_model_path_in_its_one_line_error(capsys):
    """An error names what it could not use: a path, and so what a file's name carries, is shown escaped."""
    assert cli.main(["serve", "-m", "/nonexistent/evil\x1b[2J\nforged", "--port", "0"]) != 0
    error = capsys.readouterr().err
    assert "\x1b" not in error and len(error.splitlines()) == 1 and "evil\\x1b[2J\\nforged" in error


def test_a_documents_name_is_shown_escaped_on_stderr(tiny_model_dir, tmp_path):
    """A file's name reaches the terminal in the reading line ("NAME: N tokens"): a name is not an escape sequence."""
    document = tmp_path / "report\x1b]0;pwned\x07\u202e.txt"
    document.write_text("The roof leaks. " * 20)
    result = CliRunner().invoke(cli.app, ["ask", str(document), "What leaks?", "-m", str(tiny_model_dir),
                                          "--max-new-tokens", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert "report\\x1b]0;pwned\\x07\\u202e.txt" in result.stderr
    assert not any(character in result.stderr for character in "\x1b\x07\u202e")


def test_the_loading_spinner_shows_a_model_path_escaped_and_not_as_markup(monkeypatch):
    shown = io.StringIO()
    monkeypatch.setattr(display, "err", Console(file=shown, force_terminal=True, width=200))
    with display.status("Loading /models/[bold]evil\x1b[2J"):
        time.sleep(0.3)
    assert "/models/[bold]evil\\x1b[2J" in shown.getvalue() and "\x1b[2J" not in shown.getvalue()
