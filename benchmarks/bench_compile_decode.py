"""Decoding one token: gali's static step (engine/static_decode.py; on a GPU the CUDA graph it records itself) against
torch.compile of the model's forward over transformers' StaticCache (gpt-fast's route; mode "reduce-overhead"
replays CUDA graphs through torch.compile's own graph trees on a GPU), side by side on the same prompt and tokens.

    python benchmarks/bench_compile_decode.py --model smollm2 --device cpu --dtype float32 --length 1024 --tokens 16
    python benchmarks/bench_compile_decode.py --shape llama3-8b --device cuda --dtype bfloat16 --length 8192 \
        --tokens 32 --rounds 3 --variants eager,static,compile-reduce-overhead --json $OUT/compile-8k.json

Variants (--variants, any of them, in this order each round, rotated by one each round):
  eager                     the model's forward on gali's KV cache (the reference logits)
  static                    gali's static step as `gali` decodes by default: on the CPU the native attention and
                            the projections as bytes where they lie on grids; on CUDA recorded as one CUDA graph
  static-float              CPU: the static step with the projections in PyTorch (no grids)
  static-compile            the static step (checked as `static`) run through torch.compile(mode="reduce-overhead")
                            instead of its own CUDA graph: replacing only the hand-recorded graph
  compile-default           torch.compile(model.forward) over a StaticCache of length + 2 + tokens slots
  compile-reduce-overhead   the same with mode="reduce-overhead" (CUDA graphs on a GPU; on a CPU Inductor skips them)

One prefill of `--length` random tokens per cache (gali's for eager/static, one StaticCache per compiled variant,
prefilled by the uncompiled forward), then token `length` decoded once per variant as its warm-up (the static
step's first step, checked against the forward; a compiled variant's compilation: its first calls are timed as the
compile time), then `--rounds` rounds of `--tokens` tokens each per variant, the same ids at the same indices.
Reported per variant: median ms a token over rounds (each round's median) and range, the compile/record seconds,
the largest relative logit difference to `eager` (max |a - b| / max |eager|), and how many of the tokens' argmax
agree with eager's. `--method` applies a gali method first (torch.compile then traces its hooks: see the recompiles
column, torch._dynamo's count of frames compiled).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as gali runs on a CPU (gali_cli/threads.py), before torch

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speed import SHAPES, build_model, check_choices, run_context, synchronize

from gali_cli.config import MethodSettings
from gali_cli.engine.attention.decode_route import ROUTES
from gali_cli.engine.seam.cache_argument import with_cache
from gali_cli.engine.seam.kv_cache import new_cache, reserve
from gali_cli.engine.seam.packed_modules import model_device
from gali_cli.engine.seam.static_decode import StaticDecoder, difference, model_route
from gali_cli.generate import truncate_cache
from gali_cli.methods.registry import NAMES
from gali_cli.patching import apply_method, prefill_spans

VARIANTS = ("eager", "static", "static-float", "static-compile", "compile-default", "compile-reduce-overhead")


class GaliCache:
    """The eager and static variants' shared KV cache (gali's, rows reserved), prefilled once."""

    def __init__(self, model, method: str, ids: torch.Tensor, length: int, capacity: int) -> None:
        self.model, self.ids, self.length = model, ids, length
        self.token_ids = ids[0].tolist()  # read on the host: no device sync in a timed step
        self.cache = new_cache(model)
        reserve(self.cache, capacity)
        self.given = with_cache(model, self.cache)
        for first, last in prefill_spans(model, method, 0, length):  # as gali prefills: GALI's chunks per forward
            model(input_ids=ids[:, first:last], **self.given, use_cache=True, logits_to_keep=1)
        self.forward(length)  # the cache now holds [0, length]: every variant decodes from length + 1

    def forward(self, index: int) -> torch.Tensor:
        """The model's own forward of token `index` (the cache holds [0, index)): logits (vocab,) float32."""
        return self.model(input_ids=self.ids[:, index: index + 1], **self.given, use_cache=True).logits[0, -1].float()


class Eager:
    def __init__(self, shared: GaliCache) -> None:
        self.shared, self.setup_s = shared, 0.0

    def start(self) -> None:
        truncate_cache(self.shared.cache, self.shared.length + 1)

    def step(self, index: int) -> torch.Tensor:
        return self.shared.forward(index)


