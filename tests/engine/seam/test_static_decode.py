"""The static decoding step (seam/static_decode.py), which a GPU records as a CUDA graph: on the CPU it runs eagerly
and is held here to the model's own forward, token by token, for every method it serves."""

import warnings

import pytest
import torch
from helpers.decoding import prefilled, read_prompt, worst_step_difference
from helpers.gguf_files import write_gguf
from helpers.tiers import slow_but
from helpers.tiny_models import save_tiny_llama

from gali_cli.config import MethodSettings
from gali_cli.engine.attention import decode_route
from gali_cli.engine.attention.dense import Partial, biased_partial
from gali_cli.engine.seam import static_decode
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import new_cache, reserve
from gali_cli.engine.seam.packed_modules import PackedLinear
from gali_cli.engine.seam.static_decode import StaticDecoder, why_not_static
from gali_cli.errors import ConfigError, GaliWarning
from gali_cli.generate import DecodePath, decode, prefill, stream_generate
from gali_cli.loading import load_model
from gali_cli.methods.registry import NAMES, REGISTRY
from gali_cli.model.families import GLOBAL, LOCAL
from gali_cli.patching import apply_method, prefill_spans
from gali_cli.seam_check import tiny_model

STATIC = [name for name in sorted(NAMES) if REGISTRY[name].static_step]  # the others decode eagerly
@pytest.mark.parametrize("method", [*STATIC, "gali-noise", "gali-window-0"])
def test_every_step_equals_the_models_own_forward(make_llama, method):
    """From a 40-token prompt (past the 32-token window), 60 tokens decoded: the static step's logits equal the
    eager forward's at every index, on the same cache (GALI's group size changes several times on the way)."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_llama, method, 40, 60)
        assert why_not_static(model, cache) is None
        worst = worst_step_difference(StaticDecoder(model, cache), model, cache, tokens, 40)
    assert worst < 2e-5, worst


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("method", slow_but(["rerope", "gali", "self-extend", "chunk-llama", "leaky-rerope"],
                                            "rerope", "gali"))
def test_every_step_equals_the_forward_on_a_yarn_model(make_llama, method):
    """A model whose RoPE scales its cos/sin (YaRN's attention scaling, 1.14 here): every rotated query-key pair
    has it twice. ReRoPE's eager far keys are stored un-rotated and missed one (its steps were 0.49 of the largest
    logit off the static step's); the native kernel's heads (4 heads of 16) rotate from its table per offset."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_llama, method, 40, 30, heads=4, kv_heads=2, hidden=64,
                                         rope_parameters=YARN)
        worst = worst_step_difference(StaticDecoder(model, cache), model, cache, tokens, 40)
    assert worst < 2e-5, worst


@pytest.mark.parametrize("method", slow_but(["gali-noise", "chunk-llama", "original"], "original"))
def test_keys_cut_into_blocks_give_the_same_steps(make_llama, method, monkeypatch):
    """The step's attention cut into blocks of 16 keys (on a GPU: 256), with a last partial block and blocks wholly
    past the index, equals the forward as one block does."""
    monkeypatch.setattr(static_decode, "KEY_BLOCK", {"cpu": 16})
    test_every_step_equals_the_models_own_forward(make_llama, method)


@pytest.mark.parametrize("block", [7, 16, 200, None])
def test_split_key_attention_is_one_softmax(block):
    """Blocks merged by their log-sum-exps are one softmax over all keys, whatever the block size; keys at the
    mask's bias (a whole block of them, too) weigh nothing."""
    torch.manual_seed(0)
    rows, keys, values = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 100, 8), torch.randn(2, 3, 100, 8)
    bias = torch.randn(2, 3, 4, 100)
    bias[..., 60:] = torch.finfo(torch.float32).min
    got = static_decode.split_key_attention(rows, keys, values, bias, 0.3, block)
    logits = (rows.double() @ keys.double().transpose(-1, -2)) * 0.3 + bias.double()
    expected = torch.softmax(logits, dim=-1) @ values.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["gali-noise", "original"])
def test_steps_hold_when_attention_parts_come_back_transposed(make_llama, method, monkeypatch):
    """On CUDA, biased_partial's kernel returns (B, H, q, D) as a transposed view of (B, q, H, D). A cache shorter
    than one block of keys then has a single part, handed on as it came: `gali ask` about a short document failed
    on a GPU with "view size is not compatible". The same layout on the CPU, blocks of 256 keys as on a GPU."""
    def as_cuda_returns(*args):
        part = biased_partial(*args)
        return Partial(part.output.transpose(1, 2).contiguous().transpose(1, 2), part.lse)

    monkeypatch.setattr(static_decode, "biased_partial", as_cuda_returns)
    monkeypatch.setattr(static_decode, "KEY_BLOCK", {"cpu": 256})
    test_every_step_equals_the_models_own_forward(make_llama, method)


