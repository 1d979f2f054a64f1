import pytest
import torch
from helpers.tiny_models import prompt
from transformers import DynamicCache, Phi3Config, Phi3ForCausalLM, StaticCache

import gali_cli.engine.attention.choice as choice
import gali_cli.engine.seam.hooks as hooks
from gali_cli import ConfigError, GaliConfig, GaliError, UnsupportedModelError, apply_gali, gali_settings, remove_gali
from gali_cli.engine.attention.gali_attention import chunk_contexts
from gali_cli.engine.checks.reference_model import NaiveGali
from gali_cli.engine.math.positions import chunk_plan, interpolate
from gali_cli.engine.math.rope import absolute_table
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.methods.gali import Gali
from gali_cli.seam_check import VOCAB


def forward_pieces(model, ids: torch.Tensor, pieces) -> torch.Tensor:
    """Feed `ids` one forward per piece through one cache; return all logits."""
    cache = DynamicCache(config=model.config)
    return torch.cat([model(ids[:, a:b], **with_cache(model, cache), use_cache=True).logits for a, b in pieces], dim=1)


def engine_greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = DynamicCache(config=model.config)
    logits = model(ids, **with_cache(model, cache), use_cache=True).logits[0, -1]
    tokens, step_logits = [], []
    for _ in range(steps):
        token = int(logits.argmax())
        tokens.append(token)
        step_logits.append(logits)
        logits = model(torch.tensor([[token]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
    return tokens, step_logits


ENGINE_CASES = [  # heads, kv_heads, train_len, chunk_size, local_window, prompt_len
    (4, 2, 16, 4, 0, 13),  # below the window
    (4, 4, 16, 4, 3, 16),  # exactly the window
    (4, 2, 16, 5, 3, 17),  # one past it
    (4, 2, 16, 5, 1, 83),  # many times, chunks not dividing evenly
    (4, 4, 16, 4, 0, 80),  # chunks dividing evenly; no local window, ending on a multiple of train_len
    (4, 2, 32, 8, 31, 150),  # the widest local window
    (4, 1, 32, 7, 4, 97),  # multi-query
    pytest.param(4, 4, 64, 16, 8, 320, marks=pytest.mark.slow),  # five times the window (many times: 83 above)
    (4, 2, 64, 64, 16, 200),  # chunk as long as the window
    (4, 2, 16, 1, 2, 40),  # one-token chunks
]


@pytest.mark.parametrize("heads, kv_heads, train_len, chunk_size, local_window, prompt_len", ENGINE_CASES)
def test_engine_matches_naive_gali(make_llama, heads, kv_heads, train_len, chunk_size, local_window, prompt_len):
    model = make_llama(train_len=train_len, heads=heads, kv_heads=kv_heads)
    naive = NaiveGali(model, train_len, chunk_size, local_window)
    ids = prompt(prompt_len)
    expected = naive.prefill(ids[0].tolist())
    apply_gali(model, GaliConfig(chunk_size=chunk_size, local_window=local_window, noise=False))
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)

    naive_tokens, naive_logits = NaiveGali(model, train_len, chunk_size, local_window).greedy(ids[0].tolist(), 4)
    tokens, logits = engine_greedy(model, ids, 4)
    assert tokens == naive_tokens
    torch.testing.assert_close(torch.stack(logits).double(), torch.stack(naive_logits), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("noise", [False, True])
def test_one_forward_equals_plan_pieces_equals_naive(make_llama, noise):
    model = make_llama(train_len=16, kv_heads=2)
    ids = prompt(75)
    naive = NaiveGali(model, 16, 6, 2, noise=(11, 1.5) if noise else None)
    expected = naive.prefill(ids[0].tolist())
    apply_gali(model, GaliConfig(chunk_size=6, local_window=2, noise=noise, noise_scale=1.5, seed=11))
    whole = model(ids).logits
    pieces = forward_pieces(model, ids, chunk_plan(0, 75, 16, 6))
    # Any split along the plan's boundaries is the same too: pieces of several chunks each.
    coarse = forward_pieces(model, ids, [(0, 10), (10, 28), (28, 75)])
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(coarse, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole[0].double(), expected, rtol=1e-4, atol=1e-4)


def test_attention_routes_are_decided_once_per_forward(make_llama, monkeypatch):
    """Kernel choice and causal route are fixed for a forward: its first layer decides, every chunk of every layer
    takes them, and the next forward decides again (so a changed $GALI_KERNEL applies from the next forward)."""
    decisions = []

    def counted(name, decide):
        def wrapper(*args, **kwargs):
            decisions.append(name)
            return decide(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(choice, "decide", counted("causal", choice.decide))
    monkeypatch.setattr(choice, "checked", counted("kernel", choice.checked))
    model = apply_gali(make_llama(train_len=16, layers=3), GaliConfig(chunk_size=4, local_window=2, noise=True))
    model(prompt(60))  # 11 chunks beyond the window, 3 layers
    assert sorted(decisions) == ["causal", "kernel"]
    model(prompt(60))
    assert sorted(decisions) == ["causal", "causal", "kernel", "kernel"]


def test_noisy_decoding_matches_naive(make_llama):
    model = make_llama(train_len=16, heads=4, kv_heads=1)
    ids = prompt(50, seed=3)
    naive_tokens, naive_logits = NaiveGali(model, 16, 4, 3, noise=(5, 1.0)).greedy(ids[0].tolist(), 5)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=3, noise=True, seed=5))
    tokens, logits = engine_greedy(model, ids, 5)
    assert tokens == naive_tokens
    torch.testing.assert_close(torch.stack(logits).double(), torch.stack(naive_logits), rtol=1e-4, atol=1e-4)


def test_noise_is_seeded_and_only_beyond_the_window(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(60)
    apply_gali(model, GaliConfig(chunk_size=8, local_window=2, noise=False))
    clean = model(ids).logits
    assert GaliConfig().noise is False  # off by default (docs/benchmarks.md); the paper's setting on request
    apply_gali(model, GaliConfig(chunk_size=8, local_window=2, noise=True, seed=0))
    noisy, again = model(ids).logits, model(ids).logits
    apply_gali(model, GaliConfig(chunk_size=8, local_window=2, noise=True, seed=1))
    other_seed = model(ids).logits
    assert torch.equal(noisy, again)
    assert torch.equal(noisy[:, :16], clean[:, :16])  # inside the window there is nothing to interpolate
    assert (noisy[:, 16:] - clean[:, 16:]).abs().max() > 1e-3
    assert (noisy[:, 16:] - other_seed[:, 16:]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_within_train_len_bit_identical_to_unpatched(make_llama, dtype, attn_implementation):
    model = make_llama(train_len=16, attn_implementation=attn_implementation).to(dtype)
    ids = prompt(16)
    schedules = [[(0, 16)], [(0, 5), (5, 9), (9, 10), (10, 11), (11, 16)]]
    unpatched = [forward_pieces(model, ids, pieces) for pieces in schedules]
    apply_gali(model, GaliConfig(chunk_size=3, local_window=2))
    for pieces, expected in zip(schedules, unpatched):
        assert torch.equal(forward_pieces(model, ids, pieces), expected)


def test_remove_gali_restores_the_exact_original(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(40)
    before = model(ids).logits
    rotary, implementation = model.model.rotary_emb, model.config._attn_implementation
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2))
    assert gali_settings(model) == GaliConfig(train_len=16, chunk_size=4, local_window=2)
    patched = model(ids).logits
    apply_gali(model, GaliConfig(chunk_size=6, local_window=1))  # applying again replaces the settings
    assert gali_settings(model).chunk_size == 6
    assert remove_gali(model) is model
    assert torch.equal(model(ids).logits, before) and not torch.equal(patched, before)
    assert model.model.rotary_emb is rotary and model.config._attn_implementation == implementation
    assert not model.model._forward_pre_hooks and gali_settings(model) is None
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert state.keys() == model.state_dict().keys()
    with pytest.raises(GaliError, match="not applied"):
        remove_gali(model)


def test_batch_of_equal_length_sequences(make_llama):
    model = make_llama(train_len=16, kv_heads=2)
    ids = prompt(45, batch=2)
    naive = [NaiveGali(model, 16, 5, 2, noise=(0, 1.0), batch_index=b).prefill(ids[b].tolist()) for b in range(2)]
    apply_gali(model, GaliConfig(chunk_size=5, local_window=2, noise=True))
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    for b in range(2):
        torch.testing.assert_close(logits[b].double(), naive[b], rtol=1e-4, atol=1e-4)


def test_generate_matches_naive_greedy_decoding(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(37)
    naive_tokens, _ = NaiveGali(model, 16, 4, 2).greedy(ids[0].tolist(), 6)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=False))
    generated = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    assert generated[0, 37:].tolist() == naive_tokens


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8},  # Llama 3.1
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
    ids=["llama3", "yarn", "linear"],
)
def test_rope_types(make_llama, rope):
    model = make_llama(train_len=32, rope_parameters=rope)
    ids = prompt(90)
    expected = NaiveGali(model, 32, 8, 4).prefill(ids[0].tolist())
    inside = model(ids[:, :32]).logits
    apply_gali(model, GaliConfig(chunk_size=8, local_window=4, noise=False))
    assert torch.equal(model(ids[:, :32]).logits, inside)
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)


