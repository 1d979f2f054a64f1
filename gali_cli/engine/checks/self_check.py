"""The engine's self-check (`gali info --check`): every noisy-attention path this machine can run, held to the
PyTorch path at real head dims, head groupings, dtypes and lengths, and GALI held to Alg. 3 as written; each timed.

On a GPU it checks the fused Triton kernel (docs/performance.md, "Correctness on this GPU") and the CUDA
route of attention parts with their log-sum-exp; it is what a user with another GPU runs to tell whether they hold
there (the first-use checks, `kernel_verified` and `cuda_partial_verified`, are smaller versions of the same
comparisons). On a GPU it also holds the decoding step's Triton kernel (triton_decode.py) to the step's PyTorch route.
On a CPU it checks the native kernels: noisy attention, the decoding step's attention, and the decoding step's
projections held as bytes (grid_weights.py); the Triton kernels only under TRITON_INTERPRET=1 (slow: small
problems).
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.choice import plan_for
from ..attention.gali_attention import chunk_context, gali_attention
from ..attention.noisy_attention import tiled_noisy_attention
from ..math.noise import Noise
from ..math.positions import grouping, interpolate
from ..math.rope import RopeTable
from .reference import reference_gali_attention

_TRAIN_LEN, _LOCAL_WINDOW, _CHUNK = 256, 128, 64  # a chunk as GALI cuts it at train_len 256, past the window
# (head dim, query heads, key/value heads): SmolLM2 (GQA 3), Llama-3-8B (GQA 4), and one key head per query head.
HEAD_SHAPES = ((64, 9, 3), (128, 32, 8), (128, 8, 8))
# Keys of the checked chunk, per kind of run (the interpreter runs the kernel's code in NumPy: small only).
LENGTHS = {"cuda": (320, 1024, 4096), "cpu": (320, 2048), "interpreted": (320,), "mixed_keys": (300, 1000)}
TIMED_CALLS = 3  # per path and check, after a first untimed call; the fastest is reported (interpreted: the first)
NATIVE_DECODE_KEYS = 4096  # the cache a CPU's decoding step is checked over
INTERPRETED_DECODE_KEYS = 700  # the same through Triton's interpreter (a GPU's: 8192)
# (rows, columns, gated) of the projections held as bytes: SmolLM2's gate and up (after its RMSNorm), and a
# Llama-3-8B-sized output projection.
GRID_SHAPES = ((3072, 576, True), (4096, 4096, False))


@dataclass(frozen=True)
class Check:
    """One comparison: what ran, how far apart the two answers were, and how long each path took."""

    name: str
    error: float  # max |candidate - reference| over the output
    tolerance: float
    seconds: dict[str, float]  # path -> seconds of one call after a warm-up call
    seam: bool = False  # a check of the transformers seam (seam_check.py) rather than of an attention path

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # NaN fails


def self_check(device: torch.device, triton_interpreted: bool = False) -> Iterator[Check]:
    """Every check that applies on `device`, as it completes. `triton_interpreted`: on the CPU, also the Triton
    kernel through Triton's interpreter (TRITON_INTERPRET=1 must have been set before torch was imported)."""
    cuda = device.type == "cuda"
    kernels = _noisy_kernels(device, triton_interpreted)
    for path, kernel in kernels.items():
        if cuda:
            dtypes, lengths = (torch.float32, torch.bfloat16, torch.float16), LENGTHS["cuda"]
        elif path == "Triton":  # the interpreter's tl.dot mishandles bfloat16
            dtypes, lengths = (torch.float32, torch.float16), LENGTHS["interpreted"]
        else:
            dtypes, lengths = (torch.float32, torch.bfloat16), LENGTHS["cpu"]
        for head_dim, heads, kv_heads in HEAD_SHAPES:
            for dtype in dtypes:
                for keys in lengths:
                    yield _noisy_check(path, kernel, device, dtype, head_dim, heads, kv_heads, keys)
    for dtype in (torch.float32, torch.bfloat16):
        for keys in LENGTHS["mixed_keys"]:
            yield _gali_check(device, dtype, keys)
    if cuda:  # the route every windowed method's parts take there
        for head_dim, heads, kv_heads in HEAD_SHAPES[:2]:
            for dtype in (torch.float32, torch.bfloat16):
                yield _partial_check(device, dtype, head_dim, heads, kv_heads, 4096)
    if cuda or triton_interpreted:  # the static decoding step's attention there
        for head_dim, heads, kv_heads in HEAD_SHAPES[:2]:
            for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
                yield _decode_check(device, dtype, head_dim, heads, kv_heads, 8192 if cuda else INTERPRETED_DECODE_KEYS)
    if not cuda:  # the CPU's static decoding step: its attention and its projections
        for head_dim, heads, kv_heads in HEAD_SHAPES[:2]:
            yield _decode_check(device, torch.float32, head_dim, heads, kv_heads, NATIVE_DECODE_KEYS, "native")
        for rows, columns, gated in GRID_SHAPES:
            yield _grid_check(rows, columns, gated)
        for batch in (1, 64):  # a decoding step's product over the bytes; a prefill's over unpacked tiles
            yield _gguf_check(batch)


