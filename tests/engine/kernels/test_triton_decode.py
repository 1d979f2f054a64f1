"""triton_decode's kernel (one decoded query over the cache, each key rotated as it is read) against float64
attention, and the static decoding step through it against the model's own forward: on the CPU through Triton's
interpreter (conftest sets TRITON_INTERPRET=1), or compiled on a GPU with TRITON_INTERPRET=0. The interpreter's tl.dot
mishandles bfloat16, so bfloat16 is left to the GPU (where the decoder's first step is held to the forward)."""

import importlib
import os

import pytest
import torch
from helpers.decoding import KERNEL_METHODS, expected_attention, offset_tables, prefilled, tables, worst_step_difference
from helpers.tiers import slow_but

from gali_cli.engine.attention import decode_route
from gali_cli.engine.math.noise import Noise, head_streams
from gali_cli.engine.seam import static_decode
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.static_decode import StaticDecoder


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    return importlib.import_module("gali_cli.engine.kernels.triton_decode")


@pytest.fixture
def device():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


CASES = [  # batch, kv heads, heads per kv head, head dim, cache rows, programs per key head, token indices
    (1, 2, 3, 64, 300, 3, [0, 63, 64, 200, 299]),  # a group of 3 (rows padded to 16); runs past the index empty
    (2, 1, 4, 32, 130, 2, [63, 64, 129]),  # batch 2, tiles cut short by the index
    (1, 2, 1, 128, 70, 1, [5, 69]),  # one head per key head, one program
    (1, 1, 2, 64, 1000, 5, [999, 500]),  # runs of several tiles each
]


# The default tier: every variant and dtype on the second case (batch 2, two programs, tiles cut short).
@pytest.mark.parametrize("batch, kv_heads, group, dim, count, splits, indices", slow_but(CASES, CASES[1]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["rotated-noisy", "rotated", "as-cached", "offset-table-noisy", "offset-table"])
def test_kernel_equals_attention_from_its_definition(kernel, device, batch, kv_heads, group, dim, count, splits,
                                                     indices, dtype, variant):
    torch.manual_seed(0)
    rows = torch.randn(batch, kv_heads, group, dim).to(device, dtype)
    keys, values = (torch.randn(batch, kv_heads, count, dim).to(device, dtype) for _ in range(2))
    cos, sin = tables(count, dim, dtype, device) if variant != "as-cached" else (None, None)
    by_offset, own = {}, (cos, sin)
    if variant.startswith("offset-table"):
        by_offset = offset_tables(count, dim, dtype, device)
        cos, sin, own = by_offset.pop("cos"), by_offset.pop("sin"), by_offset.pop("own")
    noise = sigma = streams = None
    if variant.endswith("noisy"):
        noise, sigma = Noise(seed=11, layer=2, scale=1.0), (torch.rand(count) * 2.0).to(device)
        sigma[::3] = 0.0  # the keys where c = 0 get none
        streams = head_streams(noise, batch, kv_heads * group, device)
    for index in indices:
        got = kernel.rotating_decode_attention(rows, keys, values, torch.tensor(index, device=device), 0.2, cos, sin,
                                               sigma, streams, splits, **by_offset)
        expected = expected_attention(rows.cpu(), keys.cpu(), values.cpu(), index, 0.2,
                                      *(None if x is None else x.cpu() for x in own), noise,
                                      None if sigma is None else sigma.cpu())
        assert got.dtype == torch.float32 and got.shape == rows.shape
        torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-4 if dtype == torch.float32
                                   else 2e-3)