@pytest.mark.parametrize("last_token", [None, 5])
@pytest.mark.parametrize("method", ["gali", "self-extend", "original"])
def test_decode_takes_the_static_step_and_leaves_the_cache_as_eager_decoding_does(make_llama, method, last_token,
                                                                                 monkeypatch):
    """GALI_DECODE=static: `decode` checks the step against the model's forward (given the token whose logits it
    starts from, those logits; else a forward of the first token decoded), then steps statically; the tokens, and
    the cache afterwards (its length, keys and values), are those of eager decoding."""
    runs = {}
    for choice in ("eager", "static"):
        monkeypatch.setenv("GALI_DECODE", choice)
        calls = []
        with torch.inference_mode():
            model, cache, _ = prefilled(make_llama, method, 40, 30)
            model.register_forward_hook(lambda *_, calls=calls: calls.append(1))
            logits = model(input_ids=torch.tensor([[5]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
            how = DecodePath()
            tokens = list(decode(model, cache, logits.float(), lambda x: int(x.argmax()), 25, set(), how, last_token))
        runs[choice] = tokens, cache, len(calls)
        assert how.description == "eager" if choice == "eager" else how.description.startswith("static step, ")
    (eager_tokens, eager_cache, eager_calls), (tokens, cache, calls) = runs["eager"], runs["static"]
    assert tokens == eager_tokens and cache.get_seq_length() == eager_cache.get_seq_length() == 40 + 1 + 24
    assert eager_calls == 25  # the one forward before decoding, then one a token
    assert calls == (2 if last_token is None else 1)  # and a forward to check the step against, or none
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        torch.testing.assert_close(layer.values, eager_layer.values)


HELD = [*STATIC, "gali-noise", "gali-window-0", "gali-native", "self-extend-native"]


# The default tier: five of them; every method's steps against the forward: test_every_step_equals_... above.
@pytest.mark.parametrize("method", slow_but(HELD, "original", "gali", "gali-noise", "gali-native",
                                            "self-extend-native"))
def test_the_step_is_held_to_the_prefills_logits_and_leaves_its_rows_as_they_were(make_llama, method):
    """`check` at the prompt's last token, against the logits the prefill returned for it (a forward of many
    tokens, cut at the method's chunks), as generate.decode holds the step: every method's step agrees with them;
    the row the check wrote is the prefill's again afterwards, bit for bit; the steps after it equal the forward.
    "-native": heads of 16, which the native kernel attends."""
    sizes = {"heads": 4, "kv_heads": 2, "hidden": 64} if method.endswith("-native") else {}
    with torch.inference_mode():
        model, cache, ids, logits = read_prompt(make_llama, method.removesuffix("-native"), 40, 20, **sizes)
        rows = [[buffer[:, :, :40].clone() for buffer in layer.storage()] for layer in cache.layers]
        decoder = StaticDecoder(model, cache)
        assert decoder.check(ids[39], 39, logits) and decoder.difference < 1e-5, decoder.difference
        assert sizes == {} or decoder.route == "native"
        assert cache.get_seq_length() == 40
        for layer, before in zip(cache.layers, rows, strict=True):
            assert all(torch.equal(buffer[:, :, :40], row) for buffer, row in zip(layer.storage(), before))
        worst = worst_step_difference(decoder, model, cache, ids[40:], 40)
    assert worst < 2e-5, worst


@pytest.mark.parametrize("last_token", [None, 5])
def test_a_step_that_differs_from_the_forward_warns_and_decodes_eagerly(make_llama, last_token, monkeypatch):
    """A static step placing keys wrongly is caught by the check (against a forward of the first token decoded, or
    the logits decoding starts from): a warning, then eager decoding with the same tokens as eager decoding from
    the start."""
    monkeypatch.setenv("GALI_DECODE", "static")
    with torch.inference_mode():
        model, cache, _ = prefilled(make_llama, "self-extend", 40, 20)
        method = model.model._positional.method
        monkeypatch.setattr(type(method), "decode_placement", lambda self, query, keys: static_decode.Placement(
            (keys - query).double()))  # plain RoPE: wrong past the window
        logits = model(input_ids=torch.tensor([[5]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
        how = DecodePath()
        with pytest.warns(GaliWarning, match="differs from the model's own forward"):
            tokens = list(decode(model, cache, logits.float(), lambda x: int(x.argmax()), 10, set(), how,
                                 last_token))
        assert how.description == "eager"
        monkeypatch.undo()
        model2, cache2, _ = prefilled(make_llama, "self-extend", 40, 20)
        logits = model2(input_ids=torch.tensor([[5]]), **with_cache(model2, cache2), use_cache=True).logits[0, -1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tokens == list(decode(model2, cache2, logits.float(), lambda x: int(x.argmax()), 10, set()))


def test_rows_not_written_yet_cannot_reach_the_answer(make_llama):
    """The reserved rows past the cache hold whatever the allocator left; attended under a mask, NaN there would
    still make NaN logits (NaN times 0): the decoder zeroes them first."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_llama, "gali", 40, 10)
        for layer in cache.layers:
            for buffer in layer.storage():
                buffer[:, :, 40:] = float("nan")
        assert torch.isfinite(StaticDecoder(model, cache).step(tokens[0], 40)).all()


def test_bfloat16_steps_stay_within_rounding_of_float32(make_llama):
    """The static step in bfloat16 against float32's eager forward, after GALI's window (the relative rotations
    round differently from the eager ones; both stay within bfloat16's rounding)."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_llama, "gali", 40, 10)
        model16, cache16, _ = prefilled(make_llama, "gali", 40, 10, dtype=torch.bfloat16)
        decoder, given = StaticDecoder(model16, cache16), with_cache(model, cache)
        for index, token in enumerate(tokens, start=40):
            static = decoder.step(token, index)
            eager = model(input_ids=torch.tensor([[token]]), **given, use_cache=True).logits[0, -1]
            assert static_decode.difference(static, eager) < static_decode.HALF_TOLERANCE


def test_what_cannot_decode_statically_says_why(make_llama, monkeypatch):
    with torch.inference_mode():
        model, cache, _ = prefilled(make_llama, "original", 40, 10)
        apply_method(model, "dynamic-ntk", MethodSettings(train_len=32), 50)
        assert "dynamic NTK" in why_not_static(model, cache)
        assert "reserved" in why_not_static(model, new_cache(model))
    monkeypatch.setenv("GALI_DECODE", "graph")
    with pytest.raises(ConfigError, match="GALI_DECODE must be one of auto, eager, static"):
        decode_route.decode_choice()
    # auto on a CPU: every method where the native kernel attends (float32, head dim a multiple of 16), else the
    # static step for the unpatched model only
    monkeypatch.setenv("GALI_DECODE", "auto")
    with torch.inference_mode():
        model, cache, _ = prefilled(make_llama, "original", 40, 10)  # head dim 8: the PyTorch route
        assert isinstance(static_decode.static_decoder(model, cache), StaticDecoder)
        model, cache, _ = prefilled(make_llama, "gali", 40, 10)
        assert static_decode.static_decoder(model, cache) is None
        model, cache, _ = prefilled(lambda **kw: make_llama(**kw, heads=4, kv_heads=2, hidden=128), "gali", 40, 10)
        assert static_decode.static_decoder(model, cache).route == "native"
        monkeypatch.setenv("GALI_KERNEL", "torch")
        assert static_decode.static_decoder(model, cache) is None
        monkeypatch.setenv("GALI_DECODE", "static")
        assert static_decode.static_decoder(model, cache).route == "torch"


REACHES = [("gali", {"local_window": 0}), ("gali", {"local_window": 4}), ("gali", {"local_window": 7}),
           ("self-extend", {}), ("self-extend", {"group_size": 20, "neighbor_window": 5}), ("chunk-llama", {}),
           ("chunk-llama", {"dca_chunk_size": 6}), ("rerope", {}), ("gali", {"chunk_size": 3}), ("string", {}),
           ("string", {"shifted_offset": 3}), ("string", {"shifted_offset": 5, "local_window": 2}),
           ("self", {}), ("self", {"group_size": 200, "neighbor_window": 3, "self_rate": 1.0})]


@pytest.mark.parametrize("train_len", [8, 13])
@pytest.mark.parametrize("method, settings", REACHES)
def test_offsets_stay_within_the_reach_a_method_declares(make_llama, train_len, method, settings):
    """The kernels rotate keys from a table of reach + 2 rows per offset where a method declares a reach: for every
    query up to 8x the window, every key's offset up to the query is a whole number in [-reach, 0], the query's own
    0 (the row after the farthest, GALI's R(p - 1), is in the table too)."""
    from gali_cli.engine.seam.hooks import installed_method

    model = make_llama(train_len=train_len)
    apply_method(model, method, MethodSettings(train_len=train_len, noise=True, **settings), 8 * train_len)
    method, keys = installed_method(model), torch.arange(8 * train_len)
    for query in range(8 * train_len):
        placement = method.decode_placement(torch.tensor(query), keys)
        offsets = placement.offset[: query + 1]
        assert not offsets.is_floating_point() and placement.reach is not None
        assert offsets.min() >= -placement.reach and offsets.max() == 0 == offsets[query], query


def test_an_unknown_route_is_refused(make_llama):
    """A route name the step does not have (a benchmark once asked for "kernel") is an error, not a kernel call that
    fails on the first step and falls back to PyTorch with a warning."""
    model, cache, _ = prefilled(make_llama, "gali", 40, 4)
    with pytest.raises(ValueError, match="route must be one of triton, native, torch"):
        StaticDecoder(model, cache, route="kernel")


def test_a_method_whose_offsets_leave_its_reach_is_attended_in_pytorch(make_llama, monkeypatch):
    """A reach too small for the offsets (a method's mistake) would make a kernel read past its table: the first
    step finds it, warns, and takes the PyTorch route, whose steps still equal the forward."""
    from gali_cli.methods.self_extend import SelfExtend

    declared = SelfExtend.decode_placement
    monkeypatch.setattr(SelfExtend, "decode_placement",
                        lambda self, query, keys: declared(self, query, keys)._replace(reach=3))
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_llama, "self-extend", 40, 12, heads=4, kv_heads=2, hidden=64)
        decoder = StaticDecoder(model, cache)
        assert decoder.route == "native"
        given = with_cache(model, cache)
        with pytest.warns(GaliWarning, match="leave its declared reach 3"):
            decoder.first_step(tokens[0], 40, lambda: model(input_ids=torch.tensor([[tokens[0]]]), **given,
                                                               use_cache=True).logits[0, -1].float())
        assert decoder.route == "torch" and decoder.checked


# Gemma 3 (static_layers.py): three layers, local, global, local, the local ones on a window of 6 tokens and a RoPE
# base of 100 (seam_check.tiny_model), its four norms a layer, q/k norms and query_pre_attn_scalar. From a 4-token
# prompt, the window (6) and then the method's window (32) are crossed while decoding.
WINDOW = 6
NATIVE = {"heads": 4, "kv_heads": 2, "hidden": 64}  # heads of 16, which the native kernel attends


def make_gemma(**sizes):
    return tiny_model("gemma3_text", **{"sliding_window": WINDOW, **sizes})


# The default tier: GALI with and without noise on Gemma 3; every method's steps on a Llama above.
@pytest.mark.parametrize("method", slow_but([*STATIC, "gali-noise", "gali-window-0"], "gali", "gali-noise"))
@pytest.mark.parametrize("sizes", [{}, NATIVE], ids=["torch", "native"])
def test_gemma3s_every_step_equals_its_forward(method, sizes):
    """Gemma 3's static step, the global layer placed by the method and the local ones at true positions over their
    window, equals the eager forward at every index from 4 to 63: past the local window and past train_len, on the
    PyTorch route and on the native kernel's."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_gemma, method, 4, 60, **sizes)
        assert why_not_static(model, cache) is None
        decoder = StaticDecoder(model, cache)
        assert decoder.route == ("native" if sizes else "torch") and decoder.kinds == (LOCAL, GLOBAL, LOCAL)
        worst = worst_step_difference(decoder, model, cache, tokens, 4)
    assert worst < 2e-5, worst


@pytest.mark.parametrize("method", ["original", "gali-noise", "self-extend"])
@pytest.mark.parametrize("route", slow_but(["torch", "triton"], "torch"))  # Triton's kernels: test_triton_decode.py
def test_gemma3s_windows_gathered_by_the_index_tensor_equal_the_forward(method, route):
    """As a GPU takes the local window (gathered by the index tensor, no host read, for a CUDA graph), on the
    PyTorch route and through the Triton kernel (its interpreter, on the CPU)."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_gemma, method, 4, 16 if route == "triton" else 40, **NATIVE)
        decoder = StaticDecoder(model, cache, route=route)
        decoder.gather_windows = True
        worst = worst_step_difference(decoder, model, cache, tokens, 4)
    assert worst < 2e-5, worst


@pytest.mark.parametrize("shift", [-1, 1])
@pytest.mark.parametrize("method", ["original", "gali"])
@pytest.mark.parametrize("sizes", [{}, NATIVE], ids=["torch", "native"])
def test_gemma3s_local_window_one_key_off_is_caught(method, sizes, shift):
    """A window of W - 1 or W + 1 keys (j >= i - W, or j > i - W + 1) instead of transformers' i - W < j <= i is far
    from the forward once the window is full: the tests above would see it."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(make_gemma, method, 4, 12, **sizes)
        decoder = StaticDecoder(model, cache)
        decoder.window += shift
        worst = worst_step_difference(decoder, model, cache, tokens, 4)
    assert worst > 0.1, worst


@pytest.mark.parametrize("method", slow_but(["original", "gali", "self-extend", "ntk"], "original", "gali"))
@pytest.mark.parametrize("sizes", [{}, NATIVE], ids=["torch", "native"])
def test_gemma3s_step_is_held_to_the_prefills_logits(method, sizes):
    """`check` against the prefill's logits of a 40-token prompt (past both windows, cut at the method's chunks):
    it agrees, puts the row it wrote back, and the steps after it equal the forward."""
    with torch.inference_mode():
        model, cache, ids, logits = read_prompt(make_gemma, method, 40, 20, **sizes)
        rows = [[buffer[:, :, :40].clone() for buffer in layer.storage()] for layer in cache.layers]
        decoder = StaticDecoder(model, cache)
        assert decoder.check(ids[39], 39, logits) and decoder.difference < 1e-5, decoder.difference
        for layer, before in zip(cache.layers, rows, strict=True):
            assert all(torch.equal(buffer[:, :, :40], row) for buffer, row in zip(layer.storage(), before))
        worst = worst_step_difference(decoder, model, cache, ids[40:], 40)
    assert worst < 2e-5, worst


@pytest.mark.parametrize("method", ["gali", "original"])
def test_gemma3_generates_through_the_static_step(method, monkeypatch):
    """`stream_generate` on Gemma 3 (GALI_DECODE auto, heads the native kernel takes) decodes its answer with the
    static step, checked against the prefill, never falling back to eager decoding (no warning); the answer is eager
    decoding's token for token, past the local window and the method's (unless the repetition guard ends both)."""
    answers = {}
    for choice in ("eager", "auto"):
        monkeypatch.setenv("GALI_DECODE", choice)
        torch.manual_seed(0)
        model = make_gemma(train_len=32, **NATIVE)
        apply_method(model, method, MethodSettings(train_len=32), 80)
        prompt = torch.randint(0, model.config.vocab_size, (20,)).tolist()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            events = list(stream_generate(model, _Tokens(), prompt, lambda x: int(x.argmax()), 40, set(),
                                          prefill_spans(model, method, 0, 20, step=8)))
        answers[choice] = events[-1].decode_path, events[-1].answer_ids
    assert answers["eager"][0] == "eager"
    assert answers["auto"][0] == "static step, native attention"
    assert answers["auto"][1] == answers["eager"][1] and len(answers["auto"][1]) > 24


class _Tokens:
    """A tokenizer that decodes ids as their numbers (stream_generate's detokenizer asks no more)."""

    def decode(self, ids, **_) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize("quant", slow_but(["Q4_K", "Q8_0"], "Q8_0"))  # every GGUF type: test_gguf_weights.py
def test_a_gemma3_gguf_decodes_through_the_static_step(quant, tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes one (six layers, every sixth global, heads of 256), loaded with its
    projections as grids: the static step attends by the native kernel and multiplies through the grids, and equals
    the forward past the window."""
    pytest.importorskip("gguf")
    sizes = {"hidden": 256, "head_dim": 256, "layers": 6, "query_pre_attn_scalar": 256, "sliding_window": WINDOW,
             "layer_types": [LOCAL] * 5 + [GLOBAL],
             "rope_parameters": {GLOBAL: {"rope_type": "default", "rope_theta": 10000.0},
                                 LOCAL: {"rope_type": "default", "rope_theta": 10000.0}}}
    directory = save_tiny_llama(tmp_path / "model", "gemma3_text", **sizes)
    model = load_model(str(write_gguf(tmp_path / "tiny.gguf", directory, quant=quant)), device="cpu").model
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    with torch.inference_mode():
        apply_method(model, "gali", MethodSettings(train_len=16), 40)
        ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
        cache = new_cache(model)
        reserve(cache, 40)
        prefill(model, ids[:, :8], cache, prefill_spans(model, "gali", 0, 8))
        decoder = StaticDecoder(model, cache)
        assert decoder.route == "native"
        worst = worst_step_difference(decoder, model, cache, ids[0, 8:].tolist(), 8)
    assert worst < 1e-4, worst
