import pytest
import torch
from helpers.attention import HEAD_DIM, qkv, rope_table

import gali_cli.engine.attention.dense as dense
from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.dense import Partial, causal_attention, lower_right_causal_attention, merge_partials
from gali_cli.engine.attention.gali_attention import chunk_context, chunk_contexts, gali_attention, noisy
from gali_cli.engine.attention.noisy_attention import add_noise
from gali_cli.engine.checks.reference import reference_gali_attention
from gali_cli.engine.math.noise import Noise
from gali_cli.engine.math.positions import chunk_plan, interpolate
from gali_cli.engine.math.rope import key_rotation


def planned_gali_attention(query, key, value, chunks, scale, noise=None):
    """`gali_attention` with the plan a forward over these chunks decides (as `Forward.attention_plan` does)."""
    return gali_attention(query, key, value, chunks, scale, plan_for(query, key, value, 0.0, noisy(chunks, noise)),
                          noise=noise)


CASES = [  # heads, kv_heads, train_len, local_window, keys, queries
    (4, 4, 16, 3, 40, 5),
    (4, 2, 16, 0, 48, 1),
    (8, 2, 32, 31, 100, 7),
    (4, 1, 16, 1, 17, 17),
    (2, 2, 16, 5, 90, 16),
]


@pytest.mark.parametrize("heads, kv_heads, train_len, local_window, kv_len, q_len", CASES)
def test_mixed_key_equals_two_matmul_interpolation(heads, kv_heads, train_len, local_window, kv_len, q_len):
    query, key, value = qkv(2, heads, kv_heads, q_len, kv_len)
    table = rope_table(train_len + 1)
    chunk = chunk_context(table, kv_len, q_len, train_len, local_window)
    fast = planned_gali_attention(query, key, value, [chunk], scale=HEAD_DIM**-0.5)
    interp = interpolate(kv_len, train_len, local_window)
    slow = reference_gali_attention(query, key, value, table, interp, HEAD_DIM**-0.5)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, train_len, local_window, kv_len, q_len", CASES)
def test_noisy_path_matches_reference_with_the_same_noise(heads, kv_heads, train_len, local_window, kv_len, q_len):
    query, key, value = qkv(2, heads, kv_heads, q_len, kv_len, seed=1)
    table = rope_table(train_len + 1)
    interp = interpolate(kv_len, train_len, local_window)
    noise = Noise(seed=3, layer=2, scale=4.0)
    chunk = chunk_context(table, kv_len, q_len, train_len, local_window)
    fast = planned_gali_attention(query, key, value, [chunk], HEAD_DIM**-0.5, noise=noise)
    slow = reference_gali_attention(query, key, value, table, interp, HEAD_DIM**-0.5, noise=noise)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    if kv_len > train_len:
        clean = planned_gali_attention(query, key, value, [chunk], HEAD_DIM**-0.5)
        assert (fast - clean).abs().max() > 1e-3


@pytest.mark.parametrize("noise", [None, Noise(seed=0, layer=1, scale=2.0)])
@pytest.mark.parametrize("train_len, chunk_size, local_window", [(16, 3, 2), (16, 8, 0), (32, 5, 20)])
def test_chunks_reusing_keys_equal_chunks_alone(noise, train_len, chunk_size, local_window):
    """One forward over many chunks re-rotates only moved keys; each chunk must still see its own positions."""
    kv_len = 7 * train_len + 2
    pieces = chunk_plan(train_len, kv_len, train_len, chunk_size)
    query, key, value = qkv(1, 4, 2, kv_len - train_len, kv_len, seed=2)
    table = rope_table(train_len + 1)
    contexts = chunk_contexts(table, pieces, train_len, local_window)
    assert any(chunk.reuse for chunk in contexts)  # the case under test
    together = planned_gali_attention(query, key, value, contexts, HEAD_DIM**-0.5, noise=noise)
    for (first, last), _chunk in zip(pieces, contexts):
        rows = slice(first - train_len, last - train_len)
        alone = chunk_context(table, last, last - first, train_len, local_window)
        expected = planned_gali_attention(query[:, :, rows], key, value, [alone], HEAD_DIM**-0.5, noise=noise)
        torch.testing.assert_close(together[:, :, rows], expected, rtol=1e-6, atol=1e-6)
    reusing = next(chunk for chunk in contexts if chunk.reuse)
    with pytest.raises(ValueError, match="reuse"):
        planned_gali_attention(query[:, :, : reusing.queries], key, value, [reusing], HEAD_DIM**-0.5)


