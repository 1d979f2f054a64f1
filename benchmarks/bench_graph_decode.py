"""Decode on a GPU: every method's eager step against its static step replayed as a CUDA graph, side by side on the
same prefilled cache (engine/seam/static_decode.py), with how far the graph's logits are from the model's own forward.

    python benchmarks/bench_graph_decode.py --shape llama3-8b --dtype bfloat16 --train-len 8192 \
        --lengths 8192,32768 --tokens 16
    python benchmarks/bench_graph_decode.py --shape small --dtype float32 --train-len 256 --lengths 300,1100 \
        --tokens 40 --verify   # every graph step held to the forward: the correctness pass

For each length and method: one prefill, then `--tokens` tokens decoded eagerly (the model's forward, gali's KV
cache), the cache cut back, and the same tokens decoded by the static step (its first step checked against the
forward and used as the graph's warm-up, the rest replayed). Reported: median ms per token of each (the first two
tokens left out), the graph's recording time, and the relative logit difference to the forward at the last token
(every token with --verify). Writes a Markdown table to stdout and, with --json, the rows.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speed import SHAPES, build_model, synchronize

from gali_cli.config import MethodSettings
from gali_cli.engine.attention.decode_route import ROUTES
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import new_cache, reserve
from gali_cli.engine.seam.packed_modules import model_device
from gali_cli.engine.seam.static_decode import StaticDecoder, difference, model_route, why_not_static
from gali_cli.generate import truncate_cache
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, prefill_spans


def timed(run, device: torch.device) -> tuple[float, object]:
    """ms that `run()` took, the device's queued work waited for on both sides, and what it returned."""
    synchronize(device.type)
    start = time.perf_counter()
    result = run()
    synchronize(device.type)
    return 1000 * (time.perf_counter() - start), result


def measure(model, method: str, length: int, tokens: int, train_len: int, verify: bool,
            routes: list[str]) -> list[dict]:
    device = model_device(model)
    name, noise = method.removesuffix("-noise"), method.endswith("-noise")  # gali-noise: GALI with its noise on
    apply_method(model, name, MethodSettings(train_len=train_len, noise=noise), length + tokens)
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length + tokens), generator=generator).to(device)
    cache = new_cache(model)
    reserve(cache, length + tokens)
    given = with_cache(model, cache)
    prefill_ms = 0.0
    for first, last in prefill_spans(model, name, 0, length):
        ms, _ = timed(lambda first=first, last=last: model(input_ids=ids[:, first:last], **given, use_cache=True,
                                                         logits_to_keep=1), device)
        prefill_ms += ms

    def forward(index: int) -> torch.Tensor:
        return model(input_ids=ids[:, index : index + 1], **given, use_cache=True).logits[0, -1].float()

    row = {"method": method, "length": length, "prefill_s": prefill_ms / 1000}
    eager = [timed(lambda index=index: forward(index), device)[0] for index in range(length, length + tokens)]
    row["eager_ms"] = statistics.median(eager[2:])
    truncate_cache(cache, length)
    why = why_not_static(model, cache)
    if why:
        return [{**row, "static": why}]
    rows = []
    for route in routes:
        truncate_cache(cache, length)
        rows.append(static_steps(model, cache, ids, {**row, "route": route}, forward, tokens, verify))
    return rows


def static_steps(model, cache, ids: torch.Tensor, row: dict, forward, tokens: int, verify: bool) -> dict:
    """`row` with the static step's figures on `cache` (prefilled to row["length"]), attending by row["route"]:
    a kernel rotating keys as it reads them (triton on CUDA, native on the CPU), or the keys rotated in PyTorch
    first (torch)."""
    device, length = ids.device, row["length"]
    route = row["route"].removesuffix("-float")  # native-float: the native route, its projections in PyTorch
    decoder = StaticDecoder(model, cache, route=route, grid_weights=route == row["route"])
    differences = []
    ms, _ = timed(lambda: decoder.first_step(int(ids[0, length]), length, lambda: forward(length)), device)
    row.update(first_step_ms=ms, capture_s=decoder.capture_seconds, first_difference=decoder.difference,
               checked=decoder.checked)
    if not decoder.checked:
        return row
    static = []
    for index in range(length + 1, length + tokens):
        ms, logits = timed(lambda index=index: decoder.step(int(ids[0, index]), index).clone(), device)
        static.append(ms)
        if verify or index == length + tokens - 1:
            for layer in cache.layers:
                layer.extend(index)
            differences.append(difference(logits, forward(index)))
    row.update(static_ms=statistics.median(static[1:]), difference=max(differences))
    row["speedup"] = row["eager_ms"] / row["static_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--model", default=None, help="a real model instead of random weights")
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--train-len", type=int, default=8192)
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--methods", default=",".join([*sorted(NAMES), "gali-noise"]))
    parser.add_argument("--verify", action="store_true", help="hold every graph step to the forward")
    parser.add_argument("--routes", default=None, help="the step's attention: triton or native (a kernel rotating "
                        "keys as it reads them), torch (rotated first), native-float (native, the projections in "
                        "PyTorch even where their weights lie on grids); default torch and the device's kernel")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = set(args.routes.split(",") if args.routes else ()) - {*ROUTES, "native-float"}
    if unknown:  # a GPU session once measured the PyTorch route under the name "kernel", with only a warning
        parser.error(f"unknown routes {', '.join(sorted(unknown))}: use {', '.join(ROUTES)} or native-float")
    methods = args.methods.split(",")
    unknown = {method.removesuffix("-noise") for method in methods} - set(NAMES)
    if unknown:  # before the model loads, not after the first methods ran
        parser.error(f"unknown methods {', '.join(sorted(unknown))}: use {', '.join(NAMES)} (-noise: with noise)")
    model = build_model(args)
    kernel = model_route(model)
    routes = args.routes.split(",") if args.routes else sorted({"torch", kernel}, key=["torch", kernel].index)
    rows = []
    print("| method | length | eager ms/token | step's attention | graph ms/token | speed-up | recorded in | "
          "difference (first, last) |\n|---|---|---|---|---|---|---|---|", flush=True)
    with torch.inference_mode():
        for length in (int(length) for length in args.lengths.split(",")):
            for method in methods:
                try:
                    measured = measure(model, method, length, args.tokens, args.train_len, args.verify, routes)
                except torch.OutOfMemoryError as error:
                    measured = [{"method": method, "length": length, "error": str(error).split("\n")[0]}]
                    torch.cuda.empty_cache()
                rows.extend(measured)
                for row in measured:
                    if "static_ms" in row:
                        print(f"| {method} | {length} | {row['eager_ms']:.1f} | {row['route']} | "
                              f"{row['static_ms']:.2f} | {row['speedup']:.1f}x | {row['capture_s']:.2f} s | "
                              f"{row['first_difference']:.1e}, {row['difference']:.1e} |", flush=True)
                    else:
                        print(f"| {method} | {length} | {row.get('eager_ms', float('nan')):.1f} | "
                              f"{row.get('route', '-')} | - | - | - | "
                              f"{row.get('static') or row.get('error') or row.get('first_difference')} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