def test_static_cache_and_generate(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(41)
    naive_tokens, _ = NaiveGali(model, 16, 4, 2).greedy(ids[0].tolist(), 5)
    expected = NaiveGali(model, 16, 4, 2).prefill(ids[0].tolist())
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=False))
    cache = StaticCache(config=model.config, max_cache_len=64)
    logits = torch.cat([model(ids[:, a:b], **with_cache(model, cache), use_cache=True).logits for a, b in
                        [(0, 10), (10, 28), (28, 41)]], dim=1)  # cut only at plan boundaries (16 + 4k)
    torch.testing.assert_close(logits[0].double(), expected, rtol=1e-4, atol=1e-4)
    generated = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0,
        cache_implementation="static",
    )
    assert generated[0, 41:].tolist() == naive_tokens


def test_forward_and_backward_with_autograd(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(50)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=True))
    expected = model(ids).logits
    with torch.enable_grad():
        logits = model(ids).logits
        logits[:, -1].logsumexp(-1).sum().backward()
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-5, atol=1e-5)
    gradient = model.model.layers[0].self_attn.k_proj.weight.grad
    assert gradient is not None and gradient.abs().sum() > 0 and torch.isfinite(gradient).all()


def test_failed_reapply_keeps_the_previous_settings(make_llama):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    with pytest.raises(ConfigError):
        apply_gali(model, GaliConfig(train_len=32))
    assert gali_settings(model) == GaliConfig(train_len=16, chunk_size=4, local_window=2)


