"""The hostile inputs and faults of issue 16, end to end through the `gali` command: each gets its documented exit
code and a one-line message, and none is ever an "unexpected" error."""

import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import helpers.commands as commands
import pytest
import torch
from helpers.timing import scaled
from safetensors.torch import load_file, save_file

import gali_cli.runs.common as common

DOCUMENT = commands.DOCUMENT
run, doc = commands.run, commands.doc  # fixtures: a `gali` run in-process, a document

def broken_model(tiny_model_dir: Path, folder: Path, damage: str) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-5000])
    elif damage == "pickle-only":
        tensors = load_file(weights)
        weights.unlink()
        torch.save(tensors, folder / "pytorch_model.bin")
    elif damage == "missing-weight":
        tensors = load_file(weights)
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        save_file(tensors, weights, {"format": "pt"})
    return folder


CASES = {  # name: (arguments after the command's name, exit code, what stderr says)
    "/dev/zero": (["summarize", "/dev/zero"], 3, "/dev/zero is larger than the input limit of 256M: it is a device, "
                                              "which may never end"),
    "past --max-input-size": (["summarize", "{doc}", "--max-input-size", "1K"], 3, "larger than the input limit of 1K"),
    "bad --max-input-size": (["summarize", "{doc}", "--max-input-size", "lots"], 2, "must be a size such as 20G"),
    "truncated safetensors": (["summarize", "{doc}", "-m", "{truncated}"], 4,
                              "model.safetensors is damaged or incomplete"),
    "pickle-only checkpoint": (["summarize", "{doc}", "-m", "{pickle-only}"], 4,
                               "pytorch_model.bin is a pickle checkpoint, which gali never opens"),
    "missing weight": (["summarize", "{doc}", "-m", "{missing-weight}"], 4,
                       "1 missing (model.layers.0.self_attn.q_proj.weight)"),
    "--plot out.xyz": (["ppl", "{doc}", "--plot", "{tmp}/out.xyz", "-m", "{tmp}/no-model"], 2,
                       ".xyz is not an image format"),  # exit 2, not the missing model's 4: checked first
    "--plot in a missing folder": (["ppl", "{doc}", "--plot", "/missing/dir/p.png", "-m", "{tmp}/no-model"], 2,
                                   "/missing/dir is not a directory"),
    "--plot without --lengths in a batch": (["ppl", "{doc}", "{doc}", "--out", "{tmp}/o.jsonl", "--plot",
                                             "{tmp}/p.png"], 2, "it needs --lengths"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_hostile_input_is_one_line_and_its_exit_code(name, run, tiny_model_dir, doc, tmp_path):
    arguments, code, message = CASES[name]
    models = {damage: str(broken_model(tiny_model_dir, tmp_path / damage, damage))
              for damage in ("truncated", "pickle-only", "missing-weight") if f"{{{damage}}}" in " ".join(arguments)}
    arguments = [argument.format(doc=doc, tmp=tmp_path, **models) for argument in arguments]
    if "-m" not in arguments:
        arguments += ["-m", str(tiny_model_dir)]
    result = run(*arguments)
    assert result.exit_code == code, result.stderr
    assert message in result.stderr and "unexpected" not in result.stderr and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("gali: ")


def hostile_model(tiny_model_dir: Path, folder: Path, config: dict | None = None, files: dict | None = None) -> Path:
    """A copy of the tiny model with `config` merged into its config.json (None removes a key) and `files`
    written over its own (e.g. chat_template.jinja)."""
    shutil.copytree(tiny_model_dir, folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in (config or {}).items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(raw))  # json writes NaN and Infinity as Python reads them
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return folder


LOOPS = "{% for i in range(10000) %}{% for j in range(1000) %}{% set x = i %}{% endfor %}{% endfor %}"
HOSTILE_MODELS = {  # name: (config.json changes, files, what stderr says); each is exit 4 naming the model
    "zero heads": ({"num_attention_heads": 0}, {}, "num_attention_heads is 0: a model's lies between 1 and 1,024"),
    "a string for a size": ({"hidden_size": "64"}, {}, "hidden_size is '64': not a whole number"),
    "an infinite window": ({"max_position_embeddings": float("inf")}, {}, "max_position_embeddings is inf"),
    "a zero window": ({"max_position_embeddings": 0}, {}, "max_position_embeddings is 0"),
    "a negative window": ({"max_position_embeddings": -4096}, {}, "max_position_embeddings is -4096"),
    "NaN rope_theta": ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, {},
                       "rope_parameters.rope_theta is nan: not a finite number"),
    "negative rope_theta": ({"rope_parameters": None, "rope_theta": -10000.0}, {},
                            "rope_theta is -10000.0: it must be positive"),
    "negative yarn factor": ({"rope_parameters": {"rope_type": "yarn", "factor": -4.0, "rope_theta": 10000.0}}, {},
                             "rope_parameters.factor is -4.0: it must be positive"),
    "kv heads not dividing heads": ({"num_key_value_heads": 3}, {},
                                    "num_key_value_heads is 3: it does not divide num_attention_heads (4)"),
    "a thousand layers over two": ({"num_hidden_layers": 1000}, {},
                                   "its config.json does not match its weights (it describes"),
    "a vocabulary the embedding lacks": ({"vocab_size": 321}, {}, ("model.embed_tokens.weight is [320, 64], "
                                                                   "the config makes it [321, 64]")),
    "a config.json nested 100,000 deep": ({}, {"config.json": "[" * 100_000}, "maximum recursion depth exceeded"),
    "a 2 MB config.json": ({}, {"config.json": '{"model_type": "llama"' + " " * 2**21 + "}"},
                           "config.json is 2,097,175 bytes; a config takes a few kB"),
    "an empty tokenizer.json": ({}, {"tokenizer.json": ""}, "its tokenizer.json is empty"),
    "an invalid tokenizer.json": ({}, {"tokenizer.json": '{"model": 3}'}, "its tokenizer cannot be read"),
    "a template syntax error": ({}, {"chat_template.jinja": "{% for %}"}, "the model's chat template does not parse"),
    "an undefined name": ({}, {"chat_template.jinja": "{{ messages[0].nope.deeper }}"},
                          "the model's chat template fails (UndefinedError"),
    "a sandbox violation": ({}, {"chat_template.jinja": "{{ ''.__class__.__mro__ }}"},
                            "the model's chat template breaks out of its sandbox"),
    # more than 1,000,000 steps, or (on a loaded machine, where those take longer) more than 5 s: either bound
    "a template that loops": ({}, {"chat_template.jinja": LOOPS}, "the model's chat template is refused: it runs "),
    "a template that raises": ({}, {"chat_template.jinja": "{{ raise_exception('no system role') }}"},
                               "the model's chat template fails (TemplateError: no system role)"),
}


@pytest.mark.parametrize("name", HOSTILE_MODELS)
def test_a_hostile_model_is_one_line_and_exit_4(name, run, tiny_model_dir, doc, tmp_path):
    config, files, message = HOSTILE_MODELS[name]
    folder = hostile_model(tiny_model_dir, tmp_path / "hostile", config, files)
    result = run("summarize", str(doc), "--max-new-tokens", "2", "-m", str(folder))
    assert result.exit_code == 4, result.stderr
    assert message in result.stderr and str(folder) in result.stderr and not result.stdout, result.stderr
    assert "unexpected" not in result.stderr and "--train-len" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("gali: "), result.stderr


@pytest.mark.parametrize("config, files, message", [
    ({"num_hidden_layers": 10**7}, {}, "num_hidden_layers is 10000000: a model's lies between 1 and 1,024"),
    # the templates in the default tier in process only: their bounds in tests/app/test_prompts.py, a refused
    # template as gali's one line and exit 4 in test_a_hostile_model_is_one_line_and_exit_4 above
    pytest.param({}, {"chat_template.jinja": "{{ 'x' * 10**10 }}"},
                 "the model's chat template is refused: it builds more than 4,194,304 characters",
                 marks=pytest.mark.slow),
    pytest.param({}, {"chat_template.jinja": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"},
                 "the model's chat template is refused: it builds more than", marks=pytest.mark.slow),
], ids=["10^7 layers", "a string times 10^10", "a string doubled 64 times"])
def test_a_model_that_would_take_all_memory_is_refused_within_bounds(config, files, message, tiny_model_dir, doc,
                                                                     tmp_path):
    """Before the checks these grew until the kernel killed gali; here a 4 GiB address-space limit turns that into
    a failure of the test, not of the machine."""
    folder = hostile_model(tiny_model_dir, tmp_path / "hostile", config, files)
    limit = 4 * 2**30
    result = subprocess.run([sys.executable, "-m", "gali_cli", "summarize", str(doc), "--max-new-tokens", "2", "-m",
                             str(folder)], capture_output=True, text=True, timeout=scaled(300), check=False,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert result.returncode == 4 and message in result.stderr and not result.stdout, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_gali_info_checks_the_config_too(run, tiny_model_dir, tmp_path):
    folder = hostile_model(tiny_model_dir, tmp_path / "hostile", {"max_position_embeddings": 0})
    result = run("info", "-m", str(folder))
    assert result.exit_code == 4 and "max_position_embeddings is 0" in result.stderr, result.stderr


@pytest.mark.slow
def test_standard_input_from_dev_zero(tiny_model_dir):
    with open("/dev/zero", "rb") as zeros:
        result = subprocess.run([sys.executable, "-m", "gali_cli", "summarize", "-", "-m", str(tiny_model_dir)],
                                stdin=zeros, capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 3 and not result.stdout
    assert result.stderr == "gali: <stdin> is larger than the input limit of 256M: it is a device, which may never " \
                            "end; save the document to a file and give that\n"


@pytest.mark.parametrize("damage", ["overwrite 4 KiB", "scale a layer"])
def test_a_damaged_cache_entry_is_noticed_and_rebuilt(damage, run, tiny_model_dir, doc, tmp_path):
    states = tmp_path / "states"
    arguments = ["summarize", str(doc), "--max-new-tokens", "6", "--no-noise", "--cache-dir", str(states), "-m",
                 str(tiny_model_dir)]
    first = run(*arguments)
    entry, = states.glob("*.safetensors")
    if damage == "overwrite 4 KiB":
        data = bytearray(entry.read_bytes())
        middle = (8 + int.from_bytes(data[:8], "little") + len(data)) // 2
        data[middle : middle + 4096] = torch.full((1024,), 0.5).numpy().tobytes()
        entry.write_bytes(bytes(data))
    else:
        from safetensors import safe_open

        with safe_open(entry, framework="pt") as file:
            metadata = file.metadata()
        tensors = load_file(entry)
        tensors["values.0"] *= 1.5
        save_file(tensors, entry, metadata)
    again = run(*arguments, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["answer"] == first.stdout.strip()
    assert json.loads(again.stdout)["cached_tokens"] == 0 and "does not match its checksum" in again.stderr
    assert "unexpected" not in again.stderr
    third = json.loads(run(*arguments, "--json").stdout)  # rebuilt: from the cache again, the same answer
    assert third["cached_tokens"] > 0 and third["answer"] == first.stdout.strip()


def test_a_small_latin1_file_reads_as_cp1252(run, tiny_model_dir, tmp_path):
    path = tmp_path / "menu.txt"
    path.write_bytes("Hyvää päivää, mitä kuuluu?\n".encode("latin-1"))  # charset-normalizer alone: hp_roman8
    result = run("summarize", str(path), "--max-new-tokens", "2", "-m", str(tiny_model_dir))
    assert result.exit_code == 0 and "menu.txt is not UTF-8; read it as cp1252" in result.stderr
    assert "unexpected" not in result.stderr


def test_a_long_prefill_says_how_long_it_will_take(run, tiny_model_dir, tmp_path, monkeypatch):
    """The 50 MB one-line file, in small: past LONG_PREFILL (here 0 s) the estimate is one line, said once."""
    monkeypatch.setattr(common, "LONG_PREFILL", 0.0)
    path = tmp_path / "long.txt"
    path.write_text(DOCUMENT.replace("\n", " ") * 3)  # several forwards of 256 tokens
    for command in (["summarize", str(path), "--max-new-tokens", "2"], ["ppl", str(path)]):
        result = run(*command, "-m", str(tiny_model_dir))
        assert result.exit_code == 0, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("Reading ")]
        # "about" when the first two forwards' times fit (the usual case), "at least" when noisy timings do not
        assert len(lines) == 1 and re.search(r" tokens: (about|at least) .* to go at this pace \(measured on the "
                                             r"first 512; Ctrl-C stops\)$", lines[0]), result.stderr
        assert "unexpected" not in result.stderr
