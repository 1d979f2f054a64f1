"""GALI's noise on the CPU, one tile: the native kernel (engine/noise_kernel.c) against the same computation in
PyTorch, eager and through torch.compile (inductor's C++ for the CPU). Per logit: the noise (hash, Box-Muller),
the row maximum, exp and the row sum, as one chunk of noisy attention needs them.

    python benchmarks/bench_noise.py                # one thread, 576 rows x 4032 keys (SmolLM2's 64-query chunk)
    python benchmarks/bench_noise.py --threads 2 --compile
"""

import argparse
import math
import time

import torch

from gali_cli.engine.native_noise import noisy_softmax_
from gali_cli.engine.noise import GOLDEN, mix32


def in_pytorch(even, odd, row_hash, row_index, pair_hash, even_weight, odd_weight):
    """The kernel's work written as PyTorch ops (noise.py's formulas)."""
    bits = mix32(row_hash.long().unsqueeze(-1) ^ pair_hash.long())
    radius = torch.sqrt(-2.0 * torch.log(((bits >> 8).float() + 0.5) * 2.0**-24))
    angle = (mix32(bits ^ GOLDEN) >> 8).float() * (2.0 * math.pi * 2.0**-24)
    distance = (row_index.unsqueeze(-1) - 2 * torch.arange(even.shape[-1])).float()
    noisy_even = even + radius * torch.cos(angle) * distance * even_weight
    noisy_odd = odd + radius * torch.sin(angle) * (distance - 1) * odd_weight
    top = torch.maximum(noisy_even.amax(-1), noisy_odd.amax(-1))
    exp_even, exp_odd = torch.exp(noisy_even - top.unsqueeze(-1)), torch.exp(noisy_odd - top.unsqueeze(-1))
    return exp_even, exp_odd, top, exp_even.sum(-1) + exp_odd.sum(-1)


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
    pairs = args.keys // 2
    even, odd = (torch.randn(args.rows, pairs, generator=generator) * 3 for _ in range(2))
    row_hash = torch.randint(0, 2**31 - 1, (args.rows,), dtype=torch.int32, generator=generator)
    row_index = torch.arange(args.rows, dtype=torch.int32) + args.keys
    pair_hash = torch.randint(0, 2**31 - 1, (pairs,), dtype=torch.int32, generator=generator)
    weight = torch.full((pairs,), 1.0 / args.keys)
    tables = (row_hash, row_index, pair_hash, weight, weight)
    logits = args.rows * args.keys
    work_even, work_odd = even.clone(), odd.clone()  # the kernel works in place; its cost does not depend on values
    timed("native kernel", lambda: noisy_softmax_(work_even, work_odd, *tables), logits, 20)
    with torch.inference_mode():
        if args.compile:
            compiled = torch.compile(in_pytorch, dynamic=True)
            timed("torch.compile (inductor)", lambda: compiled(even, odd, *tables), logits, 5)
        timed("eager PyTorch", lambda: in_pytorch(even, odd, *tables), logits, 2)


if __name__ == "__main__":
    main()
