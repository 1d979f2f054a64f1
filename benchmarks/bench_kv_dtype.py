"""What a 16-bit KV cache would cost: perplexity and greedy answers with the cache's keys and values rounded.

On the CPU a float32 model keeps float32 keys and values (SmolLM2: 30 layers x 3 KV heads x 64 dims x 2 x 4 B =
46 KB a token). A cache stored in float16 or bfloat16 is, numerically, a float32 cache whose stored rows were
rounded to that type before anything read them: this script runs gali's own perplexity pass (gali_cli.perplexity,
as `gali ppl` runs it) and then decodes greedily from the same cache (gali_cli.generate.decode, as `gali ask` does),
with every row `GrowingLayer.update` stores rounded to float16 or bfloat16, against float32, for every method.

Per model and method, one pass over the first N tokens of the text, with the method's defaults for N tokens (as
`gali ppl --lengths` and bench_real.py run it): perplexity over the first N/4 and the first N tokens (4x and 16x the
--train-len when N = 16 x train-len); then the text's next token is given and 64 tokens are decoded greedily,
eagerly (GALI_DECODE=eager: each decoded row goes through `update`, so it is rounded too; the static step writes
its rows itself). A row's answer is where the first token that differs from float32's stands (-: all equal), with
float32's gap there between the chosen token's logit and the runner-up's (a near tie when small).

    python benchmarks/bench_kv_dtype.py -m smollm2 --train-len 128 --length 2048
    python benchmarks/bench_kv_dtype.py -m gemma3-270m --train-len 128 --length 2048 --methods original,gali
    python benchmarks/bench_kv_dtype.py report          # the markdown table of everything in the results file

Each (model, method, dtype) appends one JSON line to the results file (default benchmarks/results/kv_dtype.jsonl);
a rerun skips what is there. The text is Genesis (King James Bible) from Debian packages, fetched at run time by
bench_real.py (nothing is committed). Methods run without noise (MethodSettings' default): a float32 run repeated
gives the same figures (--repeat checks it). On a machine other jobs share, --threads 1 is much the fastest: the
figures of docs/performance.md were taken so (before OMP_WAIT_POLICY was set here, 2 threads ran 256 tokens in
20-45 s against 3-4 s with one, at load 8).
"""

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

os.environ["GALI_DECODE"] = "eager"  # every decoded row through GrowingLayer.update, where it is rounded
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as gali sets it (docs/usage.md, "CPU threads"), before torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "kv_dtype.jsonl"
DTYPES = ("float32", "float16", "bfloat16")


@contextlib.contextmanager
def stored_as(dtype_name: str, caches: list):
    """While inside: every row the KV cache stores is rounded to `dtype_name` (the keys and values a 16-bit cache
    would hold, read back in float32), and every cache `perplexities` makes is appended to `caches`."""
    import torch

    import gali_cli.perplexity as perplexity_module
    from gali_cli.engine.seam.kv_cache import GrowingLayer

    dtype = getattr(torch, dtype_name)
    update, make = GrowingLayer.update, perplexity_module.new_cache

    def rounded_update(self, key_states, value_states, *args, **kwargs):
        return update(self, key_states.to(dtype).to(key_states.dtype), value_states.to(dtype).to(value_states.dtype),
                      *args, **kwargs)

    def recorded_cache(model, kv_dtype=None):
        cache = make(model, kv_dtype)
        if not all(isinstance(layer, GrowingLayer) for layer in cache.layers):
            raise SystemExit("the cache has layers that are not GrowingLayer: they would not be rounded")
        caches.append(cache)
        return cache

    GrowingLayer.update = rounded_update
    perplexity_module.new_cache = recorded_cache
    try:
        yield
    finally:
        GrowingLayer.update, perplexity_module.new_cache = update, make


