"""The `gali` command, in-process through Typer's runner and as a real subprocess, on a tiny random Llama."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers.documents import make_pdf
from helpers.timing import scaled
from rich.console import Console
from transformers import Phi3Config, Phi3ForCausalLM
from typer.testing import CliRunner

import gali_cli.cli as cli
import gali_cli.conversation as conversation
import gali_cli.runs.common as common
from gali_cli import display
from gali_cli.display import short_path
from gali_cli.generate import Finished, TextPiece
from gali_cli.methods.registry import NAMES
from gali_cli.model.families import FAMILIES
from gali_cli.seam_check import family_cases

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
    assert answer["method"] == "gali" and answer["settings"] == {
        "train_len": 32, "chunk_size": 8, "local_window": 16, "noise": False}
    assert "stopped at --max-new-tokens 8" in plain.stderr
    assert answer["document"] == {"name": str(doc), "kind": "text", "pages": 0}
    assert answer["prompt_tokens"] > 32 and answer["peak_memory_mib"] > 0


def test_the_input_line_names_the_window_the_method_stays_within(gali, doc):
    """A lowered --train-len is the window GALI reads within: the document's length is said against it; the
    original model ignores it."""
    narrowed = gali("summarize", str(doc), "--max-new-tokens", "2", "--train-len", "16")
    assert narrowed.exit_code == 0, narrowed.stderr
    tokens = int(narrowed.stderr.split(" tokens, ")[0].split()[-1])
    assert f"{tokens / 16:.1f}x the 16-token window of --train-len (the model's: 32) (gali)" in narrowed.stderr
    original = gali("summarize", str(doc), "--max-new-tokens", "2", "--train-len", "16", "--method", "original")
    assert (f"{tokens / 32:.1f}x the model's 32-token window (original, unrestricted: --train-len 16 does not "
            "apply to it)") in original.stderr


def test_original_under_a_lowered_train_len_is_labelled_with_its_own_window(gali, doc, tmp_path):
    """--train-len narrows every method but the original model, which reads with its own window (the tiny model's:
    32): the input line, the table, --json and the plot say so."""
    args = ("ppl", str(doc), "--method", "gali,original", "--lengths", "16,64", "--train-len", "16")
    table = gali(*args)
    assert table.exit_code == 0, table.stderr
    assert "original (32-token window)" in table.stdout and "gali (" not in table.stdout
    assert "(original, unrestricted: --train-len 16 does not apply to it)" in table.stderr
    rows = json.loads(gali(*args, "--json").stdout)["results"]
    assert {(row["method"], row.get("window")) for row in rows} == {("gali", None), ("original", 32)}
    plain = gali("ppl", str(doc), "--method", "gali,original", "--lengths", "16,64")  # no --train-len: no label
    assert "original" in plain.stdout and "window" not in plain.stdout


def test_several_methods_show_how_many_are_done_and_the_time_left(gali, doc):
    """gali ppl --method a,b,c: each method's bar and its closing line say k/N, and the rest's time left."""
    result = gali("ppl", str(doc), "--method", "gali,original,ntk", "--lengths", "16,64")
    assert result.exit_code == 0, result.stderr
    done = [line for line in result.stderr.splitlines() if "done in" in line]
    assert [line.split(":")[0] for line in done] == ["[1/3] gali", "[2/3] original", "[3/3] ntk"]
    assert "2 more, " in done[0] and ("left" in done[0] or "almost done" in done[0]) and "more" not in done[2]
    assert "[2/3] original: 64/64 tokens, ppl" in result.stderr  # the bar's lines where stderr is no terminal
    single = gali("ppl", str(doc), "--lengths", "16,64")
    assert "done in" not in single.stderr and "[1/1]" not in single.stderr


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
    greedy = gali("summarize", str(doc), "--max-new-tokens", "12").stdout
    for narrow in (["--top-k", "1"], ["--top-p", "0.000001"]):  # sampling flags reach the sampler
        assert gali("summarize", str(doc), "--max-new-tokens", "12", "--temperature", "2", *narrow).stdout == greedy


def test_top_p_0_is_greedy_and_a_temperature_past_2_is_refused(gali, doc, capsys):
    """--help shows --top-p [0.0<=x<=1.0], yet 0 was refused by the sampler; the server treats it as greedy, and so
    does the CLI now. --temperature inf or 1e308 sampled every token alike: past 2 (the server's bound, and OpenAI's)
    it is a usage error, and so is NaN."""
    greedy = gali("summarize", str(doc), "--max-new-tokens", "12").stdout
    top_p_0 = gali("summarize", str(doc), "--max-new-tokens", "12", "--temperature", "1.5", "--top-p", "0")
    assert top_p_0.exit_code == 0, top_p_0.stderr
    assert top_p_0.stdout == greedy
    for option, value in [("--temperature", "inf"), ("--temperature", "1e308"), ("--temperature", "2.01"),
                          ("--temperature", "nan"), ("--top-p", "nan")]:
        for command in (["summarize", str(doc)], ["serve", "--port", "0"]):  # the server's defaults alike
            assert cli.main([*command, "-m", "demo", option, value]) == 2, (command, option, value)
            refused = capsys.readouterr().err
            assert f"Invalid value for '{option}'" in refused and len(refused.strip().splitlines()) == 1


def test_sampling_seeds_share_a_document_state_and_noise_seeds_do_not(gali, doc, tmp_path):
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}

    def ask(*options: str) -> dict:
        result = gali("ask", str(doc), "When?", "--max-new-tokens", "6", "--json", *options, env=env)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    for noise in ("--noise", "--no-noise"):
        first, second = (ask(noise, "--temperature", "0.8", "--seed", seed) for seed in ("1", "2"))
        assert first["cached_tokens"] == 0 and second["cached_tokens"] > 32  # --seed 2 did not read it again
    assert second["settings"] == {"train_len": 32, "chunk_size": 8, "local_window": 16, "noise": False}
    assert ask("--noise-seed", "3")["cached_tokens"] > 32  # without noise (the default) its seed changes nothing
    other_noise = ask("--noise", "--noise-seed", "1")
    assert other_noise["cached_tokens"] == 0 and other_noise["settings"]["noise_seed"] == 1
    assert gali("ppl", str(doc), "--noise-seed", "2").exit_code == 0
    assert gali("ppl", str(doc), "--seed", "2").exit_code == 2  # nothing is sampled there


def test_the_answer_stays_on_stdout_when_stderr_is_a_terminal(gali, doc, monkeypatch):
    monkeypatch.setattr(display, "err", Console(stderr=True, force_terminal=True, soft_wrap=True))
    quiet = gali("summarize", str(doc), "--max-new-tokens", "6", "--json")
    streamed = gali("summarize", str(doc), "--max-new-tokens", "6")
    assert streamed.exit_code == 0 and streamed.stdout == json.loads(quiet.stdout)["answer"] + "\n"


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
    cut = gali("ppl", str(doc), "--lengths", "16,64", "--json")  # the largest length is all it reads
    assert json.loads(cut.stdout)["tokens"] == 64 and "first 64 of" in cut.stderr
    for bad in (["--lengths", "100k"], ["--lengths", "two"], ["--lengths", "64", "--max-tokens", "32"],
                ["--json", "--csv"], ["--method", "gali,magic"]):
        assert gali("ppl", str(doc), *bad).exit_code == 2, bad


def test_every_method_side_by_side(gali, doc, tmp_path):
    lengths = ["--lengths", "8,32,128"]
    rows = json.loads(gali("ppl", str(doc), "--method", "all", *lengths, "--json").stdout)["results"]
    assert [r["method"] for r in rows[::3]] == list(NAMES) and {r["length"] for r in rows} == {8, 32, 128}
    by_method = {(r["method"], r["length"]): r["ppl"] for r in rows}
    # Each is exact where it promises: GALI up to train_len (32), SelfExtend and ReRoPE within their neighbour window
    # (32 / 4), Dual Chunk Attention within one chunk (3/4 of 32). (Dynamic NTK rescales a whole forward from its
    # longest position, so in one pass over 128 tokens even the first 32 move.)
    for method, length in [("gali", 32), ("self-extend", 8), ("chunk-llama", 8), ("rerope", 8), ("leaky-rerope", 8)]:
        assert by_method[(method, length)] == pytest.approx(by_method[("original", length)], rel=1e-5), method
    assert by_method[("gali", 128)] != pytest.approx(by_method[("original", 128)], rel=1e-3)
    csv = gali("ppl", str(doc), "--method", "gali,yarn", *lengths, "--csv").stdout.splitlines()
    assert csv[0] == "method,length,ppl" and len(csv) == 7 and csv[1].startswith("gali,8,")
    table = gali("ppl", str(doc), "--method", "gali,original", *lengths)
    assert "gali" in table.stdout and "original" in table.stdout and table.stdout.count("\n") > 4
    plot = tmp_path / "ppl.png"
    assert gali("ppl", str(doc), "--method", "gali,original", *lengths, "--plot", str(plot)).exit_code == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert gali("summarize", str(doc), "--method", "gali,yarn").exit_code == 2  # one method for an answer
    ours = json.loads(gali("ppl", str(doc), "--method", "rerope,leaky-rerope,dpe", *lengths, "--json", "--no-logn",
                           "--neighbor-window", "6", "--dpe-scales", "3,3,5,5").stdout)
    assert ours["settings"] == {
        "rerope": {"train_len": 32, "neighbor_window": 6, "logn": False},
        "leaky-rerope": {"train_len": 32, "neighbor_window": 6, "leaky_factor": 16, "logn": False},
        "dpe": {"train_len": 32, "neighbor_window": 6, "dpe_scales": [3, 3, 5, 5], "dpe_published": None}}


@pytest.mark.parametrize("method", ["rerope", pytest.param("leaky-rerope", marks=pytest.mark.slow), "dpe", "string"])
def test_new_methods_answer_and_chat_through_the_document_cache(gali, doc, method):
    """Their positions depend on (i, j) only: the document's state is stored, then reused by a second question with
    the same answer as reading it again."""
    first = gali("ask", str(doc), "When does the lease end?", "--method", method, "--max-new-tokens", "6", "--json")
    again = gali("ask", str(doc), "When does the lease end?", "--method", method, "--max-new-tokens", "6", "--json")
    fresh = gali("ask", str(doc), "When does the lease end?", "--method", method, "--max-new-tokens", "6", "--json",
                 "--no-cache")
    answers = [json.loads(result.stdout) for result in (first, again, fresh)]
    assert answers[0]["cached_tokens"] == 0 and answers[1]["cached_tokens"] > 32  # the document, from the cache
    assert answers[0]["answer"] == answers[1]["answer"] == answers[2]["answer"]


def test_lampe_answers_without_the_document_cache(gali, doc):
    """LaMPE's map follows the input's length: nothing is stored, each question reads the document again, and the
    answer is a fresh read's."""
    runs = [gali("ask", str(doc), "When does the lease end?", "--method", "lampe", "--max-new-tokens", "6", "--json",
                 *extra) for extra in ((), (), ("--no-cache",))]
    answers = [json.loads(result.stdout) for result in runs]
    assert [answer["cached_tokens"] for answer in answers] == [0, 0, 0]
    assert answers[0]["answer"] == answers[1]["answer"] == answers[2]["answer"]
    preview = json.loads(gali("info", "--json", "--method", "lampe").stdout)["lampe"]
    assert preview == {"train_len": 32, "neighbor_window": 2, "lampe_tail": 1, "lampe_length": 6,
                       "lampe_published": None}