def _noisy_kernels(device: torch.device, triton_interpreted: bool) -> dict[str, Callable]:
    """The fast noisy-attention paths to hold to the PyTorch path here: Triton on CUDA (or interpreted, when asked),
    the native kernel on the CPU. A path that cannot even be built shows up as a failed check, not as absent."""
    kernels = {}
    if device.type == "cuda" or triton_interpreted:
        try:
            from ..kernels.triton_attention import noisy_gali_attention
        except ImportError as error:
            kernels["Triton"] = _unavailable(error)
        else:
            kernels["Triton"] = noisy_gali_attention
    if device.type == "cpu":
        from ..attention.noisy_attention import native_noisy_attention

        kernels["native"] = native_noisy_attention
    return kernels


def _unavailable(error: Exception) -> Callable:
    def fail(*arguments):
        raise error

    return fail


def _noisy_check(path: str, kernel: Callable, device: torch.device, dtype: torch.dtype, head_dim: int, heads: int,
                 kv_heads: int, keys: int) -> Check:
    """The fast path against the PyTorch path on one chunk's problem: the last 64 queries of `keys` mixed keys."""
    generator = torch.Generator().manual_seed(keys + head_dim)
    shapes = ((1, heads, _CHUNK, head_dim), (1, kv_heads, keys, head_dim), (1, kv_heads, keys, head_dim))
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    group, grouped = grouping(keys, _TRAIN_LEN, _LOCAL_WINDOW)
    arguments = (query, key, value, group, grouped, head_dim**-0.5, Noise(seed=1, layer=3, scale=1.0))
    name = (f"noisy attention, {path} vs PyTorch: head dim {head_dim}, {heads}/{kv_heads} heads, "
            f"{str(dtype).removeprefix('torch.')}, {keys} keys")
    with torch.inference_mode():
        try:
            got, fast = _timed(kernel, arguments, device, warm_up=not _interpreted(path, device))
        except Exception as error:  # a build, launch or compile failure is this check's finding
            return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:160]})", float("nan"),
                         0.0, {})
        expected, reference = _timed(tiled_noisy_attention, arguments, device)
    return Check(name, _difference(got, expected), _tolerance(dtype, expected), {path: fast, "PyTorch": reference})


def _gali_check(device: torch.device, dtype: torch.dtype, keys: int) -> Check:
    """The engine's GALI attention (one attention over the mixed keys, noise by the route this machine takes)
    against Alg. 3 as written (two rotated copies of the keys, two logit matrices), on one chunk."""
    head_dim, heads, kv_heads = 64, 9, 3
    generator = torch.Generator().manual_seed(keys)
    shapes = ((1, heads, _CHUNK, head_dim), (1, kv_heads, keys, head_dim), (1, kv_heads, keys, head_dim))
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    table = _rope_table(_TRAIN_LEN + 1, head_dim, device, dtype)
    chunk = chunk_context(table, keys, _CHUNK, _TRAIN_LEN, _LOCAL_WINDOW)
    interp = interpolate(keys, _TRAIN_LEN, _LOCAL_WINDOW, device)
    noise = Noise(seed=2, layer=0, scale=1.0)
    with torch.inference_mode():
        plan = plan_for(query, key, value, noise=True)  # the route a forward over this chunk takes
        got, fast = _timed(lambda *a: gali_attention(*a, [chunk], head_dim**-0.5, plan, noise=noise),
                           (query, key, value), device)
        expected, reference = _timed(lambda *a: reference_gali_attention(*a, table, interp, head_dim**-0.5, noise),
                                     (query, key, value), device)
    name = f"GALI vs Alg. 3 as written: {keys} keys, {_CHUNK} queries, noise on, {str(dtype).removeprefix('torch.')}"
    return Check(name, _difference(got, expected), _tolerance(dtype, expected), {"GALI": fast, "Alg. 3": reference})


