"""Every command on the bundled demo model, in-process and as a real `gali` process."""

import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from helpers.timing import scaled
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli.loading import demo_model_path

HELD_OUT = [line for line in (demo_model_path() / "heldout.txt").read_text().splitlines() if line]


def held_out_file(min_bytes: int) -> Path:
    """A standard-library module the demo model never saw in training."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((root / name for name in HELD_OUT if (root / name).exists()), key=lambda p: p.stat().st_size)
    return next(p for p in files if p.stat().st_size >= min_bytes)


def gali(*args: str):
    result = CliRunner().invoke(cli.app, [*args, "-m", "demo"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    return result


def test_demo_model_describes_itself():
    facts = json.loads(gali("info", "--json").stdout)
    assert facts["train_len"] == 256 and facts["gali"] == {
        "train_len": 256, "chunk_size": 64, "local_window": 128, "noise": False}


def test_demo_answers_in_format(tmp_path):
    """Just past its window the demo model answers in the trained format and stops with <|eot_id|>."""
    module = tmp_path / "module.py"
    module.write_text(held_out_file(3000).read_text()[:900])
    summary = json.loads(gali("summarize", str(module), "--max-new-tokens", "64", "--json").stdout)
    assert summary["prompt_tokens"] > 256 and summary["answer"] and summary["finish_reason"] == "stop"
    answer = json.loads(gali("ask", str(module), "What does the module do?", "--max-new-tokens", "64",
                             "--json").stdout)
    assert answer["answer"] and answer["finish_reason"] == "stop"


def test_a_16_bit_kv_cache_answers_end_to_end(tmp_path):
    """`gali ask -m demo --kv-dtype float16`: read past the window into a float16 cache, decoded by the static step
    through the native kernel reading float16 rows."""
    module = tmp_path / "module.py"
    module.write_text(held_out_file(3000).read_text()[:900])
    answer = json.loads(gali("ask", str(module), "What does the module do?", "--max-new-tokens", "8", "--json",
                             "--no-cache", "--kv-dtype", "float16").stdout)
    assert answer["answer"] and answer["prompt_tokens"] > 256 and "native attention" in answer["decode_path"]


@pytest.mark.slow  # that the document cache's key holds the KV dtype: tests/app/test_document_states.py
def test_a_16_bit_kv_cache_keeps_its_own_document_states(tmp_path):
    """A float32 state is not reused for a float16 run, nor its for a float32 run; --kv-dtype model is the run
    without the option, to the bit, and shares its state."""
    module = tmp_path / "module.py"
    module.write_text(held_out_file(3000).read_text()[:900])

    def ask(*kv: str) -> dict:
        return json.loads(gali("ask", str(module), "What does the module do?", "--max-new-tokens", "8", "--json",
                               "--cache-dir", str(tmp_path / "states"), *kv).stdout)

    default, half = ask(), ask("--kv-dtype", "float16")
    assert half["answer"] and half["cached_tokens"] == 0 < default["prompt_tokens"]
    same, again = ask("--kv-dtype", "model"), ask("--kv-dtype", "float16")
    assert same["answer"] == default["answer"] and same["cached_tokens"] > 0
    assert again["answer"] == half["answer"] and again["cached_tokens"] == same["cached_tokens"]


def test_every_model_command_takes_kv_dtype_and_refuses_a_bad_one_in_a_line(capsys):
    """--kv-dtype is a model option (options.py): every command that loads a model has it, and a value it does not
    know is Click's one-line usage error, exit 2, before anything is read or loaded."""
    for command in (["summarize", "x.txt"], ["ask", "x.txt", "q"], ["chat", "x.txt"], ["ppl", "x.txt"],
                    ["eval", "niah_single_1"], ["serve", "--port", "0"], ["ask", "x.txt", "q", "--out", "o"],
                    ["info"]):
        assert cli.main([*command, "-m", "demo", "--kv-dtype", "float8"]) == 2, command
        refused = capsys.readouterr().err
        assert "Invalid value for '--kv-dtype'" in refused and len(refused.strip().splitlines()) == 1, refused


@pytest.mark.slow  # past the window: test_demo_answers_in_format; four windows: the ppl test below
def test_demo_reads_many_times_its_window():
    module = held_out_file(6000)
    summary = json.loads(gali("summarize", str(module), "--max-new-tokens", "16", "--json").stdout)
    assert summary["prompt_tokens"] > 4 * 256 and summary["answer"]


def test_gali_reads_past_the_window_better_than_the_unpatched_model():
    module = str(held_out_file(8000))
    lengths = ["--lengths", "256,1024", "--max-tokens", "1024", "--json"]
    gali_ppl = {r["length"]: r["ppl"] for r in json.loads(gali("ppl", module, *lengths).stdout)["results"]}
    original = {r["length"]: r["ppl"] for r in
                json.loads(gali("ppl", module, *lengths, "--method", "original").stdout)["results"]}
    assert gali_ppl[256] == pytest.approx(original[256], rel=1e-4)  # inside the window GALI changes nothing
    assert gali_ppl[1024] < original[1024]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gali") is None, reason="the console script is installed by pip install -e .")
def test_console_script_runs_the_demo():
    module = held_out_file(3000)
    result = subprocess.run(["gali", "summarize", str(module), "-m", "demo", "--max-new-tokens", "32"],
                            capture_output=True, text=True, timeout=scaled(300), env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and str(module) in result.stderr
    assert subprocess.run(["gali", "--version"], capture_output=True, text=True).stdout.startswith("gali ")
