"""How the `gali` command shows things: the answer on stdout, messages and live progress displays on stderr, and
perplexity tables, CSV and plots.

stdout only ever gets what this module's `write` and `print_*` functions write, and they first stop every live
display on stderr (progress bars, the loading spinner): a live display redraws its lines in place, several times a
second, by moving the cursor to their start and erasing them (`\r ESC[2K`), and when stdout is the same terminal
that erases the line the answer is being written on.
"""

import io
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path

from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from .errors import ConfigError, GaliError
from .estimate import duration
from .extras import install_hint
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
    _print(text.translate(_CONTROLS) if _stdout_is_terminal() else text)


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
    _print(json_text(document) + "\n")


def print_number(value: float) -> None:
    """A perplexity alone on stdout."""
    _print(f"{value:.4f}\n")


def _print(text: str) -> None:
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


def _stdout_console() -> Console:
    stop_drawing()
    return Console(highlight=False)


def print_facts(facts: dict, json_output: bool) -> None:
    """`gali info`'s facts: one JSON object, or aligned lines."""
    if json_output:
        print_json(facts)
        return
    width, lines = max(map(len, facts)) + 2, []
    for key, value in facts.items():
        if key == "cuda":
            value = "; ".join(f"{gpu['name']} ({gpu['memory_gib']} GiB)" for gpu in value) or "no GPU"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif key == "attention_routes":  # gali info -v: a route a line
            value = (";\n" + " " * width).join(value.split("; "))
        lines.append(f"{key:<{width}}{value}\n")
    _print("".join(lines))


def print_check(check) -> None:
    """A check of `gali info --check` on stdout: the verdict, what was compared, the gap and each path's time; on one
    line where it fits the width (the terminal's; into a pipe, COLUMNS, else 80), else wrapped at it, the lines after
    the first indented."""
    whole = "\xa0"  # a space the wrapping keeps: "max error 1e-06 (tolerance 0.0001)" and "gali 2.1 ms" stay whole
    timings = ", ".join(f"{path}{whole}{seconds * 1000:.1f}{whole}ms" for path, seconds in check.seconds.items())
    verdict = "ok  " if check.ok else "FAIL"
    gap = f"max error {check.error:.2g} (tolerance {check.tolerance:.2g})".replace(" ", whole)
    text = f"{verdict} {check.name}: {gap}{'; ' + timings if timings else ''}"
    lines = textwrap.wrap(text, max(40, _stdout_console().width), subsequent_indent="     ", break_long_words=False,
                          break_on_hyphens=False)
    _print("".join(line.replace(whole, " ") + "\n" for line in lines))


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
    size = _count(window)
    return f"{method} ({size}{'' if size.endswith('k') else '-token'} window)"


def _labels(rows: list[dict]) -> dict[str, str]:
    """Each method of `rows`, in their order, with its label (method_label, from a row's "window")."""
    labels: dict[str, str] = {}
    for row in rows:
        labels.setdefault(row["method"], method_label(row["method"], row.get("window")))
    return labels


def ppl_table(rows: list[dict]) -> Table:
    """Methods down, lengths across, the best (lowest) perplexity of each length in bold, as the paper's Table 3
    ("-" where a method has no figure, e.g. no document of a batch reached that length)."""
    lengths = sorted({row["length"] for row in rows})
    labels = _labels(rows)
    value = {(row["method"], row["length"]): row["ppl"] for row in rows}
    best = {length: min(ppl for (_, n), ppl in value.items() if n == length) for length in lengths}
    table = Table("method", *(str(length) for length in lengths))
    for method, label in labels.items():
        cells = ["-" if (method, n) not in value else f"[bold]{value[(method, n)]:.3f}[/]"
                 if value[(method, n)] == best[n] else f"{value[(method, n)]:.3f}" for n in lengths]
        table.add_row(escape(label), *cells)
    return table


def print_ppl_table(rows: list[dict]) -> None:
    _stdout_console().print(ppl_table(rows))


