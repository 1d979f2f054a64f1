"""Docs that are generated or quoted must match the code: the CLI reference, the CI blocks, every `gali` command line
shown, and every relative link."""

import dataclasses
import importlib.util
import inspect
import re
import shlex
from enum import Enum
from pathlib import Path

import pytest
import typer
from helpers.paths import ROOT

from gali_cli.cli import _parse_lengths, app
from gali_cli.config import MethodSettings
from gali_cli.errors import ConfigError
from gali_cli.exits import EXIT_CODES
from gali_cli.runs.choices import ModelChoice

USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # where commands are shown to users
DEV_DOCS = sorted((ROOT / "docs" / "dev").glob("*.md"))  # the developers' pages: their commands must parse too
ALL_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the notebook's links must resolve too
SHELL_BLOCK_LANGUAGES = {"", "bash", "sh", "shell", "console"}
COMMAND_WRAPPERS = {"nice", "time", "env", "torchrun", "accelerate"}  # words that run `gali` given after them


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    assert (ROOT / "docs" / "cli.md").read_text() == _cli_reference().render(), (
        "run: python docs/cli_reference.py > docs/cli.md")


def test_the_methods_table_is_the_registrys():
    """docs/methods.md's summary table is generated from methods/registry.py, so a new method cannot miss it."""
    from gali_cli.methods.registry import summary_table

    text = (ROOT / "docs" / "methods.md").read_text()
    table = text.split("<!-- methods:begin", 1)[1].split("-->\n", 1)[1].split("<!-- methods:end -->", 1)[0]
    assert table == summary_table(), "run: python -m gali_cli.methods.registry, and paste it between the markers"


def test_the_cli_reference_lists_every_exit_code():
    documented = {code for code, _ in _cli_reference().EXIT_CODE_MEANINGS}
    assert documented == {0, 1, 2, 130, *EXIT_CODES.values()}


def test_ci_runs_the_readme_blocks():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- ci:begin -->\n```bash\n(.*?)```\n<!-- ci:end -->", readme, flags=re.S)
    assert len(blocks) == 2  # set-up with the demo model, then the tests
    assert "ci:begin" in (ROOT / ".ci" / "run").read_text()


def test_the_try_out_installs_the_cpu_build_of_torch():
    """The README's first command is the one a CPU user runs, and CI runs it as written (issue 50: it installed
    PyPI's default Linux torch, with a few GB of CUDA libraries, and the CPU index was in the paragraph under it).
    torch is installed in a pip call of its own, with PyTorch's CPU index added to PyPI: pip ranks the index's
    2.13.0+cpu above PyPI's 2.13.0, and where the index cannot be reached (CI) it takes torch from PyPI's side."""
    readme = (ROOT / "README.md").read_text()
    try_out = re.findall(r"<!-- ci:begin -->\n```bash\n(.*?)```\n<!-- ci:end -->", readme, flags=re.S)[0]
    torch_installs = [call.split() for call in try_out.split("&&") if re.search(r"\bpip install\b.*\btorch==", call)]
    assert len(torch_installs) == 1, try_out
    words = torch_installs[0]
    assert words[words.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu", words
    assert [word for word in words[2:] if not word.startswith("-") and "://" not in word] == ["torch==2.13.0"]


def test_install_hints_name_what_can_be_installed():
    """No help text, error or doc tells a user to install `gali-cli[...]` from a package index, where no gali-cli is
    published (issue 50): each says `pip install -e ".[extra]"`, which works in gali's clone."""
    sources = [*ALL_DOCS, *sorted((ROOT / "gali_cli").rglob("*.py"))]
    stale = [f"{path.relative_to(ROOT)}:{number}" for path in sources
             for number, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"gali-cli\\?\[", line)]
    assert not stale, stale


# ---- every `gali` command line in a shell block parses ----

def shell_blocks(markdown: str) -> list[str]:
    """The text of each fenced block in a shell language (or none) and of each indented block."""
    blocks = [body for language, body in re.findall(r"^```(\w*)\n(.*?)^```", markdown, flags=re.S | re.M)
              if language in SHELL_BLOCK_LANGUAGES]
    outside_fences = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    blocks += re.findall(r"(?:(?<=\n\n)|^)((?: {4}.*\n?)+)", outside_fences)
    return blocks


