"""ReAttention's selection alone: CPU seconds of one `select` call (one chunk, one layer) by the length of the middle.

    python benchmarks/bench_selection.py --lengths 8k,30k,60k
    cd OLD_WORKTREE && python benchmarks/bench_selection.py --lengths 60k     # an older commit, beside it

The shapes are SmolLM2-135M's with `--train-len 1024` and ReAttention's defaults there: 9 query heads on 3 key heads,
head dim 64, a chunk of 128 queries, top 4 keys, spans of 32, 15 spans kept. A prefill of N tokens past the window
makes one call per chunk (N / 128) in each of the 30 layers, the middle growing to N - 544, so the calls at the longest
lengths are what a 64x input spends its time on. The keys are random: no ties, so this times the blocks' scores and
top-k, not the tie-breaking (the first layer's repeated tokens in a real text add to it). Reports the best of
--repeats calls, in CPU seconds of this process (one torch thread unless --threads).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's gali_cli, also in an older worktree
from gali_cli.methods.reattention import select

HEADS, KV_HEADS, QUERIES, DIM = 9, 3, 128, 64
TOP_KEYS, SPAN, CLIP = 4, 32, 15


def tokens(text: str) -> int:
    """'60k' -> 60000 (k is a thousand here: the middle's lengths are not powers of two)."""
    return int(float(text[:-1]) * 1000) if text.lower().endswith("k") else int(text)


def seconds_a_call(length: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(HEADS, QUERIES, DIM, generator=generator)
    middle = torch.randn(KV_HEADS, length, DIM, generator=generator)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        select(query, middle, TOP_KEYS, SPAN, CLIP)
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8k,30k,60k", help="lengths of the middle, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| keys in the middle | CPU seconds a call |\n|---|---|")
    for length in map(tokens, args.lengths.split(",")):
        print(f"| {length:,} | {seconds_a_call(length, args.repeats):.3f} |")


if __name__ == "__main__":
    main()