class Static:
    """gali's static step; its first step (token `length`) checked against the forward, and recorded on a GPU."""

    def __init__(self, shared: GaliCache, grid_weights: bool, route: str | None) -> None:
        self.shared = shared
        route = route or model_route(shared.model)
        self.decoder = StaticDecoder(shared.model, shared.cache, route=route, grid_weights=grid_weights)
        length = shared.length
        started = time.perf_counter()
        self.decoder.first_step(shared.token_ids[length], length, lambda: shared.forward(length))
        synchronize(shared.ids.device.type)
        self.setup_s = time.perf_counter() - started
        if not self.decoder.checked:
            raise RuntimeError(f"the static step differs from the forward (relative {self.decoder.difference})")
        self.description = self.decoder.description()

    def start(self) -> None:
        truncate_cache(self.shared.cache, self.shared.length + 1)

    def step(self, index: int) -> torch.Tensor:
        return self.decoder.step(self.shared.token_ids[index], index).float()


class StaticCompiled(Static):
    """gali's static step, checked as `Static` is, then run through torch.compile(mode="reduce-overhead") instead of
    the CUDA graph the step records itself: what replacing the hand-recorded graph (and nothing else) would give.
    The first three calls at token `length` are the compile time."""

    def __init__(self, shared: GaliCache, route: str | None) -> None:
        super().__init__(shared, grid_weights=True, route=route)
        self.decoder.graph = None  # the step's own recording, set aside
        self.compiled = torch.compile(self.decoder._step, mode="reduce-overhead", dynamic=False)
        self.frames = 0
        started = time.perf_counter()
        for _ in range(3):
            truncate_cache(shared.cache, shared.length)
            self.step(shared.length)
        synchronize(shared.ids.device.type)
        self.setup_s += time.perf_counter() - started
        self.description += "; the step through torch.compile(mode='reduce-overhead')"

    def step(self, index: int) -> torch.Tensor:
        decoder = self.decoder
        decoder.token.fill_(self.shared.token_ids[index])
        decoder.index.fill_(index)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logits = self.compiled()
        self.frames += torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
        for layer in decoder.layers:  # as StaticDecoder.step leaves the cache's views
            layer.extend(index + 1)
        return logits[0, -1].float().clone()


class Compiled:
    """torch.compile of the model's forward over its own StaticCache; the first three calls (token `length`, then
    twice more: cudagraph trees record on a later call than the first) are the compile time."""

    def __init__(self, model, ids: torch.Tensor, length: int, capacity: int, mode: str | None) -> None:
        from transformers import StaticCache

        self.ids, self.length = ids, length
        device = ids.device
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        model(input_ids=ids[:, :length], past_key_values=self.cache, use_cache=True, logits_to_keep=1,
              cache_position=torch.arange(length, device=device))
        self.forward = torch.compile(model.forward, mode=mode, dynamic=False)
        # The token and its index in tensors of their own: no Python int and no view's offset is traced.
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.token = ids[:, :1].clone()
        self.frames = 0  # frames torch._dynamo compiled during this variant's calls (1: no recompilation)
        started = time.perf_counter()
        for _ in range(3):
            self.rewind(length)
            self.step(length)
        synchronize(device.type)
        self.setup_s = time.perf_counter() - started

    def start(self) -> None:
        self.rewind(self.length + 1)

    def rewind(self, index: int) -> None:
        """Write the next token at `index`: transformers' StaticLayer writes at its own count of tokens
        (`cumulative_length`, a tensor at a static address), not at `cache_position`, so decoding the same indices
        again (warm-up, rounds) sets it back; slots past it are masked by the cache positions and written again."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(index)

    def step(self, index: int) -> torch.Tensor:
        self.positions.fill_(index)
        self.token.copy_(self.ids[:, index: index + 1])
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = self.forward(input_ids=self.token, past_key_values=self.cache, use_cache=True,
                           cache_position=self.positions, position_ids=self.positions.view(1, 1))
        self.frames += torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
        return out.logits[0, -1].float().clone()  # reduce-overhead's outputs are overwritten by the next replay


def decode(runner, length: int, tokens: int, device: torch.device, logits: dict, name: str) -> float:
    """One round of `runner`: the median ms of its tokens; the first round's logits kept in `logits[name]`."""
    runner.start()
    per_token, made = [], []
    for index in range(length + 1, length + 1 + tokens):
        synchronize(device.type)
        start = time.perf_counter()
        made.append(runner.step(index))
        synchronize(device.type)
        per_token.append(1000 * (time.perf_counter() - start))
    logits.setdefault(name, torch.stack(made))
    return statistics.median(per_token)


