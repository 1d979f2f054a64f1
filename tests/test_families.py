"""The model families beyond Llama (gali_cli/model/families.py): each read past its window by every method as its
float64 restatement reads it, exact within the window, decoded by the static step where the family has one, and
refused in one line where gali does not serve it."""

import json

import pytest
import torch

from gali_cli.config import MethodSettings
from gali_cli.engine.checks import reference_model as ref
from gali_cli.engine.seam import with_cache
from gali_cli.engine.seam.kv_cache import new_cache, reserve
from gali_cli.engine.seam.static_decode import StaticDecoder, why_not_static
from gali_cli.errors import UnsupportedModelError
from gali_cli.generate import prefill
from gali_cli.model.config import read_model_config
from gali_cli.model.families import FAMILIES, default_train_len, family_of, why_no_methods
from gali_cli.patching import apply_method, prefill_spans, remove_method
from gali_cli.seam_check import CASES, PROMPT, VOCAB, seam_check, tiny_model

OTHER_FAMILIES = [family.model_type for family in FAMILIES if family.model_type != "llama"]


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_every_method_equals_its_float64_restatement(model_type, case, prompt):
    """A 40-token prompt (2.5 windows) prefilled in several forwards and 4 tokens decoded, each method against its
    restatement computed from the weights (biases and q/k norms included)."""
    check = seam_check(tiny_model(model_type, train_len=16), prompt, case)
    assert check.ok, (check.name, check.error)


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_eager_decoding_equals_the_restatement_too(model_type, prompt, monkeypatch):
    """The checks above decode by the static step where it pays; here every token by the eager forward."""
    monkeypatch.setenv("GALI_DECODE", "eager")
    for case in [case for case in CASES if case.label in ("gali", "self-extend", "rerope")]:
        check = seam_check(tiny_model(model_type, train_len=16), prompt, case)
        assert check.ok, (check.name, check.error)


