"""How the `gali` command shows things: messages and live progress displays on stderr, the answer on stdout, and
the names tables and plots give to paths, methods and token counts (tables.py and plots.py draw them).

stdout only ever gets what `write` and `print_text` write (tables.py's `print_*` functions go through it), and they
first stop every live display on stderr (progress bars, the loading spinner): a live display redraws its lines in
place, several times a second, by moving the cursor to their start and erasing them (`\r ESC[2K`), and when stdout is
the same terminal that erases the line the answer is being written on.
"""

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.spinner import Spinner
from rich.text import Text

from .errors import GaliError
from .estimate import duration
from .printable import json_text, printable

err = Console(stderr=True, highlight=False, soft_wrap=True)  # never hard-wrap: one error, one line
_drawing: list[Live] = []  # the live displays now drawing on stderr, newest last
# What a terminal would obey rather than show: C0 controls but tab and newline, DEL, C1 controls. A model's answer
# shows them as the Unicode pictures of control characters (or U+FFFD) instead of clearing the screen or
# rewriting a line.
_CONTROLS = {code: (0x2400 + code if code < 32 else 0x2421 if code == 127 else 0xFFFD)
             for code in [*range(32), *range(127, 160)] if chr(code) not in "\t\n"}


def say(message: str, style: str | None = None) -> None:
    """A line on stderr. Messages quote file names, model paths and request text, so each is shown printable():
    a name cannot drive the terminal or forge a line."""
    err.print(printable(message), style=style, markup=False)


def warn(message: str) -> None:
    err.print("[yellow]warning:[/] ", end="")
    err.print(printable(message), markup=False)


def fail(message: str) -> None:
    stop_drawing()  # the error line must not be redrawn over
    err.print("[red]gali:[/] ", end="")
    err.print(printable(message), markup=False)


@contextmanager


def _live(display: Live) -> Iterator[None]:
    """Keep `display` in the list `stop_drawing` stops, while it may draw."""
    _drawing.append(display)
    try:
        yield
    finally:
        _drawing.remove(display)


def stop_drawing() -> None:
    """Stop every live display on stderr (its last frame is erased), so that nothing redraws the terminal while
    stdout is written. A stopped display stays stopped: its bar may go on counting, unseen."""
    for display in reversed(_drawing):
        display.stop()


def write(text: str) -> None:
    """A piece of a streamed answer on stdout, at once. On a terminal, control characters (escape sequences, a
    carriage return) are shown as symbols instead of being obeyed: a model must not be able to rewrite the screen."""
    print_text(text.translate(_CONTROLS) if _stdout_is_terminal() else text)


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def read_line(prompt: str) -> str:
    """A line typed at the terminal after `prompt`, with line editing and history where the readline module exists;
    EOFError at Ctrl-D. When stdout is the terminal, input() hands the prompt to readline, which redraws it as the
    line is edited (a prompt printed apart is erased by Ctrl-U or a recalled line); otherwise the prompt goes to
    stderr, never into what stdout collects."""
    try:
        import readline  # noqa: F401 - importing it gives input() line editing and history
    except ImportError:
        pass
    stop_drawing()
    if _stdout_is_terminal():
        return input(prompt)
    err.print(prompt, end="", markup=False)
    return input()


@contextmanager


def status(message: str) -> Iterator[None]:
    """A spinner with `message` on stderr while the block runs (on a terminal)."""
    spinning = Spinner("dots", Text(printable(message)))  # Text: a model path's "[...]" is not Rich markup
    with Live(spinning, console=err, transient=True, refresh_per_second=12.5) as spinner, _live(spinner):
        yield


def print_json(document: dict) -> None:
    print_text(json_text(document) + "\n")


def print_number(value: float) -> None:
    """A perplexity alone on stdout."""
    print_text(f"{value:.4f}\n")