def test_noisy_path_is_the_same_in_any_tiling(monkeypatch):
    query, key, value = qkv(1, 4, 2, 12, 80)
    chunk = chunk_context(rope_table(17), 80, 12, 16, 2)
    noise = Noise(seed=0, layer=0, scale=1.0)
    whole = planned_gali_attention(query, key, value, [chunk], 0.25, noise=noise)
    monkeypatch.setitem(dense._LOGITS_TILE_ELEMENTS, "cpu", 4 * 80 * 5)  # tiles of 5 queries
    assert torch.equal(planned_gali_attention(query, key, value, [chunk], 0.25, noise=noise), whole)


def planned_causal_attention(query, key, value, scale):
    """dense.causal_attention by the plan a forward decides for these tensors (the routes take it as an argument)."""
    return causal_attention(query, key, value, scale, 0.0, plan_for(query, key, value))


@pytest.mark.parametrize("attention", [planned_causal_attention, lower_right_causal_attention])  # CPU, CUDA
@pytest.mark.parametrize("q_len, kv_len", [(1, 9), (9, 9), (4, 9), (3, 40)])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_causal_attention_is_lower_right(attention, q_len, kv_len, kv_heads):
    query, key, value = qkv(2, 4, kv_heads, q_len, kv_len)
    got = attention(query, key, value, scale=0.3)
    key_r, value_r = key.repeat_interleave(4 // kv_heads, 1), value.repeat_interleave(4 // kv_heads, 1)
    logits = query @ key_r.transpose(-1, -2) * 0.3
    future = torch.arange(kv_len) > torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
    expected = torch.softmax(logits.masked_fill(future, float("-inf")), -1) @ value_r
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_noise_has_the_specified_distribution():
    kv_len, train_len, local_window = 600, 64, 4
    interp = interpolate(kv_len, train_len, local_window)
    weight = interp.weight.float()
    query_index = torch.arange(kv_len - 50, kv_len)
    logits = torch.zeros(4, 16, 50, kv_len)
    add_noise(logits, query_index, interp.group, interp.grouped, Noise(seed=1, layer=0, scale=2.5))
    sigma = (query_index.unsqueeze(1) - torch.arange(kv_len)).float() * 2.5 / kv_len
    interpolated = (weight != 0).expand(50, -1)
    assert not logits[..., ~interpolated].any()  # zero wherever c == 0 (and past the grouped keys)
    sampled = interpolated & (sigma != 0)
    standardized = logits[..., sampled] / sigma[sampled]
    assert abs(standardized.mean().item()) < 0.01
    assert abs(standardized.std().item() - 1) < 0.01
    # The spread grows with the distance i - j, as sigma says.
    near, far = logits[..., interpolated & (sigma < 0.8)], logits[..., interpolated & (sigma > 1.8)]
    assert far.std() > 2 * near.std()


def test_in_window_rotation_is_the_models_own_table():
    table = rope_table(16, torch.bfloat16)
    chunk = chunk_context(table, 12, 4, 16, 3)
    assert not chunk.interpolated
    assert torch.equal(chunk.key_cos, table.cos[:12]) and torch.equal(chunk.query_sin, table.sin[8:12])


def test_bf16_keeps_the_interpolation_weight():
    # The authors' trap: bf16 has no fractions above 256 (spacing 2), so c computed in bf16 is 0 there.
    train_len, kv_len = 512, 1800
    interp = interpolate(kv_len, train_len, 8)
    p = interp.ceil.double() - interp.weight
    high = p >= 256
    assert interp.weight[high].count_nonzero() > 100
    assert not (p.bfloat16().ceil() - p.bfloat16())[high].any()  # what computing c in bf16 gives
    # Our bf16 tables mix ceil and floor with the exact c, rounding only the result.
    table = rope_table(train_len + 1, torch.bfloat16)
    chunk = chunk_context(table, kv_len, 1, train_len, 8)
    c = interp.weight.float().unsqueeze(1)
    exact = (1 - c) * table.cos32[interp.ceil] + c * table.cos32[interp.floor]
    torch.testing.assert_close(chunk.key_cos.float(), exact, rtol=0, atol=2**-8)
    fractional = interp.weight != 0
    off_ceil = (chunk.key_cos.float() - table.cos32[interp.ceil]).abs().amax(dim=1)
    assert (off_ceil[fractional] > 2**-7).float().mean() > 0.9  # really interpolated, not rounded to a neighbour


@pytest.mark.parametrize("train_len, local_window", [(16, 0), (16, 1), (16, 5), (16, 15), (32, 8)])
def test_key_rotation_is_the_interpolated_rotation_of_alg_2_positions(train_len, local_window):
    """(1 - c) R(ceil p) + c R(floor p) for every key, from the positions of Alg. 2, for whole chunks and row ranges."""
    table = rope_table(train_len + 1)
    for keys in range(train_len + 1, 6 * train_len, 7):
        interp = interpolate(keys, train_len, local_window)
        c = interp.weight.float().unsqueeze(-1)
        cos = (1 - c) * table.cos32[interp.ceil] + c * table.cos32[interp.floor]
        sin = (1 - c) * table.sin32[interp.ceil] + c * table.sin32[interp.floor]
        ranges = [(0, keys), (interp.grouped // 2, keys), (1, interp.grouped), (interp.grouped, keys), (keys - 1, keys)]
        for first, last in [(first, last) for first, last in ranges if first < last]:
            got_cos, got_sin = key_rotation(table, keys, first, last, train_len, interp.group, interp.grouped)
            torch.testing.assert_close(got_cos, cos[first:last], rtol=0, atol=1e-6)
            torch.testing.assert_close(got_sin, sin[first:last], rtol=0, atol=1e-6)


def test_causal_attention_matches_the_masked_formulation_with_and_without_gradients():
    """Without gradients the CPU takes a mask-free route (two calls merged by log-sum-exp); with them, a route whose
    backward is exact. Both must equal attention with an explicit lower-right mask."""
    query, key, value = qkv(2, 4, 2, 5, 12)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                enable_gqa=True)
    got = planned_causal_attention(query, key, value, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    gradients = []
    for attend in (planned_causal_attention, lambda q, k, v, scale: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)):
        leaves = [x.clone().requires_grad_() for x in (query, key, value)]
        with torch.enable_grad():
            attend(*leaves, 0.3).square().sum().backward()
        gradients.append([leaf.grad for leaf in leaves])
    for got, want in zip(*gradients, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_parts_in_different_dtypes_merge_in_float32():
    """GALI's noisy decode part comes in the model's dtype, a GPU part in float32 (dense.partial_attention)."""
    generator = torch.Generator().manual_seed(0)
    first, second = (Partial(torch.randn(1, 2, 3, 4, generator=generator), torch.randn(1, 2, 3, generator=generator))
                     for _ in range(2))
    expected = merge_partials([first, second])
    for parts in ([first._replace(output=first.output.bfloat16()), second],
                  [first, second._replace(output=second.output.bfloat16())]):
        merged = merge_partials(parts)
        assert merged.output.dtype == torch.float32
        torch.testing.assert_close(merged.output, expected.output, atol=2e-2, rtol=0)