def measure(loaded, ids: list[int], method: str, train_len: int, dtype_name: str, answer_tokens: int) -> dict:
    """Perplexity over ids[:N // 4] and ids[:N] (N = len(ids) - 1) in one pass, then `answer_tokens` greedy tokens
    after the text's next token, with the cache's rows stored as `dtype_name`."""
    import torch

    from gali_cli.config import MethodSettings
    from gali_cli.generate import decode, make_sampler, stop_token_ids
    from gali_cli.patching import apply_method, forward_ends, prefill_spans
    from gali_cli.perplexity import perplexities

    model, length = loaded.model, len(ids) - 1
    caches: list = []
    started = time.perf_counter()
    with stored_as(dtype_name, caches), torch.inference_mode():
        settings = apply_method(model, method, MethodSettings(train_len=train_len), length)
        found = perplexities(model, torch.tensor([ids[:length]]), [length // 4, length],
                             prefill_spans(model, method, 0, length), boundaries=forward_ends(model, method, 0, length))
        ppl_seconds = time.perf_counter() - started
        forced = torch.full((model.config.get_text_config().vocab_size,), float("-inf"))
        forced[ids[length]] = 0.0  # the first "sampled" token is the text's next one: then greedy from there
        margins: list[float] = []  # per step: the chosen token's logit minus the runner-up's (how near a tie)

        def greedy(logits: torch.Tensor) -> int:
            top = torch.topk(logits.float(), 2).values
            margins.append(float(top[0] - top[1]))
            return make_sampler()(logits)

        tokens = list(decode(model, caches[-1], forced, greedy, answer_tokens + 1,
                             stop_token_ids(model, loaded.tokenizer)))[1:]
    return {"settings": {key: value for key, value in settings.items() if isinstance(value, (int, float, str, bool))},
            "ppl": {str(result.length): result.ppl for result in found}, "answer": tokens,
            "margins": [round(margin, 4) for margin in margins[1:]],
            "ppl_seconds": round(ppl_seconds, 1), "seconds": round(time.perf_counter() - started, 1)}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _key(record: dict) -> tuple:
    return record["model"], record["train_len"], record["length"], record["method"], record["dtype"], record["run"]


def run(args: argparse.Namespace) -> None:
    import torch
    from bench_real import text

    from gali_cli.loading import load_model
    from gali_cli.methods.registry import NAMES
    from gali_cli.prompts import text_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    methods = list(NAMES) if args.methods == "all" else args.methods.split(",")
    dtypes = [name for name in args.dtypes.split(",") if name]
    done = {_key(record) for record in _records(args.results)}
    loaded = load_model(args.model, device="cpu")
    if loaded.model.dtype != torch.float32:
        raise SystemExit(f"the model loaded in {loaded.model.dtype}: this compares against a float32 cache")
    ids = text_ids(loaded.tokenizer, text("genesis"), add_special_tokens=True)[: args.length + 1]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for method in methods:
        for dtype_name, run_index in [(d, 0) for d in dtypes] + [("float32", 1)] * (method in args.repeat):
            spec = {"model": args.model, "train_len": args.train_len, "length": args.length, "method": method,
                    "dtype": dtype_name, "run": run_index}
            if _key(spec) in done:
                continue
            print(f"{method} {dtype_name}{' (again)' if run_index else ''} ...", file=sys.stderr, flush=True)
            record = {**spec, **measure(loaded, ids, method, args.train_len, dtype_name, args.answer_tokens),
                      "date": str(date.today()), "threads": torch.get_num_threads(),
                      "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__}
            with open(args.results, "a") as results:
                results.write(json.dumps(record) + "\n")
            print(f"  {record['ppl']} in {record['seconds']} s", file=sys.stderr, flush=True)


def _first_difference(answer: list[int], reference: list[int]) -> str:
    """Where the first token that differs from the reference's stands (1-based), '-' when none does."""
    for index, (token, expected) in enumerate(zip(answer, reference, strict=False)):
        if token != expected:
            return str(index + 1)
    return "-" if len(answer) == len(reference) else str(min(len(answer), len(reference)) + 1)


def report(args: argparse.Namespace) -> None:
    """One markdown table per (model, train_len, length): float32's perplexity at N/4 and N, each 16-bit type's
    relative difference, and where each one's greedy answer first differs."""
    latest = {_key(record): record for record in _records(args.results)}
    groups: dict[tuple, dict] = {}
    for record in latest.values():
        group = groups.setdefault((record["model"], record["train_len"], record["length"]), {})
        group[(record["method"], record["dtype"], record["run"])] = record
    for (model, train_len, length), group in groups.items():
        lengths = [str(length // 4), str(length)]
        print(f"\n{model}, --train-len {train_len}: {lengths[0]} and {lengths[1]} tokens "
              f"({int(lengths[0]) // train_len}x and {length // train_len}x the window), then "
              f"{args.answer_tokens} greedy tokens\n")
        print("| method | " + " | ".join(f"PPL fp32 @{n} | fp16 | bf16" for n in lengths)
              + " | answer fp16 | answer bf16 |")
        print("|---" * (2 + 3 * len(lengths)) + "|---|")
        for method in dict.fromkeys(method for method, _, _ in group):
            reference = group.get((method, "float32", 0))
            if reference is None:
                continue
            cells = []
            for n in lengths:
                cells.append(f"{reference['ppl'][n]:.4f}")
                for dtype_name in ("float16", "bfloat16"):
                    other = group.get((method, dtype_name, 0))
                    cells.append(f"{100 * (other['ppl'][n] / reference['ppl'][n] - 1):+.3f}%" if other else "")
            for dtype_name in ("float16", "bfloat16"):
                other = group.get((method, dtype_name, 0))
                where = _first_difference(other["answer"], reference["answer"]) if other else ""
                margins = reference.get("margins") or group.get((method, "float32", 1), {}).get("margins", [])
                if where not in ("", "-") and int(where) <= len(margins):
                    where += f" (gap {margins[int(where) - 1]:.3f})"
                cells.append(where)
            again = group.get((method, "float32", 1))
            if again is not None and (again["ppl"] != reference["ppl"] or again["answer"] != reference["answer"]):
                cells[-1] += " (float32 run twice differs!)"
            print(f"| {method} | " + " | ".join(cells) + " |")
        repeated = [method for method, dtype_name, run_index in group if run_index]
        if repeated:
            print(f"\nfloat32 run twice (same perplexity and answer unless marked): {', '.join(repeated)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["run", "report"], default="run")
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--train-len", type=int, default=128, help="the window the methods are told (default 128)")
    parser.add_argument("--length", type=int, default=2048, help="N: tokens of text (default 2048, 16x of 128)")
    parser.add_argument("--methods", default="all", help="comma-separated, or all (every method in the registry)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--repeat", default="", help="methods whose float32 run is repeated (determinism check)")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    args = parser.parse_args()
    args.repeat = [name for name in args.repeat.split(",") if name]
    if args.length % 4:
        parser.error("--length must be a multiple of 4")
    if args.command == "report":
        report(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
