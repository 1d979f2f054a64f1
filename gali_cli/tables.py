"""What the commands print on stdout as tables and aligned lines: perplexities and eval scores (as tables or CSV),
the caches' entries, and `gali info`'s facts and checks. Everything goes through display.print_text or
display.stdout_console, which stop the live displays on stderr first.
"""

import io
import textwrap
from collections.abc import Callable
from datetime import datetime

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .display import method_labels, print_json, print_text, say, short_count, short_path, stdout_console
from .printable import printable


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
    print_text("".join(lines))


def print_check(check) -> None:
    """A check of `gali info --check` on stdout: the verdict, what was compared, the gap and each path's time; on one
    line where it fits the width (the terminal's; into a pipe, COLUMNS, else 80), else wrapped at it, the lines after
    the first indented."""
    whole = "\xa0"  # a space the wrapping keeps: "max error 1e-06 (tolerance 0.0001)" and "gali 2.1 ms" stay whole
    timings = ", ".join(f"{path}{whole}{seconds * 1000:.1f}{whole}ms" for path, seconds in check.seconds.items())
    verdict = "ok  " if check.ok else "FAIL"
    gap = f"max error {check.error:.2g} (tolerance {check.tolerance:.2g})".replace(" ", whole)
    text = f"{verdict} {check.name}: {gap}{'; ' + timings if timings else ''}"
    lines = textwrap.wrap(text, max(40, stdout_console().width), subsequent_indent="     ", break_long_words=False,
                          break_on_hyphens=False)
    print_text("".join(line.replace(whole, " ") + "\n" for line in lines))


def ppl_table(rows: list[dict]) -> Table:
    """Methods down, lengths across, the best (lowest) perplexity of each length in bold, as the paper's Table 3
    ("-" where a method has no figure, e.g. no document of a batch reached that length)."""
    lengths = sorted({row["length"] for row in rows})
    labels = method_labels(rows)
    value = {(row["method"], row["length"]): row["ppl"] for row in rows}
    best = {length: min(ppl for (_, n), ppl in value.items() if n == length) for length in lengths}
    table = Table("method", *(str(length) for length in lengths))
    for method, label in labels.items():
        cells = ["-" if (method, n) not in value else f"[bold]{value[(method, n)]:.3f}[/]"
                 if value[(method, n)] == best[n] else f"{value[(method, n)]:.3f}" for n in lengths]
        table.add_row(escape(label), *cells)
    return table


def print_ppl_table(rows: list[dict]) -> None:
    stdout_console().print(ppl_table(rows))


def print_ppl_csv(rows: list[dict]) -> None:
    print_text("method,length,ppl\n" + "".join(f"{r['method']},{r['length']},{r['ppl']:.6f}\n" for r in rows))


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
    table = Table("task", "length", *map(escape, method_labels(rows).values()),
                  caption="(in brackets: the GALI paper's score for this model)" if paper else None)
    for task, length in lines:
        values = [score.get((task, length, method)) for method in methods]
        best = max((value for value in values if value is not None), default=None)
        cells = ["-" if value is None else f"[bold]{value:.1f}[/]" if value == best else f"{value:.1f}"
                 for value in values]
        cells = [cell + (f" ({paper[task, length, method]:.1f})" if (task, length, method) in paper else "")
                 for cell, method in zip(cells, methods)]
        table.add_row(task, short_count(length) if length else "-", *cells)
    return table


def print_eval_table(rows: list[dict]) -> None:
    stdout_console().print(eval_table(rows))


def print_eval_csv(rows: list[dict]) -> None:
    print_text("task,length,method,score,samples,seconds_per_sample\n" + "".join(
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
    console, table = stdout_console(), Table(box=box.SIMPLE_HEAD)
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
    print_text("".join(line.rstrip() + "\n" for line in lines))


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
