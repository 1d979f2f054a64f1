"""What a person sees: gali in a pseudo-terminal, its screen drawn by a terminal emulator (tests/helpers/terminal.py).

A streamed answer must stay on the screen: no progress bar or spinner may redraw the terminal while stdout is
written, whether stdout and stderr are one terminal or not. The answer to find on the screen is the one the same
command writes into a file.
"""

import sysconfig
from pathlib import Path

import pytest
from helpers.terminal import Terminal, squeeze
from helpers.timing import scaled

pytest.importorskip("pyte")
QUESTION = "What does this module do?"


@pytest.fixture(scope="module")
def code(tmp_path_factory) -> Path:
    """About 500 tokens of Python (two windows of the demo model), from the standard library."""
    path = tmp_path_factory.mktemp("terminal") / "textwrap_head.py"
    path.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:1500])
    return path


def demo(*args: str) -> list[str]:
    return [*args, "-m", "demo", "--max-new-tokens", "40", "--no-cache"]


def answer_in_a_file(tmp_path: Path, args: list[str]) -> str:
    """The answer `args` write on stdout when it is a file (stderr on a terminal, as when a person redirects)."""
    out = tmp_path / "answer.txt"
    with Terminal() as terminal, open(out, "wb") as file:
        terminal.run(*args, stdout=file)
        assert terminal.finish() == 0, terminal.text()
        assert squeeze(out.read_text()) not in squeeze(terminal.text())  # stderr had the header, not the answer
    text = out.read_text()
    assert text.strip()
    return text


def test_summarize_leaves_the_whole_answer_on_the_screen(code, tmp_path):
    args = demo("summarize", str(code))
    expected = answer_in_a_file(tmp_path, args)
    with Terminal() as terminal:
        terminal.run(*args, "-v")
        assert terminal.finish() == 0
        lines = terminal.lines()
    screen = "\n".join(lines)
    assert squeeze(expected) in squeeze(screen), f"the answer\n{expected}\nis not on the screen:\n{screen}"
    below_header = terminal.row_after("x the model's 256-token window", ")")
    stats = next(i for i, line in enumerate(lines) if line.startswith("prompt "))
    assert below_header <= stats and squeeze(expected) in squeeze("".join(lines[below_header:stats]))
    assert "Reading" not in screen and "━" not in screen  # the bar is gone, not left over the answer


UNENDING = ("--temperature", "1", "--top-k", "10", "--seed", "0")  # the tiny model's answer runs on (below)


@pytest.mark.slow  # in process: test_cli.py's Ctrl-C tests; as a process: test_ctrl_c_while_streaming
def test_ctrl_c_keeps_what_was_written(tiny_model_dir, tmp_path):
    document = tmp_path / "lease.txt"
    document.write_text("The lease ends in March. The tenant pays rent monthly.\n" * 8)
    with Terminal(lines=200) as terminal:  # tall: what comes after Ctrl-C is typed must not scroll the start away
        # sampled from the 10 likeliest tokens: a greedy answer of the tiny model falls into a loop that stops by
        # itself, and one sampled from all of them draws its end token within a few hundred (half a second): either
        # can end before Ctrl-C comes; this one runs on (3,000 tokens, no end token, no loop, seeds 0 and 1)
        terminal.run("summarize", str(document), "-m", str(tiny_model_dir), "--max-new-tokens", "100000",
                     *UNENDING)
        terminal.wait_for(lambda t: "Reading" not in t.text() and len(answer_text(t)) > 20)  # the answer is coming
        seen = answer_text(terminal)
        terminal.type("\x03")
        assert terminal.finish() == 130, terminal.text()
        assert squeeze(seen) in squeeze(answer_text(terminal))
        assert terminal.text().splitlines()[-1] == "interrupted"


def answer_text(terminal: Terminal) -> str:
    """The screen below the header line (the document's name and length, "...-token window (gali)"): where the
    answer goes."""
    below_header = terminal.row_after("-token window", ")")
    return "" if below_header is None else "\n".join(terminal.lines()[below_header:]).strip()


