"""Decode speed, side by side in one process: each method with gali's KV cache (appends in place) and with
transformers' DynamicCache (concatenates), after a prompt of each length; optionally the unpatched model's decode
step compiled by torch.compile over a StaticCache, the route issue 26 asked about.

    python benchmarks/bench_decode.py --model smollm2 --train-len 1024 --lengths 1024,4096 --threads 2 \
        --methods original,gali,self-extend,chunk-llama,string --compile

Rounds interleave every (method, cache) pair, so that a shared machine's load shifts alike for all of them; the table
reports medians of the per-token times over rounds, and each pair's speed relative to the unpatched model with
transformers' cache in the same run.
"""

import argparse
import statistics
import time
from datetime import date

import torch
from transformers import DynamicCache, StaticCache

from gali_cli.config import MethodSettings
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import new_cache
from gali_cli.loading import load_model
from gali_cli.patching import apply_method, remove_method


def decode_ms(model, ids: torch.Tensor, length: int, tokens: int, cache, step=None) -> float:
    """Prefill `length` tokens into `cache` in one forward, then decode `tokens`; the median ms of a step."""
    given = with_cache(model, cache)
    model(ids[:, :length], **given, use_cache=True, logits_to_keep=1)
    times = []
    for position in range(length, length + tokens):
        token = ids[:, position : position + 1]
        start = time.perf_counter()
        if step is None:
            model(token, **given, use_cache=True, logits_to_keep=1)
        else:
            step(token, cache, torch.tensor([position]))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--train-len", type=int, default=1024)
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--methods", default="original,gali,self-extend,chunk-llama,string")
    parser.add_argument("--tokens", type=int, default=12, help="decoded per measurement (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="also the unpatched model compiled over a StaticCache")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu", dtype=args.dtype).model
    lengths = [int(length) for length in args.lengths.split(",")]
    methods = args.methods.split(",")
    ids = torch.randint(0, model.config.vocab_size, (1, max(lengths) + args.tokens), generator=torch.Generator()
                        .manual_seed(0))
    caches = {"growing": new_cache, "dynamic": lambda m: DynamicCache(config=m.config)}
    runs = [(method, kind) for method in methods for kind in caches]
    compiled = None
    if args.compile:
        runs.append(("original", "static+compile"))
        compiled = torch.compile(model.forward, dynamic=False)
    results = {(run, length): [] for run in runs for length in lengths}
    compile_seconds = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for length in lengths:
                for method, kind in runs:
                    remove_method(model)
                    if method != "original":
                        apply_method(model, method, MethodSettings(train_len=args.train_len), length + args.tokens)
                    if kind == "static+compile":
                        cache = StaticCache(config=model.config, max_cache_len=length + args.tokens)

                        def step(token, cache, position):
                            return compiled(input_ids=token, past_key_values=cache, use_cache=True,
                                            cache_position=position, logits_to_keep=1)

                        if length not in compile_seconds:  # the first call of a shape compiles it
                            start = time.perf_counter()
                            warm = StaticCache(config=model.config, max_cache_len=length + args.tokens)
                            model(ids[:, :length], past_key_values=warm, use_cache=True, logits_to_keep=1)
                            step(ids[:, length : length + 1], warm, torch.tensor([length]))
                            compile_seconds[length] = time.perf_counter() - start
                        results[((method, kind), length)].append(decode_ms(model, ids, length, args.tokens, cache,
                                                                           step))
                    else:
                        results[((method, kind), length)].append(
                            decode_ms(model, ids, length, args.tokens, caches[kind](model)))
                    print(f"{method} {kind} {length}: {results[((method, kind), length)][-1]:.1f} ms", flush=True)
    remove_method(model)
    print(f"\n# {date.today()} - torch {torch.__version__} - {torch.get_num_threads()} threads - {args.model} "
          f"{args.dtype} - train_len {args.train_len} - median of {args.rounds} rounds of {args.tokens - 1} tokens")
    base = {length: statistics.median(results[(("original", "dynamic"), length)]) for length in lengths}
    print("\n| method | KV cache | " + " | ".join(f"ms/token after {length} (x speed)" for length in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for run in runs:
        cells = []
        for length in lengths:
            ms = statistics.median(results[(run, length)])
            cells.append(f"{ms:.1f} ({base[length] / ms:.2f}x)")
        print(f"| {run[0]} | {run[1]} | " + " | ".join(cells) + " |")
    if compile_seconds:
        print("\ncompile time, s: " + ", ".join(f"{length}: {seconds:.0f}" for length, seconds in
                                              compile_seconds.items()))


if __name__ == "__main__":
    main()