def test_prefill_cuts_forwards_only_at_chunk_boundaries(gali, doc, tiny_model_dir):
    """With chunks of 5, a 256-token forward would end inside a chunk; the CLI must cut at 32 + 5k instead."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from gali_cli.config import MethodSettings
    from gali_cli.patching import apply_method

    long_doc = doc.parent / "long.txt"
    long_doc.write_text(DOCUMENT * 3)
    got = json.loads(gali("ppl", str(long_doc), "--chunk-size", "5", "--no-noise", "--json").stdout)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(DOCUMENT * 3, return_tensors="pt").input_ids
    assert ids.shape[1] == got["tokens"] > 300
    apply_method(model, "gali", MethodSettings(chunk_size=5, noise=False), ids.shape[1])
    logits = model(ids).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:]).exp().item()
    assert got["ppl"] == pytest.approx(expected, rel=1e-4)


def test_info(gali, tiny_model_dir):
    facts = json.loads(gali("info", "--json", "--chunk-size", "6").stdout)
    assert facts["train_len"] == 32 and facts["architecture"] == "LlamaForCausalLM"
    assert facts["gali"]["chunk_size"] == 6 and facts["gali"]["local_window"] == 16
    assert facts["device"] in ("cpu", "cuda") and "bitsandbytes" in facts["bitsandbytes"]
    assert "noisy_attention" not in facts  # noise is off: its path is no fact of this run (-v shows it)
    facts = json.loads(gali("info", "--json", "-v").stdout)
    if facts["device"] == "cpu":
        assert facts["noisy_attention"].startswith(("native CPU kernel (built with", "PyTorch ("))
    forced = json.loads(gali("info", "--json", "--noise", env={"GALI_KERNEL": "torch"}).stdout)
    assert forced["noisy_attention"] == "PyTorch (GALI_KERNEL=torch)"
    if facts["device"] == "cpu":
        forced = json.loads(gali("info", "--json", "--noise",
                                 env={"GALI_KERNEL": "triton", "TRITON_INTERPRET": "0"}).stdout)
        assert forced["noisy_attention"] in ("error: GALI_KERNEL=triton needs CUDA",
                                             "PyTorch (triton is not installed)")
    previews = json.loads(gali("info", "--json", "--method", "all", "--leaky-factor", "4").stdout)
    assert previews["rerope"] == {"train_len": 32, "neighbor_window": 8, "logn": True}
    assert previews["leaky-rerope"]["reaches"] == 8 + 4 * (31 - 8) + 1  # how far k = 4 takes the window
    assert previews["dpe"]["neighbor_window"] == 4 and previews["dpe"]["dpe_published"] is None
    assert previews["string"] == {"train_len": 32, "shifted_offset": 10, "local_window": 5, "string_scale": True,
                                  "reaches": 37, "string_published": None}
    text = gali("info")
    assert text.exit_code == 0 and "train_len" in text.stdout
    assert gali("info", env={"GALI_MODEL": str(tiny_model_dir)}, model=False).exit_code == 0


def test_standard_input_and_pdfs(gali, tmp_path):
    assert gali("summarize", "-", "--max-new-tokens", "4", input=DOCUMENT).exit_code == 0
    pdf = make_pdf(tmp_path / "lease.pdf", [DOCUMENT[:300], None, DOCUMENT[300:600]])
    result = gali("ask", str(pdf), "When?", "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0 and "read text from 2 of 3 pages; none on page 2 (scanned images)" in result.stderr
    assert json.loads(result.stdout)["document"]["pages"] == 3
    locked = make_pdf(tmp_path / "locked.pdf", [DOCUMENT[:300]], password="pw")
    refused = gali("summarize", str(locked))
    assert refused.exit_code == 3 and "--password" in refused.stderr and refused.stdout == ""
    assert gali("summarize", str(locked), "--password", "pw", "--max-new-tokens", "4").exit_code == 0


def test_a_pdf_mostly_without_text_exits_3_unless_partial_reading_is_allowed(gali, tmp_path):
    path = make_pdf(tmp_path / "scanned.pdf", ["The lease ends in March.", None, None])
    refused = gali("summarize", str(path), "--max-new-tokens", "2")
    assert refused.exit_code == 3 and not refused.stdout
    assert "text on only 1 of 3 pages (scanned images on the others)" in refused.stderr
    assert "--allow-partial" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    read = gali("summarize", str(path), "--max-new-tokens", "2", "--allow-partial")
    assert read.exit_code == 0, read.stderr
    assert "read text from 1 of 3 pages; none on pages 2, 3 (scanned images)" in read.stderr


def test_bad_inputs_exit_3_with_one_line(gali, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7\n%broken\n1 0 obj << /Type /Catalog")
    scan = make_pdf(tmp_path / "scan.pdf", [None])
    locked = make_pdf(tmp_path / "locked.pdf", [DOCUMENT[:100]], password="pw")
    for args, message in [([tmp_path / "nope.txt"], "no such file"), ([tmp_path / "empty.txt"], "is empty"),
                          ([tmp_path / "blob.bin"], "binary"), ([tmp_path], "directory"), ([scan], "OCR"),
                          ([tmp_path / "broken.pdf"], "not a readable PDF"),
                          ([locked, "--password", "nope"], "wrong password")]:
        result = gali("summarize", *map(str, args))
        assert result.exit_code == 3, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1 and not result.stdout


def test_usage_errors_exit_2_before_anything_is_read(gali, tmp_path):
    missing = str(tmp_path / "does-not-matter.txt")
    for args in [("--temperature", "-1"), ("--chunk-size", "0"), ("--local-window", "40"), ("--method", "magic"),
                 ("--top-p", "2"), ("--train-len", "64"), ("--quantize", "3bit"), ("--factor", "0.5"),
                 ("--dpe-scales", "2,x"), ("--leaky-factor", "1"), ("--method", "dpe", "--neighbor-window", "40"),
                 ("--method", "dpe", "--dpe-scales", "2,2,2")]:
        result = gali("summarize", missing, *args)
        assert result.exit_code == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["summarize", "x", "--factor", "abc"], ["ppl", "x", "--lengths", "1.5k"],
                                  ["ask", "x"], ["summarize", "x", "--max-new-tokens", "0"], ["nonsense"],
                                  ["ask", "x", " "]])
def test_usage_errors_are_one_line_from_the_executable(args, capsys, tiny_model_dir):
    assert cli.main([*args, "-m", str(tiny_model_dir)] if args[0] != "nonsense" else args) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("gali: ") and not captured.out


def test_model_problems_exit_4(gali, doc, tmp_path):
    result = gali("summarize", str(doc), "-m", str(tmp_path / "no-model-here"), model=False)
    assert result.exit_code == 4 and "no such file or directory" in result.stderr
    phi3 = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0)
    Phi3ForCausalLM(phi3).save_pretrained(tmp_path / "m")
    result = gali("summarize", str(doc), "-m", str(tmp_path / "m"), model=False)
    assert result.exit_code == 4
    assert "'phi3' model; gali supports Llama, Mistral, Qwen2, Qwen3, Gemma 3" in result.stderr


def test_out_of_memory_suggests_quantizing(gali, doc, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(conversation, "stream_generate", out_of_memory)
    result = gali("summarize", str(doc))
    assert result.exit_code == 4 and "--quantize 4bit" in result.stderr


def test_unexpected_errors_are_one_line_unless_debugging(gali, doc, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something odd")

    monkeypatch.setattr(conversation, "stream_generate", broken)
    result = gali("summarize", str(doc))
    assert result.exit_code == 1 and "RuntimeError: something odd" in result.stderr
    assert "Traceback" not in result.stderr and "GALI_DEBUG=1" in result.stderr
    assert isinstance(gali("summarize", str(doc), env={"GALI_DEBUG": "1"}).exception, RuntimeError)


def test_interrupt_keeps_what_was_printed(gali, doc, monkeypatch):
    def interrupted(*args, **kwargs):
        yield TextPiece("The lease")
        yield TextPiece(" ends")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversation, "stream_generate", interrupted)
    result = gali("summarize", str(doc))
    assert result.exit_code == 130 and result.stdout == "The lease ends\n"


@pytest.mark.parametrize("command", [["summarize"], ["ask", "When does the lease end?"]])
def test_ctrl_c_during_the_answer_keeps_the_documents_read(gali, doc, tmp_path, monkeypatch, command):
    """The document's state is stored once it is read, before the answer: Ctrl-C in the answer does not lose it,
    and the next question starts from it."""
    import gali_cli.generate as generate

    real_decode = generate.decode

    def interrupted(*args, **kwargs):
        yield from []
        raise KeyboardInterrupt

    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    monkeypatch.setattr(generate, "decode", interrupted)
    stopped = gali(command[0], str(doc), *command[1:], env=env)
    assert stopped.exit_code == 130, stopped.stderr
    entries = json.loads(gali("cache", "list", "--json", env=env, model=False).stdout)["entries"]
    assert [entry["document"] for entry in entries] == [str(doc.resolve())]
    monkeypatch.setattr(generate, "decode", real_decode)
    again = gali("ask", str(doc), "Who repairs the roof?", "--max-new-tokens", "2", env=env)
    assert again.exit_code == 0 and "document state from the cache" in again.stderr


@pytest.mark.parametrize("stream", [[], ["--no-stream"]], ids=["streamed", "at-the-end"])
def test_an_answer_starts_at_its_first_word(gali, doc, monkeypatch, stream):
    def blank_first(*args, **kwargs):
        for text in ["\n", "\n ", " The lease", " ends."]:
            yield TextPiece(text)
        yield Finished("stop", 10, 10, 4, 0.1, 0.1, 0)

    monkeypatch.setattr(conversation, "stream_generate", blank_first)
    result = gali("summarize", str(doc), "--no-cache", *stream)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "The lease ends.\n"


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_quantized_on_cpu_is_refused_with_what_to_use(gali, doc, bits):
    """bitsandbytes on the CPU ran several times slower than the float model and saved next to no memory (issue
    50): refused in one line naming the alternatives, as a usage error (load_model itself still takes it: the
    tests of bitsandbytes' loading run on the CPU)."""
    result = gali("summarize", str(doc), "--quantize", bits, "--device", "cpu", "--max-new-tokens", "4", "-v")
    assert result.exit_code == 2 and not result.stdout
    assert result.stderr == (f"gali: --quantize {bits} is for CUDA GPUs: on the CPU bitsandbytes runs several times "
                             "slower than the float model. Leave --quantize out, or give a GGUF file (-m "
                             "FILE.gguf)\n")


def subprocess_gali(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gali_cli", *args], capture_output=True, text=True,
                          timeout=scaled(300), env={**os.environ, **(env or {})}, **kwargs)


@pytest.mark.slow
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
    process = subprocess.Popen(  # SIGINT as at a shell's prompt, even where pytest runs as a background job
        [sys.executable, "-m", "gali_cli", "summarize", str(doc), "-m", str(tiny_model_dir), "--max-new-tokens",
         "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = process.stdout.read(1)  # the answer has started
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=scaled(60))
    assert process.returncode == 130, stderr
    assert first and (first + rest).endswith(b"\n")


@pytest.mark.parametrize("words", [["--help"], ["summarize", "DOC", "--max-new-tokens", "40", "--no-cache"]],
                         ids=["help", "answer"])
def test_a_reader_that_stops_early_ends_it_quietly(tiny_model_dir, doc, words):
    """`gali ... | head`: head closes the pipe once it has its lines, which is a normal end, exit 0 and silent."""
    words = [str(doc) if word == "DOC" else word for word in words]
    model = ["-m", str(tiny_model_dir)] if "summarize" in words else []
    process = subprocess.Popen([sys.executable, "-m", "gali_cli", *words, *model], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before gali writes its first byte
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=scaled(300)) == 0, stderr
    assert "Broken" not in stderr and "Error" not in stderr and "unexpected" not in stderr


def test_the_second_question_reuses_the_document(gali, doc, tmp_path):
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    first = gali("ask", str(doc), "When does the lease end?", "--max-new-tokens", "6", "--json", env=env)
    second = gali("ask", str(doc), "Who repairs the roof?", "--max-new-tokens", "6", "--json", env=env)
    uncached = gali("ask", str(doc), "Who repairs the roof?", "--max-new-tokens", "6", "--json", "--no-cache",
                    env=env)
    assert first.exit_code == second.exit_code == uncached.exit_code == 0, second.stderr
    first, second, uncached = (json.loads(run.stdout) for run in (first, second, uncached))
    assert first["cached_tokens"] == 0 and second["cached_tokens"] > 32 and uncached["cached_tokens"] == 0
    assert second["answer"] == uncached["answer"]
    listed = json.loads(gali("cache", "list", "--json", env=env, model=False).stdout)
    assert len(listed["entries"]) == 1 and listed["entries"][0]["document"] == str(doc.resolve())
    assert listed["entries"][0]["tokens"] == second["cached_tokens"]
    table = gali("cache", "list", env=env, model=False)
    # shown as one would type it from here (relative to the working directory when that is shorter), never cut
    assert short_path(str(doc.resolve())) in table.stdout and "1 cached document state" in table.stderr
    cleared = gali("cache", "clear", env=env, model=False)
    assert cleared.exit_code == 0 and "Removed 1 cached document state" in cleared.stderr
    assert json.loads(gali("cache", "list", "--json", env=env, model=False).stdout)["entries"] == []


def test_a_damaged_cache_entry_is_rebuilt(gali, doc, tmp_path):
    states = tmp_path / "states"
    first = gali("summarize", str(doc), "--max-new-tokens", "6", "--cache-dir", str(states))
    entry, = states.glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[:200])
    again = gali("summarize", str(doc), "--max-new-tokens", "6", "--cache-dir", str(states))
    assert again.exit_code == 0 and again.stdout == first.stdout
    assert "warning: ignoring the damaged document cache entry" in again.stderr
    assert len(list(states.glob("*.safetensors"))) == 1  # rebuilt


def test_cache_clear_says_what_it_could_not_remove(gali, doc, tmp_path, monkeypatch):
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    for question in ("When?", "Who?"):
        assert gali("ask", str(doc), question, "--max-new-tokens", "2", "--method", "original", env=env).exit_code == 0
    assert gali("ask", str(doc), "Who?", "--max-new-tokens", "2", env=env).exit_code == 0  # a second entry (gali)
    unlink = Path.unlink
    stuck = []

    def refuse_one(path, missing_ok=False):  # as a directory without write permission would (root ignores modes)
        if not stuck:
            stuck.append(path)
        if path in stuck:
            raise PermissionError(13, "Permission denied")
        unlink(path, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_one)
    result = gali("cache", "clear", env=env, model=False)
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "unexpected" not in result.stderr
    assert result.stderr.startswith("gali: removed 1 cached document state (")
    assert "but not the other 1 (" in result.stderr and f"Permission denied ({stuck[0]})" in result.stderr


def test_no_cache_writes_nothing_and_a_bad_cache_dir_is_a_usage_error(gali, doc, tmp_path):
    states = tmp_path / "states"
    assert gali("summarize", str(doc), "--max-new-tokens", "2", "--no-cache", "--cache-dir", str(states)).exit_code == 0
    assert not states.exists()
    (tmp_path / "file").write_text("x")
    result = gali("summarize", str(doc), "--cache-dir", str(tmp_path / "file"))
    assert result.exit_code == 2 and f"gali: --cache-dir {tmp_path / 'file'}: not a directory" in result.stderr
    for where in ("file", "file/below"):  # the variable, named as the variable (it was called --cache-dir)
        result = gali("summarize", str(doc), env={"GALI_CACHE_DIR": str(tmp_path / where)})
        assert result.exit_code == 2 and f"gali: GALI_CACHE_DIR {tmp_path / where}: " in result.stderr, result.stderr
    result = gali("summarize", str(doc), env={"GALI_CACHE_LIMIT": "plenty"})
    assert result.exit_code == 2 and "GALI_CACHE_LIMIT" in result.stderr


def test_chat_answers_each_question_in_turn(gali, doc):
    questions = "When does the lease end?\n\nWho repairs the roof?\n"
    result = gali("chat", str(doc), "--max-new-tokens", "5", "--json", input=questions)
    assert result.exit_code == 0, result.stderr
    turns = [json.loads(line) for line in result.stdout.splitlines()]
    assert [turn["question"] for turn in turns] == ["When does the lease end?", "Who repairs the roof?"]
    assert [turn["turn"] for turn in turns] == [1, 2] and turns[1]["cached_tokens"] > turns[0]["prompt_tokens"]
    single = json.loads(gali("ask", str(doc), "When does the lease end?", "--max-new-tokens", "5", "--json").stdout)
    assert turns[0]["answer"] == single["answer"]  # the first turn is `gali ask`
    plain = gali("chat", str(doc), "--max-new-tokens", "5", input=questions)
    assert plain.stdout.splitlines() == [turn["answer"] for turn in turns]
    assert gali("chat", "-", input=questions).exit_code == 2


def test_cache_list_shows_names_as_they_are(gali, doc, tmp_path):
    odd = tmp_path / "notes[draft].txt"
    odd.write_text(DOCUMENT)
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    assert gali("summarize", str(odd), "--max-new-tokens", "2", env=env).exit_code == 0
    assert "notes[draft].txt" in gali("cache", "list", env=env, model=False).stdout


def test_cache_list_names_documents_by_absolute_path_and_never_cuts_them(gali, tmp_path, monkeypatch):
    folder = tmp_path / "a folder with a rather long name" / "and-another-one-below-it"
    folder.mkdir(parents=True)
    name = "CC0-1.0.the-licence-text-of-a-document-whose-name-goes-on-and-on.txt"
    (folder / name).write_text(DOCUMENT)
    (folder / "other.txt").write_text(DOCUMENT.upper())
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    monkeypatch.chdir(folder)
    assert gali("summarize", name, "--max-new-tokens", "2", env=env).exit_code == 0  # a relative name
    batch = gali("summarize", str(folder), "--out", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", env=env)
    assert batch.exit_code == 0
    listed = json.loads(gali("cache", "list", "--json", env=env, model=False).stdout)["entries"]
    assert sorted(entry["document"] for entry in listed) == [str(folder.resolve() / name),
                                                             str(folder.resolve() / "other.txt")]
    piped = gali("cache", "list", env={**env, "COLUMNS": "40"}, model=False).stdout  # into a pipe: whole lines
    assert any(line.split()[0] == name for line in piped.splitlines() if line.strip())
    monkeypatch.setattr(display, "Console", lambda **kwargs: Console(**kwargs, force_terminal=True, width=40))
    narrow = gali("cache", "list", env=env, model=False).stdout  # a narrow terminal: an entry a paragraph
    assert "…" not in narrow and name in narrow.splitlines() and "other.txt" in narrow.splitlines()


@pytest.mark.parametrize("columns, width", [("60", 60), (None, 80), ("200", 200)])
def test_cache_list_into_a_pipe_keeps_to_columns_without_trailing_spaces(gali, doc, tmp_path, columns, width):
    """`gali cache list | less`: a table where it fits COLUMNS (80 without it), else a paragraph an entry, its details
    wrapped at that width; only a name (never cut) may be wider, and no line ends in spaces."""
    # Both caches of this test's own: the user's model cache may hold entries whose long names are lines of their own.
    env = {"GALI_CACHE_DIR": str(tmp_path / "states"), "GALI_MODEL_CACHE": str(tmp_path / "models")}
    assert gali("summarize", str(doc), "--max-new-tokens", "2", env=env).exit_code == 0
    listed = gali("cache", "list", env={**env, "COLUMNS": columns}, model=False)
    assert listed.exit_code == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines and all(line == line.rstrip() for line in lines)
    assert all(len(line) <= width for line in lines if short_path(str(doc)) not in line)
    table = lines[0].split() == ["document", "model", "method", "tokens", "MiB", "last", "used"]
    assert table == (width == 200)
    if not table:
        assert lines[0] == short_path(str(doc)) and lines[1].startswith("  ") and "tokens" in listed.stdout


def test_ctrl_c_in_chat_stops_one_answer(gali, doc, monkeypatch):
    real_ask, calls = conversation.Conversation.ask, []

    def ask(self, instruction, *args, **kwargs):
        calls.append(instruction)
        if len(calls) == 1:
            raise KeyboardInterrupt
        yield from real_ask(self, instruction, *args, **kwargs)

    monkeypatch.setattr(conversation.Conversation, "ask", ask)
    result = gali("chat", str(doc), "--max-new-tokens", "3", input="First?\nSecond?\n")
    assert result.exit_code == 0 and "answer stopped" in result.stderr
    assert len(result.stdout.splitlines()) == 1 and calls[1] == cli.ask_instruction("Second?")


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("noise", [False, True])
def test_info_prints_the_attention_plan(gali, monkeypatch, kernel, noise):
    """gali info's words are the plan's, as the engine decides it for this device, dtype and noise."""
    from gali_cli.engine.attention.plan import decide

    flags = ["--noise"] if noise else []
    facts = json.loads(gali("info", "--json", "-v", *flags, env={"GALI_KERNEL": kernel}).stdout)
    monkeypatch.setenv("GALI_KERNEL", kernel)
    plan = decide(facts["device"], facts["dtype"], forward_only=True, noise=noise)
    assert facts["attention"] == plan.summary() and facts["attention_routes"] == plan.describe()
    assert facts["noisy_attention"] == decide(facts["device"], facts["dtype"], True, noise=True).noisy_words()
    if noise:
        assert f"noisy chunks: {facts['noisy_attention']};" in facts["attention_routes"]
    verbose = gali("info", "-v", *flags, env={"GALI_KERNEL": kernel})
    assert plan.describe() in " ".join(verbose.stdout.split())  # a route a line
    routes = verbose.stdout.split("attention_routes", 1)[1].split("\n")[: plan.describe().count("; ") + 1]
    assert all("; " not in route for route in routes)
    text = gali("info", *flags, env={"GALI_KERNEL": kernel})
    line, = [line for line in text.stdout.splitlines() if line.startswith("attention")]
    assert line.split(None, 1)[1] == plan.summary() and len(line) < 100 and "attention_routes" not in text.stdout
    assert ("noisy_attention" in text.stdout) == noise
    assert ("no noise" in line) != noise


def test_a_mistyped_gali_kernel_fails_before_the_model_loads(gali, doc):
    result = gali("summarize", str(doc), env={"GALI_KERNEL": "fastest"})
    assert result.exit_code == 2 and not result.stdout
    assert result.stderr.strip() == "gali: GALI_KERNEL must be one of auto, triton, native, torch, got 'fastest'"


def test_gali_warnings_are_one_line_on_stderr(gali, doc, monkeypatch):
    """E.g. a fused kernel that failed its first-use check: the run goes on, the user is told once, in one line."""
    import warnings

    import gali_cli.engine.attention.noisy_attention as noisy_attention
    from gali_cli.errors import GaliWarning

    def fall_back(*arguments):
        warnings.warn("the fused GALI kernel does not run here (test); noisy attention uses the slower PyTorch path",
                      GaliWarning, stacklevel=2)
        return False

    monkeypatch.setattr(noisy_attention, "kernel_verified", fall_back)  # the first-use checks the plan runs
    monkeypatch.setattr(noisy_attention, "native_verified", fall_back)
    result = gali("summarize", str(doc), "--max-new-tokens", "2", "--noise")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "fused GALI kernel" in line]
    assert lines and lines[0].startswith("warning: the fused GALI kernel does not run here (test)")


def test_serve_without_its_extra_says_what_to_install(gali, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    result = gali("serve", "--port", "0")
    assert result.exit_code == 2 and result.stdout == ""
    clone = Path(cli.__file__).resolve().parents[1]  # the tests run from gali's clone
    assert result.stderr.strip() == (f'gali: gali serve needs the server extra: pip install -e ".[serve]" in {clone} '
                                     "(uvicorn is missing)")


@pytest.mark.parametrize("env, options, bound", [
    ({"GALI_MAX_PROMPT_TOKENS": "300"}, [], 300),
    ({"GALI_MAX_PROMPT_TOKENS": "300"}, ["--max-prompt-tokens", "40"], 40),  # the flag over the variable
    ({}, [], None),
])
def test_serve_takes_the_prompt_bound_every_command_takes(gali, monkeypatch, env, options, bound):
    """GALI_MAX_PROMPT_TOKENS bounds every local command's prompt; `gali serve` ignored it."""
    import gali_cli.runs.serve

    served = []
    monkeypatch.setattr(gali_cli.runs.serve, "serve", lambda choice, serving: served.append(serving))
    assert gali("serve", "--port", "0", *options, env=env).exit_code == 0
    assert served[0].max_prompt_tokens == bound


def test_serve_refuses_bad_settings_before_loading(gali, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(common, "load_model", no_loading)
    assert gali("serve", "--method", "gali,yarn").exit_code == 2
    assert gali("serve", "--port", "70000").exit_code == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = gali("serve", "--port", str(taken.getsockname()[1]))
    assert busy.exit_code == 1 and "cannot listen on 127.0.0.1" in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1

    def unknown(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    bad_host = gali("serve", "--host", "gali.example")
    assert bad_host.exit_code == 2 and bad_host.stderr.strip() == "gali: --host gali.example: Name or service not known"


# The self-check's lines on the CPU: the transformers seam's (every method's examples on a Llama, two cases on each
# other family: derived from the registry, so a new method adds its own), then the attention paths' own.
SEAM_CHECKS = sum(len(family_cases(family.model_type)) for family in FAMILIES)
PATH_CHECKS = 12  # noisy attention native vs PyTorch (4), GALI vs Alg. 3 (2), the decoding step's attention (2),
# its projections as bytes (2), GGUF Q6_K matrices read into bytes (2)
CHECKS = SEAM_CHECKS + PATH_CHECKS


@pytest.fixture
def small_self_check(monkeypatch):
    """The self-check's own code on smaller problems (the full one takes minutes on two shared cores)."""
    from gali_cli.engine.checks import self_check

    monkeypatch.setattr(self_check, "HEAD_SHAPES", ((64, 9, 3), (128, 4, 4)))
    monkeypatch.setattr(self_check, "LENGTHS",
                        {"cuda": (320,), "cpu": (320,), "interpreted": (200,), "mixed_keys": (300,)})
    monkeypatch.setattr(self_check, "TIMED_CALLS", 1)
    monkeypatch.setattr(self_check, "NATIVE_DECODE_KEYS", 700)
    monkeypatch.setattr(self_check, "INTERPRETED_DECODE_KEYS", 300)  # still two runs of the keys, a tile cut short
    monkeypatch.setattr(self_check, "GRID_SHAPES", ((192, 96, True), (64, 160, False)))


def test_info_check_runs_the_self_check_on_this_machine(gali, small_self_check, monkeypatch):
    import gali_cli.seam_check as seam_check

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seam_checks, ran = seam_check.seam_checks, []

    def recorded():
        for item in seam_checks():
            ran.append(item)
            yield item

    monkeypatch.setattr(seam_check, "seam_checks", recorded)
    result = gali("info", "--check", env={"TRITON_INTERPRET": "0"})
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    assert "no GPU here: checking the CPU paths" in result.stderr
    assert f"self-check: {CHECKS} of {CHECKS} passed in " in result.stderr
    assert len(lines) == CHECKS and all(line.startswith("ok ") for line in lines)
    seam = SEAM_CHECKS
    assert sum(line.startswith("ok   transformers seam, ") for line in lines[:seam]) == seam  # the seam first
    assert any("native vs PyTorch: head dim 128, 4/4 heads, bfloat16, 320 keys" in line for line in lines)
    assert any(line.startswith("ok   GALI vs Alg. 3 as written: 300 keys") and "GALI " in line and " ms" in line
               for line in lines)
    assert sum(line.startswith("ok   a decoding step's attention, native vs float64") for line in lines) == 2
    assert any(line.startswith("ok   a decoding step's projection as bytes vs float64: 192 x 96, after an RMSNorm, "
                               "SiLU-gated") for line in lines)
    assert sum(line.startswith("ok   a GGUF Q6_K matrix read into bytes vs float64") for line in lines) == 2
    # --json changes only how the checks are printed: it shows the seam's checks of the run above again (the seam is
    # deterministic: running it twice took half this test), and runs the attention paths' checks again.
    assert len(ran) == seam
    monkeypatch.setattr(seam_check, "seam_checks", lambda: iter(ran))
    facts = json.loads(gali("info", "--check", "--json", env={"TRITON_INTERPRET": "0"}).stdout)
    checks = facts["check"]["checks"]
    assert facts["check"]["device"] == "cpu" and facts["train_len"] == 32 and len(checks) == CHECKS
    assert sum(item["seam"] for item in checks) == seam
    assert all(item["ok"] and item["max_error"] <= item["tolerance"] and item["seconds"] for item in checks)


def test_a_check_keeps_to_the_width_and_its_figures_whole(monkeypatch, capsys):
    """gali info --check's lines were 220 characters: a check now wraps at the width (COLUMNS into a pipe), the
    lines after its first indented, a figure never split from its name."""
    from types import SimpleNamespace

    from gali_cli import tables

    check = SimpleNamespace(ok=True, name="a decoding step's attention, native vs float64: head dim 64, 9/3 heads, "
                            "float32, 700 keys, noise on, keys rotated by a table per offset, mixed (GALI)",
                            error=1.5e-7, tolerance=1e-4, seconds={"native": 0.0119, "PyTorch": 0.092})
    monkeypatch.setenv("COLUMNS", "60")
    tables.print_check(check)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 2 and all(len(line) <= 60 for line in lines)
    assert lines[0].startswith("ok   a decoding step's") and all(line.startswith("     ") for line in lines[1:])
    joined = " ".join(line.strip() for line in lines)
    assert "max error 1.5e-07 (tolerance 0.0001); native 11.9 ms, PyTorch 92.0 ms" in joined
    monkeypatch.setenv("COLUMNS", "300")
    tables.print_check(check)
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_info_check_reports_a_wrong_kernel_and_fails(gali, small_self_check, monkeypatch):
    import gali_cli.engine.attention.noisy_attention as noisy_attention
    import gali_cli.engine.kernels.native_noise as native_noise

    assert noisy_attention.native_verified()  # the first-use check passed: the kernel goes wrong after it
    right = native_noise.noisy_partial

    def wrong(*arguments):
        part = right(*arguments)
        return part._replace(output=part.output + 0.5)

    monkeypatch.setattr(native_noise, "noisy_partial", wrong)
    result = gali("info", "--check", env={"TRITON_INTERPRET": "0"})
    assert result.exit_code == 1
    assert sum(line.startswith("FAIL noisy attention, native vs PyTorch") for line in result.stdout.splitlines()) == 4
    assert sum(line.startswith("FAIL GALI vs Alg. 3") for line in result.stdout.splitlines()) == 2  # its route
    assert result.stderr.strip().splitlines()[-1] == (
        f"gali: self-check: 7 of {CHECKS} checks failed on cpu (see above); GALI_KERNEL=torch runs the PyTorch path")
    assert "FAIL transformers seam, gali with noise" in result.stdout  # noisy GALI takes the wrong kernel too


@pytest.mark.slow  # a failing check reported, exit 1: test_info_check_reports_a_wrong_kernel_and_fails
def test_info_check_reports_wrong_products_as_bytes(gali, small_self_check, monkeypatch):
    from gali_cli.engine.seam.grid_weights import GridWeight

    product = GridWeight.__call__
    monkeypatch.setattr(GridWeight, "__call__", lambda self, x, **options: product(self, x, **options) * 1.01)
    result = gali("info", "--check", env={"TRITON_INTERPRET": "0"})
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert sum(line.startswith("FAIL a decoding step's projection as bytes") for line in lines) == 2
    assert sum(line.startswith("FAIL a GGUF Q6_K matrix read into bytes") for line in lines) == 1  # its one row
    assert f"3 of {CHECKS} checks failed on cpu" in result.stderr


def test_info_check_fails_on_a_transformers_that_renamed_the_cache_again(gali, small_self_check,
                                                                         cache_argument_renamed):
    result = gali("info", "--check", env={"TRITON_INTERPRET": "0"})
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    seam = [line for line in lines if "transformers seam" in line]
    assert len(seam) == SEAM_CHECKS
    assert all(line.startswith("FAIL") and "(SeamError: transformers " in line for line in seam)
    assert "takes its KV cache under none of the names gali knows (cache, past_key_values)" in seam[0]
    assert sum(line.startswith("ok   ") for line in lines) == PATH_CHECKS  # the attention paths themselves hold
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"gali: self-check: {SEAM_CHECKS} of {CHECKS} checks failed; the transformers seam fails (see above): gali's "
        "answers would be wrong with transformers ")


def test_a_transformers_outside_the_tested_range_is_said_once(gali, doc, monkeypatch):
    import gali_cli.compat as compat

    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.99.0")
    monkeypatch.setattr(compat, "_warned", False)
    result = gali("summarize", str(doc), "--max-new-tokens", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("warning: transformers 5.99.0 is outside the releases gali is tested with (>=5.6,") == 1
    info = gali("info")
    assert re.search(r"transformers_tested +no: gali is tested with >=5\.6,", info.stdout)
    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.24.0")
    assert re.search(r"transformers_tested +yes \(>=5\.6,", gali("info").stdout)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_info_check_runs_the_triton_kernel_interpreted_when_asked(gali, small_self_check, monkeypatch):
    """conftest sets TRITON_INTERPRET=1 before torch loads triton: the kernel's code runs in NumPy on the CPU."""
    import gali_cli.seam_check as seam_check

    # The transformers seam's checks are test_info_check_runs_the_self_check_on_this_machine's; here the kernels'.
    monkeypatch.setattr(seam_check, "seam_checks", lambda: iter(()))
    result = gali("info", "--check", env={"TRITON_INTERPRET": "1"})
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "the Triton kernels under TRITON_INTERPRET=1" in result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("ok   noisy attention, Triton vs PyTorch") for line in lines) == 4
    assert sum(line.startswith("ok   a decoding step's attention, Triton vs float64") for line in lines) == 2


def test_cache_list_says_what_sets_alike_entries_apart(gali, doc, tmp_path):
    """Two states of one document, model and method look the same in a list: the column says how they differ."""
    env = {"GALI_CACHE_DIR": str(tmp_path / "states")}
    for chunk in ("8", "16"):
        assert gali("ask", str(doc), "When?", "--max-new-tokens", "2", "--chunk-size", chunk, env=env).exit_code == 0
    listed = json.loads(gali("cache", "list", "--json", env=env, model=False).stdout)["entries"]
    assert sorted(entry["differs_by"] for entry in listed) == ["chunk_size 16", "chunk_size 8"]
    assert {entry["identity"]["transformers"] for entry in listed} == {transformers.__version__}
    table = gali("cache", "list", env=env, model=False).stdout
    assert "differs by" in table and "chunk_size 8" in table and "chunk_size 16" in table


@pytest.mark.parametrize("args, message", [
    (["ask", "notes.txt"], 'missing DOCS or QUESTION: the documents come first, then the question, e.g. gali ask '
                           'notes.txt "What is due on Friday?" (see gali ask --help)'),
    (["summarize", "--top-p", "2"], "(see gali summarize --help)"),
    (["cache", "bogus"], "No such command 'bogus'. (see gali cache --help)"),
    (["bogus"], "No such command 'bogus'. (see gali --help)"),
])
def test_a_usage_error_names_what_is_missing_and_the_help_to_read(args, message, capsys):
    """`gali ask FILE` without a question once said "Missing argument 'DOCS'" (Click fills QUESTION from the end),
    and every usage error pointed at `gali --help`, not the command's own."""
    assert cli.main(args) == 2
    assert capsys.readouterr().err.strip().endswith(message)


@pytest.mark.parametrize("command", [["summarize"], ["ask", "QUESTION"], ["ppl"], ["chat"]])
def test_a_prompt_past_max_prompt_tokens_is_refused_before_any_forward(gali, doc, command, monkeypatch):
    """--max-prompt-tokens (or GALI_MAX_PROMPT_TOKENS) bounds every command's prompt: exit 3 and one line, and the
    model never runs a forward."""
    from transformers import LlamaForCausalLM

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(LlamaForCausalLM, "forward", no_forward)
    files = [command[0], str(doc), *command[1:]]
    for bound in (["--max-prompt-tokens", "20"], []):
        refused = gali(*files, *bound, env={} if bound else {"GALI_MAX_PROMPT_TOKENS": "20"}, input="hi\n")
        assert refused.exit_code == 3, refused.output
        message, = refused.stderr.strip().splitlines()[-1:]
        assert "more than the 20 gali reads here" in message and "--max-prompt-tokens" in message


@pytest.mark.parametrize("command", [["summarize"], ["ask", "QUESTION"], ["ppl"], ["chat"],
                                     ["summarize", "--out", "OUT"], ["ppl", "--out", "OUT"]])
def test_a_text_past_the_bound_in_characters_is_refused_before_it_is_tokenized(gali, tmp_path, command, monkeypatch):
    """A 200 MB text under --max-input-size was tokenized whole (320 s, 4.8 GB) before the prompt bound refused it:
    more characters than the bound times the longest token's (41 here) is surely more tokens, refused at once."""
    import gali_cli.conversation
    import gali_cli.runs.ppl

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the text was tokenized")

    monkeypatch.setattr(gali_cli.conversation, "conversation_ids", no_tokenizing)
    monkeypatch.setattr(gali_cli.runs.ppl, "text_ids", no_tokenizing)
    big = tmp_path / "big.txt"
    big.write_text("word " * 2000)  # 10,000 characters; no token of the tiny model's is longer than 19
    arguments = [command[0], str(big), *(str(tmp_path / "out.jsonl") if part == "OUT" else part
                                         for part in command[1:]), "--max-prompt-tokens", "200"]
    refused = gali(*arguments, input="hi\n")
    said = re.compile(r"the prompt has 10,0\d\d characters, so at least 5\d\d tokens \(none of this model's stands for "
                      r"more than 19 characters\), more than the 200 gali reads here \(--max-prompt-tokens or "
                      r"GALI_MAX_PROMPT_TOKENS; by default, what half the free memory holds of their keys and values\)")
    if "--out" in command:  # batch mode: the document's record says why, the run exits 1
        assert refused.exit_code == 1, refused.output
        assert said.search(json.loads((tmp_path / "out.jsonl").read_text())["error"])
        return
    assert refused.exit_code == 3, refused.output
    message, = refused.stderr.strip().splitlines()[-1:]
    assert said.search(message) and f"{big}: " in message, message


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 70368744177664 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
], ids=["torch's CPU allocator", "Python's"])
def test_running_out_of_memory_exits_4_in_one_line(gali, doc, failure, monkeypatch):
    """docs/cli.md: out of memory exits 4 with a hint; on the CPU it exited 1 as "unexpected RuntimeError"."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    def out_of_memory(*args, **kwargs):
        raise failure

    monkeypatch.setattr(LlamaMLP, "forward", out_of_memory)
    for command in (["summarize"], ["ppl"]):
        result = gali(command[0], str(doc), "--no-cache" if command == ["summarize"] else "--json")
        assert result.exit_code == 4, result.output
        assert result.stderr.strip().splitlines()[-1] == ("gali: ran out of memory (RAM): try a smaller --chunk-size, "
                                                          "or a shorter input (--max-prompt-tokens bounds it before "
                                                          "reading)")


def test_the_default_prompt_bound_is_what_half_the_free_memory_holds(monkeypatch):
    from gali_cli.estimate import holdable_tokens

    assert holdable_tokens(1000, 256, 10**9) == 500_000  # half of 1 GB, 1 kB a token
    assert holdable_tokens(1000, 256, 10**4) == 256  # never below the model's window


def test_wrapped_parts_keep_their_commas_within_the_width():
    from gali_cli.tables import _wrap_parts

    parts = ", ".join(["a" * 20, "b" * 33, "c" * 10, "last used 2026-11-28 10:55"])
    for width in range(40, 70):
        lines = _wrap_parts(parts, width)
        assert all(len(line) <= width for line in lines), (width, lines)
        assert ", ".join(line.strip().rstrip(",") for line in lines) == parts