@pytest.mark.parametrize("dtype", slow_but([torch.float16, torch.bfloat16], torch.float16))
@pytest.mark.parametrize("variant", slow_but(["rotated-noisy", "as-cached", "offset-table"], "rotated-noisy"))
def test_16_bit_keys_and_values_give_the_float32_numbers_of_their_rounded_rows(kernel, device, dtype, variant):
    """A 16-bit cache of a float32 model (--kv-dtype): float32 rows over keys and values widened as each tile is
    loaded give the numbers of the float32 cache holding the same rows rounded (bfloat16 too: the products are
    float32's)."""
    batch, kv_heads, group, dim, count, splits, indices = CASES[1]
    torch.manual_seed(0)
    rows = torch.randn(batch, kv_heads, group, dim).to(device)
    keys, values = (torch.randn(batch, kv_heads, count, dim).to(device, dtype) for _ in range(2))
    cos, sin = tables(count, dim, torch.float32, device) if variant != "as-cached" else (None, None)
    by_offset = {}
    if variant == "offset-table":
        by_offset = offset_tables(count, dim, torch.float32, device)
        cos, sin = by_offset.pop("cos"), by_offset.pop("sin")
        del by_offset["own"]
    sigma = streams = None
    if variant.endswith("noisy"):
        sigma = (torch.rand(count) * 2.0).to(device)
        streams = head_streams(Noise(seed=11, layer=2, scale=1.0), batch, kv_heads * group, device)
    for index in indices:
        at = torch.tensor(index, device=device)
        got, expected = (kernel.rotating_decode_attention(rows, k, v, at, 0.2, cos, sin, sigma, streams, splits,
                                                          **by_offset)
                         for k, v in ((keys, values), (keys.float(), values.float())))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_keys_past_the_index_are_never_read(kernel, device):
    """NaN in every row after the index (rows a CUDA graph has not written yet) cannot reach the output: the kernel
    stops at the index instead of masking, whatever the number of programs."""
    torch.manual_seed(0)
    rows, keys, values = torch.randn(1, 1, 2, 32), torch.randn(1, 1, 200, 32), torch.randn(1, 1, 200, 32)
    keys[:, :, 71:], values[:, :, 71:] = float("nan"), float("nan")
    for splits in (1, 2, 7):
        got = kernel.rotating_decode_attention(*(x.to(device) for x in (rows, keys, values)),
                                               torch.tensor(70, device=device), 0.3, splits=splits)
        torch.testing.assert_close(got.cpu().double(), expected_attention(
            rows, keys[:, :, :71], values[:, :, :71], 70, 0.3), rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused(kernel):
    rows, keys = torch.randn(1, 1, 2, 32), torch.randn(1, 1, 10, 32)
    cos, at = torch.ones(10, 32), torch.zeros(10, dtype=torch.int32)
    for arguments in ({"cos": cos}, {"sigma": torch.zeros(10)}, {"cos": cos, "sin": cos.t().contiguous().t()},
                      {"table_rows": at}, {"cos": cos, "sin": cos, "mix": torch.zeros(10)},
                      {"cos": cos, "sin": cos, "table_rows": at[:9]}, {"cos": cos, "sin": cos, "table_rows": at.long()},
                      {"cos": cos, "sin": cos, "table_rows": at, "mix": torch.zeros(10).double()}):
        with pytest.raises(ValueError):
            kernel.rotating_decode_attention(rows, keys, keys, torch.tensor(3), 1.0, **arguments)


# The default tier: two methods here, every method through the native kernel (test_native_decode.py).
@pytest.mark.parametrize("method", slow_but(KERNEL_METHODS, "original", "gali"))
def test_the_static_step_through_the_kernel_equals_the_forward(kernel, device, method):
    """Past a 32-token window (a 70-token prompt), 24 tokens decoded by the static step attending through the
    kernel (3 programs per key head, each several tiles) equal the model's own forward at every index; head dim 32
    and 3 query heads per key head, the shapes the kernel serves. (The model is built on the CPU: interpreted only;
    on a GPU the decoder's first step holds the kernel to the forward.)"""
    from gali_cli.seam_check import tiny_llama

    if device != "cpu":
        pytest.skip("the tiny model lives on the CPU")
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: tiny_llama(**kw, heads=6, kv_heads=2, hidden=192), method,
                                         70, 24)
        decoder = StaticDecoder(model, cache, route="triton")
        decoder.kernel_splits = 3
        worst = worst_step_difference(decoder, model, cache, tokens, 70)
    assert worst < 2e-5, worst


def test_the_route_follows_the_device_and_gali_kernel(monkeypatch):
    """CUDA with triton: the Triton kernel for heads it has a variant for; the CPU in float32: the native kernel;
    GALI_KERNEL=torch (or a kernel of the other device): the PyTorch route."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    route = decode_route.attention_route
    monkeypatch.setattr(decode_route, "triton_installed", lambda: True)
    assert route(cuda, torch.bfloat16, 128, 4) == route(cuda, torch.float32, 64, 3) == "triton"
    assert route(cuda, torch.float16, 256, 4) == "triton" and route(cuda, torch.float32, 256, 4) == "torch"
    assert route(cuda, torch.bfloat16, 96, 4) == route(cuda, torch.bfloat16, 16, 4) == "torch"
    assert route(cpu, torch.float32, 64, 3) == "native"
    assert route(cpu, torch.bfloat16, 64, 3) == route(cpu, torch.float32, 64, 32) == "torch"
    for choice, on_cuda, on_cpu in (("torch", "torch", "torch"), ("native", "torch", "native"),
                                    ("triton", "triton", "torch")):
        monkeypatch.setenv("GALI_KERNEL", choice)
        assert (route(cuda, torch.bfloat16, 128, 4), route(cpu, torch.float32, 64, 3)) == (on_cuda, on_cpu)
    monkeypatch.setenv("GALI_KERNEL", "auto")
    monkeypatch.setattr(decode_route, "triton_installed", lambda: False)
    assert route(cuda, torch.bfloat16, 128, 4) == "torch"


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_a_kernel_that_fails_or_differs_leaves_the_attention_to_pytorch(kernel, failure, monkeypatch):
    """The decoder's first step through a kernel that cannot run here (a compile error) or computes wrongly warns
    once and takes the keys-rotated-in-PyTorch route, held to the forward in turn: the tokens are eager decoding's."""
    from gali_cli.generate import decode
    from gali_cli.seam_check import tiny_llama

    def broken(rows, *arguments):
        if failure == "raises":
            raise RuntimeError("no kernel image is available")
        return torch.zeros(rows.shape)

    monkeypatch.setattr(kernel, "rotating_decode_attention", broken)
    monkeypatch.setattr(static_decode, "attention_route", lambda *arguments: "triton")
    answers = {}
    for choice in ("eager", "static"):
        monkeypatch.setenv("GALI_DECODE", choice)
        with torch.inference_mode():
            model, cache, _ = prefilled(lambda **kw: tiny_llama(**kw, heads=6, kv_heads=2, hidden=192), "gali", 40, 12)
            logits = model(input_ids=torch.tensor([[5]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
            if choice == "static":
                match = "cannot run here" if failure == "raises" else "kernel differs from the model's own forward"
                with pytest.warns(static_decode.GaliWarning, match=match) as warned:
                    answers[choice] = list(decode(model, cache, logits.float(), lambda x: int(x.argmax()), 10, set()))
                assert len(warned) == 1  # not "decoding eagerly": the PyTorch route agreed
            else:
                answers[choice] = list(decode(model, cache, logits.float(), lambda x: int(x.argmax()), 10, set()))
    assert answers["static"] == answers["eager"]