def _partial_check(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
                   keys: int) -> Check:
    """Attention over part of the keys with its log-sum-exp (SelfExtend, ChunkLlama, ReRoPE, DPE, STRING, LaMPE):
    torch's memory-efficient CUDA kernel against explicit float32 logits, output and log-sum-exp."""
    from ..attention.dense import cuda_partial, explicit_partial, partial_difference

    generator = torch.Generator().manual_seed(keys + heads)
    shapes = ((1, heads, _CHUNK, head_dim), (1, kv_heads, keys, head_dim), (1, kv_heads, keys, head_dim))
    query, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    name = (f"attention parts with log-sum-exp, CUDA kernel vs explicit logits: head dim {head_dim}, "
            f"{heads}/{kv_heads} heads, {str(dtype).removeprefix('torch.')}, {keys} keys")
    with torch.inference_mode():
        try:
            got, fast = _timed(cuda_partial, (query, key, value, head_dim**-0.5), device)
        except Exception as error:  # a missing kernel or an unsupported layout is this check's finding
            return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:160]})", float("nan"),
                         0.0, {})
        expected, reference = _timed(explicit_partial, (query, key, value, head_dim**-0.5), device)
    tolerance = max(_tolerance(dtype, expected.output), _tolerance(dtype, expected.lse))
    return Check(name, partial_difference(got, expected), tolerance, {"CUDA": fast, "explicit": reference})


