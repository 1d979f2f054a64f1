"""gali ppl --plot: the picture a researcher would put in a paper (read back from the figure matplotlib drew)."""

import pytest

from gali_cli import display, plots
from gali_cli.methods.registry import NAMES

pytest.importorskip("matplotlib")


def drawn(monkeypatch, rows: list[dict], window: int, saved: dict | None = None):
    """The figure plot_ppl saved, kept open for inspection (`saved`: gets savefig's keywords)."""
    from matplotlib.figure import Figure

    figures = []

    def save(figure, path, **keywords):
        figures.append(figure)
        (saved if saved is not None else {}).update(keywords)

    monkeypatch.setattr(Figure, "savefig", save)
    plots.plot_ppl(rows, "unused.png", "title", window)
    figure, = figures
    figure.canvas.draw()
    return figure.axes[0]


def _method_lines(axes) -> list:
    """The lines that carry a method's points (not the window's mark or the clipped points' triangles)."""
    methods = {text.get_text() for text in axes.get_legend().get_texts()}
    return [line for line in axes.lines if line.get_label() in methods]


def test_every_method_has_its_own_colour_and_marker_and_the_axis_fits_the_data(monkeypatch):
    """gali ppl --method all: a line per registered method (twelve when this was written), none merging into another
    by look; the y axis runs just past the data (6.25 to 19 with twelve: not to 28), at 150 dpi or more."""
    from matplotlib.colors import to_hex

    methods = [f"method{index}" for index in range(len(NAMES))]
    rows = [{"method": method, "length": length, "ppl": 6.0 + index + length / 4096}
            for index, method in enumerate(methods) for length in (1024, 2048, 4096, 8192)]
    saved = {}
    axes = drawn(monkeypatch, rows, window=2048, saved=saved)
    lines = _method_lines(axes)
    assert [line.get_label() for line in lines] == methods
    assert len({to_hex(line.get_color()) for line in lines}) == len(NAMES)
    assert len({line.get_marker() for line in lines}) == len(NAMES)
    low, high = axes.get_ylim()
    lowest, highest = min(row["ppl"] for row in rows), max(row["ppl"] for row in rows)  # 6.25 and 19 with twelve
    assert lowest / 1.1 < low < lowest and highest < high < highest * 1.1
    assert axes.figure.dpi >= 150 and saved.get("dpi", axes.figure.dpi) >= 150
    assert not any(text.get_text() == "above the scale\n(value shown)" for text in axes.get_legend().get_texts())


def test_more_lines_than_colours_never_repeat_colour_marker_and_dashes_together():
    styles = [plots.line_style(index) for index in range(60)]
    assert len({(s["color"], s["marker"], s["linestyle"]) for s in styles}) == 60
    assert len({(s["color"], s["marker"]) for s in styles}) == 60


def test_infinite_and_huge_perplexities_are_clipped_and_said(monkeypatch):
    rows = [{"method": "gali", "length": length, "ppl": 10.0 + length / 1024} for length in (1024, 2048, 4096)]
    rows += [{"method": "original", "length": 1024, "ppl": 11.0}, {"method": "original", "length": 2048, "ppl": 1e9},
             {"method": "original", "length": 4096, "ppl": float("inf")}]
    axes = drawn(monkeypatch, rows, window=1024)
    low, high = axes.get_ylim()
    assert 9.0 < low < 11.0 and high < 14.0 * 4 * 1.5
    assert {"1,000,000,000", "inf"} <= {text.get_text() for text in axes.texts}
    assert "above the scale\n(value shown)" in [text.get_text() for text in axes.get_legend().get_texts()]


def test_the_title_names_the_model_and_the_window():
    assert plots.plot_title("Perplexity of book.txt", "demo", 1024, 8192) == (
        "Perplexity of book.txt\ndemo, --train-len 1k")
    assert plots.plot_title("Perplexity of book.txt", "demo", None, 8192).endswith("train_len 8k (the model's)")


def test_axes_in_tokens_window_marked_legend_outside(monkeypatch):
    rows = [{"method": method, "length": length, "ppl": 18.0 - length / 4096 + index}
            for index, method in enumerate(("gali", "self-extend")) for length in (512, 1024, 2048, 4096)]
    axes = drawn(monkeypatch, rows, window=1024)
    assert [label.get_text() for label in axes.get_xticklabels()] == ["512", "1k", "2k", "4k"]
    assert all("×" not in label.get_text() and "^" not in label.get_text() for label in axes.get_yticklabels())
    assert "training window (1k)" in [text.get_text() for text in axes.texts]
    assert any(line.get_xdata()[0] == 1024 and line.get_linestyle() == ":" for line in axes.lines)
    legend = axes.get_legend()
    assert legend.get_bbox_to_anchor().x0 > axes.get_window_extent().x1  # beside the axes, never over the points


def test_a_divergent_method_does_not_flatten_the_others(monkeypatch):
    """The original model past its window (thousands) is drawn on the top edge with its value; the others keep the
    height of the plot."""
    rows = [{"method": "gali", "length": length, "ppl": 18.0} for length in (1024, 2048, 4096)]
    rows += [{"method": "original", "length": length, "ppl": ppl} for length, ppl in ((1024, 17.0), (2048, 400.0),
                                                                                      (4096, 6144.0))]
    axes = drawn(monkeypatch, rows, window=1024)
    low, high = axes.get_ylim()
    assert high < 18.0 * 4 * 1.5 and low > 10
    assert {"400", "6,144"} <= {text.get_text() for text in axes.texts}
    assert "above the scale\n(value shown)" in [text.get_text() for text in axes.get_legend().get_texts()]


def test_counts_as_people_write_them():
    assert [display.short_count(n) for n in (512, 1024, 2048, 3000, 32768, 12345)] == [
        "512", "1k", "2k", "3,000", "32k", "12,345"]
