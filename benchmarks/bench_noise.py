"""GALI's noise on the CPU, one tile: the native kernel (kernels/native_noise.c) against the same computation in
PyTorch, eager and through torch.compile (inductor's C++ for the CPU). Per logit: the noise (hash, Box-Muller),
the row maximum, exp and the row sum, as one chunk of noisy attention needs them.

    python benchmarks/bench_noise.py                # one thread, 576 rows x 4032 keys (SmolLM2's 64-query chunk)
    python benchmarks/bench_noise.py --threads 2 --compile
"""

import argparse
import math
import time

import torch

from gali_cli.engine.kernels.native_noise import RowLayout, noisy_softmax_, pair_hashes
from gali_cli.engine.math.noise import GOLDEN, mix32


def in_pytorch(logits, scale, row_hash, row_index, pair_hash, weight):
    """The kernel's work written as PyTorch ops (noise.py's formulas)."""
    bits = mix32(row_hash.long().unsqueeze(-1) ^ pair_hash.long())
    radius = torch.sqrt(-2.0 * torch.log(((bits >> 8).float() + 0.5) * 2.0**-24))
    angle = (mix32(bits ^ GOLDEN) >> 8).float() * (2.0 * math.pi * 2.0**-24)
    normals = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=-1).flatten(-2)
    distance = (row_index.unsqueeze(-1) - torch.arange(logits.shape[-1])).float()
    noisy = logits * scale + normals[:, : logits.shape[-1]] * distance * weight
    top = noisy.amax(-1)
    numerators = torch.exp(noisy - top.unsqueeze(-1))
    return numerators, top, numerators.sum(-1)


def timed(name: str, function, logits: int, repeats: int) -> None:
    start = time.perf_counter()
    function()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    seconds = (time.perf_counter() - start) / repeats
    print(f"{name:28s} {seconds * 1e3:8.2f} ms  {seconds / logits * 1e9:6.2f} ns/logit  (first call {first:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=576)
    parser.add_argument("--keys", type=int, default=4032)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also torch.compile (the first call compiles: ~30 s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.keys, generator=generator) * 24
    row_hash = torch.randint(0, 2**31 - 1, (args.rows,), dtype=torch.int32, generator=generator)
    row_index = torch.full((args.rows,), args.keys, dtype=torch.int32)  # every row: the query after the keys
    pair_hash = pair_hashes((args.keys + 1) // 2)
    group, key = 7, torch.arange(args.keys)  # every key grouped, 6 in 7 of them interpolated (c != 0)
    weight = torch.where(key % group != 0, 1.0 / args.keys, 0.0)
    # The kernel finds each row's stream and index from the layout; the PyTorch version is given them per row.
    layout = RowLayout(row_hash, queries=1, first_query=args.keys, tile_start=0)  # a head per row
    count = args.rows * args.keys
    work = logits.clone()  # in place; the kernel's cost does not depend on the values
    timed("native kernel", lambda: noisy_softmax_(work, 0.125, layout, group, args.keys, 1.0 / args.keys), count, 20)
    with torch.inference_mode():
        pytorch_tables = (0.125, row_hash, row_index, pair_hash, weight)
        if args.compile:
            compiled = torch.compile(in_pytorch, dynamic=True)
            timed("torch.compile (inductor)", lambda: compiled(logits, *pytorch_tables), count, 5)
        timed("eager PyTorch", lambda: in_pytorch(logits, *pytorch_tables), count, 2)

if __name__ == "__main__":
    main()
