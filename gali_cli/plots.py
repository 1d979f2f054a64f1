"""Plots of `--plot`: perplexity and eval scores against length, a line per method, saved as an image with
matplotlib (imported only when a plot is drawn)."""

import os
from pathlib import Path

from .display import method_labels, short_count, short_path
from .errors import ConfigError
from .extras import install_hint

# One colour and one marker a line, none repeated among the first 14; past them the dash pattern changes too, so
# that no two lines share colour, marker and dashes. Colours: matplotlib's tab10, then black, navy, goldenrod and
# dark green.
LINE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                "#17becf", "#000000", "#000080", "#b8860b", "#006400")
LINE_MARKERS = ("o", "s", "D", "^", "v", "P", "*", "X", "h", "p", "<", ">", "d", "8")
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
    window = (f"--train-len {short_count(train_len)}" if train_len is not None and train_len != model_window
              else f"train_len {short_count(model_window)} (the model's)")
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
    for index, (method, label) in enumerate(method_labels(rows).items()):
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
    axes.annotate(f"training window ({short_count(window)})", (window, 0), xycoords=("data", "axes fraction"),
                  xytext=(4, 5), textcoords="offset points", fontsize=8, color="0.3")
    if clipped:
        axes.plot([], [], linestyle="none", marker="^", markersize=8, markerfacecolor="white", color="0.3",
                  label="above the scale\n(value shown)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_ylim(low * math.exp(-margin), high * math.exp(margin + (0.12 * span + math.log(1.1) if clipped else 0)))
    axes.set_xlim(min([*lengths, window]) / 1.2, max([*lengths, window]) * 1.2)
    axes.xaxis.set_major_locator(FixedLocator(lengths))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_count(x)))
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
        for index, (method, label) in enumerate(method_labels(rows).items()):
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