def shell_lines(block: str) -> list[str]:
    """The block's commands, a continued line (ending in a backslash) joined to the next."""
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def gali_arguments(line: str) -> list[list[str]]:
    """The arguments of each `gali` (or `python -m gali_cli`) run in a shell line: pipes, `&&`, `;`, environment
    prefixes and wrappers such as `torchrun ... --no-python gali` are shell, not gali. A `$(...)` is kept as one
    word, as the shell would substitute it."""
    line = re.sub(r"\$\([^()]*(?:\([^()]*\))?[^()]*\)", "SUBSTITUTED", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words, runs, command = list(lexer), [], []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|<>()"):
            runs.append(command)
            command = []
        else:
            command.append(word)
    found = []
    for command in runs:
        while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
            command = command[1:]  # VAR=value gali ...
        if command[:3] == ["python", "-m", "gali_cli"]:
            found.append(command[3:])
        elif command[:1] == ["gali"]:
            found.append(command[1:])
        elif command[:1] and command[0] in COMMAND_WRAPPERS and "gali" in command:
            found.append(command[command.index("gali") + 1:])
    return found


MODEL_OPTIONS = {*inspect.signature(ModelChoice.parse).parameters,
                 *(field.name for field in dataclasses.fields(MethodSettings))}


def check_values(command, context) -> None:
    """The values a command parses when it runs, not as the options are read (--method, the method settings,
    --lengths), checked by the functions the command calls: a bad one raises ConfigError, as the command would
    before loading anything."""
    values = {name: value.value if isinstance(value, Enum) else value for name, value in context.params.items()}
    if "method" in values:
        method = next(parameter for parameter in command.params if parameter.name == "method")
        ModelChoice.parse(**{name: value for name, value in values.items() if name in MODEL_OPTIONS},
                          many_methods=method.metavar == "NAMES")
    if values.get("lengths") is not None:
        _parse_lengths(values["lengths"])


def parse(arguments: list[str]) -> None:
    """Parse `gali ARGUMENTS` with the real CLI's click parser, then check the values its command would parse
    first; nothing runs. A bad line raises a TyperException (typer's click's usage errors) or a ConfigError."""
    command = typer.main.get_command(app)  # typer's own click (vendored): its errors are TyperExceptions
    parent, name = None, "gali"
    while True:
        try:
            context = command.make_context(name, list(arguments), parent=parent, resilient_parsing=False)
        except typer.Exit as done:  # --help or --version: a valid line that prints and stops
            assert done.exit_code == 0
            return
        if not hasattr(command, "resolve_command"):  # a command, not a group of them
            check_values(command, context)
            return
        remaining = [*context._protected_args, *context.args]
        if not remaining:
            return
        name, command, arguments = command.resolve_command(context, remaining)
        parent = context


def documented_commands(files: list[Path]) -> list[tuple[str, str, list[str]]]:
    return [(path.relative_to(ROOT).as_posix(), line, arguments)
            for path in files for block in shell_blocks(path.read_text()) for line in shell_lines(block)
            for arguments in gali_arguments(line)]


COMMANDS = documented_commands([*USER_DOCS, *DEV_DOCS])


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20
    assert {path for path, _, _ in COMMANDS} >= {"README.md", "docs/eval.md", "docs/batch.md", "docs/performance.md"}


@pytest.mark.parametrize(("path", "line", "arguments"), COMMANDS, ids=[f"{p}:{a[:2]}" for p, _, a in COMMANDS])
def test_every_documented_command_parses(path: str, line: str, arguments: list[str]):
    try:
        parse(arguments)
    except typer.TyperException as error:
        pytest.fail(f"{path}: `{line}` does not parse: {error.format_message()}")
    except ConfigError as error:
        pytest.fail(f"{path}: `{line}` has a bad value: {error}")


@pytest.mark.parametrize(("line", "expected"), [
    ("gali ask report.txt \"why?\" --max-new-tokens 30 | head -3", [["ask", "report.txt", "why?", "--max-new-tokens",
                                                                      "30"]]),
    ("OMP_NUM_THREADS=1 nice gali ppl x.txt  # a comment", [["ppl", "x.txt"]]),
    ("torchrun --standalone --nproc-per-node 8 --no-python gali summarize d/ --out o.jsonl",
     [["summarize", "d/", "--out", "o.jsonl"]]),
    ("cd /tmp && python -m gali_cli info -m demo", [["info", "-m", "demo"]]),
    ("gali ppl $(python -c 'print(1)')/a.py -m demo", [["ppl", "SUBSTITUTED/a.py", "-m", "demo"]]),
    ("pip install gali", []),
])
def test_command_lines_are_split_as_the_shell_splits_them(line: str, expected: list[list[str]]):
    assert gali_arguments(line) == expected


@pytest.mark.parametrize("arguments", [
    ["summarize", "FILE", "--no-such-option"],
    ["ppl", "FILE", "--lengths", "1k,two"],
    ["ask", "FILE", "Q", "--method", "no-such-method"],
    ["no-such-command"],
    ["cache", "list", "--models", "x"],
    ["summarize", "FILE", "--method", "gali,yarn"],  # one method only, where ppl takes a list
    ["ppl", "FILE", "--dpe-scales", "two"],
])
def test_a_broken_command_fails_to_parse(arguments: list[str]):
    with pytest.raises((typer.TyperException, ConfigError)):
        parse(arguments)


# ---- every relative link resolves ----

def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading counts by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The ids a page's links may point at: its headings', as GitHub makes them, and those of `<a id>` tags."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        if count:
            seen[f"{anchor}-{count}"] = 1
    return set(seen) | set(re.findall(r'<a id="([^"]+)"></a>', markdown))  # and anchors set by hand


def relative_links(markdown: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


LINKS = [(path, target) for path in ALL_DOCS for target in relative_links(path.read_text())]


def test_the_docs_have_links():
    assert len(LINKS) > 30


@pytest.mark.parametrize(("path", "target"), LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS])
def test_every_relative_link_resolves(path: Path, target: str):
    file, _, anchor = target.partition("#")
    linked = (path.parent / file).resolve() if file else path
    assert linked.exists(), f"{path.relative_to(ROOT)}: the link {target} points to nothing"
    if anchor and linked.suffix == ".md":
        assert anchor in anchors(linked.read_text()), f"{path.relative_to(ROOT)}: {target} has no such heading"


@pytest.mark.parametrize(("heading", "anchor"), [
    ("`gali cache list`", "gali-cache-list"),
    ("Decoding: nothing re-rotated", "decoding-nothing-re-rotated"),
    ("Perplexity, genesis, smollm2, train_len 1024 (one pass)", "perplexity-genesis-smollm2-train_len-1024-one-pass"),
    ("bfloat16 on the CPU", "bfloat16-on-the-cpu"),
])
def test_anchors_are_made_as_github_makes_them(heading: str, anchor: str):
    assert github_anchor(heading) == anchor
