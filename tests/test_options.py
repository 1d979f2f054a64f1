"""The model options: declared once (MethodSettings' fields carry their flags), parsed into a ModelChoice."""

import subprocess
import sys
from dataclasses import fields

import typer
from typer.testing import CliRunner

from gali_cli.config import MethodSettings
from gali_cli.options import with_model_options
from gali_cli.runs import ModelChoice


def chosen(*args: str) -> ModelChoice:
    """The ModelChoice a command gets for `args`."""
    app, seen = typer.Typer(), []

    @app.command()
    @with_model_options
    def command(json_output: bool = False, choice: ModelChoice = None) -> None:
        seen.append(choice)

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return seen[0]


def test_every_flagged_setting_is_an_option_that_reaches_the_settings():
    flagged = [setting.name for setting in fields(MethodSettings) if "flag" in setting.metadata]
    assert "noise_scale" not in flagged and {"chunk_size", "factor", "dca_chunk_size"} <= set(flagged)
    assert chosen().settings == MethodSettings()
    choice = chosen("--chunk-size", "5", "--no-noise", "--factor", "2.5", "--group-size", "3", "--noise-seed", "7",
                    "-m", "demo", "--quantize", "4bit", "--method", "gali,yarn")
    assert choice.settings == MethodSettings(chunk_size=5, noise=False, factor=2.5, group_size=3, noise_seed=7)
    assert (choice.model, choice.quantize, choice.device, choice.methods) == ("demo", "4bit", "auto", ("gali", "yarn"))


def test_the_command_line_parses_without_torch():
    """--help, --version and usage errors answer before torch or transformers is imported (each run imports them)."""
    script = ("import sys; from gali_cli.cli import main; "
              "codes = [main(a) for a in (['summarize', 'x', '--method', 'magic'], ['ppl', 'x', '--lengths', 'two'],"
              " ['info', '--chunk-size', '0'])]; "
              "print(codes, sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[2, 2, 2] []", result.stderr
