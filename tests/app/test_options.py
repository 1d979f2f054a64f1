"""The model options: declared once (MethodSettings' fields carry their flags), parsed into a ModelChoice."""

import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import typer
from helpers.timing import scaled
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli.config import MethodSettings
from gali_cli.methods.registry import NAMES
from gali_cli.options import with_model_options
from gali_cli.runs.choices import ModelChoice


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
    when it previews the settings of rerope, leaky-rerope or dpe: methods.registry.PREVIEWED)."""
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


def test_what_needs_no_model_is_refused_before_torch(tmp_path):
    """Issue 50 met these after the heavy imports (8 to 14 s): several documents without --out, an --out that is not
    a results file, an image-only PDF, --device cuda without a GPU; and --quantize on the CPU, and a --train-len too
    narrow to read with, went by without a word. Each is now said before torch or transformers is imported."""
    from helpers.documents import make_pdf

    from gali_cli.model.machine import gpu_possible, torch_build

    doc, other, notes = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "notes.txt"
    for path in (doc, other, notes):
        path.write_text(f"{path.stem}: the lease ends in March.\n")
    scanned = make_pdf(tmp_path / "scan.pdf", [None, None])
    runs = {f"summarize {doc} {other} -m demo": 2, f"ask {doc} {other} When? -m demo": 2,
            f"ppl {doc} {other} -m demo": 2, f"summarize {doc} {other} --out {notes} -m demo": 2,
            f"ppl {doc} --out {notes} -m demo": 2, f"summarize {scanned} -m demo": 3, f"chat {scanned} -m demo": 3,
            f"ppl {scanned} -m demo": 3, f"summarize {doc} --quantize 4bit --device cpu -m demo": 2,
            f"ask {doc} {other} When? --out {tmp_path}/o.jsonl --quantize 8bit --device cpu -m demo": 2,
            "serve --quantize 4bit --device cpu -m demo": 2, f"summarize {tmp_path}/gone.txt -m demo --train-len 8": 3}
    if not gpu_possible(torch_build()):  # where a GPU may be there, only torch can tell
        runs[f"summarize {doc} --device cuda -m demo"] = 2
    script = ("import sys; from gali_cli.cli import main; "
              "codes = [main(args.split()) for args in sys.argv[1].split('|')]; "
              "print(codes, sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script, "|".join(runs)], capture_output=True, text=True,
                            timeout=scaled(120), env={**os.environ, "HF_HUB_OFFLINE": "1", "GALI_DEVICE": "auto"})
    assert result.stdout.strip().splitlines()[-1] == f"{list(runs.values())} []", result.stdout + result.stderr
    said = result.stderr
    assert said.count("several documents need --out FILE.jsonl") == 3, said
    assert said.count(f"--out {notes} exists and is not a gali results file") == 2, said
    assert notes.read_text() == "notes: the lease ends in March.\n"  # left untouched
    assert said.count("scan.pdf has no extractable text (scanned images): run OCR on it first") == 3, said
    assert said.count("--quantize 4bit is for CUDA GPUs: on the CPU bitsandbytes runs several times slower than "
                      "the float model. Leave --quantize out, or give a GGUF file (-m FILE.gguf)") == 2, said
    assert "--quantize 8bit is for CUDA GPUs" in said and not (tmp_path / "o.jsonl").exists()
    assert "warning: --train-len 8 keeps positions within 8 tokens, about a sentence" in said
    if not gpu_possible(torch_build()):
        assert "--device cuda: no CUDA GPU is available (use --device cpu)" in said


@pytest.mark.parametrize("model, train_len, warned", [("demo", "63", True), ("demo", "64", False),
                                                      ("tiny", "8", False), ("tiny", "7", True)])
def test_a_train_len_of_a_sentence_is_warned_about(tiny_model_dir, tmp_path, model, train_len, warned):
    """The warning is for a --train-len of about a sentence: below 64 tokens, or a quarter of the model's own window
    for the tests' tiny model (window 32), which reads at 16 in many tests."""
    args = ["summarize", str(tmp_path / "gone.txt"), "-m", "demo" if model == "demo" else str(tiny_model_dir),
            "--train-len", train_len]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 3 and ("warning: --train-len" in result.stderr) == warned, result.stderr


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


@pytest.mark.parametrize("command, extra", [("ppl", "plot"), ("eval", "plot"), ("serve", "serve")])
def test_help_names_the_extra_to_install(command, extra):
    """Rich would take "[plot]" for markup and show "." alone: what to install must be shown whole, in the form that
    works from gali's clone (no gali-cli is published on a package index: issue 50)."""
    result = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert f'pip install -e ".[{extra}]"' in result.stdout, result.stdout


def test_usage_lines_name_the_arguments():
    usage = {name: CliRunner().invoke(cli.app, [name, "--help"]).stdout for name in ("ask", "chat")}
    assert "Usage: gali ask [OPTIONS] DOCS... QUESTION" in usage["ask"]
    assert "Usage: gali chat [OPTIONS] FILE" in usage["chat"]


@pytest.mark.parametrize("command, method, message", [
    ("summarize", "bogus", f"must be one of {', '.join(NAMES)}; got"),
    ("ppl", "bogus", "a comma list of them, or all; got 'bogus'"),
    ("summarize", "gali,yarn", "--method takes one method here, got 'gali,yarn' (lists and 'all' are for gali ppl)"),
    ("ask", "all", "--method takes one method here"),
])
def test_method_errors_offer_what_the_command_takes(capsys, command, method, message):
    args = [command, "x", *(["Q"] if command == "ask" else []), "--method", method]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