def eval_table(rows: list[dict]) -> Table:
    """`gali eval`'s scores: a row per task and length, a column per method, the best of each row in bold (RULER's
    score: mean x100), and the mean over tasks per length when there are several tasks."""
    methods = list(dict.fromkeys(row["method"] for row in rows))
    score = {(row["task"], row["length"], row["method"]): row["score"] for row in rows}
    lines = list(dict.fromkeys((row["task"], row["length"]) for row in rows))
    tasks = list(dict.fromkeys(task for task, _ in lines))
    if len(tasks) > 1:
        for length in dict.fromkeys(length for _, length in lines):
            for method in methods:
                found = [score[task, length, method] for task in tasks if (task, length, method) in score]
                if len(found) == len(tasks):
                    score["mean", length, method] = round(sum(found) / len(found), 2)
            lines.append(("mean", length))
    paper = {(row["task"], row["length"], row["method"]): row["paper"] for row in rows if "paper" in row}
    table = Table("task", "length", *map(escape, _labels(rows).values()),
                  caption="(in brackets: the GALI paper's score for this model)" if paper else None)
    for task, length in lines:
        values = [score.get((task, length, method)) for method in methods]
        best = max((value for value in values if value is not None), default=None)
        cells = ["-" if value is None else f"[bold]{value:.1f}[/]" if value == best else f"{value:.1f}"
                 for value in values]
        cells = [cell + (f" ({paper[task, length, method]:.1f})" if (task, length, method) in paper else "")
                 for cell, method in zip(cells, methods)]
        table.add_row(task, _count(length) if length else "-", *cells)
    return table


def print_eval_table(rows: list[dict]) -> None:
    _stdout_console().print(eval_table(rows))


def print_eval_csv(rows: list[dict]) -> None:
    _print("task,length,method,score,samples,seconds_per_sample\n" + "".join(
        f"{r['task']},{r['length'] or ''},{r['method']},{r['score']:.2f},{r['samples']},{r['seconds_per_sample']}\n"
        for r in rows))


def print_cache_entries(entries: list, directory, limit: int) -> None:
    """`gali cache list`: the cached documents on stdout, the totals on stderr."""
    rows = [(printable(short_path(entry.document)), printable(short_path(entry.model)), printable(entry.method),
             str(entry.tokens),
             f"{entry.size / 2**20:.1f}", datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M"),
             printable(entry.differences(entries))) for entry in entries]
    columns = ("document", "model", "method", "tokens", "MiB", "last used", "differs by")
    if not any(row[-1] for row in rows):  # no two entries of one document, model and method
        rows, columns = [row[:-1] for row in rows], columns[:-1]
    _print_whole(columns, rows, {"tokens", "MiB"},
                 lambda model, method, tokens, size, used, differs="": f"{model}, {method}, {tokens} tokens, {size} "
                                                                       f"MiB, last used {used}"
                                                                       + (f"; differs by {differs}" if differs
                                                                          else ""))
    total = sum(entry.size for entry in entries)
    say(f"{len(entries)} cached document state{'s' if len(entries) != 1 else ''}, {total / 2**30:.2f} of "
        f"{limit / 2**30:.2f} GiB, in {short_path(str(directory))}", style="dim")


def print_model_entries(entries: list, directory) -> None:
    """`gali cache list`, second part: the model cache's entries (on stdout when there are any) and their total on
    stderr, saying which this installation cannot use and how to delete those."""
    if not entries:
        return
    rows = [(printable(short_path(entry.gguf)), entry.dtype, printable(entry.transformers), f"{entry.size / 2**20:.1f}",
             datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M"),
             "yes" if entry.usable else f"no: {entry.reason_unusable}") for entry in entries]
    _print_whole(("read from", "holds", "transformers", "MiB", "last used", "usable here"), rows, {"MiB"},
                 lambda dtype, release, size, used, usable: f"{dtype}, transformers {release}, {size} MiB, "
                                                            f"last used {used}, usable here: {usable}")
    unusable = [entry for entry in entries if not entry.usable]
    total = sum(entry.size for entry in entries)
    say(f"{len(entries)} model cache entr{'ies' if len(entries) != 1 else 'y'}, {total / 2**30:.2f} GiB, in "
        f"{short_path(str(directory))}" + (f"; {len(unusable)} not usable by this installation "
                                           f"({sum(e.size for e in unusable) / 2**30:.2f} GiB): gali cache prune"
                                           if unusable else ""), style="dim")


