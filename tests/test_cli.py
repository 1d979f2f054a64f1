"""The `gali` command, in-process through Typer's runner and as a real subprocess, on a tiny random Llama."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM
from typer.testing import CliRunner

import gali_cli.cli as cli
from gali_cli.generate import TextPiece
from test_documents import make_pdf

DOCUMENT = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof.\n" * 12


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "lease.txt"
    path.write_text(DOCUMENT)
    return path


@pytest.fixture
def gali(tiny_model_dir):
    """Run `gali ARGS -m <tiny model>`; stdout and stderr come back apart."""

    def run(*args: str, input: str | None = None, env: dict | None = None, model: bool = True):
        extra = ["-m", str(tiny_model_dir)] if model else []
        return CliRunner().invoke(cli.app, [*args, *extra], input=input, env={"COLUMNS": "200", **(env or {})})

    return run


def test_summarize_prints_only_the_answer(gali, doc):
    plain = gali("summarize", str(doc), "--max-new-tokens", "8")
    assert plain.exit_code == 0, plain.stderr
    as_json = gali("summarize", str(doc), "--max-new-tokens", "8", "--json")
    answer = json.loads(as_json.stdout)
    assert plain.stdout == answer["answer"] + "\n"
    assert DOCUMENT[:40] not in plain.stdout
    assert "tokens" in plain.stderr and "x the model's 32-token window" in plain.stderr
    assert answer["finish_reason"] == "length" and answer["generated_tokens"] == 8
    assert answer["method"] == "gali" and answer["gali"] == {
        "train_len": 32, "chunk_size": 4, "local_window": 0, "noise": True, "noise_scale": 1.0, "seed": 0}
    assert answer["document"] == {"name": str(doc), "kind": "text", "pages": 0}
    assert answer["prompt_tokens"] > 32 and answer["peak_memory_mib"] > 0


def test_ask_streams_the_same_answer_as_no_stream(gali, doc):
    streamed = gali("ask", str(doc), "When does the lease end?", "--max-new-tokens", "10")
    whole = gali("ask", str(doc), "When does the lease end?", "--max-new-tokens", "10", "--no-stream")
    assert streamed.exit_code == whole.exit_code == 0
    assert streamed.stdout.strip() == whole.stdout.strip() != ""
    other = gali("ask", str(doc), "Who repairs the roof?", "--max-new-tokens", "10")
    assert other.exit_code == 0
    assert gali("ask", str(doc), "  ").exit_code == 2


def test_sampling_is_reproducible_with_a_seed(gali, doc):
    runs = [gali("summarize", str(doc), "--max-new-tokens", "12", "--temperature", "1.5", "--seed", seed).stdout
            for seed in ["5", "5", "6"]]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_ppl(gali, doc):
    single = gali("ppl", str(doc))
    assert single.exit_code == 0 and float(single.stdout) > 1
    as_json = json.loads(gali("ppl", str(doc), "--json").stdout)
    assert as_json["ppl"] == pytest.approx(float(single.stdout), rel=1e-3)
    assert as_json["method"] == "gali" and as_json["tokens"] > 100
    table = gali("ppl", str(doc), "--lengths", "16,32,64", "--method", "original")
    assert table.exit_code == 0 and all(str(n) in table.stdout for n in (16, 32, 64))
    results = json.loads(gali("ppl", str(doc), "--lengths", "16,32,64", "--json").stdout)["results"]
    assert [(r["method"], r["length"]) for r in results] == [("gali", 16), ("gali", 32), ("gali", 64)]
    limited = gali("ppl", str(doc), "--max-tokens", "50", "--json")
    assert json.loads(limited.stdout)["tokens"] == 50 and "first 50 of" in limited.stderr
    assert gali("ppl", str(doc), "--lengths", "100k").exit_code == 2
    assert gali("ppl", str(doc), "--lengths", "two").exit_code == 2


def test_info(gali, tiny_model_dir):
    facts = json.loads(gali("info", "--json", "--chunk-size", "8").stdout)
    assert facts["train_len"] == 32 and facts["architecture"] == "LlamaForCausalLM"
    assert facts["gali"]["chunk_size"] == 8 and facts["gali"]["local_window"] == 0
    assert facts["device"] in ("cpu", "cuda") and "bitsandbytes" in facts["bitsandbytes"]
    text = gali("info")
    assert text.exit_code == 0 and "train_len" in text.stdout
    assert gali("info", env={"GALI_MODEL": str(tiny_model_dir)}, model=False).exit_code == 0


def test_standard_input_and_pdfs(gali, tmp_path):
    assert gali("summarize", "-", "--max-new-tokens", "4", input=DOCUMENT).exit_code == 0
    pdf = make_pdf(tmp_path / "lease.pdf", [DOCUMENT[:300], None, DOCUMENT[300:600]])
    result = gali("ask", str(pdf), "When?", "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0 and "no text on page 2" in result.stderr
    assert json.loads(result.stdout)["document"]["pages"] == 3
    locked = make_pdf(tmp_path / "locked.pdf", [DOCUMENT[:300]], password="pw")
    refused = gali("summarize", str(locked))
    assert refused.exit_code == 3 and "--password" in refused.stderr and refused.stdout == ""
    assert gali("summarize", str(locked), "--password", "pw", "--max-new-tokens", "4").exit_code == 0


def test_bad_inputs_exit_3_with_one_line(gali, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 8)
    scan = make_pdf(tmp_path / "scan.pdf", [None])
    for path, message in [(tmp_path / "nope.txt", "no such file"), (tmp_path / "empty.txt", "is empty"),
                          (tmp_path / "blob.bin", "binary"), (tmp_path, "directory"), (scan, "OCR")]:
        result = gali("summarize", str(path))
        assert result.exit_code == 3, (path, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1 and not result.stdout


def test_usage_errors_exit_2_before_anything_is_read(gali, tmp_path):
    missing = str(tmp_path / "does-not-matter.txt")
    for args in [("--temperature", "-1"), ("--chunk-size", "0"), ("--local-window", "40"), ("--method", "magic"),
                 ("--top-p", "2"), ("--train-len", "64"), ("--quantize", "3bit")]:
        result = gali("summarize", missing, *args)
        assert result.exit_code == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_model_problems_exit_4(gali, doc, tmp_path):
    result = gali("summarize", str(doc), "-m", str(tmp_path / "no-model-here"), model=False)
    assert result.exit_code == 4 and "no such directory" in result.stderr
    MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    result = gali("summarize", str(doc), "-m", str(tmp_path / "m"), model=False)
    assert result.exit_code == 4 and "'mistral' model" in result.stderr


def test_out_of_memory_suggests_quantizing(gali, doc, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cli, "stream_generate", out_of_memory)
    result = gali("summarize", str(doc))
    assert result.exit_code == 4 and "--quantize 4bit" in result.stderr


def test_unexpected_errors_are_one_line_unless_debugging(gali, doc, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something odd")

    monkeypatch.setattr(cli, "stream_generate", broken)
    result = gali("summarize", str(doc))
    assert result.exit_code == 1 and "RuntimeError: something odd" in result.stderr
    assert "Traceback" not in result.stderr and "GALI_DEBUG=1" in result.stderr
    assert isinstance(gali("summarize", str(doc), env={"GALI_DEBUG": "1"}).exception, RuntimeError)


def test_interrupt_keeps_what_was_printed(gali, doc, monkeypatch):
    def interrupted(*args, **kwargs):
        yield TextPiece("The lease")
        yield TextPiece(" ends")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "stream_generate", interrupted)
    result = gali("summarize", str(doc))
    assert result.exit_code == 130 and result.stdout == "The lease ends\n"


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_quantized_on_cpu(gali, doc, bits):
    result = gali("summarize", str(doc), "--quantize", bits, "--device", "cpu", "--max-new-tokens", "4", "-v")
    assert result.exit_code == 0, result.stderr
    assert "peak memory" in result.stderr


def subprocess_gali(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gali_cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, **kwargs)


def test_real_process_separates_stdout_and_stderr(tiny_model_dir, doc):
    result = subprocess_gali("summarize", str(doc), "-m", str(tiny_model_dir), "--max-new-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) >= {"answer", "model", "method", "finish_reason", "prompt_tokens"}
    assert "tokens" in result.stderr
    offline = subprocess_gali("summarize", str(doc), "-m", "no-such-org/no-such-model",
                              env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 4 and "no-such-org/no-such-model" in offline.stderr
    assert len(offline.stderr.strip().splitlines()) == 1


def test_ctrl_c_while_streaming(tiny_model_dir, doc):
    process = subprocess.Popen(
        [sys.executable, "-m", "gali_cli", "summarize", str(doc), "-m", str(tiny_model_dir), "--max-new-tokens",
         "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    first = process.stdout.read(1)  # the answer has started
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert first and (first + rest).endswith(b"\n")