def build(name: str, model, ids: torch.Tensor, shared: GaliCache, capacity: int, route: str | None):
    if name == "eager":
        return Eager(shared)
    if name.startswith("static"):
        truncate_cache(shared.cache, shared.length)  # its first step is token `length`, held to the forward
        if name == "static-compile":
            return StaticCompiled(shared, route)
        return Static(shared, grid_weights=name == "static", route=None)
    return Compiled(model, ids, shared.length, capacity, name.removeprefix("compile-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default=None, help="a real model as gali loads it (smollm2, a path)")
    parser.add_argument("--shape", choices=SHAPES, default="smollm2-135m", help="random weights of this shape")
    parser.add_argument("--layers", type=int, default=0, help="the model's first layers only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--train-len", type=int, default=8192, help="random models' window; a method's train_len")
    parser.add_argument("--method", default="original", help=f"original (unpatched) or one of {', '.join(NAMES)}")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens prefilled")
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="eager,static,static-float,compile-default,compile-reduce-overhead")
    parser.add_argument("--route", choices=ROUTES, default=None, help="static-compile's attention (default: the "
                        "device's kernel; on a CPU the native kernel reads the index in Python, which breaks the graph "
                        "every token: torch there)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the rows and the run's context to this file")
    args = parser.parse_args()
    variants = args.variants.split(",")
    check_choices(parser, variants, VARIANTS, "variants")
    if args.method != "original" and args.method not in NAMES:
        parser.error(f"unknown method {args.method}: use original or {', '.join(NAMES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model = build_model(args)
    capacity = args.length + 2 + args.tokens
    if args.method != "original":
        apply_method(model, args.method, MethodSettings(train_len=args.train_len), capacity)
    device = model_device(model)
    ids = torch.randint(0, model.config.vocab_size, (1, capacity), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    load_before = os.getloadavg()
    rows = {}
    with torch.inference_mode():
        shared = GaliCache(model, args.method, ids, args.length, capacity)
        runners = {}
        for name in variants:
            try:
                runners[name] = build(name, model, ids, shared, capacity, args.route)
            except Exception as failure:  # a variant that cannot run here is reported, the others go on
                rows[name] = {"variant": name, "error": f"{type(failure).__name__}: {str(failure)[:300]}"}
        times = {name: [] for name in runners}
        logits = {}
        names = list(runners)
        for turn in range(args.rounds):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                if name in rows:  # failed in an earlier round
                    continue
                try:
                    times[name].append(decode(runners[name], args.length, args.tokens, device, logits, name))
                except Exception as failure:  # e.g. a graph that cannot be recorded here: the others go on
                    rows[name] = {"variant": name, "error": f"{type(failure).__name__}: {str(failure)[:300]}"}
        reference = logits.get("eager")
        for name, runner in runners.items():
            if name in rows:
                continue
            row = {"variant": name, "ms": statistics.median(times[name]), "ms_min": min(times[name]),
                   "ms_max": max(times[name]), "setup_s": runner.setup_s,
                   "frames": getattr(runner, "frames", None), "how": getattr(runner, "description", "")}
            if reference is not None:
                row["difference"] = difference(logits[name], reference)
                row["same_argmax"] = float((logits[name].argmax(-1) == reference.argmax(-1)).float().mean())
            rows[name] = row
    print(f"| variant | ms a token (range over {args.rounds} rounds) | x eager | compile / record s | frames "
          "compiled | logits vs eager: rel. diff, same argmax |\n|---|---|---|---|---|---|")
    eager_ms = rows.get("eager", {}).get("ms")
    for name in variants:
        row = rows[name]
        if "error" in row:
            print(f"| {name} | {row['error']} | | | | |")
            continue
        speed = f"{eager_ms / row['ms']:.2f}x" if eager_ms else "-"
        print(f"| {name} | {row['ms']:.2f} ({row['ms_min']:.2f}-{row['ms_max']:.2f}) | {speed} | "
              f"{row['setup_s']:.2f} | {row['frames'] if row['frames'] is not None else '-'} | "
              f"{row.get('difference', float('nan')):.1e}, {row.get('same_argmax', float('nan')):.0%} |")
    context = run_context(load_before, device=str(device),
                          gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
    print(f"\n{context['gpu'] or 'CPU'}, torch {torch.__version__}, {context['threads']} threads; load average "
          f"before {load_before}, after {context['load_after']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"context": context, "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    main()
