"""native_decode's kernel (one decoded query over the cache on the CPU, each key rotated as it is read, GALI's noise
drawn as it goes) against float64 attention from its definition, and the static decoding step through it against the
model's own forward."""

import dataclasses
import warnings

import pytest
import torch
from helpers.decoding import KERNEL_METHODS, expected_attention, offset_tables, prefilled, tables, worst_step_difference
from helpers.timing import scaled

from gali_cli.engine.attention import decode_route
from gali_cli.engine.kernels import native_decode, native_library
from gali_cli.engine.kernels.native_decode import native_decode_attention
from gali_cli.engine.kernels.native_noise import int32_bits
from gali_cli.engine.math.noise import Noise, head_streams
from gali_cli.engine.seam.static_decode import StaticDecoder
from gali_cli.errors import GaliWarning
from gali_cli.seam_check import tiny_llama

CASES = [  # batch, kv heads, heads per kv head, head dim, cache rows, runs per key head, token indices
    (1, 2, 3, 64, 300, 3, [0, 1, 63, 64, 200, 299]),  # runs past the index empty, an odd number of keys
    (2, 1, 4, 32, 130, 2, [63, 64, 129]),  # batch 2, tiles cut short by the index
    (1, 2, 1, 128, 70, 1, [5, 69]),  # one head per key head, one run
    (1, 1, 16, 256, 1000, 5, [999, 500]),  # the widest heads and group, runs of several tiles each
    (1, 3, 3, 64, 700, None, [699]),  # runs chosen by the kernel
]


@pytest.mark.parametrize("batch, kv_heads, group, dim, count, runs, indices", CASES)
@pytest.mark.parametrize("variant", ["rotated-noisy", "rotated", "as-cached", "offset-table-noisy", "offset-table"])
def test_kernel_equals_attention_from_its_definition(batch, kv_heads, group, dim, count, runs, indices, variant):
    torch.manual_seed(0)
    rows = torch.randn(batch, kv_heads, group, dim)
    keys, values = torch.randn(batch, kv_heads, count, dim), torch.randn(batch, kv_heads, count, dim)
    cos, sin = tables(count, dim, torch.float32, "cpu") if variant != "as-cached" else (None, None)
    by_offset, own = {}, (cos, sin)
    if variant.startswith("offset-table"):
        by_offset = offset_tables(count, dim, torch.float32, "cpu")
        cos, sin, own = by_offset.pop("cos"), by_offset.pop("sin"), by_offset.pop("own")
    noise = sigma = streams = None
    if variant.endswith("noisy"):
        noise, sigma = Noise(seed=11, layer=2, scale=1.0), torch.rand(count) * 2.0
        sigma[::3] = 0.0
        streams = int32_bits(head_streams(noise, batch, kv_heads * group, torch.device("cpu")))
    for index in indices:
        got = native_decode_attention(rows, keys, values, index, 0.2, cos, sin, sigma, streams, runs, **by_offset)
        expected = expected_attention(rows, keys, values, index, 0.2, *own, noise, sigma)
        assert got.dtype == torch.float32 and got.shape == rows.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch, kv_heads, group, dim, count, runs, indices", CASES[:3])
@pytest.mark.parametrize("variant", ["rotated-noisy", "as-cached", "offset-table"])
def test_16_bit_keys_and_values_give_the_float32_numbers_of_their_rounded_rows(batch, kv_heads, group, dim, count,
                                                                                 runs, indices, variant, dtype):
    """A 16-bit cache (--kv-dtype) read by the kernel, each row widened as it is loaded: the very numbers of the
    float32 kernel over the same rows rounded, half subnormals, signed zeros and infinities included."""
    torch.manual_seed(0)
    rows = torch.randn(batch, kv_heads, group, dim)
    keys, values = (torch.randn(batch, kv_heads, count, dim).to(dtype) for _ in range(2))
    keys[..., 1, :5] = torch.tensor([1e-6, -3e-7, 6e-5, -0.0, 0.0])  # subnormal in float16
    values[..., 2, :3] = torch.tensor([float("inf"), 1e-7, 6e4])
    cos, sin = tables(count, dim, torch.float32, "cpu") if variant != "as-cached" else (None, None)
    by_offset = {}
    if variant.startswith("offset-table"):
        by_offset = offset_tables(count, dim, torch.float32, "cpu")
        cos, sin = by_offset.pop("cos"), by_offset.pop("sin")
        del by_offset["own"]
    noise = {}
    if variant.endswith("noisy"):
        noise = {"sigma": torch.rand(count) * 2.0, "streams": int32_bits(head_streams(
            Noise(seed=11, layer=2, scale=1.0), batch, kv_heads * group, torch.device("cpu")))}
    for index in indices:
        got = native_decode_attention(rows, keys, values, index, 0.2, cos, sin, runs=runs, **noise, **by_offset)
        expected = native_decode_attention(rows, keys.float(), values.float(), index, 0.2, cos, sin, runs=runs,
                                           **noise, **by_offset)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_keys_past_the_index_are_never_read():
    torch.manual_seed(0)
    rows, keys, values = torch.randn(1, 1, 2, 32), torch.randn(1, 1, 200, 32), torch.randn(1, 1, 200, 32)
    keys[:, :, 71:], values[:, :, 71:] = float("nan"), float("nan")
    for runs in (1, 2, 7):
        got = native_decode_attention(rows, keys, values, 70, 0.3, runs=runs)
        torch.testing.assert_close(got.double(), expected_attention(rows, keys[:, :, :71], values[:, :, :71], 70, 0.3),
                                   rtol=1e-5, atol=1e-5)


