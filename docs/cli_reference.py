"""Write docs/cli.md from the `gali` command's own --help (tests/test_docs.py fails when it is stale).

    python docs/cli_reference.py > docs/cli.md
"""

from typer.testing import CliRunner

from gali_cli.cli import app

COMMANDS = ["summarize", "ask", "chat", "ppl", "eval", "serve", "info", "cache", "cache list", "cache clear",
            "cache prune"]


def render() -> str:
    runner = CliRunner()
    sections = ["# `gali` command reference", "", "Generated from `--help` by `python docs/cli_reference.py`.", ""]
    for command in [None, *COMMANDS]:
        args = [*command.split(), "--help"] if command else ["--help"]
        result = runner.invoke(app, args, env={"COLUMNS": "100", "NO_COLOR": "1"}, color=False)
        title = f"gali {command}" if command else "gali"
        lines = [line.rstrip() for line in result.stdout.splitlines()]
        while lines and not lines[0]:
            lines.pop(0)
        sections += [f"## `{title}`", "", "```text", *lines, "```", ""]
    return "\n".join(sections)


if __name__ == "__main__":
    print(render(), end="")
