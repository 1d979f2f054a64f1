"""The `gali` command run in-process, as a user meets it, and a short document to run it on. `run` and `doc` are
fixtures: a test module takes them in as `run, doc = commands.run, commands.doc`."""

from dataclasses import dataclass
from pathlib import Path

import pytest

import gali_cli.cli as cli

DOCUMENT = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof.\n" * 12


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys, monkeypatch):
    """Run the `gali` executable's main in-process (usage errors too are one line there, as for a user)."""
    monkeypatch.setenv("COLUMNS", "200")

    def gali(*args: str) -> Result:
        code = cli.main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return gali


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "lease.txt"
    path.write_text(DOCUMENT)
    return path
