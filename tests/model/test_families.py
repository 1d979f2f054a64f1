"""The model families beyond Llama (gali_cli/model/families.py): each read past its window by every method as its
float64 restatement reads it, exact within the window, decoded by the static step where the family has one, and
refused in one line where gali does not serve it."""

import dataclasses
import json

import pytest
import torch
from helpers.tiers import slow_but

from gali_cli.config import MethodSettings
from gali_cli.engine.checks import reference_model as ref
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import new_cache, reserve
from gali_cli.engine.seam.static_decode import StaticDecoder, why_not_static
from gali_cli.errors import UnsupportedModelError
from gali_cli.generate import prefill
from gali_cli.model.config import read_model_config
from gali_cli.model.families import FAMILIES, default_train_len, family_of, why_no_methods
from gali_cli.patching import apply_method, prefill_spans, remove_method
from gali_cli.seam_check import CASES, PROMPT, VOCAB, seam_check, tiny_model

OTHER_FAMILIES = [family.model_type for family in FAMILIES if family.model_type != "llama"]
STATIC_FAMILIES = [family.model_type for family in FAMILIES if family.model_type != "llama"
                   and family.no_static_step is None]


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(7))


# The default tier: every method on Gemma 3; GALI and the unpatched model on each family: gali info --check's seam.
@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
@pytest.mark.parametrize("model_type", slow_but(OTHER_FAMILIES, "gemma3_text"))
def test_every_method_equals_its_float64_restatement(model_type, case, prompt):
    """A 40-token prompt (2.5 windows) prefilled in several forwards and 4 tokens decoded, each method against its
    restatement computed from the weights (biases and q/k norms included)."""
    check = seam_check(tiny_model(model_type, train_len=16), prompt, case)
    assert check.ok, (check.name, check.error)


@pytest.mark.parametrize("model_type", slow_but(OTHER_FAMILIES, "qwen2"))
def test_eager_decoding_equals_the_restatement_too(model_type, prompt, monkeypatch):
    """The checks above decode by the static step where it pays; here every token by the eager forward."""
    monkeypatch.setenv("GALI_DECODE", "eager")
    for case in [case for case in CASES if case.label in ("gali", "self-extend", "rerope")]:
        check = seam_check(tiny_model(model_type, train_len=16), prompt, case)
        assert check.ok, (check.name, check.error)