@pytest.mark.slow  # chat's answers in turn: test_cli.py's test_chat_answers_each_question_in_turn
def test_chat_shows_each_answer_and_keeps_the_prompt(code, tmp_path):
    args = demo("chat", str(code))
    expected = gali_answers(tmp_path, args, [QUESTION, "And then?"])
    with Terminal() as terminal:
        terminal.run(*args)
        terminal.wait_for(lambda t: t.lines()[t.screen.cursor.y].startswith(">"))
        terminal.type(QUESTION + "\r")
        terminal.wait_for(lambda t: prompts(t) == 2)
        terminal.type("a line to forget\x15")  # Ctrl-U clears the line; the prompt stays
        terminal.wait_for(lambda t: t.lines()[t.screen.cursor.y].rstrip() == ">")
        terminal.type("And then?\r")
        terminal.wait_for(lambda t: prompts(t) == 3)
        terminal.type("\x04")
        assert terminal.finish() == 0
        screen = terminal.text()
    first, second = screen.split(f"> {QUESTION}")[1].split("> And then?")
    assert squeeze(expected[0]) in squeeze(first) and squeeze(expected[1]) in squeeze(second)


def prompts(terminal: Terminal) -> int:
    return sum(line.startswith(">") for line in terminal.lines())


def gali_answers(tmp_path: Path, args: list[str], questions: list[str]) -> list[str]:
    """What `gali chat` answers to `questions` piped in (one a line), answer by answer."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "gali_cli", *args, "--json"], input="\n".join(questions) + "\n",
                            capture_output=True, text=True, timeout=scaled(600), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return [json.loads(line)["answer"] for line in result.stdout.splitlines()]


@pytest.mark.slow  # in process: test_cli.py's test_ctrl_c_in_chat_stops_one_answer
def test_ctrl_c_in_chat_stops_one_answer_and_asks_again(tiny_model_dir, tmp_path):
    document = tmp_path / "lease.txt"
    document.write_text("The lease ends in March. The tenant pays rent monthly.\n" * 8)
    with Terminal(lines=200) as terminal:
        # an answer that runs on until Ctrl-C, as in test_ctrl_c_keeps_what_was_written
        terminal.run("chat", str(document), "-m", str(tiny_model_dir), "--max-new-tokens", "100000", *UNENDING)
        terminal.wait_for(lambda t: prompts(t) == 1)
        terminal.type("When?\r")
        terminal.wait_for(lambda t: "Reading" not in t.text() and len(after(t, "> When?")) > 20)
        seen = after(terminal, "> When?")
        terminal.type("\x03")
        terminal.wait_for(lambda t: prompts(t) == 2)
        assert squeeze(seen) in squeeze(after(terminal, "> When?"))
        assert "(answer stopped; the question is forgotten)" in terminal.text()
        terminal.type("\x04")
        assert terminal.finish() == 0


def after(terminal: Terminal, marker: str) -> str:
    text = terminal.text()
    return text.split(marker, 1)[1].strip() if marker in text else ""


SCREENS = {  # where stdout and stderr go: one terminal, two terminals, or stderr into a file
    "one terminal": lambda terminal, other, log: {},
    "two terminals": lambda terminal, other, log: {"stderr": other.slave},
    "stderr in a file": lambda terminal, other, log: {"stderr": log},
}


@pytest.mark.slow
@pytest.mark.parametrize("screens", list(SCREENS))
@pytest.mark.parametrize("command", ["summarize", "ask", "ask --no-stream", "summarize -v"])
def test_every_answer_stays_on_the_screen(code, tmp_path, command, screens):
    name, *flags = command.split()
    args = demo(name, str(code), *([QUESTION] if name == "ask" else []), *flags)
    expected = answer_in_a_file(tmp_path, args)
    with Terminal() as terminal, Terminal() as other, open(tmp_path / "stderr.log", "wb") as log:
        terminal.run(*args, **SCREENS[screens](terminal, other, log))
        assert terminal.finish(other) == 0
        screen = terminal.text()
        stderr = other.text() if screens == "two terminals" else (tmp_path / "stderr.log").read_text()
    assert squeeze(expected) in squeeze(screen), f"the answer\n{expected}\nis not on the screen:\n{screen}"
    if screens != "one terminal":
        assert screen.strip() == expected.strip()  # stdout's terminal shows the answer alone
        assert "-token window" in stderr and squeeze(expected) not in squeeze(stderr)
        assert ("prompt " in stderr) == ("-v" in flags)


@pytest.mark.slow
def test_the_cache_note_comes_before_the_answer(code, tmp_path):
    args = ["summarize", str(code), "-m", "demo", "--max-new-tokens", "40", "--cache-dir", str(tmp_path / "states")]
    expected = answer_in_a_file(tmp_path, args)  # stores the document's state
    with Terminal() as terminal:
        terminal.run(*args)
        assert terminal.finish() == 0
        lines = terminal.lines()
    note = next(i for i, line in enumerate(lines) if line.startswith("(document state from the cache"))
    assert squeeze(expected) in squeeze("".join(lines[note + 1:]))


@pytest.mark.slow
@pytest.mark.parametrize("screens", ["one terminal", "two terminals"])
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "-v"])
def test_chat_answers_stay_on_the_screen(code, tmp_path, screens, verbose):
    """Each answer stays between its question and the next prompt, and stderr's terminal gets the rest."""
    args = demo("chat", str(code)) + (["-v"] if verbose else [])
    expected = gali_answers(tmp_path, args, [QUESTION, "And then?"])
    with Terminal() as terminal, Terminal() as other, open(tmp_path / "stderr.log", "wb") as log:
        terminal.run(*args, **SCREENS[screens](terminal, other, log))
        at_prompt = lambda t: t.lines()[t.screen.cursor.y].startswith(">")  # noqa: E731
        terminal.wait_for(at_prompt, other)
        terminal.type(QUESTION + "\r")
        terminal.wait_for(lambda t: prompts(t) == 2, other)
        terminal.type("And then?\r")
        terminal.wait_for(lambda t: prompts(t) == 3, other)
        terminal.type("\x04")
        assert terminal.finish(other) == 0
        screen, stderr = terminal.text(), other.text()
    first, second = screen.split(f"> {QUESTION}")[1].split("> And then?")
    assert squeeze(expected[0]) in squeeze(first) and squeeze(expected[1]) in squeeze(second)
    if screens == "two terminals":
        assert "-token window" in stderr and "-token window" not in screen
        assert squeeze(expected[0]) not in squeeze(stderr)
        assert ("prompt " in stderr) == verbose


