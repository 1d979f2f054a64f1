"""How the `gali` command shows things: stderr messages and progress bars, and perplexity tables, CSV and plots.

stdout only ever gets what `print_json`, `print_facts`, `print_ppl_table`, `print_ppl_csv` and
`print_cache_entries` write.
"""

import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import ConfigError

err = Console(stderr=True, highlight=False, soft_wrap=True)  # never hard-wrap: one error, one line


def say(message: str, style: str | None = None) -> None:
    err.print(message, style=style, markup=False)


def warn(message: str) -> None:
    err.print("[yellow]warning:[/] ", end="")
    err.print(message, markup=False)


def fail(message: str) -> None:
    err.print("[red]gali:[/] ", end="")
    err.print(message, markup=False)


def print_json(document: dict) -> None:
    sys.stdout.write(json.dumps(document, ensure_ascii=False) + "\n")


def print_facts(facts: dict, json_output: bool) -> None:
    """`gali info`'s facts: one JSON object, or aligned lines."""
    if json_output:
        print_json(facts)
        return
    width = max(map(len, facts)) + 2
    for key, value in facts.items():
        if key == "cuda":
            value = "; ".join(f"{gpu['name']} ({gpu['memory_gib']} GiB)" for gpu in value) or "no GPU"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        sys.stdout.write(f"{key:<{width}}{value}\n")


def print_check(check) -> None:
    """One line of `gali info --check` on stdout: the verdict, what was compared, the gap and each path's time."""
    timings = ", ".join(f"{path} {seconds * 1000:.1f} ms" for path, seconds in check.seconds.items())
    verdict = "ok  " if check.ok else "FAIL"
    sys.stdout.write(f"{verdict} {check.name}: max error {check.error:.2g} (tolerance {check.tolerance:.2g})"
                     f"{'; ' + timings if timings else ''}\n")
    sys.stdout.flush()


class Bar:
    """A Rich progress bar on stderr, fed through (done, total) callbacks; silent when stderr is no terminal."""

    def __init__(self, progress: Progress, label: str) -> None:
        self.progress, self.label = progress, label
        self.task = progress.add_task(label, total=None, visible=False)
        self.next_line = 0.0  # without a terminal: a line at most every 1/8 of the way

    def __call__(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total, visible=True)

    def with_figure(self, name: str) -> Callable[[int, int, float], None]:
        """A (done, total, figure) callback that also shows a running figure, e.g. the perplexity so far."""

        def update(done: int, total: int, figure: float) -> None:
            self(done, total)
            self.progress.update(self.task, description=f"{self.label} ({name} {figure:.3f})")
            if not err.is_terminal and (done >= self.next_line * total or done == total):
                say(f"{self.label}: {done}/{total} tokens, {name} {figure:.3f}")
                self.next_line = done / total + 1 / 8

        return update

    def describe(self, label: str) -> None:
        self.progress.update(self.task, description=label)

    def hide(self) -> None:
        self.progress.update(self.task, visible=False)


@contextmanager
def progress_bar(label: str):
    """A `Bar`; stdout is left alone, so that a streamed answer can follow on it."""
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal, redirect_stdout=False,
                  redirect_stderr=False) as progress:
        yield Bar(progress, label)


def ppl_table(rows: list[dict]) -> Table:
    """Methods down, lengths across, the best (lowest) perplexity of each length in bold, as the paper's Table 3
    ("-" where a method has no figure, e.g. no document of a batch reached that length)."""
    lengths = sorted({row["length"] for row in rows})
    methods = list(dict.fromkeys(row["method"] for row in rows))
    value = {(row["method"], row["length"]): row["ppl"] for row in rows}
    best = {length: min(ppl for (_, n), ppl in value.items() if n == length) for length in lengths}
    table = Table("method", *(str(length) for length in lengths))
    for method in methods:
        cells = ["-" if (method, n) not in value else f"[bold]{value[(method, n)]:.3f}[/]"
                 if value[(method, n)] == best[n] else f"{value[(method, n)]:.3f}" for n in lengths]
        table.add_row(method, *cells)
    return table


def print_ppl_table(rows: list[dict]) -> None:
    Console(highlight=False).print(ppl_table(rows))


def print_cache_entries(entries: list, directory, limit: int) -> None:
    """`gali cache list`: a table of cached documents on stdout, the totals on stderr."""
    if entries:
        table = Table(box=box.SIMPLE_HEAD)
        for column in ("document", "model", "method", "tokens", "MiB", "last used"):
            table.add_column(column, justify="right" if column in ("tokens", "MiB") else "left")
        for entry in entries:
            used = datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M")
            table.add_row(escape(entry.document), escape(entry.model), escape(entry.method), str(entry.tokens),
                          f"{entry.size / 2**20:.1f}", used)
        Console(highlight=False).print(table)
    total = sum(entry.size for entry in entries)
    say(f"{len(entries)} cached document state{'s' if len(entries) != 1 else ''}, {total / 2**30:.2f} of "
        f"{limit / 2**30:.2f} GiB, in {directory}", style="dim")


def print_ppl_csv(rows: list[dict]) -> None:
    sys.stdout.write("method,length,ppl\n" + "".join(f"{r['method']},{r['length']},{r['ppl']:.6f}\n" for r in rows))


def check_plotting(path: str) -> None:
    """Fail before any work when --plot cannot be honoured: no matplotlib, a format it cannot write (named by the
    file's suffix), or a folder that is not there or not writable."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError("--plot needs matplotlib: pip install 'gali-cli[plot]'") from error
    formats = set(Figure().canvas.get_supported_filetypes()) - {"pgf"}  # pgf needs a LaTeX installation
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise ConfigError(f"--plot {path}: {'.' + suffix + ' is not' if suffix else 'no suffix names'} an image "
                          f"format matplotlib writes ({', '.join(sorted(formats))})")
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        problem = ("is a directory" if target.is_dir() else f"{folder} is not a directory" if not folder.is_dir()
                   else f"{folder} is not writable")
        raise ConfigError(f"--plot {path}: {problem}")


def plot_ppl(rows: list[dict], path: str, title: str) -> None:
    """Perplexity against length, one line per method, saved as an image at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(row["method"] for row in rows):
        points = sorted((row["length"], row["ppl"]) for row in rows if row["method"] == method)
        axes.plot(*zip(*points), marker="o", label=method)
    axes.set(xscale="log", yscale="log", xlabel="tokens", ylabel="perplexity", title=title)
    axes.legend()
    figure.tight_layout()
    try:
        figure.savefig(path)
    except (OSError, RuntimeError, ValueError) as error:  # e.g. the disk filled up, or Pillow lacks a codec
        raise ConfigError(f"--plot {path}: {getattr(error, 'strerror', None) or error}") from error
    finally:
        plt.close(figure)