@pytest.mark.parametrize("model_type, part", [("qwen2", "self_attn.k_proj.bias"), ("qwen3", "self_attn.k_norm.weight")])
def test_the_restatement_misses_nothing_of_the_family(model_type, part):
    """The restatement with the family's own part taken out (a bias, a norm's weights) is far from the model: the
    tests above would fail if the hooks dropped it."""
    model = tiny_model(model_type, train_len=16)
    ids = list(range(10))
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].double()
    naive = ref.NaiveRoPE(model)
    assert (naive.prefill(ids) - expected).abs().max() < 1e-4
    naive = ref.NaiveRoPE(model)
    for name in [name for name in naive.weights if name.endswith(part)]:
        naive.weights[name] = torch.zeros_like(naive.weights[name]) + (1.0 if "norm" in part else 0.0)
    assert (naive.prefill(ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_within_the_window_gali_is_the_unpatched_model(model_type):
    model = tiny_model(model_type, train_len=32)
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = model(ids).logits
        apply_method(model, "gali", MethodSettings(), 32)
        got = model(ids).logits
    remove_method(model)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
@pytest.mark.parametrize("method", ["original", "gali", "self-extend"])
def test_the_static_step_equals_the_models_own_forward(model_type, method):
    """From a 40-token prompt past the 32-token window: each static step's logits against the eager forward's on
    the same cache (Qwen3's q/k norms applied in it)."""
    model = tiny_model(model_type, train_len=32)
    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        apply_method(model, method, MethodSettings(train_len=32), 50)
        cache = new_cache(model)
        reserve(cache, 50)
        prefill(model, ids[:, :40], cache, prefill_spans(model, method, 0, 40, step=24))
        assert why_not_static(model, cache) is None
        decoder, given, worst = StaticDecoder(model, cache, route="torch"), with_cache(model, cache), 0.0
        for index, token in enumerate(ids[0, 40:].tolist(), start=40):
            static = decoder.step(token, index).clone()
            for layer in cache.layers:
                layer.extend(index)
            eager = model(input_ids=torch.tensor([[token]]), **given, use_cache=True).logits[0, -1].float()
            worst = max(worst, (static - eager).abs().max().item())
    assert worst < 1e-4


def _config_dir(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


@pytest.mark.parametrize("model_type, shown", [("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")])
def test_a_family_is_read_and_named(tmp_path, model_type, shown):
    config = read_model_config(_config_dir(tmp_path, model_type=model_type, max_position_embeddings=4096))
    assert config.facts()["family"] == shown and config.train_len == 4096
    assert config.facts()["methods"] == "yes"


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3", "falcon"])
def test_a_model_of_another_family_is_refused_naming_the_supported_ones(tmp_path, model_type):
    with pytest.raises(UnsupportedModelError, match=rf"is a '{model_type}' model; gali supports Llama, Mistral, "
                                                    r"Qwen2, Qwen3$"):
        read_model_config(_config_dir(tmp_path, model_type=model_type))


def test_qwen3s_train_len_is_its_pretraining_context_not_the_window_padded_for_the_answer():
    assert default_train_len({"model_type": "qwen3", "max_position_embeddings": 40960}) == 32768
    assert default_train_len({"model_type": "qwen3", "max_position_embeddings": 262144}) == 262144
    assert default_train_len({"model_type": "qwen2", "max_position_embeddings": 32768}) == 32768


def test_a_sliding_window_refuses_the_position_methods_and_reads_as_transformers_does(tmp_path):
    shown = read_model_config(_config_dir(tmp_path, model_type="mistral", sliding_window=4096)).facts()["methods"]
    assert shown == ("no: its layers attend within a sliding window of 4096 tokens, so it never sees a distance it "
                     "was not trained on: read it with --method original")
    assert why_no_methods({"model_type": "mistral", "sliding_window": None}) is None
    assert why_no_methods({"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}) is None
    assert "sliding window of 4096 tokens" in why_no_methods({"model_type": "mistral", "sliding_window": 4096})
    model = tiny_model("mistral", train_len=16, sliding_window=8)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UnsupportedModelError, match=r"^gali does not apply to this model: its layers attend within "
                                                    r"a sliding window of 8 tokens"):
        apply_method(model, "gali", MethodSettings(), 24)
    with torch.inference_mode():
        expected = model(ids).logits
        apply_method(model, "original", MethodSettings(), 24)
        cache = new_cache(model)
        logits = prefill(model, ids, cache, [(0, 12), (12, 24)])
    assert (logits - expected[0, -1]).abs().max() < 1e-5


@pytest.fixture(scope="module", params=OTHER_FAMILIES)
def family_model_dir(request, tmp_path_factory):
    """A tiny random model of each other family (window 32) and the tests' tokenizer, on disk."""
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp(request.param), request.param, hidden=64)


def test_the_commands_read_past_the_window_on_each_family(family_model_dir, tmp_path):
    from typer.testing import CliRunner

    from gali_cli import cli

    def gali(*args: str):
        return CliRunner().invoke(cli.app, [*args, "-m", str(family_model_dir)], env={"COLUMNS": "200"})

    document = tmp_path / "notes.txt"
    document.write_text("The lease runs for three years and the rent is due on the first of each month. " * 4)
    info = json.loads(gali("info", "--json").stdout)
    family = family_of(json.loads((family_model_dir / "config.json").read_text()))
    assert info["family"] == family.name and info["methods"] == "yes"
    for method in ("gali", "self-extend"):
        ppl = gali("ppl", str(document), "--method", method, "--json")
        assert ppl.exit_code == 0, ppl.stderr
        assert json.loads(ppl.stdout)["tokens"] > 32  # past the 32-token window
    answer = gali("ask", str(document), "When is the rent due?", "--max-new-tokens", "4", "--json")
    assert answer.exit_code == 0, answer.stderr
    assert json.loads(answer.stdout)["answer"] is not None
    summary = gali("summarize", str(document), "--method", "self-extend", "--max-new-tokens", "4", "--json")
    assert summary.exit_code == 0, summary.stderr
    assert json.loads(summary.stdout)["answer"] is not None


@pytest.mark.parametrize("model_type, sizes", [("qwen2", {}), ("qwen3", {"head_dim": 128})])
def test_a_gguf_of_the_family_loads_and_reads_past_its_window(model_type, sizes, tmp_path):
    """A GGUF written as llama.cpp lays out a Qwen (biases, q/k norms, heads wider than hidden / heads): its header
    read by `gali info`, its weights dequantized by transformers to the model the directory holds, and GALI read
    past the window with it."""
    pytest.importorskip("gguf")
    from conftest import save_tiny_llama, write_gguf
    from typer.testing import CliRunner

    from gali_cli import cli
    from gali_cli.model.loading import load_model

    directory = save_tiny_llama(tmp_path / "model", model_type, hidden=64, **sizes)
    path = write_gguf(tmp_path / f"tiny-{model_type}.gguf", directory, quantized=False)
    config = read_model_config(str(path))
    assert config.facts()["family"] == family_of({"model_type": model_type}).name and config.train_len == 32
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        from_gguf = load_model(str(path), device="cpu", dtype="float32").model(ids).logits
        from_directory = load_model(str(directory), device="cpu", dtype="float32").model(ids).logits
    assert (from_gguf - from_directory).abs().max() < 1e-4
    document = tmp_path / "notes.txt"
    document.write_text("The lease runs for three years and the rent is due on the first of each month. " * 4)
    ppl = CliRunner().invoke(cli.app, ["ppl", str(document), "-m", str(path), "--json"])
    assert ppl.exit_code == 0, ppl.stderr
    assert json.loads(ppl.stdout)["tokens"] > 32


def test_a_qwen3_gguf_whose_heads_transformers_would_misread_is_refused(tmp_path):
    pytest.importorskip("gguf")
    from conftest import save_tiny_llama, write_gguf

    directory = save_tiny_llama(tmp_path / "model", "qwen3", hidden=64, head_dim=32)
    path = write_gguf(tmp_path / "tiny-qwen3.gguf", directory)
    with pytest.raises(UnsupportedModelError, match=r"a Qwen3 GGUF with heads 32 wide; transformers reads every "
                                                    r"Qwen3 GGUF's as 128"):
        read_model_config(str(path))


@pytest.mark.parametrize("quantize", ["8bit", "4bit"])
def test_bitsandbytes_on_each_family(family_model_dir, quantize):
    """Each family loads in bitsandbytes 8 or 4 bits and GALI reads past its window with it."""
    from gali_cli.model.loading import load_model

    loaded = load_model(str(family_model_dir), quantize=quantize, device="cpu")
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        apply_method(loaded.model, "gali", MethodSettings(), 48)
        cache = new_cache(loaded.model)
        logits = prefill(loaded.model, ids, cache, prefill_spans(loaded.model, "gali", 0, 48, step=16))
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 48
