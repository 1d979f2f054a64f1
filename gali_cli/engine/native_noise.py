"""Noisy GALI attention on the CPU with the noise made by a small native kernel (noise_kernel.c).

The PyTorch path (noisy_attention.explicit_noisy_partial) makes noise.py's normals in about twenty elementwise
passes over every logit, each a round trip through memory: on a CPU that costs several times the attention itself.
Here the logits come from two matrix products (even and odd keys: the two keys of a pair share their uniforms), and
one C function sweeps each row twice while it is in cache: the noise added and the maximum found, then the softmax
numerators and their sum. The noise is noise.py's to float32 rounding (the same hashed bits; see the C file).

The kernel is compiled on first use by the system's C compiler (`$CC`, else `cc`) into the user cache directory
(~/.cache/gali/kernels on Linux), keyed by its source, compiler and CPU, and loaded with ctypes: a fraction of a
second, once per machine. noisy_attention.native_verified holds it to the PyTorch path before first use; a machine
without a working compiler gets one warning and the PyTorch path.

Shapes: B batch, H query heads, Hkv key/value heads, R = H / Hkv * q stacked rows, n keys, D head dim.
"""

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import platformdirs
import torch

from ..errors import GaliError
from .dense import Partial
from .kernel_choice import compiler
from .noise import GOLDEN, Noise, head_streams, mix32

SOURCE = Path(__file__).with_name("noise_kernel.c")
# -fno-math-errno, -fno-trapping-math: sqrt and comparisons become plain vector instructions (no errno, no traps).
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_NATIVE_CPU = ["-march=native"]  # tried first; a compiler that does not know it builds for the generic CPU
# Explicit logits held at once per half (even or odd keys): 1M float32, 4 MiB.
_TILE_ELEMENTS = 1 << 20


class KernelBuildError(GaliError):
    """The native noise kernel could not be compiled or loaded here."""


def kernel_directory() -> Path:
    return Path(platformdirs.user_cache_dir("gali")) / "kernels"


@functools.cache
def load_kernel() -> ctypes._CFuncPtr:
    """The C function `gali_noisy_softmax`, compiled on first use (once per machine: the library is kept)."""
    source = SOURCE.read_bytes()
    command = compiler()
    identity = hashlib.sha256(source + repr((command, _FLAGS, _cpu_identity())).encode()).hexdigest()[:16]
    library = kernel_directory() / f"noise-{identity}{'.dylib' if platform.system() == 'Darwin' else '.so'}"
    if not library.exists():
        _build(command, library)
    try:
        function = ctypes.CDLL(str(library)).gali_noisy_softmax
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"cannot load {library}: {error}") from error
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, size, pointer, pointer, pointer, pointer, pointer, size, size, size,
                         pointer, pointer]
    function.restype = None
    return function


