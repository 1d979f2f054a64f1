"""tests/helpers/terminal.py: where a header line ends on the screen, however the terminal wrapped it."""

import pytest

pytest.importorskip("pyte")
from helpers.terminal import Terminal  # after the skip: the helper imports pyte

COLUMNS = 120


# one row; exactly one row (COLUMNS characters); "-token window" cut by the row's edge; wrapped past it
@pytest.mark.parametrize("path_length", [10, 62, 76, 95])
def test_the_row_after_a_header_is_found_whatever_it_wraps_to(path_length):
    header = f"/{'p' * path_length}.txt: 223 tokens, 7.0x the model's 32-token window (gali)"
    with Terminal(columns=COLUMNS, lines=10) as terminal:
        terminal.stream.feed(f"{header}\r\nThe answer.\r\n".encode())
        row = terminal.row_after("-token window", ")")
        assert terminal.lines()[row] == "The answer."
        assert row == -(-len(header) // COLUMNS)
        assert terminal.row_after("not on the screen", ")") is None
