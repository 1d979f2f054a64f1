import pytest
import torch
from helpers.attention import HEAD_DIM, qkv, rope_table
from transformers import DynamicCache

from gali_cli.engine.attention.choice import plan_for
from gali_cli.engine.attention.dense import PARTIAL
from gali_cli.engine.attention.kept_keys import KeptKeys
from gali_cli.methods.windowed import windowed_attention


def rope64(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (..., n, D) rotated at positions (n,), float64."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM))
    angles = positions.double().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    half = HEAD_DIM // 2
    return x.double() * angles.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1).double() * angles.sin()


def expected(query, key, value, far_query, far_key, window, start, scale):
    """Explicit float64 logits: RoPE at true positions where i - j < window, far_query . far_key elsewhere."""
    per_kv = query.shape[1] // key.shape[1]
    stop = start + query.shape[2]
    key, value = key[:, :, :stop].repeat_interleave(per_kv, 1), value[:, :, :stop].repeat_interleave(per_kv, 1)
    i, j = torch.arange(start, stop), torch.arange(stop)
    near = rope64(query, i) @ rope64(key, j).transpose(-1, -2) * scale
    far = torch.zeros_like(near)
    reach = max(0, stop - window)
    far[..., :reach] = far_query.double() @ far_key[:, :, :reach].double().repeat_interleave(per_kv, 1).transpose(
        -1, -2) * scale
    distance = i.unsqueeze(1) - j
    logits = torch.where(distance < window, near, far).masked_fill(distance < 0, float("-inf"))
    return torch.softmax(logits, dim=-1) @ value.double()


def planned_windowed_attention(query, key, value, table, far_query, far_key, window, start, scale):
    """`windowed_attention` with the plan its forward would decide (`Forward.attention_plan`)."""
    return windowed_attention(query, key, value, table, far_query, far_key, window, start, scale,
                              plan_for(query, key, value))


CASES = [  # kv_heads, window, start, queries: tiles whole and partial, first tiles near token 0, one query
    (2, 4, 0, 30), (1, 4, 2, 13), (4, 5, 9, 5), (2, 3, 20, 1), (2, 8, 0, 8), (1, 1, 3, 7), (2, 6, 5, 2),
    (4, 2, 1, 17), (2, 7, 40, 23),
]


@pytest.mark.parametrize("kv_heads, window, start, queries", CASES)
def test_windowed_attention_is_the_split_softmax(kv_heads, window, start, queries):
    stop = start + queries
    query, key, value = qkv(2, 4, kv_heads, queries, stop + 2, seed=window + start)
    far_query, far_key, _ = qkv(2, 4, kv_heads, queries, stop + 2, seed=queries)
    table = rope_table(2 * window)
    got = planned_windowed_attention(query, key, value, table, far_query, far_key, window, start, 0.4)
    torch.testing.assert_close(got.double(), expected(query, key, value, far_query, far_key, window, start, 0.4),
                               rtol=1e-5, atol=1e-5)


def test_windowed_attention_under_autograd_takes_the_explicit_route_with_the_same_result():
    query, key, value = qkv(1, 4, 2, 11, 30, seed=3)
    far_query, far_key, _ = qkv(1, 4, 2, 11, 30, seed=4)
    table = rope_table(8)
    fast = planned_windowed_attention(query, key, value, table, far_query, far_key, 4, 19, 0.4)
    leaves = [x.clone().requires_grad_() for x in (query, key, value, far_query, far_key)]
    with torch.enable_grad():
        slow = planned_windowed_attention(leaves[0], leaves[1], leaves[2], table, leaves[3], leaves[4], 4, 19, 0.4)
        slow.square().sum().backward()
        reference = [x.detach().double().requires_grad_() for x in (query, key, value, far_query, far_key)]
        expected(reference[0], reference[1], reference[2], reference[3], reference[4], 4, 19, 0.4).square().sum(
        ).backward()
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-6)
    for leaf, want in zip(leaves, reference, strict=True):
        torch.testing.assert_close(leaf.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_lse_routes_agree(causal):
    query, key, value = qkv(2, 6, 2, 5, 5 if causal else 9)

    def attention_lse(query, key, value, scale, causal):  # the route the plan picks for these tensors
        return PARTIAL[plan_for(query, key, value).partial](query, key, value, scale, causal=causal)

    fast = attention_lse(query, key, value, 0.3, causal)
    with torch.enable_grad():
        explicit = attention_lse(query.requires_grad_(), key, value, 0.3, causal)
    torch.testing.assert_close(explicit.output, fast.output, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(explicit.lse, fast.lse, rtol=1e-5, atol=1e-6)


def test_kept_keys_rotate_only_new_tokens_while_a_cache_continues():
    calls = []

    def rotation(first, last):
        calls.append((first, last))
        table = rope_table(last)
        return table.cos32[first:last], table.sin32[first:last]

    kept, cache, other = KeptKeys(), DynamicCache(), DynamicCache()
    _, key, _ = qkv(2, 4, 2, 1, 40)
    full = rotation(0, 40)
    whole = key * full[0] + torch.cat((-key[..., HEAD_DIM // 2 :], key[..., : HEAD_DIM // 2]), -1) * full[1]
    calls.clear()
    for start, stop in [(0, 10), (10, 11), (11, 30)]:
        torch.testing.assert_close(kept.rotated(cache, 0, key, start, stop, rotation), whole[:, :, :stop])
    assert calls == [(0, 10), (10, 11), (11, 30)]
    kept.rotated(cache, 0, key, 20, 25, rotation)  # the cache was cut back: everything again
    kept.rotated(other, 0, key, 0, 5, rotation)  # another cache has its own keys
    kept.rotated(cache, 1, key, 25, 26, rotation)  # another layer too
    assert calls[3:] == [(0, 25), (0, 5), (0, 26)]
    torch.testing.assert_close(kept.rotated(cache, 0, key[:1], 25, 26, rotation), whole[:1, :, :26])  # batch size
    assert calls[-1] == (0, 26)