@pytest.mark.slow
@pytest.mark.parametrize("screens", ["one terminal", "two terminals"])
@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "-v"])
def test_batch_lines_stay_above_the_bar_and_the_bar_goes(code, tmp_path, screens, verbose):
    """A line per finished document, in order, left on stderr's screen; the progress bar gone at the end; stdout's
    terminal (when it is another) gets nothing: the summaries are in the JSON-lines file."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (folder / name).write_text(code.read_text())
    with Terminal() as terminal, Terminal() as other, open(tmp_path / "stderr.log", "wb") as log:
        terminal.run("summarize", str(folder), "--out", str(tmp_path / "out.jsonl"), "-m", "demo",
                     "--max-new-tokens", "8", "--no-cache", *(["-v"] if verbose else []),
                     **SCREENS[screens](terminal, other, log))
        assert terminal.finish(other) == 0, terminal.text()
        lines = (other if screens == "two terminals" else terminal).lines()
        screen = terminal.text()
    done = [line for line in lines if line.startswith("[")]
    assert [line.split(":")[0].rsplit("/", 1)[-1] for line in done] == ["a.txt", "b.txt", "c.txt"], lines
    assert any(line.startswith("3 documents: 3 done") for line in lines)
    assert not any("━" in line for line in lines)  # the bar is gone
    if screens == "two terminals":
        assert screen == ""


@pytest.mark.slow
def test_chat_reads_the_document_before_it_prompts(code, tmp_path):
    """The wait comes before the prompt, not after the first question: when ">" shows, the document is read (its
    state already in the document cache); a second chat says it came from the cache, before its prompt."""
    states = tmp_path / "states"
    args = ["chat", str(code), "-m", "demo", "--max-new-tokens", "5", "--cache-dir", str(states)]
    for run in ("first", "second"):
        with Terminal() as terminal:
            terminal.run(*args)
            terminal.wait_for(lambda t: t.lines()[t.screen.cursor.y].startswith(">"))
            assert len(list(states.glob("*.safetensors"))) == 1, terminal.text()
            before_prompt = terminal.text()
            assert ("document state from the cache" in before_prompt) == (run == "second"), before_prompt
            assert "Ctrl-D leaves." in before_prompt, before_prompt  # said once, before the bare "> " (issue 50)
            terminal.type(QUESTION + "\r")
            terminal.wait_for(lambda t: prompts(t) == 2)
            terminal.type("\x04")
            assert terminal.finish() == 0
            assert terminal.text().count("document state from the cache") == (run == "second")
            assert terminal.text().count("Ctrl-D leaves") == 1