@pytest.mark.parametrize("model_type, part", [("qwen2", "self_attn.k_proj.bias"), ("qwen3", "self_attn.k_norm.weight"),
                                              ("gemma3_text", "self_attn.k_norm.weight"),
                                              ("gemma3_text", "pre_feedforward_layernorm.weight"),
                                              ("gemma3_text", "post_feedforward_layernorm.weight")])
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
    if family_of(model.config).layer_kinds:  # local layers go a block of queries at a time: the square to rounding
        assert (got - expected).abs().max() < 1e-5
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_gemma3s_local_layers_in_blocks_equal_the_unpatched_masked_square(attn_implementation):
    """44 tokens inside the window, 5.5 times the local layers' window of 8: the patched local layers take a window
    of queries at a time, each over the window before it; the unpatched model computes one masked 44 x 44 square.
    Equal to rounding, in one forward and in forwards that start and end inside a block."""
    model = tiny_model("gemma3_text", train_len=64, attn_implementation=attn_implementation)
    ids = torch.randint(0, VOCAB, (1, 44), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = model(ids).logits[0]
        apply_method(model, "gali", MethodSettings(), 44)
        whole = model(ids).logits[0]
        cache = new_cache(model)
        pieces = torch.cat([model(ids[:, a:b], **with_cache(model, cache), use_cache=True).logits[0]
                            for a, b in [(0, 5), (5, 21), (21, 44)]])
    remove_method(model)
    assert (whole - expected).abs().max() < 1e-5 and (pieces - expected).abs().max() < 1e-5


@pytest.mark.parametrize("model_type", STATIC_FAMILIES)
@pytest.mark.parametrize("method", slow_but(["original", "gali", "self-extend"], "gali"))
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


@pytest.mark.parametrize("model_type, shown", [("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"),
                                               ("gemma3_text", "Gemma 3")])
def test_a_family_is_read_and_named(tmp_path, model_type, shown):
    config = read_model_config(_config_dir(tmp_path, model_type=model_type, max_position_embeddings=4096))
    assert config.facts()["family"] == shown and config.train_len == 4096
    assert config.facts()["methods"] == "yes"


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3", "phi3", "falcon"])
def test_a_model_of_another_family_is_refused_naming_the_supported_ones(tmp_path, model_type):
    with pytest.raises(UnsupportedModelError, match=rf"is a '{model_type}' model; gali supports Llama, Mistral, "
                                                    r"Qwen2, Qwen3, Gemma 3$"):
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


@pytest.fixture(scope="module", params=slow_but(OTHER_FAMILIES, "gemma3_text"))  # the other families: -m slow
def family_model_dir(request, tmp_path_factory):
    """A tiny random model of each other family (window 32) and the tests' tokenizer, on disk."""
    from helpers.tiny_models import save_tiny_llama

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


def test_serve_and_batch_mode_read_past_the_window_on_each_family(family_model_dir, tmp_path):
    """gali serve's worker (without HTTP) answers a second question about a document past the window from the first
    one's state, as a fresh read would; batch mode writes one line per document."""
    from helpers.server import fresh_answer, question_prompt, worker_job
    from typer.testing import CliRunner

    from gali_cli import cli
    from gali_cli.generate import TextPiece
    from gali_cli.loading import load_model
    from gali_cli.server.worker import Done, ModelWorker

    loaded = load_model(str(family_model_dir), "none", "cpu", "float32")
    worker = ModelWorker(loaded, "gali", MethodSettings(), None, 4)
    document = "The lease runs for three years and the rent is due on the first of each month. " * 4
    events_of = []
    for question in ("When is the rent due?", "How long is the lease?"):
        prompt = question_prompt(loaded, f"{document}\n\n{question}")
        job, events = worker_job(prompt)
        worker._answer(job)
        events_of.append(events)
    done = events_of[-1][-1]
    assert isinstance(done, Done) and done.cached_tokens > 32 and len(prompt.ids) > 32  # past the 32-token window
    answer = "".join(event.text for event in events_of[-1] if isinstance(event, TextPiece))
    assert answer == fresh_answer(loaded, prompt)

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(document)
    out = tmp_path / "answers.jsonl"
    result = CliRunner().invoke(cli.app, ["ask", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "When is it due?",
                                          "--out", str(out), "--max-new-tokens", "3", "-m", str(family_model_dir)])
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 and all(line["status"] == "ok" and line["prompt_tokens"] > 32 for line in lines), lines


@pytest.mark.parametrize("model_type, sizes", [("qwen2", {}), ("qwen3", {"head_dim": 128})])
def test_a_gguf_of_the_family_loads_and_reads_past_its_window(model_type, sizes, tmp_path):
    """A GGUF written as llama.cpp lays out a Qwen (biases, q/k norms, heads wider than hidden / heads): its header
    read by `gali info`, its weights dequantized by transformers to the model the directory holds, and GALI read
    past the window with it."""
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_gguf
    from helpers.tiny_models import save_tiny_llama
    from typer.testing import CliRunner

    from gali_cli import cli
    from gali_cli.loading import load_model

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
    from helpers.gguf_files import write_gguf
    from helpers.tiny_models import save_tiny_llama

    directory = save_tiny_llama(tmp_path / "model", "qwen3", hidden=64, head_dim=32)
    path = write_gguf(tmp_path / "tiny-qwen3.gguf", directory)
    with pytest.raises(UnsupportedModelError, match=r"a Qwen3 GGUF with heads 32 wide; transformers reads every "
                                                    r"Qwen3 GGUF's as 128"):
        read_model_config(str(path))


@pytest.mark.parametrize("quantize", ["8bit", "4bit"])
def test_bitsandbytes_on_each_family(family_model_dir, quantize):
    """Each family loads in bitsandbytes 8 or 4 bits and GALI reads past its window with it."""
    from gali_cli.loading import load_model

    loaded = load_model(str(family_model_dir), quantize=quantize, device="cpu")
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        apply_method(loaded.model, "gali", MethodSettings(), 48)
        cache = new_cache(loaded.model)
        logits = prefill(loaded.model, ids, cache, prefill_spans(loaded.model, "gali", 0, 48, step=16))
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 48


# Gemma 3: local layers (a window of 8 on a RoPE base of 100) around a global one (base 10,000), logits scaled by
# query_pre_attn_scalar^-1/2 (seam_check.tiny_model); the methods place the global layer's keys only.


def test_gemma3s_restatement_misses_none_of_its_parts():
    """The restatement without the local layers' window, with their base swapped for the global one, with the
    logits scaled by 1/sqrt(head_dim), without the embedding scale or without Gemma's 1 + weight in its norms is far
    from the model: each part is one a route could drop."""
    import copy

    model = tiny_model("gemma3_text", train_len=16)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].double()
    assert (ref.NaiveRoPE(model).prefill(ids) - expected).abs().max() < 1e-4

    def without(change) -> float:
        naive = ref.NaiveRoPE(model)
        change(naive)
        return (naive.prefill(ids) - expected).abs().max().item()

    def no_window(naive):
        naive.config = copy.deepcopy(naive.config)
        naive.config.sliding_window = 1000

    def one_base(naive):
        naive.local_inv_freq = naive.inv_freq

    def plain_scaling(naive):
        naive.pre_attn_scale = None

    def no_embedding_scale(naive):
        naive.family = dataclasses.replace(naive.family, embedding_scale=False)

    def plain_norms(naive):
        naive.family = dataclasses.replace(naive.family, norm_offset=0.0)

    for change in (no_window, one_base, plain_scaling, no_embedding_scale, plain_norms):
        assert without(change) > 1e-2, change.__name__


