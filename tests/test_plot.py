"""gali ppl --plot: the picture a researcher would put in a paper (read back from the figure matplotlib drew)."""

import pytest

from gali_cli import display

pytest.importorskip("matplotlib")


def drawn(monkeypatch, rows: list[dict], window: int):
    """The figure plot_ppl saved, kept open for inspection."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, path: figures.append(figure))
    display.plot_ppl(rows, "unused.png", "title", window)
    figure, = figures
    figure.canvas.draw()
    return figure.axes[0]


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
    assert [display._count(n) for n in (512, 1024, 2048, 3000, 32768, 12345)] == [
        "512", "1k", "2k", "3,000", "32k", "12,345"]
