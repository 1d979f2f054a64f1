"""The commands on a CUDA GPU, as a user with one runs them (skipped without one; conftest runs every other test's
commands on the CPU). Short documents and long ones, every method, both decoding routes of the graphed step:
PyTorch attention (head dim 16, which the Triton kernel does not take) and the Triton kernel (head dim 64).

A first run of the suite on a GPU found `gali ask` failing on any document shorter than a block of 256 keys
("view size is not compatible"): nothing here compares with the CPU to the last digit, but every command must
answer, and float32 perplexities must agree with the CPU's to float32 rounding."""

import json

import pytest
import torch
from helpers.tiny_models import save_tiny_llama
from typer.testing import CliRunner

from gali_cli import cli
from gali_cli.methods.registry import NAMES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHORT = "The lease ends in March. The tenant pays rent monthly.\n" * 3  # well under 256 tokens
LONG = "The lease ends in March. The tenant pays rent monthly, and the landlord repairs the roof.\n" * 40


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny random Llama with head dim 64 (4/2 heads of 64), window 32: the Triton decoding kernel takes it."""
    return save_tiny_llama(tmp_path_factory.mktemp("wide-llama"), heads=4, kv_heads=2, hidden=256)


@pytest.fixture
def on_gpu(tmp_path, monkeypatch):
    """Run `gali ARGS` on the GPU with a document of `text`; stdout and stderr apart."""
    monkeypatch.setenv("GALI_DEVICE", "cuda")

    def run(model_dir, text: str, *args: str):
        path = tmp_path / "doc.txt"
        path.write_text(text)
        command = [args[0], str(path), *args[1:], "-m", str(model_dir)]  # conftest gives each test its own cache
        return CliRunner().invoke(cli.app, command, env={"COLUMNS": "200"})

    return run


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["short", "long"])
@pytest.mark.parametrize("model", ["tiny_model_dir", "wide_model_dir"])
@pytest.mark.parametrize("method", ["gali", "self-extend", "original"])
def test_ask_answers_on_the_gpu(on_gpu, request, model, text, method):
    result = on_gpu(request.getfixturevalue(model), text, "ask", "When does the lease end?", "--method", method,
                    "--max-new-tokens", "12", "--json", "-v")
    assert result.exit_code == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["answer"] and answer["generated_tokens"] == 12
    assert "CUDA graph" in answer["decode_path"], answer["decode_path"]


@pytest.mark.parametrize("noise", ["--noise", "--no-noise"])
def test_summarize_streams_on_the_gpu_in_half_precision(on_gpu, wide_model_dir, noise):
    result = on_gpu(wide_model_dir, LONG, "summarize", "--method", "gali", noise, "--dtype", "bfloat16",
                    "--max-new-tokens", "16")
    assert result.exit_code == 0 and result.stdout.strip(), result.stderr


def test_every_methods_perplexity_equals_the_cpus_in_float32(on_gpu, wide_model_dir, monkeypatch):
    args = ["ppl", "--method", "all", "--lengths", "16,64,256", "--dtype", "float32", "--json"]
    gpu = on_gpu(wide_model_dir, LONG, *args)
    monkeypatch.setenv("GALI_DEVICE", "cpu")
    cpu = on_gpu(wide_model_dir, LONG, *args)
    assert gpu.exit_code == cpu.exit_code == 0, gpu.stderr + cpu.stderr
    rows = [(json.loads(run.stdout)["results"]) for run in (gpu, cpu)]
    assert [r["method"] for r in rows[0]] == [r["method"] for r in rows[1]] and len(rows[0]) == 3 * len(NAMES)
    for on_cuda, on_cpu in zip(*rows):
        assert on_cuda["ppl"] == pytest.approx(on_cpu["ppl"], rel=2e-4), on_cuda["method"]


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_a_bitsandbytes_model_answers_on_the_gpu(on_gpu, wide_model_dir, bits):
    pytest.importorskip("bitsandbytes")
    result = on_gpu(wide_model_dir, LONG, "ask", "When does the lease end?", "--quantize", bits,
                    "--max-new-tokens", "8", "-v")
    assert result.exit_code == 0 and result.stdout.strip(), result.stderr