def test_the_items_shared_by_a_pool_give_the_same_answer(monkeypatch):
    """A library built without OpenMP shares the work through a thread pool: the same numbers."""
    torch.manual_seed(0)
    rows, keys, values = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 900, 64), torch.randn(1, 2, 900, 64)
    threaded = native_decode_attention(rows, keys, values, 899, 0.2, runs=3)
    kernel = native_library.load_kernel()
    monkeypatch.setattr(native_decode, "load_kernel", lambda: dataclasses.replace(kernel, threaded=False))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    torch.testing.assert_close(native_decode_attention(rows, keys, values, 899, 0.2, runs=3), threaded)


def test_bad_arguments_are_refused():
    """The C function walks raw pointers: what would make it read past a tensor, or write a dtype it does not,
    is refused before the call."""
    rows, keys = torch.randn(1, 1, 2, 32), torch.randn(1, 1, 10, 32)
    cos, streams = torch.ones(10, 16), torch.zeros(2, dtype=torch.int32)
    at = torch.zeros(10, dtype=torch.int32)
    for arguments, kwargs in (((rows, keys, keys), {"cos": cos}), ((rows, keys, keys), {"sigma": torch.zeros(10)}),
                              ((rows.double(), keys, keys), {}), ((rows, keys.half(), keys), {}),
                              ((rows, keys.double(), keys.double()), {}), ((rows, keys.half(), keys.bfloat16()), {}),
                              ((torch.randn(1, 1, 2, 24), torch.randn(1, 1, 10, 24), torch.randn(1, 1, 10, 24)), {}),
                              ((rows, keys.transpose(-1, -2).contiguous().transpose(-1, -2), keys), {}),
                              ((rows, torch.randn(1, 1, 10, 16), keys), {}), ((rows, keys, keys[:, :, :9]), {}),
                              ((rows, keys, keys), {"cos": cos[:, :4], "sin": cos[:, :4]}),
                              ((rows, keys, keys), {"cos": cos[:9], "sin": cos[:9]}),
                              ((rows, keys, keys), {"sigma": torch.zeros(9), "streams": streams}),
                              ((rows, keys, keys), {"sigma": torch.zeros(10), "streams": streams[:1]}),
                              ((rows, keys, keys), {"runs": -1}),
                              ((rows, keys, keys), {"table_rows": at}),
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "mix": torch.zeros(10)}),
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at[:9]}),
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at.long()}),
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at, "mix": at.half()}),
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at + 10}),  # past the table
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at - 1}),  # before it
                              ((rows, keys, keys), {"cos": cos, "sin": cos, "table_rows": at + 9,  # its next row,
                                                    "mix": torch.zeros(10)})):  # mixed, past the table
        with pytest.raises(ValueError):
            native_decode_attention(*arguments, 3, 1.0, **kwargs)
    for index in (-1, 10):
        with pytest.raises(ValueError):
            native_decode_attention(rows, keys, keys, index, 1.0)


def test_results_do_not_follow_torchs_default_dtype():
    torch.manual_seed(0)
    rows, keys = torch.randn(1, 1, 2, 32), torch.randn(1, 1, 10, 32)
    expected = native_decode_attention(rows, keys, keys, 9, 0.5)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = native_decode_attention(rows, keys, keys, 9, 0.5)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_the_static_step_through_the_native_kernel_equals_the_forward(method):
    """Past a 32-token window (a 70-token prompt), 24 tokens decoded by the static step attending through the
    native kernel (3 runs per key head) equal the model's own forward at every index; head dim 32 and 3 query heads
    per key head."""
    with torch.inference_mode():
        model, cache, tokens = prefilled(lambda **kw: tiny_llama(**kw, heads=6, kv_heads=2, hidden=192), method,
                                         70, 24)
        decoder = StaticDecoder(model, cache)
        assert decoder.route == "native"
        decoder.kernel_splits = 3
        worst = worst_step_difference(decoder, model, cache, tokens, 70)
    assert worst < 2e-5, worst


def test_a_machine_that_cannot_build_the_kernel_warns_once_and_decodes_in_pytorch(monkeypatch):
    def no_compiler():
        raise native_library.KernelBuildError("no C compiler (cc: not found)")

    monkeypatch.setattr(native_library, "load_kernel", no_compiler)
    decode_route.native_decode_available.cache_clear()
    try:
        with pytest.warns(GaliWarning, match="native decoding kernel cannot be built here"):
            assert decode_route.attention_route(torch.device("cpu"), torch.float32, 64, 3) == "torch"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert decode_route.attention_route(torch.device("cpu"), torch.float32, 64, 3) == "torch"
    finally:
        decode_route.native_decode_available.cache_clear()


@pytest.mark.slow
def test_a_built_wheel_carries_the_native_kernels_sources(tmp_path):
    """The C sources (and their header) are compiled on the user's machine at first use: a wheel without one of them
    (package data not declared) would leave every installed copy on the slow PyTorch paths, with a warning."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from helpers.paths import ROOT

    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", "build", "__pycache__", "*.egg-info", ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=scaled(600))
    (wheel,) = tmp_path.glob("*.whl")
    carried = set(zipfile.ZipFile(wheel).namelist())
    declared = [path.resolve().relative_to(ROOT).as_posix() for path in native_library.BUILT_FROM]
    missing = [path for path in declared if path not in carried]
    assert not missing, missing