def _print_whole(columns: tuple[str, ...], rows: list[tuple[str, ...]], right: set[str],
                 paragraph: Callable[..., str]) -> None:
    """Rows on stdout with their first column (a name) never cut: a table where it fits the width (the terminal's;
    into a pipe or a file, COLUMNS, else 80), else one row a paragraph, the name on a line of its own (which the
    terminal wraps; into a pipe, whole) and the rest below it, indented (into a pipe, wrapped at the width). Into a
    pipe no line ends in spaces."""
    if not rows:
        return
    console, table = _stdout_console(), Table(box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*map(escape, row))
    width = console.measure(table, options=console.options.update_width(2**16)).maximum
    if console.is_terminal:
        if width <= console.width:
            console.print(table)
            return
        for name, *rest in rows:
            console.print(name, markup=False, soft_wrap=True)
            console.print(f"  {paragraph(*rest)}", markup=False, soft_wrap=True, style="dim")
        return
    if width <= console.width:
        plain = Console(file=io.StringIO(), width=console.width, highlight=False, color_system=None)
        plain.print(table)
        lines = [line.rstrip() for line in plain.file.getvalue().splitlines()]
        while lines and not lines[0]:  # the box's empty top edge
            lines.pop(0)
    else:
        lines = [line for name, *rest in rows for line in (name, *_wrap_parts(paragraph(*rest), console.width))]
    _print("".join(line.rstrip() + "\n" for line in lines))


def _wrap_parts(text: str, width: int) -> list[str]:
    """`text`, a list of parts joined by ", ", on lines of at most `width` characters where the parts allow (a part
    is never split: "last used 2026-11-28 10:55" stays whole, so one longer than the width stands alone), the first
    indented by two spaces, the rest by four."""
    lines: list[str] = []
    for part in text.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) + 1 <= width:  # + 1: the comma a next part would add
            lines[-1] += ", " + part
        else:
            if lines:
                lines[-1] += ","
            lines.append(("    " if lines else "  ") + part)
    return lines


def _count(tokens: float) -> str:
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


def print_ppl_csv(rows: list[dict]) -> None:
    _print("method,length,ppl\n" + "".join(f"{r['method']},{r['length']},{r['ppl']:.6f}\n" for r in rows))


def check_plotting(path: str) -> None:
    """Fail before any work when --plot cannot be honoured: no matplotlib, a format it cannot write (named by the
    file's suffix), or a folder that is not there or not writable."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(f"--plot needs matplotlib: {install_hint('plot')}") from error
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


# One colour and one marker a line, none repeated among the first 13; past them the dash pattern changes too, so
# that no two lines share colour, marker and dashes. Colours: matplotlib's tab10, then black, navy and goldenrod.
LINE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                "#17becf", "#000000", "#000080", "#b8860b")
LINE_MARKERS = ("o", "s", "D", "^", "v", "P", "*", "X", "h", "p", "<", ">", "d")
LINE_STYLES = ("-", "--", "-.", ":")
PLOT_DPI = 150


def line_style(index: int) -> dict:
    """The colour, marker and dashes of a plot's `index`th line: distinct from every other line's, together."""
    turn = index // len(LINE_COLOURS)
    return {"color": LINE_COLOURS[index % len(LINE_COLOURS)],
            "marker": LINE_MARKERS[(index + turn) % len(LINE_MARKERS)],
            "linestyle": LINE_STYLES[turn % len(LINE_STYLES)]}


def plot_title(subject: str, model: str, train_len: int | None, model_window: int) -> str:
    """A plot's title: what was measured, the model, and the window the methods kept to (--train-len, or the
    model's own)."""
    window = (f"--train-len {_count(train_len)}" if train_len is not None and train_len != model_window
              else f"train_len {_count(model_window)} (the model's)")
    return f"{subject}\n{short_path(model)}, {window}"