def test_changing_the_attention_implementation_afterwards_is_caught(make_llama):
    model = apply_gali(make_llama(train_len=16))
    model.set_attn_implementation("sdpa")
    with pytest.raises(GaliError, match="remove the method first"):
        model(prompt(20))


def test_default_dtype_does_not_leak_into_the_tables(make_llama):
    model = make_llama(train_len=16)
    ids = prompt(60)
    apply_gali(model, GaliConfig(chunk_size=4, local_window=2, noise=False))
    expected = model(ids).logits
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert torch.equal(model(ids).logits, expected)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_interpolation_and_tracks_fp32(make_llama, dtype):
    train_len, length = 512, 1300
    model = make_llama(train_len=train_len, hidden=64, layers=2)
    ids = prompt(length)
    settings = GaliConfig(chunk_size=256, local_window=16, noise=False)
    apply_gali(model, settings)
    reference = model(ids).logits[0, train_len:]
    logits = model.to(dtype)(ids).logits[0, train_len:].float()
    error = (logits - reference).norm() / reference.norm()
    assert error < 0.05, f"relative error {error:.3f} against the fp32 engine"
    # The half-precision model runs the exact fp64 interpolation weights (the chunk tables prove it).
    table = hooks.Forward(model.model._positional, 0, length).table(ids.device, dtype)
    chunks = chunk_contexts(table, chunk_plan(0, length, train_len, 256), train_len, 16)
    interp = interpolate(length, train_len, 16)
    c = interp.weight.float().unsqueeze(1)
    exact = (1 - c) * table.cos32[interp.ceil] + c * table.cos32[interp.floor]
    torch.testing.assert_close(chunks[-1].key_cos.float(), exact[chunks[-1].reuse :], rtol=0, atol=2**-7)


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_quantized_model(make_llama, tmp_path, bits):
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    make_llama(train_len=16, hidden=64).save_pretrained(tmp_path)
    quantization = (
        BitsAndBytesConfig(load_in_8bit=True)
        if bits == 8
        else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    )
    model = LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map="cpu").eval()
    reference = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = prompt(70)
    unpatched = model(ids[:, :16]).logits
    settings = GaliConfig(chunk_size=6, local_window=2, noise=False)
    apply_gali(model, settings)
    apply_gali(reference, settings)
    assert torch.equal(model(ids[:, :16]).logits, unpatched)
    whole = model(ids).logits.float()
    # LLM.int8 picks outlier columns per batch of rows, so different splits differ by a little quantization noise.
    pieces = forward_pieces(model, ids, chunk_plan(0, 70, 16, 6)).float()
    torch.testing.assert_close(pieces, whole, rtol=0, atol=0.1)
    exact = reference(ids).logits
    correlation = torch.corrcoef(torch.stack([whole[0, 16:].flatten(), exact[0, 16:].flatten()]))[0, 1]
    assert correlation > 0.9