def _build(command: list[str], library: Path) -> None:
    """Compile the kernel into `library`, atomically (a half-written library is never loaded)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        errors = []
        for cpu in (_NATIVE_CPU, []):
            try:
                result = subprocess.run([*command, *_FLAGS, *cpu, "-o", str(built), str(SOURCE)],
                                        capture_output=True, text=True, timeout=120, check=False)
            except (OSError, subprocess.SubprocessError) as error:
                raise KernelBuildError(f"no C compiler ({' '.join(command)}: {error})") from error
            if result.returncode == 0:
                os.replace(built, library)
                return
            errors.append(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
        raise KernelBuildError(f"{' '.join(command)} failed: {errors[-1]}")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and features (a cache shared by machines must not mix them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


@functools.cache
def _workers(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gali-noise")


def noisy_softmax_(
    even: torch.Tensor,
    odd: torch.Tensor,
    row_stream: torch.Tensor,
    row_index: torch.Tensor,
    pair_hash: torch.Tensor,
    even_weight: torch.Tensor,
    odd_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the noise to contiguous float32 logits (rows, m) of keys 2m (`even`) and 2m + 1 (`odd`), then turn them
    into exp(logit - row maximum), in place; returns each row's maximum and sum of numerators, (rows,) each.

    row_stream, row_index: (rows,) int32, each row's noise stream (noise.head_streams, as int32) and query index;
    pair_hash, even_weight, odd_weight: from `pair_tables`. Rows are shared among
    torch's intra-op thread count (the C calls release the GIL).
    """
    kernel = load_kernel()
    rows, pairs = even.shape
    if odd.shape != even.shape or not (even.is_contiguous() and odd.is_contiguous()):
        raise ValueError("even and odd logits must be contiguous and of one shape")
    top, total = even.new_empty(rows), even.new_empty(rows)
    arguments = (even.data_ptr(), odd.data_ptr(), pairs, row_stream.data_ptr(), row_index.data_ptr(),
                 pair_hash.data_ptr(), even_weight.data_ptr(), odd_weight.data_ptr())

    def run(begin: int, end: int) -> None:
        kernel(*arguments, begin, end, pairs, top.data_ptr(), total.data_ptr())

    threads = max(1, min(torch.get_num_threads(), rows, rows * pairs // 4096))  # small tiles: one thread
    bounds = [rows * part // threads for part in range(threads + 1)]
    spans = list(itertools.pairwise(bounds))
    pending = [_workers(threads - 1).submit(run, *span) for span in spans[1:]] if threads > 1 else []
    run(*spans[0])
    for job in pending:
        job.result()
    return top, total


def noisy_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    noise: Noise,
    query_index: torch.Tensor,
    group: int,
    grouped: int,
    total_keys: int,
) -> Partial:
    """Noisy GALI attention of queries (B, H, q, D) over keys [0, n) that they all see, as a `Partial`.

    Args:
        query: rotated queries; key, value (B, Hkv, n, D): the mixed keys (K_mix) of tokens 0..n-1, and values.
        query_index: (q,) the queries' token indices.
        group, grouped: g and G of Alg. 2: key j gets noise when j < G and j % g != 0.
        total_keys: T, the chunk's key count (sigma = (i - j) / T * noise.scale).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    pairs = (keys + 1) // 2
    # Even and odd keys as strided views (no copies); an odd count gets one padding column that no row sees.
    key_even, key_odd = key[:, :, 0::2].float(), key[:, :, 1::2].float()
    value_even, value_odd = value[:, :, 0::2].float(), value[:, :, 1::2].float()
    tables = pair_tables(pairs, group, grouped, noise.scale / total_keys, query.device)
    # Query heads sharing a key head are stacked as rows: (B, Hkv, H / Hkv * q).
    streams = _int32(head_streams(noise, batch, heads, query.device)).view(batch, heads, 1).expand(-1, -1, q_len)
    row_stream = streams.reshape(batch, kv_heads, per_kv * q_len)
    row_index = query_index.to(torch.int32).repeat(per_kv).expand(batch, kv_heads, -1)
    stacked = (query.float() * scale).reshape(batch, kv_heads, per_kv * q_len, dim)

    outputs, lses = [], []
    rows_total = stacked.shape[2]
    tiles = -(-rows_total * batch * kv_heads * pairs // _TILE_ELEMENTS)
    tile = -(-rows_total // tiles)
    for start in range(0, rows_total, tile):
        rows = slice(start, start + tile)
        even = torch.matmul(stacked[:, :, rows], key_even.transpose(-1, -2))  # (B, Hkv, r, pairs)
        odd = torch.matmul(stacked[:, :, rows], key_odd.transpose(-1, -2))
        if keys % 2:
            odd = torch.nn.functional.pad(odd, (0, 1), value=float("-inf"))
        top, total = noisy_softmax_(even.view(-1, pairs), odd.view(-1, pairs), row_stream[:, :, rows].contiguous(),
                                    row_index[:, :, rows].contiguous(), *tables)
        total = total.view(batch, kv_heads, -1, 1)
        output = torch.matmul(even, value_even)
        output.add_(torch.matmul(odd[..., : value_odd.shape[2]], value_odd)).div_(total)
        outputs.append(output)
        lses.append(top.view(batch, kv_heads, -1) + torch.log(total.squeeze(-1)))
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    return Partial(output.view(batch, heads, q_len, dim).to(value.dtype), lse.view(batch, heads, q_len))


@functools.lru_cache(maxsize=16)
def pair_tables(pairs: int, group: int, grouped: int, sigma_unit: float, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel needs per pair m of a chunk's keys: mix32(m ^ GOLDEN) (int32), and the weights of keys 2m
    and 2m + 1 (float32): `sigma_unit` (noise scale / T) where the key gets noise (j < G, j % g != 0), else 0.
    The same for every layer of a chunk: kept for the next layers."""
    pair = torch.arange(pairs, device=device)
    weights = (torch.where((j < grouped) & (j % group != 0), sigma_unit, 0.0).float() for j in (2 * pair, 2 * pair + 1))
    return _int32(mix32(pair ^ GOLDEN)), *weights


def _int32(values: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 (noise.py's convention) as int32 with the same bits."""
    return torch.where(values > 0x7FFFFFFF, values - (1 << 32), values).to(torch.int32)