def plot_ppl(rows: list[dict], path: str, title: str, window: int) -> None:
    """Perplexity against length, one line per method (each its own colour and marker: line_style), saved as an
    image at `path` at PLOT_DPI: lengths in tokens (2k, 8k), the training `window` marked, the legend beside the axes,
    and the y axis fitted to the data with a small margin. One method's divergence (the original model past its
    window, in the thousands, or an infinite perplexity) must not flatten the others into the floor: points above 4x
    the best at their length are drawn on the top edge as open triangles with their values, and the legend says
    so."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    finite = [row["ppl"] for row in rows if math.isfinite(row["ppl"]) and row["ppl"] > 0] or [1.0]
    best = {}
    for row in rows:
        if math.isfinite(row["ppl"]):
            best[row["length"]] = min(best.get(row["length"], math.inf), row["ppl"])
    high = min(max(finite), max(best.values(), default=max(finite)) * 4)  # a spread of 4x above the best shows
    low = min(finite)
    clipped = any(not row["ppl"] <= high for row in rows)  # above the bound, infinite or not a number
    span = math.log(high / low) if high > low else math.log(1.1)
    margin = max(0.04 * span, math.log(1.02))
    lengths = sorted({row["length"] for row in rows})
    figure, axes = plt.subplots(figsize=(9, 5), dpi=PLOT_DPI)
    for index, (method, label) in enumerate(_labels(rows).items()):
        points = sorted((row["length"], row["ppl"]) for row in rows if row["method"] == method)
        xs, ys = zip(*points)
        style = line_style(index)
        axes.plot(xs, [y if y <= high else high for y in ys], markersize=5, linewidth=1.5, label=label, **style)
        for x, y in points:
            if not y <= high:
                axes.plot([x], [high], marker="^", markersize=9, markerfacecolor="white", color=style["color"])
                value = f"{y:.3g}" if y < 1000 else f"{y:,.0f}" if math.isfinite(y) else str(y)
                axes.annotate(value, (x, high), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                              color=style["color"])
    axes.axvline(window, color="0.4", linestyle=":", linewidth=1.2)
    axes.annotate(f"training window ({_count(window)})", (window, 0), xycoords=("data", "axes fraction"),
                  xytext=(4, 5), textcoords="offset points", fontsize=8, color="0.3")
    if clipped:
        axes.plot([], [], linestyle="none", marker="^", markersize=8, markerfacecolor="white", color="0.3",
                  label="above the scale\n(value shown)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_ylim(low * math.exp(-margin), high * math.exp(margin + (0.12 * span + math.log(1.1) if clipped else 0)))
    axes.set_xlim(min([*lengths, window]) / 1.2, max([*lengths, window]) * 1.2)
    axes.xaxis.set_major_locator(FixedLocator(lengths))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _count(x)))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.3g}"))
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:.3g}") if high / low < 20 else NullFormatter())
    axes.grid(True, which="major", color="0.9", linewidth=0.8)
    axes.set(xlabel="tokens evaluated (log scale)", ylabel="perplexity (log scale)", title=title)
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, frameon=False, fontsize=9)
    figure.tight_layout()
    _save(figure, path)


def _save(figure, path: str) -> None:
    """Write `figure` to `path` at PLOT_DPI, and let it go."""
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=PLOT_DPI)
    except (OSError, RuntimeError, ValueError) as error:  # e.g. the disk filled up, or Pillow lacks a codec
        raise ConfigError(f"--plot {path}: {getattr(error, 'strerror', None) or error}") from error
    finally:
        plt.close(figure)


def plot_eval(rows: list[dict], path: str, title: str, window: int) -> None:
    """Score against length, a panel per task and a line per method, saved as an image at `path`, the training
    `window` marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    figure, panels = plt.subplots(1, len(tasks), figsize=(4 * len(tasks) + 2, 3.5), squeeze=False, dpi=PLOT_DPI)
    for axes, task in zip(panels[0], tasks):
        for index, (method, label) in enumerate(_labels(rows).items()):
            points = sorted((row["length"], row["score"]) for row in rows
                            if row["task"] == task and row["method"] == method and row["length"])
            if points:
                axes.plot(*zip(*points), markersize=4, label=label, **line_style(index))
        axes.axvline(window, color="0.4", linestyle=":", linewidth=1.2)
        axes.set_xscale("log", base=2)
        axes.set(title=task, xlabel="tokens (log scale)", ylabel="score", ylim=(-3, 103))
    panels[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False, fontsize=9)
    figure.suptitle(title)
    figure.tight_layout()
    _save(figure, path)