def test_padded_batches_and_custom_positions_are_refused(make_llama):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2))
    ids = prompt(30, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(GaliError, match="unpadded"):
        model(ids, attention_mask=mask)
    with pytest.raises(GaliError, match="position_ids"):
        model(ids, position_ids=torch.arange(30).unsqueeze(0) * 2)
    model(ids, position_ids=torch.arange(30).unsqueeze(0))  # a plain arange is fine


def test_unsupported_models_get_a_clear_error(make_llama):
    phi3 = Phi3ForCausalLM(
        Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    )
    with pytest.raises(UnsupportedModelError, match=r"^Phi3ForCausalLM is a 'phi3' model; gali supports Llama"):
        apply_gali(phi3)
    dynamic = make_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        apply_gali(dynamic)
    with pytest.raises(UnsupportedModelError):
        apply_gali(torch.nn.Linear(2, 2))


def test_train_len_beyond_the_models_window_is_refused(make_llama):
    with pytest.raises(ConfigError, match="--train-len"):
        apply_gali(make_llama(train_len=16), GaliConfig(train_len=32))
    with pytest.raises(ConfigError, match="--local-window"):
        apply_gali(make_llama(train_len=16), GaliConfig(local_window=20))


def test_smaller_train_len_than_the_model(make_llama):
    model = make_llama(train_len=32)
    ids = prompt(70)
    expected = NaiveGali(model, 16, 5, 3).prefill(ids[0].tolist())
    apply_gali(model, GaliConfig(train_len=16, chunk_size=5, local_window=3, noise=False))
    torch.testing.assert_close(model(ids).logits[0].double(), expected, rtol=1e-4, atol=1e-4)


def _decode_logits(model, cache, steps: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = []
    for _ in range(steps):
        token = torch.randint(0, VOCAB, (2, 1), generator=generator)
        logits.append(model(input_ids=token, **with_cache(model, cache)).logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("kv_heads, local_window, noise", [  # the default tier: one case without noise, one with
    (2, 2, False), pytest.param(4, 0, False, marks=pytest.mark.slow),
    (1, 5, True), pytest.param(2, 15, True, marks=pytest.mark.slow),
])
def test_decoding_without_re_rotation_matches_re_chunking(make_llama, monkeypatch, kv_heads, local_window, noise):
    """60 one-token steps from 21 to 80 keys: g changes several times, keys leave the tail one or two a step."""
    model = apply_gali(make_llama(train_len=16, kv_heads=kv_heads), GaliConfig(chunk_size=4, local_window=local_window,
                                                                                noise=noise))
    prompt = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    runs = {}
    for fast in (True, False):
        monkeypatch.setattr(Gali, "fast_decode", fast)
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, **with_cache(model, cache))
        runs[fast] = _decode_logits(model, cache, 60)
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=1e-5)


def test_decode_states_follow_their_cache(make_llama, monkeypatch):
    """Two caches decoded in turn, and a cache that is cut back and refilled, decode as if each were alone."""
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2, noise=False))
    prompts = [torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
               for length in (20, 27)]

    def decoded(interleave: bool) -> list[torch.Tensor]:
        caches = [DynamicCache(config=model.config) for _ in prompts]
        for cache, ids in zip(caches, prompts):
            model(input_ids=ids, **with_cache(model, cache))
        if not interleave:
            return [_decode_logits(model, cache, 8, seed) for seed, cache in enumerate(caches)]
        halves = [[_decode_logits(model, cache, 4, seed)] for seed, cache in enumerate(caches)]
        for seed, cache in enumerate(caches):  # the same tokens: seeded streams, continued
            generator = torch.Generator().manual_seed(seed)
            torch.randint(0, VOCAB, (4, 2, 1), generator=generator)
            steps = [model(input_ids=torch.randint(0, VOCAB, (2, 1), generator=generator),
                           **with_cache(model, cache)).logits[:, -1] for _ in range(4)]
            halves[seed].append(torch.stack(steps))
        return [torch.cat(half) for half in halves]

    monkeypatch.setattr(Gali, "fast_decode", False)
    expected = decoded(interleave=False)
    monkeypatch.setattr(Gali, "fast_decode", True)
    for got, want in zip(decoded(interleave=True), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    cache = DynamicCache(config=model.config)
    model(input_ids=prompts[0], **with_cache(model, cache))
    _decode_logits(model, cache, 5)
    for layer in cache.layers:  # cut back to the prompt, as a cancelled chat turn does
        layer.keys, layer.values = layer.keys[:, :, :20], layer.values[:, :, :20]
    after_cut = _decode_logits(model, cache, 6, seed=3)
    fresh = DynamicCache(config=model.config)
    model(input_ids=prompts[0], **with_cache(model, fresh))
    torch.testing.assert_close(after_cut, _decode_logits(model, fresh, 6, seed=3), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8},
                                  {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16}])
