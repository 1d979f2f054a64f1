"""Write docs/cli.md from the `gali` command's own --help (tests/project/test_docs.py fails when it is stale).

    python docs/cli_reference.py > docs/cli.md
"""

from typer.testing import CliRunner

from gali_cli.cli import app

# The codes are gali_cli/exits.py's EXIT_CODES plus click's usage errors and Ctrl-C; tests/project/test_docs.py
# checks the set.
EXIT_CODE_MEANINGS = [
    (0, "done"),
    (1, "a runtime error; in batch mode, a document that failed (the others were still done)"),
    (2, "bad usage: an unknown option, a bad value, conflicting flags, an output path that cannot be written, a "
        "`--plot` format matplotlib does not write, a batch's `--out` that another gali run is writing"),
    (3, "unreadable input: missing, empty, binary, corrupt, encrypted without `--password`, a PDF without text (OCR "
        "it first) or with text on fewer than half its pages (unless `--allow-partial`), larger than "
        "`--max-input-size`"),
    (4, "a model that cannot be loaded or is not supported: a damaged or cut-short file, pickle checkpoints only "
        "(gali never unpickles; the message says how to convert them), weights missing or of the wrong shape, a "
        "config, GGUF header, tokenizer or chat template that fails the checks in [models.md](models.md), or out of "
        "memory (with a hint: `--quantize 4bit` or a smaller `--chunk-size`)"),
    (130, "interrupted by Ctrl-C; what was printed is kept"),
]
EXIT_CODES = "\n".join(["## Exit codes", "", "| code | meaning |", "|---|---|",
                        *(f"| {code} | {meaning} |" for code, meaning in EXIT_CODE_MEANINGS), "",
                        "Errors are one line on stderr; `GALI_DEBUG=1` shows the traceback.", ""])

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
    return "\n".join([*sections, EXIT_CODES])


if __name__ == "__main__":
    print(render(), end="")
