"""The model options: declared once (MethodSettings' fields carry their flags), parsed into a ModelChoice."""

import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import typer
from timing import scaled
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli.config import MethodSettings
from gali_cli.options import with_model_options
from gali_cli.runs import ModelChoice


def chosen(*args: str, many_methods: bool = False) -> ModelChoice:
    """The ModelChoice a command gets for `args`."""
    app, seen = typer.Typer(), []

    @app.command()
    @with_model_options(many_methods=many_methods)
    def command(json_output: bool = False, choice: ModelChoice = None) -> None:
        seen.append(choice)

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return seen[0]


def test_every_flagged_setting_is_an_option_that_reaches_the_settings(monkeypatch):
    monkeypatch.delenv("GALI_DEVICE")  # conftest's: the commands on the CPU
    flagged = [setting.name for setting in fields(MethodSettings) if "flag" in setting.metadata]
    assert "noise_scale" not in flagged and {"chunk_size", "factor", "dca_chunk_size"} <= set(flagged)
    assert chosen().settings == MethodSettings()
    choice = chosen("--chunk-size", "5", "--no-noise", "--factor", "2.5", "--group-size", "3", "--noise-seed", "7",
                    "-m", "demo", "--quantize", "4bit", "--method", "gali,yarn", many_methods=True)
    assert choice.settings == MethodSettings(chunk_size=5, noise=False, factor=2.5, group_size=3, noise_seed=7)
    assert (choice.model, choice.quantize, choice.device, choice.methods) == ("demo", "4bit", "auto", ("gali", "yarn"))
    monkeypatch.setenv("GALI_DEVICE", "cpu")
    assert chosen().device == "cpu" and chosen("--device", "auto").device == "auto"


def test_the_command_line_answers_without_torch(tiny_model_dir, tiny_gguf, tmp_path):
    """--help, --version, gali info (a GGUF's and the default model's too), usage errors and a document that is not
    there answer before torch or transformers is imported (the runs that load a model import them; so does gali info
    when it previews the settings of rerope, leaky-rerope or dpe: config.PREVIEWED_METHODS)."""
    from gali_cli.model.config import smollm2_gguf

    script = ("import sys; from gali_cli.cli import main; "
              "codes = [main(args.split()) for args in sys.argv[1].split('|')]; "
              "print(codes, sorted({'torch', 'transformers'} & set(sys.modules)))")
    runs = {"--help": 0, "--version": 0, "summarize --help": 0, "summarize x --method magic": 2,
            "ppl x --lengths two": 2, "info --chunk-size 0 -m demo": 2, "info -m demo": 0, "info --json -m demo": 0,
            f"info -m {tiny_model_dir} --method original,ntk,dynamic-ntk,yarn,self-extend,chunk-llama,gali": 0,
            f"info -m {tiny_gguf}": 0,
            "info": 0 if smollm2_gguf() else 4, f"summarize {tmp_path}/missing.txt -m demo": 3,
            f"ask {tmp_path} question -m demo": 3, f"chat {tmp_path}/missing.txt -m demo": 3,
            f"ppl {tmp_path}/x -m demo": 3,
            "info -m no-such-org/no-such-model": 4}
    result = subprocess.run([sys.executable, "-c", script, "|".join(runs)], capture_output=True, text=True,
                            timeout=scaled(120), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.stdout.strip().splitlines()[-1] == f"{list(runs.values())} []", result.stdout + result.stderr
    assert "train_len" in result.stdout and '"kv_heads": 2' in result.stdout
    assert "no-such-org/no-such-model" in result.stderr.splitlines()[-1]


COMMANDS = [[], ["summarize"], ["ask"], ["chat"], ["ppl"], ["eval"], ["serve"], ["info"], ["cache"], ["cache", "list"],
            ["cache", "clear"], ["cache", "prune"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command) or "gali")
def test_help_says_what_each_option_takes(command):
    """Metavars a person reads (FILE, N, NAME; nothing after a flag), never Python types, and no pointer to a file
    that an installed gali does not have."""
    result = CliRunner().invoke(cli.app, [*command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0
    assert not re.search(r"<(str|int|float|bool|list|path)\b", result.stdout), result.stdout
    assert not re.search(r"\bdocs/\w+\.md\b", result.stdout)
    flags = [line for line in result.stdout.splitlines() if re.search(r"│ --(help|json|no-stream|verbose) ", line)]
    assert flags and all(re.search(r"--[\w-]+( +-v)? {2,}[A-Z]", line) for line in flags), flags  # help text next


@pytest.mark.parametrize("command, extra", [("ppl", "plot"), ("serve", "serve")])
def test_help_names_the_extra_to_install(command, extra):
    """Rich would take "[plot]" for markup and show "gali-cli" alone: what to install must be shown whole."""
    result = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert f"pip install 'gali-cli[{extra}]'" in result.stdout, result.stdout


def test_usage_lines_name_the_arguments():
    usage = {name: CliRunner().invoke(cli.app, [name, "--help"]).stdout for name in ("ask", "chat")}
    assert "Usage: gali ask [OPTIONS] DOCS... QUESTION" in usage["ask"]
    assert "Usage: gali chat [OPTIONS] FILE" in usage["chat"]


@pytest.mark.parametrize("command, method, message", [
    ("summarize", "bogus",
     "must be one of original, ntk, dynamic-ntk, yarn, self-extend, chunk-llama, rerope, leaky-rerope, dpe, gali, "
     "string, lampe, self; got"),
    ("ppl", "bogus", "a comma list of them, or all; got 'bogus'"),
    ("summarize", "gali,yarn", "--method takes one method here, got 'gali,yarn' (lists and 'all' are for gali ppl)"),
    ("ask", "all", "--method takes one method here"),
])
def test_method_errors_offer_what_the_command_takes(capsys, command, method, message):
    args = [command, "x", *(["Q"] if command == "ask" else []), "--method", method]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