def _decode_check(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
                  keys: int, path: str = "Triton") -> Check:
    """One decoded query over a cache of `keys` rows, its token three quarters of the way in: triton_decode's
    kernel (`path` "Triton") or native_decode's ("native": float32 on the CPU) — keys rotated as read, GALI's noise
    drawn in it, rows past the token unread — against the same attention in float64; timed beside the static step's
    PyTorch route (keys rotated first, noise and mask as a bias), which in float32 was itself farther from float64
    than the kernel (docs/notes/2026-11-performance-history.md, "GPU: decoding as a CUDA graph (issue 26)"): hence
    float64 as the reference. Head dim 64 rotates each key as GALI's step does, by a row of a RoPE table
    per offset (a 1k window's) mixed with the next; the others by each key's own row of a table."""
    from ..math.noise import head_streams, standard_normal
    from ..math.rope import rotate_fused
    from ..seam.static_decode import split_key_attention

    generator = torch.Generator().manual_seed(keys + head_dim)
    group = heads // kv_heads
    shapes = ((1, kv_heads, group, head_dim), (1, kv_heads, keys, head_dim), (1, kv_heads, keys, head_dim))
    rows, key, value = (torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    by_offset = {}
    if head_dim == 64:
        frequencies = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        offsets = -torch.arange(1026, dtype=torch.float64).unsqueeze(-1) * frequencies
        table_rows = torch.randint(0, 1025, (keys,), generator=generator, dtype=torch.int32)
        mix = torch.rand(keys, generator=generator) * (torch.arange(keys) % 3 > 0)
        by_offset = {"table_rows": table_rows.to(device), "mix": mix.to(device)}
        table = [f(offsets).float().to(device) for f in (torch.cos, torch.sin)]
        own = [torch.lerp(f(offsets)[table_rows.long()], f(offsets)[table_rows.long() + 1], mix.double()[:, None])
               for f in (torch.cos, torch.sin)]
    else:
        angles = torch.rand(keys, head_dim // 2, generator=generator, dtype=torch.float64) * keys
        own = [f(angles) for f in (torch.cos, torch.sin)]
    cos, sin = (torch.cat((x, x), dim=-1).to(device, dtype) for x in own)
    # What the kernel rotates by: the table's float32 rows mixed (held to the float64 mix), or the rows as given.
    exact_cos, exact_sin = (torch.cat((x, x), dim=-1).to(device) for x in own) if by_offset else (cos, sin)
    index, noise = 3 * keys // 4, Noise(seed=4, layer=1, scale=1.0)
    sigma = torch.rand(keys, generator=generator).to(device)
    streams, scale = head_streams(noise, 1, heads, device), head_dim**-0.5
    name = (f"a decoding step's attention, {path} vs float64: head dim {head_dim}, {heads}/{kv_heads} heads, "
            f"{str(dtype).removeprefix('torch.')}, {keys} keys, noise on, keys rotated by "
            f"{'a table per offset, mixed (GALI)' if by_offset else 'rows of their own'}")

    draws = standard_normal(noise, 1, heads, torch.tensor([index], device=device), keys) * sigma

    def torch_route() -> torch.Tensor:
        bias = draws.clone()
        bias[..., index + 1 :] = torch.finfo(dtype).min
        return split_key_attention(rows, rotate_fused(key, cos, sin), value, bias.to(dtype).view(1, kv_heads, group,
                                                                                                   keys), scale, 256)

    def float64() -> torch.Tensor:
        turned = torch.cat((-key[..., head_dim // 2 :], key[..., : head_dim // 2]), dim=-1).double()
        rotated = key.double() * exact_cos.double() + turned * exact_sin.double()
        logits = (rows.double() @ rotated.transpose(-1, -2)) * scale + draws.double().view(1, kv_heads, group, keys)
        return torch.softmax(logits[..., : index + 1], dim=-1) @ value[:, :, : index + 1].double()

    with torch.inference_mode():
        try:
            if path == "Triton":
                from ..kernels.triton_decode import rotating_decode_attention

                at = torch.tensor(index, device=device)
                kernel_cos, kernel_sin = table if by_offset else (cos, sin)
                got, fast = _timed(lambda: rotating_decode_attention(rows, key, value, at, scale, kernel_cos,
                                                                     kernel_sin, sigma, streams, **by_offset), (),
                                   device, warm_up=not _interpreted(path, device))
            else:
                from ..kernels.native_decode import native_decode_attention
                from ..kernels.native_noise import int32_bits

                bits = int32_bits(streams)
                kernel_cos, kernel_sin = table if by_offset else (cos.float(), sin.float())
                got, fast = _timed(lambda: native_decode_attention(rows, key, value, index, scale, kernel_cos,
                                                                   kernel_sin, sigma, bits, **by_offset), (), device)
        except Exception as error:  # a missing triton, a compile, build or launch failure is this check's finding
            return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:160]})", float("nan"),
                         0.0, {})
        _, reference = _timed(torch_route, (), device)
        expected = float64()
    return Check(name, _difference(got, expected), _tolerance(dtype, expected), {path: fast, "PyTorch": reference})


def _grid_check(rows: int, columns: int, gated: bool) -> Check:
    """A projection as a GGUF Q4_1 matrix loads (each block of 32 weights on a grid of 16 levels), held as bytes by
    grid_weights and multiplied after an RMSNorm (`gated`: SiLU of the gate's rows times the up rows below them),
    against the same product in float64. Timed alone: one matrix called again and again stays in the CPU's caches,
    where PyTorch's float32 product is as fast; what the bytes save is memory traffic over a whole model's weights
    (docs/performance.md)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ..seam.grid_weights import BLOCK, to_grid

    generator = torch.Generator().manual_seed(rows + columns)
    codes = torch.randint(0, 16, (rows, columns), generator=generator)
    codes[:, ::BLOCK], codes[:, 1::BLOCK] = 0, 15  # each block spans its 16 levels, as Q4_1's quantizer makes it
    step = (torch.rand(rows, columns // BLOCK, generator=generator) * 0.01 + 1e-3).half().float()
    weight = (step * -8).repeat_interleave(BLOCK, 1) + step.repeat_interleave(BLOCK, 1) * codes
    norm = LlamaRMSNorm(columns, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(columns, generator=generator) + 0.5)
    x = torch.randn(1, 1, columns, generator=generator)
    name = (f"a decoding step's projection as bytes vs float64: {rows} x {columns}, after an RMSNorm"
            f"{', SiLU-gated' if gated else ''}")

    with torch.inference_mode():
        try:
            grid = to_grid([weight])
            if grid is None:
                raise ValueError("the weights were not found on their grids")
            got, fast = _timed(lambda: grid(x, gated=gated, norm=norm), (), torch.device("cpu"))
        except Exception as error:  # a build failure, or weights not found on their grids, is this check's finding
            return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:160]})", float("nan"),
                         0.0, {})
        wide = x.double()
        product = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()) @ (
            weight.double().T)
        gate, up = product.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up if gated else product
    return Check(name, _difference(got, expected), _tolerance(torch.float32, expected), {"bytes": fast})


def _gguf_check(batch: int, rows: int = 1024, columns: int = 1024) -> Check:
    """A GGUF Q6_K matrix (sub-blocks of 16 weights, each a scale times codes 0..63 less 32; random blocks) read as
    a GGUF file's loading reads it (model/gguf_blocks.py) and multiplied as a loaded model multiplies it
    (PackedLinear: `batch` rows), against the gguf package's own dequantization in float64."""
    import gguf
    import numpy as np

    from ...model.gguf_blocks import Q6_K, read_grid
    from ..seam.grid_weights import GridWeight
    from ..seam.packed_modules import PackedLinear

    name = f"a GGUF Q6_K matrix read into bytes vs float64: {rows} x {columns}, {batch} row{'s' * (batch > 1)}"
    random = np.random.default_rng(batch)
    blocks = random.integers(0, 256, size=(rows * columns // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = random.uniform(1e-5, 2e-5, size=len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    x = torch.randn(batch, columns, generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode():
        try:
            arrays = read_grid(raw, Q6_K, columns)
            layer = PackedLinear(GridWeight(*(torch.from_numpy(part) for part in (arrays.codes, arrays.step,
                                                                                    arrays.base)), arrays.block))
            got, fast = _timed(layer, (x,), torch.device("cpu"))
        except Exception as error:  # a build failure or a wrong read is this check's finding
            return Check(f"{name} ({type(error).__name__}: {' '.join(str(error).split())[:160]})", float("nan"),
                         0.0, {})
        weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)).double()
        expected = x.double() @ weight.T
    return Check(name, _difference(got, expected), _tolerance(torch.float32, expected), {"bytes": fast})


def _interpreted(path: str, device: torch.device) -> bool:
    """Whether `path` runs through Triton's interpreter here (Triton on a CPU: TRITON_INTERPRET=1)."""
    return path == "Triton" and device.type != "cuda"


def _timed(function: Callable, arguments: tuple, device: torch.device, warm_up: bool = True) -> tuple[Any, float]:
    """The result, and the fastest of TIMED_CALLS calls after a first one (which compiles, builds or warms caches).
    `warm_up=False`, for Triton's interpreter: the first call's own time (nothing is compiled, and each call runs the
    kernel in NumPy for seconds, so more calls would only repeat the same answer slowly)."""
    if not warm_up:
        _synchronize(device)
        start = time.perf_counter()
        result = function(*arguments)
        _synchronize(device)
        return result, time.perf_counter() - start
    result = function(*arguments)
    best = float("inf")
    for _ in range(TIMED_CALLS):
        _synchronize(device)
        start = time.perf_counter()
        function(*arguments)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return result, best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()


def _tolerance(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """float32: 1e-4; half precisions: 2e-2 (the outputs are rounded to 8 or 11 bits), relative to the output."""
    return (1e-4 if dtype == torch.float32 else 2e-2) * max(1.0, expected.float().abs().max().item())


def _rope_table(rows: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> RopeTable:
    """A Llama RoPE table (base 10000) of `rows` positions."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.arange(rows, device=device).float().unsqueeze(1) * inverse
    angles = torch.cat((angles, angles), dim=-1)
    return RopeTable(angles.cos().to(dtype), angles.sin().to(dtype), angles.cos(), angles.sin())