def print_text(text: str) -> None:
    """`text` on stdout, at once, live displays stopped first; a write that fails (a full disk) is a GaliError."""
    stop_drawing()
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # the reader went away: the command line stops quietly
    except OSError as error:  # redirected to a full disk, or to a file system gone read-only
        with suppress(AttributeError, OSError, ValueError):  # what stays in the buffer goes nowhere at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise GaliError(f"cannot write to standard output: {error.strerror or error}") from None


def stdout_console() -> Console:
    """A console on stdout, live displays stopped first."""
    stop_drawing()
    return Console(highlight=False)


class Bar:
    """A Rich progress bar on stderr, fed through (done, total) callbacks; silent when stderr is no terminal."""

    def __init__(self, progress: Progress, label: str) -> None:
        self.progress, self.label = progress, label
        self.task = progress.add_task(label, total=None, visible=False)
        self.next_line = 0.0  # without a terminal: a line at most every 1/8 of the way

    def __call__(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total, visible=True)

    def with_figure(self, name: str, left: Callable[[int, int], float | None] | None = None
                    ) -> Callable[[int, int, float], None]:
        """A (done, total, figure) callback that also shows a running figure, e.g. the perplexity so far, and, with
        `left`, the seconds the whole job still needs (from this bar's done and total; None: not known yet)."""

        def update(done: int, total: int, figure: float) -> None:
            self(done, total)
            seconds = left(done, total) if left else None
            remaining = f"; {time_left(seconds)}" if seconds is not None else ""
            self.progress.update(self.task, description=f"{self.label} ({name} {figure:.3f}{remaining})")
            if not err.is_terminal and (done >= self.next_line * total or done == total):
                say(f"{self.label}: {done}/{total} tokens, {name} {figure:.3f}{remaining}")
                self.next_line = done / total + 1 / 8

        return update

    def describe(self, label: str) -> None:
        self.progress.update(self.task, description=label)

    def stop(self) -> None:
        """Take the bar off the screen now (the work it follows is done); later calls count unseen."""
        self.progress.stop()


def elapsed(seconds: float) -> str:
    """Time a part of a job took: 4.2 s, or in minutes and more past a minute and a half."""
    return f"{seconds:.1f} s" if seconds < 90 else duration(seconds)


def time_left(seconds: float) -> str:
    """An estimate of the time a job still needs, in words: "about 3.5 minutes left"."""
    return f"about {duration(seconds)} left" if seconds >= 1 else "almost done"


@contextmanager


def progress_bar(label: str) -> Iterator[Bar]:
    """A `Bar` on stderr while the block runs. What the block prints through `err` goes above it; writing to stdout
    (`write`, `print_*`) stops it first."""
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal, redirect_stdout=False,
                  redirect_stderr=False) as progress, _live(progress.live):
        yield Bar(progress, label)


def method_label(method: str, window: int | None = None) -> str:
    """A method as tables and plots name it: with its own `window` where it reads past --train-len, e.g. "original
    (8k window)" (the original model is never narrowed by --train-len)."""
    if not window:
        return method
    size = short_count(window)
    return f"{method} ({size}{'' if size.endswith('k') else '-token'} window)"


def method_labels(rows: list[dict]) -> dict[str, str]:
    """Each method of `rows`, in their order, with its label (method_label, from a row's "window")."""
    labels: dict[str, str] = {}
    for row in rows:
        labels.setdefault(row["method"], method_label(row["method"], row.get("window")))
    return labels


def short_count(tokens: float) -> str:
    """A token count as people write it on an axis: 512, 2k and 32k for multiples of 1024, else 3,000."""
    tokens = round(tokens)
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def short_path(name: str) -> str:
    """An absolute path as one would type it here: relative to the working directory, or from ~, when that is
    shorter; anything else (a hub id, "<stdin>") as it is."""
    if not os.path.isabs(name):
        return name
    shorter = [name]
    try:
        shorter.append(os.path.relpath(name))
    except ValueError:  # another drive (Windows)
        pass
    home = os.path.expanduser("~")
    if home not in ("", "~", os.sep) and name.startswith(home + os.sep):
        shorter.append("~" + name[len(home):])
    return min(shorter, key=len)
