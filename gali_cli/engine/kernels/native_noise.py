"""Noisy GALI attention on the CPU with the noise made by a small native kernel (native_noise.c, loaded by
native_library.py).

The PyTorch path (noisy_attention.explicit_noisy_partial) makes noise.py's normals in about twenty elementwise
passes over every logit, each a round trip through memory: on a CPU that costs several times the attention itself.
Here the logits come from one matrix product, and one C function sweeps each row twice while it is in cache: the
noise added and the maximum found, then the softmax numerators and their sum. The noise is noise.py's to float32
rounding (the same hashed bits; see native_common.h).

The kernel is compiled on first use and kept (native_library.py). noisy_attention.native_verified holds it to the
PyTorch path before first use; a machine without a working compiler gets one warning and the PyTorch path.

Shapes: B batch, H query heads, Hkv key/value heads, q queries, n keys, D head dim; the H / Hkv query heads that
share a key head are stacked as the rows of one matrix product.
"""

import functools
import threading
from dataclasses import dataclass

import torch

from ..math.noise import GOLDEN, Noise, head_streams, mix32
from ..math.partials import Partial
from .native_library import load_kernel, share_among_threads

# Explicit logits held at once: 1M float32, 4 MiB.
_TILE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class RowLayout:
    """Whose rows a tile of logits holds, so that the kernel finds each row's noise stream and token index itself:
    the query heads sharing one key head, stacked, `queries` rows each; the tile starts at stacked row `tile_start`.
    Stacked row s is query s % queries (token first_query + s % queries) of the key head's query head s // queries.
    """

    head_stream: torch.Tensor  # (H / Hkv,) int32: noise.head_streams of the key head's query heads
    queries: int
    first_query: int
    tile_start: int


def noisy_softmax_(
    logits: torch.Tensor, scale: float, layout: RowLayout, group: int, grouped: int, sigma_unit: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale float32 logits q.k (rows, n) of keys 0..n-1 (each row contiguous), add the noise, then turn them into
    exp(logit - row maximum), in place; returns each row's maximum and sum of numerators, (rows,) each (written into
    `out`, two contiguous float32 tensors, when given).

    Key j gets noise of sigma (i - j) * sigma_unit where c != 0: j < grouped and j % group != 0. Rows are shared among
    torch's intra-op thread count (by OpenMP in the kernel, else by a thread pool here: the C calls release the GIL).
    """
    kernel = load_kernel()
    rows, keys = logits.shape
    top, total = out if out is not None else (logits.new_empty(rows), logits.new_empty(rows))
    if (logits.stride(1) != 1 or not layout.head_stream.is_contiguous() or not top.is_contiguous()
            or not total.is_contiguous() or top.numel() != rows or total.numel() != rows):
        raise ValueError("the logits' rows, the head streams and the results must be contiguous")
    threads = max(1, min(torch.get_num_threads(), rows, rows * keys // 8192))  # small tiles: one thread
    pair_hash = pair_hashes((keys + 1) // 2)
    arguments = (logits.data_ptr(), logits.stride(0), keys, scale, layout.head_stream.data_ptr(), layout.queries,
                 layout.first_query, layout.tile_start, pair_hash.data_ptr(), group, grouped, sigma_unit)

    def run(begin: int, end: int, threads: int = 1) -> None:
        kernel.function(*arguments, begin, end, top.data_ptr(), total.data_ptr(), threads)

    share_among_threads(run, rows, threads, kernel.threaded)
    return top, total


def noisy_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    noise: Noise,
    first_query: int,
    group: int,
    grouped: int,
    total_keys: int,
) -> Partial:
    """Noisy GALI attention of queries (B, H, q, D) over keys [0, n) that they all see, as a `Partial`.

    One key head at a time, its query heads stacked as the rows of two plain matrix products (logits, then the
    numerators times the values): on two threads these ran faster than one batched product over the key heads, which
    leaves a thread idle when their number is odd (docs/dev/engine.md, "On the CPU: the native kernel").

    Args:
        query: rotated queries; key, value (B, Hkv, n, D): the mixed keys (K_mix) of tokens 0..n-1, and values.
        first_query: the token index of the first query (the others follow it).
        group, grouped: g and G of Alg. 2: key j gets noise when j < G and j % g != 0.
        total_keys: T, the chunk's key count (sigma = (i - j) / T * noise.scale).
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    per_kv = heads // kv_heads
    streams = cpu_head_streams(noise, batch, heads).view(batch * kv_heads, per_kv)
    stacked = query.float().reshape(batch * kv_heads, per_kv * q_len, dim)
    dtype, key, value = value.dtype, key.float().flatten(0, 1), value.float().flatten(0, 1)  # (B * Hkv, n, D)
    output = stacked.new_empty(stacked.shape)
    top, total = stacked.new_empty(stacked.shape[:2]), stacked.new_empty(stacked.shape[:2])
    tile = max(1, _TILE_ELEMENTS // keys)
    for head in range(batch * kv_heads):
        for start in range(0, stacked.shape[1], tile):
            rows = slice(start, min(start + tile, stacked.shape[1]))
            logits = torch.mm(stacked[head, rows], key[head].T, out=_scratch(rows.stop - start, keys))
            layout = RowLayout(streams[head], q_len, first_query, start)
            noisy_softmax_(logits, scale, layout, group, grouped, noise.scale / total_keys,
                           out=(top[head, rows], total[head, rows]))
            torch.mm(logits, value[head], out=output[head, rows])
    output.div_(total.unsqueeze(-1))  # normalised, and the log-sum-exps, once for every head
    lse = total.log_().add_(top)
    return Partial(output.view(batch, heads, q_len, dim).to(dtype), lse.view(batch, heads, q_len))


@functools.lru_cache(maxsize=64)
def cpu_head_streams(noise: Noise, batch: int, heads: int) -> torch.Tensor:
    """noise.head_streams as int32 on the CPU, kept for the layer's next chunks and decoding steps."""
    return int32_bits(head_streams(noise, batch, heads, torch.device("cpu")))


_pair_hashes = torch.empty(0, dtype=torch.int32)


def pair_hashes(pairs: int) -> torch.Tensor:
    """mix32(m ^ GOLDEN) as int32 for pairs m < `pairs`: a prefix of one table, grown by doubling (the same for every
    chunk, layer and seed)."""
    global _pair_hashes
    if len(_pair_hashes) < pairs:
        _pair_hashes = int32_bits(mix32(torch.arange(max(pairs, 2 * len(_pair_hashes), 4096)) ^ GOLDEN))
    return _pair_hashes[:pairs]


_held = threading.local()


def _scratch(rows: int, columns: int) -> torch.Tensor:
    """A float32 CPU buffer (rows, columns) for a tile's logits, reused from call to call (by this thread): a fresh
    tile of several MiB would be new pages from the system each time, their faults costing as much as the kernel.
    One buffer inside torch.inference_mode and one outside: neither kind of tensor may be written in the other."""
    size, inference = rows * columns, torch.is_inference_mode_enabled()
    buffers = _held.__dict__.setdefault("buffers", {})
    if inference not in buffers or buffers[inference].numel() < size:
        buffers[inference] = torch.empty(max(size, _TILE_ELEMENTS))
    return buffers[inference][:size].view(rows, columns)


def int32_bits(values: torch.Tensor) -> torch.Tensor:
    """32-bit values held in int64 (noise.py's convention) as int32 with the same bits."""
    return torch.where(values > 0x7FFFFFFF, values - (1 << 32), values).to(torch.int32)
