"""Running `gali` the way a person does: in a pseudo-terminal, its output drawn by a terminal emulator (pyte).

A pipe hides what a terminal shows: a progress display that redraws its line with `\\r ESC[2K` erases whatever else
was written there, and only a terminal emulator replays that. `Terminal` gives a process a pty (its controlling
terminal, so that typing Ctrl-C interrupts it as it would a person's) and keeps the screen it would show.
"""

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pyte

from helpers.timing import scaled


def _as_at_a_terminal() -> None:
    """In the child before it runs gali: the pty becomes its controlling terminal, and Ctrl-C interrupts as it does
    for a command typed at a shell (a shell without job control starts background jobs with SIGINT ignored, and
    Python then leaves it ignored: tests started that way would see no KeyboardInterrupt)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A pty of `columns` x `lines` and the screen it shows. Use it as a context manager; `run` starts one process
    with its stdin, stdout and stderr on the pty unless told otherwise."""

    def __init__(self, columns: int = 120, lines: int = 40) -> None:
        self.screen = pyte.Screen(columns, lines)
        self.stream = pyte.ByteStream(self.screen)
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.process: subprocess.Popen | None = None
        self.raw = b""  # every byte the process wrote, for failure messages

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for descriptor in (self.master, self.slave):
            try:
                os.close(descriptor)
            except OSError:
                pass

    def run(self, *args: str, stdout=None, stderr=None, env: dict | None = None) -> subprocess.Popen:
        """Start `python -m gali_cli ARGS` on this terminal; `stdout`/`stderr` may send a stream elsewhere (a file,
        or another Terminal's slave)."""
        environment = {key: value for key, value in os.environ.items()
                       if key not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
        environment.update({"TERM": "xterm-256color", "PYTHONUNBUFFERED": "0", **(env or {})})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gali_cli", *args], stdin=self.slave, stdout=stdout or self.slave,
            stderr=stderr or self.slave, env=environment, start_new_session=True, close_fds=True,
            preexec_fn=_as_at_a_terminal)
        return self.process

    def type(self, keys: str) -> None:
        """Keys typed at the terminal (\\x03 is Ctrl-C, \\x04 Ctrl-D, \\r Enter)."""
        os.write(self.master, keys.encode())

    def read(self, timeout: float = 0.05) -> bool:
        """Draw what the process wrote within `timeout` seconds; False once nothing more can come."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the other side is closed
            return False
        self.raw += data
        self.stream.feed(data)
        return bool(data)

    def wait_for(self, condition: Callable[["Terminal"], bool], *others: "Terminal", timeout: float = 240.0) -> None:
        """Read until `condition(self)` holds (drawing on `others` too: terminals its stderr goes to, which must be
        read or the process blocks once their buffer is full); AssertionError with the screen when it does not in
        time (`timeout`, written for a quiet machine, scaled to this one's load)."""
        deadline = time.monotonic() + scaled(timeout)
        while not condition(self):
            for other in others:
                other.read(0)
            screens = "\n".join([self.text(), *(other.text() for other in others)])
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; the screens show:\n{screens}")
            exited = self.process is not None and self.process.poll() is not None
            if (not self.read() or (exited and not self.read(0.5))) and not condition(self):
                raise AssertionError(f"gali exited or the terminal closed; the screens show:\n{screens}")

    def shows(self, text: str) -> bool:
        return squeeze(text) in squeeze(self.text())

    def finish(self, *others: "Terminal", timeout: float = 240.0) -> int:
        """Read until the process exits and its output is drawn (on `others` too: terminals its stderr went to);
        its exit code."""
        deadline = time.monotonic() + scaled(timeout)
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"gali did not finish; the screen shows:\n{self.text()}")
            for terminal in (self, *others):
                terminal.read(0.02)
        for terminal in (self, *others):
            while terminal.read(0.2) and select.select([terminal.master], [], [], 0)[0]:
                pass
        return self.process.returncode

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def text(self) -> str:
        return "\n".join(self.lines()).rstrip()

    def row_after(self, start: str, end: str) -> int | None:
        """The row below the one where the text from `start` (its first appearance) to the next `end` ends, however
        many rows the terminal wrapped it onto (a long path in a header wraps); None while it is not on the screen."""
        rows = self.screen.display
        flat = "".join(rows)  # each row is exactly the screen's width: a wrapped line reads on across rows
        found = flat.find(start)
        if found < 0 or (stop := flat.find(end, found + len(start))) < 0:
            return None
        return (stop + len(end) - 1) // self.screen.columns + 1


def squeeze(text: str) -> str:
    """`text` without whitespace: a terminal wraps long lines and leaves no trace of trailing spaces, so an answer
    is compared with the screen letter by letter."""
    return "".join(text.split())


def gali_json(*args: str, cwd: Path | None = None) -> dict:
    """`gali ARGS --json` in a plain subprocess: what the answer is, to find on the screen."""
    import json

    result = subprocess.run([sys.executable, "-m", "gali_cli", *args, "--json"], capture_output=True, text=True,
                            timeout=scaled(600), cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
