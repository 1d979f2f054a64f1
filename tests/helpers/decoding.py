"""The static decoding step's tests: a tiny model with a method applied and a prompt prefilled, the step held to the
model's own forward token by token, and the decoding kernels' attention from its definition in float64; and what a
16-bit KV cache is held to (--kv-dtype): a float32 cache whose rows are rounded as they are stored."""

import torch

from gali_cli.config import MethodSettings
from gali_cli.engine.math.noise import standard_normal
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import GrowingLayer, new_cache, reserve
from gali_cli.engine.seam.static_decode import StaticDecoder
from gali_cli.generate import prefill
from gali_cli.patching import apply_method, prefill_spans

SETTINGS = {"gali-noise": MethodSettings(train_len=32, noise=True), "gali-window-0": MethodSettings(
    train_len=32, local_window=0, chunk_size=8), "leaky-rerope": MethodSettings(train_len=32, leaky_factor=4),
    "dpe": MethodSettings(train_len=32, dpe_scales=(1, 2, 4, 8))}


def prefilled(make_llama, method: str, prompt: int, answer: int, dtype=torch.float32, **llama):
    """A tiny Llama with `method` applied, a cache holding `prompt` random tokens with room for `answer` more,
    and the tokens to decode."""
    model, cache, ids, _ = read_prompt(make_llama, method, prompt, answer, dtype, **llama)
    return model, cache, ids[prompt:]


def read_prompt(make_llama, method: str, prompt: int, answer: int, dtype=torch.float32, **llama):
    """`prefilled`, with all the tokens (the prompt's, then those to decode) and the prefill's logits."""
    torch.manual_seed(0)
    model = make_llama(train_len=32, **llama).to(dtype)
    name = method.split("-noise")[0].split("-window")[0]
    apply_method(model, name, SETTINGS.get(method, MethodSettings(train_len=32)), prompt + answer)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + answer))
    cache = new_cache(model)
    reserve(cache, prompt + answer)
    logits = prefill(model, ids[:, :prompt], cache, prefill_spans(model, name, 0, prompt, step=24))
    return model, cache, ids[0].tolist(), logits


class RoundedLayer(GrowingLayer):
    """A layer of a KV cache in the compute dtype whose rows are rounded to `rounding` as they are stored: numerically
    what a cache stored in that dtype holds, read back in the compute dtype (what a 16-bit cache is held to)."""

    def __init__(self, rounding: torch.dtype) -> None:
        super().__init__()
        self.rounding = rounding

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.rounding).to(rows.dtype)


def rounded_cache(model, rounding: torch.dtype):
    """`new_cache(model)` with `RoundedLayer`s."""
    cache = new_cache(model)
    cache.layers = [RoundedLayer(rounding) for _ in cache.layers]
    return cache


def decoded_logits(model, method: str, cache, ids: list[int], prompt: int, eager: int, route: str) -> torch.Tensor:
    """Every logit row a generation on `cache` reads: `ids[:prompt]` prefilled in forwards of up to 24 tokens (the
    last row's), then each next token of `ids`, `eager` of them by the model's own forward and the rest by the static
    step on `route` (StaticDecoder); (1 + len(ids) - prompt, vocab). (Inside torch.inference_mode.)"""
    reserve(cache, len(ids))
    rows = [prefill(model, torch.tensor([ids[:prompt]]), cache, prefill_spans(model, method, 0, prompt, step=24))]
    given = with_cache(model, cache)
    for index in range(prompt, prompt + eager):
        rows.append(model(input_ids=torch.tensor([[ids[index]]]), **given, use_cache=True).logits[0, -1].float())
    decoder = StaticDecoder(model, cache, route)
    rows += [decoder.step(token, index).clone() for index, token in enumerate(ids[prompt + eager :], prompt + eager)]
    return torch.stack(rows)


def worst_step_difference(decoder: StaticDecoder, model, cache, tokens: list[int], start: int) -> float:
    """Decode `tokens` from token index `start` with `decoder`, holding each step's logits to the model's own
    forward for the same token on the same cache: the largest difference, absolute. (Inside torch.inference_mode.)"""
    given, worst = with_cache(model, cache), 0.0
    for index, token in enumerate(tokens, start=start):
        static = decoder.step(token, index).clone()
        assert cache.get_seq_length() == index + 1
        for layer in cache.layers:
            layer.extend(index)
        eager = model(input_ids=torch.tensor([[token]]), **given, use_cache=True).logits[0, -1].float()
        worst = max(worst, (static - eager).abs().max().item())
    return worst


KERNEL_METHODS = ["original", "gali", "gali-noise", "gali-window-0", "self-extend", "chunk-llama", "rerope",
                  "leaky-rerope", "dpe", "string", "lampe", "self", "yarn"]


def expected_attention(rows, keys, values, index, scale, cos=None, sin=None, noise=None, sigma=None):
    """The same attention in float64 from its definition: keys rotated as rope.rotate does, noise.standard_normal's
    draws times sigma added after scaling, keys past `index` left out."""
    rows, keys, values = rows.double(), keys.double(), values.double()
    batch, kv_heads, group, _ = rows.shape
    if cos is not None:
        half = keys.shape[-1] // 2
        turned = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
        keys = keys * cos.double() + turned * sin.double()
    logits = torch.einsum("bhgd,bhcd->bhgc", rows, keys) * scale
    if noise is not None:
        draws = standard_normal(noise, batch, kv_heads * group, torch.tensor([index]), keys.shape[2])
        logits = logits + (draws.double() * sigma.double()).view(batch, kv_heads, group, -1)
    logits[..., index + 1 :] = float("-inf")
    return torch.einsum("bhgc,bhcd->bhgd", logits.softmax(-1), values)


def tables(count: int, dim: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (C, D) of random angles, halves equal, as the static step makes them."""
    angles = torch.rand(count, dim // 2, dtype=torch.float64) * 200.0
    return (torch.cat((f(angles), f(angles)), dim=-1).to(device, dtype) for f in (torch.cos, torch.sin))


def offset_tables(count: int, dim: int, dtype: torch.dtype, device: str) -> dict:
    """GALI's rotation from a RoPE table per offset: a table of 40 rows of random angles (D/2 wide), a row per key
    (some the last but one, whose next row is the table's last) and a mix towards the next row (0 for a third of
    the keys), as `rotating_decode_attention` takes them; and each key's own row of cos/sin (C, D) interpolated in
    float64, as `expected_attention` takes them."""
    angles = torch.rand(40, dim // 2, dtype=torch.float64) * 200.0
    rows = torch.randint(0, 39, (count,), dtype=torch.int32)
    rows[::7] = 38
    mix = torch.rand(count, dtype=torch.float32)
    mix[::3] = 0.0
    own = [torch.lerp(f(angles)[rows.long()], f(angles)[rows.long() + 1], mix.double()[:, None])
           for f in (torch.cos, torch.sin)]
    return {"cos": torch.cos(angles).to(device, dtype), "sin": torch.sin(angles).to(device, dtype),
            "table_rows": rows.to(device), "mix": mix.to(device),
            "own": [torch.cat((x, x), dim=-1).to(dtype).double() for x in own]}
