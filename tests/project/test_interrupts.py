"""tests/helpers/interrupts.py: one SIGINT stops a test run that was started with SIGINT ignored, as a script's
background job is."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import ROOT
from helpers.timing import scaled

SLEEPING = """import pathlib
import time


def test_sleeps():
    pathlib.Path("started").touch()
    time.sleep(600)
"""


def run_interrupted(folder: Path, conftest: str) -> subprocess.Popen:
    """pytest on a test that sleeps, started with SIGINT ignored, sent one SIGINT once the test runs."""
    (folder / "conftest.py").write_text(conftest)
    (folder / "test_sleeps.py").write_text(SLEEPING)
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sleeps.py"],
                               cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + scaled(60)
    while not (folder / "started").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    return process


def test_one_sigint_stops_a_run_started_with_sigint_ignored(tmp_path):
    process = run_interrupted(tmp_path, "from helpers.interrupts import pytest_configure  # noqa: F401\n")
    try:
        output, _ = process.communicate(timeout=scaled(20))
    finally:
        process.kill()
    assert process.returncode == 2 and "KeyboardInterrupt" in output, output