@pytest.mark.parametrize("method", ["original", "self-extend", "chunk-llama", "rerope", "dpe", "string"])
def test_gemma3_decodes_eagerly_as_one_forward_over_everything_computes(method):
    """40 tokens prefilled in forwards of 12, then 6 fed one forward each (the eager decoding step,
    GALI_DECODE=eager's; tests/engine/seam/test_static_decode.py holds the static one to it), against the logits of
    one forward over all 46. (GALI's positions depend on where its chunks end, so its decoding is held to its
    restatement instead, above.)"""
    model = tiny_model("gemma3_text", train_len=16)
    ids = torch.randint(0, VOCAB, (1, 46), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        apply_method(model, method, MethodSettings(), 46)
        whole = new_cache(model)
        spans = prefill_spans(model, method, 0, 46, step=46)
        expected = torch.cat([model(ids[:, a:b], **with_cache(model, whole), use_cache=True).logits[0]
                              for a, b in spans])[40:]
        cache = new_cache(model)
        prefill(model, ids[:, :40], cache, prefill_spans(model, method, 0, 40, step=12))
        assert why_not_static(model, cache) is None
        given = with_cache(model, cache)
        got = torch.cat([model(ids[:, index : index + 1], **given, use_cache=True).logits[0]
                         for index in range(40, 46)])
    remove_method(model)
    assert (got - expected).abs().max() < 1e-4


def test_gemma3_original_is_the_unpatched_model_in_several_forwards():
    model = tiny_model("gemma3_text", train_len=16)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        expected = model(ids).logits[0, -1]
        apply_method(model, "original", MethodSettings(), 40)
        logits = prefill(model, ids, new_cache(model), [(0, 12), (12, 30), (30, 40)])
    assert (logits - expected).abs().max() < 1e-5


def test_soft_capped_attention_logits_refuse_the_methods():
    assert why_no_methods({"model_type": "gemma3_text", "attn_logit_softcapping": None}) is None
    assert why_no_methods({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}) == (
        "its attention logits are soft-capped at 50.0, which gali's attention routes do not apply: read it with "
        "--method original")
    model = tiny_model("gemma3_text", train_len=16, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModelError, match=r"^gali does not apply to this model: its attention logits are "
                                                    r"soft-capped at 50.0"):
        apply_method(model, "gali", MethodSettings(), 24)


@pytest.mark.parametrize("config, train_len, rope", [
    # Gemma 3 1B's config.json as transformers 4 wrote it: flat rope_theta (the global layers') and no scaling.
    ({"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
      "max_position_embeddings": 32768}, 32768, {"rope_theta": 1000000.0, "rope_type": "default"}),
    # The 4B on's text config: the global layers' RoPE scaled linearly by 8, trained at 128k with it.
    ({"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
      "sliding_window": 1024, "max_position_embeddings": 131072}, 131072,
     {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"}),
    # As transformers 5 writes it: a set per layer kind.
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
      "max_position_embeddings": 131072}, 131072, {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"}),
], ids=["1b", "4b-transformers-4", "4b-transformers-5"])
def test_gemma3s_config_shows_its_global_rope_and_the_window_it_was_trained_at(tmp_path, config, train_len, rope):
    facts = read_model_config(_config_dir(tmp_path, model_type="gemma3_text", **config)).facts()
    assert facts["family"] == "Gemma 3" and facts["train_len"] == train_len and facts["rope"] == rope
    assert facts["methods"] == "yes"
    assert "static_step" not in facts  # it decodes through the static step (tests/engine/seam/test_static_decode.py)


def test_a_hostile_gemma3_rope_per_kind_is_refused(tmp_path):
    from gali_cli.errors import ModelLoadError

    kinds = {"full_attention": {"rope_type": "default", "rope_theta": float("inf")}}
    with pytest.raises(ModelLoadError, match=r"rope_parameters.full_attention.rope_theta is inf"):
        read_model_config(_config_dir(tmp_path, model_type="gemma3_text", rope_parameters=kinds))
    with pytest.raises(ModelLoadError, match=r"sliding_window is 1e\+300: not a window a model has"):
        read_model_config(_config_dir(tmp_path, model_type="gemma3_text", sliding_window=1e300))


def test_ntk_and_yarn_rescale_only_gemma3s_global_layers():
    model = tiny_model("gemma3_text", train_len=16)
    local = model.model.rotary_emb.sliding_attention_inv_freq.clone()
    apply_method(model, "yarn", MethodSettings(factor=3), 40)
    rotary = model.model.rotary_emb.rescaled
    assert torch.equal(rotary.sliding_attention_inv_freq, local)
    assert rotary.rope_type == {"full_attention": "yarn", "sliding_attention": "default"}
    remove_method(model)
    assert type(model.model.rotary_emb).__name__ == "Gemma3RotaryEmbedding"


GEMMA3_GGUF = {"hidden": 64, "head_dim": 256, "layers": 6, "query_pre_attn_scalar": 256,
               # as transformers reads a Gemma 3 GGUF: every sixth layer global, the local base 10,000
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}


def test_a_gemma3_gguf_loads_and_reads_past_its_window(tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes one (norms as 1 + weight, tied output), read by transformers to the model
    the directory holds, and GALI read past the window with it. (transformers makes a GemmaTokenizer of every
    Gemma 3 GGUF's vocabulary, a SentencePiece one; the tests' byte-level one cannot stand in for it, so the model
    is fed token ids here, not a document.)"""
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_gguf
    from helpers.tiny_models import save_tiny_llama

    from gali_cli.loading import load_model

    directory = save_tiny_llama(tmp_path / "model", "gemma3_text", **GEMMA3_GGUF)
    path = write_gguf(tmp_path / "tiny-gemma3.gguf", directory, quantized=False)
    facts = read_model_config(str(path)).facts()
    assert facts["family"] == "Gemma 3" and facts["train_len"] == 32 and facts["methods"] == "yes"
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        from_gguf = load_model(str(path), device="cpu", dtype="float32").model(ids).logits
        from_directory = load_model(str(directory), device="cpu", dtype="float32").model(ids).logits
    assert (from_gguf - from_directory).abs().max() < 1e-4
    model = load_model(str(path), device="cpu", dtype="float32").model
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        apply_method(model, "gali", MethodSettings(), 48)
        cache = new_cache(model)
        logits = prefill(model, ids, cache, prefill_spans(model, "gali", 0, 48, step=16))
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 48


@pytest.mark.parametrize("change, refusal", [
    ({"query_pre_attn_scalar": 128, "head_dim": 128}, r"attention logits are scaled by 1/sqrt\(128\); transformers "
                                                      r"reads every Gemma 3 GGUF's as 1/sqrt\(256\)"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
     r"global RoPE is scaled \(linear, factor 8.0: Gemma 3 4B on\); transformers reads it unscaled"),
], ids=["query-scale", "rope-scaling"])
def test_a_gemma3_gguf_transformers_would_misread_is_refused(tmp_path, change, refusal):
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_gguf
    from helpers.tiny_models import save_tiny_llama

    directory = save_tiny_llama(tmp_path / "model", "gemma3_text", **{**GEMMA3_GGUF, **change})
    path = write_gguf(tmp_path / "tiny-gemma3.gguf", directory)
    with pytest.raises(UnsupportedModelError, match=refusal):
        read_model_config(str(path))