def test_absolute_table_is_the_models_rotary(make_llama, rope):
    model = make_llama(train_len=64, rope_parameters=rope)
    rotary = model.model.rotary_emb
    positions = torch.arange(64)
    cos, sin = rotary(torch.empty(0), positions.unsqueeze(0))
    lookup = absolute_table(rotary.inv_freq, rotary.attention_scaling, torch.float32)
    ours = lookup(positions)
    torch.testing.assert_close(ours[0], cos[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours[1], sin[0], rtol=0, atol=2e-5)


def test_decoding_may_switch_between_inference_mode_and_no_grad(make_llama):
    model = apply_gali(make_llama(train_len=16), GaliConfig(chunk_size=4, local_window=2, noise=False))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, VOCAB, (2, 20)), **with_cache(model, cache))
        model(input_ids=torch.randint(0, VOCAB, (2, 1)), **with_cache(model, cache))
    with torch.no_grad():
        assert model(input_ids=torch.randint(0, VOCAB, (2, 1)), **with_cache(model, cache)).logits.isfinite().all()


def test_models_built_from_one_config_object_are_patched_apart(make_llama):
    """Transformers picks the attention from the config object: patching one model must not switch the other."""
    from transformers import LlamaForCausalLM

    first = make_llama(train_len=16)
    second = LlamaForCausalLM(first.config).eval()
    second.load_state_dict(first.state_dict())
    ids = prompt(40)
    plain = first(ids).logits
    apply_gali(first, GaliConfig(chunk_size=4, local_window=2))
    patched = first(ids).logits
    assert torch.equal(second(ids).logits, plain)  # untouched by the first model's patch
    apply_gali(second, GaliConfig(chunk_size=4, local_window=2))
    assert torch.equal(second(ids).logits, patched)
    shared = second.config
    remove_gali(first)
    assert torch.equal(first(ids).logits, plain) and torch.equal(second(ids).logits, patched)
    remove_gali(second)
    assert torch.equal(second(ids).logits, plain) and second.config is first.config is not shared
    assert first.config._attn_implementation == "sdpa"
