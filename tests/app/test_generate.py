from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

from gali_cli import ConfigError, GaliConfig, apply_gali
from gali_cli.config import MethodSettings
from gali_cli.engine.math.positions import chunk_plan
from gali_cli.engine.seam.kv_cache import new_cache
from gali_cli.generate import (
    ANSWER_ROWS_RESERVED,
    Finished,
    TextPiece,
    _Detokenizer,
    forward_spans,
    make_sampler,
    prefill,
    stop_token_ids,
    stream_generate,
)
from gali_cli.patching import apply_method, forward_ends, prefill_spans


@pytest.fixture
def tiny(tiny_model_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_greedy_and_seeded_sampling():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert make_sampler()(logits) == int(logits.argmax())

    def draws(seed: int) -> list[int]:
        sample = make_sampler(1.0, seed=seed)
        return [sample(logits) for _ in range(30)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    assert {make_sampler(5.0, top_k=1, seed=s)(logits) for s in range(10)} == {int(logits.argmax())}
    assert {make_sampler(5.0, top_p=1e-6, seed=s)(logits) for s in range(10)} == {int(logits.argmax())}
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {make_sampler(50.0, top_k=3, seed=s)(logits) for s in range(40)} == top3


@pytest.mark.parametrize("settings, flag", [({"temperature": -1}, "--temperature"), ({"top_p": 0}, "--top-p"),
                                            ({"top_p": 1.5}, "--top-p"), ({"top_k": -2}, "--top-k")])
def test_bad_sampling_settings(settings, flag):
    with pytest.raises(ConfigError, match=flag):
        make_sampler(**settings)


def test_forward_spans():
    assert forward_spans(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    plan_ends = [last for _, last in chunk_plan(0, 100, 32, 8)]  # 32, 40, ..., 96, 100
    assert forward_spans(0, 100, 20, plan_ends) == [(0, 32), (32, 48), (48, 64), (64, 80), (80, 100)]
    assert forward_spans(5, 6, 20, [6]) == [(5, 6)]


def test_prefill_along_spans_equals_one_forward(tiny):
    model, _ = tiny
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=True))
    ids = torch.randint(0, 300, (1, 150), generator=torch.Generator().manual_seed(0))
    whole = model(ids).logits[0, -1]
    spans = forward_spans(0, 150, 20, forward_ends(model, "gali", 0, 150))
    assert len(spans) > 5
    torch.testing.assert_close(prefill(model, ids, DynamicCache(config=model.config), spans), whole)


def test_a_bar_moves_through_a_long_forward_layer_by_layer(tiny, monkeypatch):
    """A bar (a progress callback with `within`) hears each decoder layer of a forward of WATCHED_FORWARD tokens or
    more; the callback itself only whole forwards; the result is the same, and no hook stays behind."""
    import gali_cli.generate as generate

    model, _ = tiny
    monkeypatch.setattr(generate, "WATCHED_FORWARD", 40)
    ids = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(0))
    forwards, steps = [], []

    class Bar:
        def __call__(self, done, total):
            forwards.append((done, total))

        def within(self, done, total):
            steps.append((done, total))

    spans = [(0, 80), (80, 100)]  # the second forward is shorter than WATCHED_FORWARD: no steps inside it
    logits = prefill(model, ids, DynamicCache(config=model.config), spans, Bar())
    layers = model.config.num_hidden_layers
    assert forwards == [(0, 100), (80, 100), (100, 100)]
    assert steps == [(80 * (index + 1) // layers, 100) for index in range(layers)]
    assert all(not layer._forward_hooks for layer in model.model.layers)
    torch.testing.assert_close(logits, model(ids).logits[0, -1])
    plain = []
    prefill(model, ids, DynamicCache(config=model.config), spans, lambda done, total: plain.append(done))
    assert plain == [0, 80, 100]


def test_stream_generate_is_greedy_decoding(tiny):
    model, tokenizer = tiny
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=False))
    prompt = tokenizer("The lease ends in March. " * 20).input_ids  # several times the 32-token window
    events = list(stream_generate(model, tokenizer, prompt, make_sampler(), 12, stop_token_ids(model, tokenizer),
                                  [(0, len(prompt))]))
    *pieces, finished = events
    assert all(isinstance(piece, TextPiece) for piece in pieces) and isinstance(finished, Finished)
    ids, expected = torch.tensor([prompt]), []
    for _ in range(12):
        expected.append(int(model(ids).logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
    assert "".join(piece.text for piece in pieces) == tokenizer.decode(expected, skip_special_tokens=True)
    assert (finished.reason, finished.prompt_tokens, finished.generated_tokens) == ("length", len(prompt), 12)
    assert finished.peak_memory_bytes > 0 and finished.prefill_tokens_per_second > 0


def test_stop_tokens_end_the_answer(tiny):
    model, tokenizer = tiny
    stops = stop_token_ids(model, tokenizer)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in stops and tokenizer.convert_tokens_to_ids("<|end_of_text|>") in stops
    always_eot = lambda logits: eot  # noqa: E731
    events = list(stream_generate(model, tokenizer, [0, 5, 6], always_eot, 10, stops, [(0, 3)]))
    assert events == [events[-1]] and events[-1].reason == "stop" and events[-1].generated_tokens == 1


def test_detokenizer_holds_back_partial_characters(tiny):
    _, tokenizer = tiny
    ids = tokenizer("東京 café", add_special_tokens=False).input_ids
    detokenizer = _Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids]
    assert "".join(pieces) == "東京 café" and not any("\ufffd" in piece for piece in pieces)
    cut = _Detokenizer(tokenizer)  # an answer that ends inside a character: its bytes are left out
    whole = [cut.add(token) for token in tokenizer("東", add_special_tokens=False).input_ids]
    partial = [cut.add(token) for token in tokenizer("京", add_special_tokens=False).input_ids[:-1]]
    assert "".join(whole) == "東" and partial == [""] * len(partial) and cut.finish() == ""


def test_the_detokenizer_decodes_a_few_tokens_at_a_time(tiny):
    """However long a line, each token decodes only the tokens not shown yet and those of the last piece (decoding
    the whole line again for each token cost SmolLM2's tokenizer 1.2 ms a token over a line of 2,048 tokens); the
    pieces join to the answer decoded as a whole."""
    _, tokenizer = tiny
    ids = tokenizer("東京 café, naïve: the lease ends in March. " * 40, add_special_tokens=False).input_ids
    lengths = []

    class Counting:
        def decode(self, tokens, **kwargs):
            lengths.append(len(tokens))
            return tokenizer.decode(tokens, **kwargs)

    detokenizer = _Detokenizer(Counting())
    pieces = [detokenizer.add(token) for token in ids] + [detokenizer.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) and len(ids) > 400 and max(lengths) <= 8


@pytest.mark.parametrize("method", ["original", "gali", pytest.param("self-extend", marks=pytest.mark.slow),
                                    pytest.param("chunk-llama", marks=pytest.mark.slow)])
def test_the_static_step_gives_eager_decodings_tokens_and_runs_no_forward_to_be_checked(tiny, method, monkeypatch):
    """The CLI's path (stream_generate) decodes greedily through the static step the tokens that the model's own
    forward gives, token for token; the step is held to the prefill's logits of the prompt's last token, so the
    model's forward runs for the prefill alone (a forward to check it against cost 2-4 steps' time per answer)."""
    model, tokenizer = tiny
    prompt = tokenizer("The lease ends in March. " * 12).input_ids  # past the 32-token window
    answers = {}
    for choice in ("eager", "static"):
        monkeypatch.setenv("GALI_DECODE", choice)
        apply_method(model, method, MethodSettings(train_len=32), len(prompt) + 24)
        spans, forwards = prefill_spans(model, method, 0, len(prompt)), []
        hook = model.register_forward_hook(lambda *_, forwards=forwards: forwards.append(1))
        *pieces, finished = stream_generate(model, tokenizer, prompt, make_sampler(), 24, set(), spans)
        hook.remove()
        answers[choice] = finished.answer_ids
        assert "".join(piece.text for piece in pieces) == tokenizer.decode(finished.answer_ids)
        assert len(forwards) == len(spans) + (23 if choice == "eager" else 0)
        assert finished.decode_path == "eager" if choice == "eager" else finished.decode_path.startswith("static")
    assert answers["static"] == answers["eager"] and len(answers["eager"]) == 24


def test_only_the_generator_runs_in_inference_mode(tiny):
    """The caller's code between two events runs as it would anyway (here under no_grad, not inference mode)."""
    model, tokenizer = tiny
    cache = DynamicCache(config=model.config)
    prompt = tokenizer("The lease ends in March. " * 4).input_ids
    modes = [torch.is_inference_mode_enabled()
             for _ in stream_generate(model, tokenizer, prompt, make_sampler(), 6, set(), [(0, len(prompt))],
                                      cache=cache)]
    assert len(modes) > 1 and not any(modes)
    assert cache.layers[0].keys.is_inference()  # the model itself ran in inference mode


def test_the_verbose_line_says_what_was_read_and_rates_that_mean_something():
    from gali_cli.runs.answer import stats_line

    def finished(prompt, prefilled, generated, decode_seconds):
        return Finished(reason="length", prompt_tokens=prompt, prefilled_tokens=prefilled, generated_tokens=generated,
                        prefill_seconds=0.5, decode_seconds=decode_seconds, peak_memory_bytes=2**30)

    cached = stats_line(finished(4350, 20, 1, 0.0001))
    assert cached.startswith("prompt 4350 tokens: 4330 from the cache, 20 read in 0.50 s (40 tokens/s); ")
    assert "generated 1 token, length" in cached and "tokens/s after" not in cached  # no rate from one token
    fresh = stats_line(finished(100, 100, 5, 2.0))
    assert fresh.startswith("prompt 100 tokens: 100 read in 0.50 s (200 tokens/s); generated 5 tokens (2.0 tokens/s "
                            "after the first), length")
    assert finished(100, 100, 1, 0.0001).decode_tokens_per_second is None
    described = replace(finished(100, 100, 5, 2.0), decode_path="static step, native attention")
    assert "generated 5 tokens (2.0 tokens/s after the first: static step, native attention), length" in stats_line(
        described)


def test_a_huge_token_limit_reserves_rows_for_a_plausible_answer_only(tiny):
    """--max-new-tokens 1000000 (or a server client's max_tokens) once reserved a million rows per layer up front:
    24 GB for SmolLM2, and the process was killed. The answer below stops on the first token all the same."""
    model, tokenizer = tiny
    stops = stop_token_ids(model, tokenizer)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    cache = new_cache(model)
    events = list(stream_generate(model, tokenizer, [0, 5, 6], lambda logits: eot, 10**12, stops, [(0, 3)],
                                  cache=cache))
    assert events[-1].reason == "stop"
    assert {layer.storage()[0].shape[2] for layer in cache.layers} == {3 + ANSWER_ROWS_RESERVED}
