"""Prefill and decode cost of GALI and the other methods (ReRoPE, Leaky ReRoPE and DPE included) against the
unpatched model, on random Llama weights or a real checkpoint (`--model PATH|FILE.gguf|smollm2`, loaded as gali
loads it).

Each variant runs in its own worker process, so that peak memory is the variant's own (peak RSS on CPU,
torch.cuda.max_memory_allocated on CUDA); rounds interleave the variants, and the tables report medians over rounds
and ratios to the unpatched model measured in the same run.

    python benchmarks/bench_speed.py                      # CPU, small Llama, train_len 256, 16x = 4096 tokens
    python benchmarks/bench_speed.py --factors 1,4,16,32 --variants sdpa,gali,gali-noise,anchor --decode-factors ""
    python benchmarks/bench_speed.py --device cuda --shape llama3-8b --train-len 8192 --factors 1,4,8,16 \
        --dtype bfloat16 --variants sdpa,gali,gali-noise,gali-noise-torch,anchor --rounds 1 --repeats 1
    # a real model, 4096 tokens at 16x and 32x, every method, decode after each prefill, 2 threads:
    python benchmarks/bench_speed.py --model smollm2 --train-len 256,128 --tokens 4096 --threads 2 \
        --variants sdpa,gali,gali-noise,gali-noise-torch,self-extend,chunk-llama --decode-factors "" --decode-tokens 16

A worker that fails (out of memory, typically the anchor at long lengths) is reported as such; the others go on.
The KV cache is gali's, which appends in place (engine/seam/kv_cache.py); figures in docs/performance.md dated before
2026-11-26's "Decode on the CPU" used transformers' DynamicCache: `--cache dynamic` measures that again.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {  # hidden, heads, kv_heads, intermediate, layers, vocab
    "small": (512, 4, 1, 1792, 4, 32000),  # Llama-3 proportions (head dim 128, 4 query heads per kv head), scaled down
    "smollm2-135m": (576, 9, 3, 1536, 30, 49152),  # SmolLM2-135M's shape (head dim 64), for GPUs without its file
    "llama3-8b": (4096, 32, 8, 14336, 32, 128256),
}
VARIANTS = {
    "sdpa": "the unpatched model (SDPA), one forward",
    "gali": "GALI, noise off, one forward",
    "gali-noise": "GALI, noise on, one forward (the fused Triton kernel on CUDA)",
    "gali-noise-torch": "GALI, noise on, one forward, PyTorch path (GALI_KERNEL=torch)",
    "gali-pieces": "GALI, noise off, one forward per chunk",
    "sdpa-pieces": "the unpatched model, one forward per GALI chunk",
    "self-extend": "SelfExtend, one forward",
    "chunk-llama": "ChunkLlama (dual chunk attention), one forward",
    "anchor": "two-matmul GALI as the authors compute it (noise on): per chunk, keys rotated at ceil and at floor "
              "and repeated per head, two float32 logit matrices",
    "rerope": "ReRoPE, its defaults (window train_len/4, log n), one forward",
    "leaky-rerope": "Leaky ReRoPE, its defaults (window train_len/4, k 16, log n), one forward",
    "dpe": "DPE, its defaults (window train_len/8, 8 groups at the scale that reaches the input), one forward",
    "string": "STRING, its defaults (shift 0.33 train_len, local window min(128, shift / 2), logit scale on), one "
              "forward",
    "lampe": "LaMPE, its defaults (head train_len/16, tail 200/8192 of it, mapping length 3/16 of it), one forward",
}
METHOD_VARIANTS = ("rerope", "leaky-rerope", "dpe", "string", "lampe")  # applied by name with their default settings


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    if args.model:
        from gali_cli.loading import load_model

        model = load_model(args.model, device=args.device, dtype=args.dtype).model
        if args.layers:  # its first layers only: each layer costs the same, so the ratios hold, in less time
            model.model.layers = model.model.layers[: args.layers]
            model.config.num_hidden_layers = len(model.model.layers)
        return model
    hidden, heads, kv_heads, intermediate, layers, vocab = SHAPES[args.shape]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(args.train_len),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(previous)
    return model


def make_cache(model: LlamaForCausalLM, kind: str):
    """An empty KV cache: gali's, which appends in place (`growing`), or transformers' DynamicCache (`dynamic`)."""
    from transformers import DynamicCache

    from gali_cli.engine.seam.kv_cache import new_cache

    return new_cache(model) if kind == "growing" else DynamicCache(config=model.config)


def peak_memory_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def check_choices(parser: argparse.ArgumentParser, given: list[str], known, what: str) -> None:
    """A usage error naming what in `given` (a comma-separated option's values) is not in `known`, before any model
    loads."""
    unknown = set(given) - set(known)
    if unknown:
        parser.error(f"unknown {what} {', '.join(sorted(unknown))}: use {', '.join(known)}")


def run_context(load_before: tuple[float, float, float], **facts) -> dict:
    """What a benchmark's figures depend on, for its JSON: the command line, torch, the machine, the load average
    before and after (the machines are shared), OpenMP's wait policy, and `facts` of its own."""
    return {"argv": sys.argv[1:], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "load_before": load_before, "load_after": os.getloadavg(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), **facts}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def two_matmul_gali(settings):
    """GALI computed the straightforward way, as the anchor: Alg. 3 literally, per chunk (the tests' oracle)."""
    from gali_cli.engine.checks.reference import reference_gali_attention
    from gali_cli.engine.math.noise import Noise
    from gali_cli.engine.math.positions import interpolate
    from gali_cli.methods.gali import Gali

    class TwoMatmulGali(Gali):
        def attend(self, forward, module, query, key, value, scaling, dropout, **kwargs):
            config, outputs = self.config, []
            noise = Noise(config.seed, module.layer_idx, config.noise_scale) if config.noise else None
            table = forward.table(query.device, query.dtype)
            for first, last in self.chunks(forward.start, forward.stop):
                if last <= config.train_len:
                    outputs.append(forward.exact_attention(module, query, key, value, last, scaling, dropout))
                    continue
                rows = slice(first - forward.start, last - forward.start)
                interp = interpolate(last, config.train_len, config.local_window, query.device)
                outputs.append(reference_gali_attention(query[:, :, rows], key[:, :, :last], value[:, :, :last],
                                                        table, interp, scaling, noise).transpose(1, 2))
            return torch.cat(outputs, dim=1)

    return TwoMatmulGali(settings)


def apply_variant(model: LlamaForCausalLM, variant: str, train_len: int, tokens: int):
    """Patch `model` for `variant` (replacing any method applied before); returns GALI's resolved settings."""
    from gali_cli import GaliConfig, apply_gali
    from gali_cli.config import MethodSettings
    from gali_cli.engine.seam.hooks import install
    from gali_cli.patching import apply_method, remove_method

    remove_method(model)
    os.environ["GALI_KERNEL"] = "torch" if variant == "gali-noise-torch" else "auto"
    settings = GaliConfig(noise=variant.startswith("gali-noise") or variant == "anchor").resolved(train_len)
    if variant.startswith("gali"):
        apply_gali(model, settings)
    elif variant == "anchor":
        install(model, two_matmul_gali(settings))
    elif variant in ("self-extend", "chunk-llama", *METHOD_VARIANTS):
        apply_method(model, variant, MethodSettings(train_len=train_len), tokens)
    return settings


def peak_rss_mib() -> float:
    """The process's peak resident memory since the last `reset_peak_rss` (Linux: VmHWM), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux: writing 5 to /proc/self/clear_refs resets VmHWM); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def reset_peak(device: str) -> bool:
    """Start a new peak-memory window: CUDA's allocator statistics on a GPU, VmHWM on the CPU."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return True
    return reset_peak_rss()


def peak_mib(device: str) -> float:
    """Peak memory since `reset_peak`: allocated GPU memory on CUDA, resident memory on the CPU."""
    return peak_memory_mib(device) if device == "cuda" else peak_rss_mib()


def side_by_side(args: argparse.Namespace, variants: list[str], runs: list[tuple[int, int]]) -> dict:
    """All variants in this one process on one loaded model, interleaved forward by forward, `args.rounds` times:
    on a shared machine the load shifts alike for all of them, so their ratios hold. Peak memory per forward (CUDA:
    the allocator's peak; CPU: VmHWM), reset before each."""

    from gali_cli.engine.seam.cache_argument import with_cache

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = build_model(args)
    generator = torch.Generator().manual_seed(0)
    longest = max(train_len * factor for train_len, factor in runs)
    ids = torch.randint(0, model.config.vocab_size, (1, longest + args.decode_tokens), generator=generator)
    ids = ids.to(args.device)
    results = {(variant, *run): [] for variant in variants for run in runs}
    with torch.no_grad():
        model(ids[:, :8], logits_to_keep=1)  # warm-up: kernels, thread pools; the native kernel built and checked
        for _ in range(args.rounds):
            for train_len, factor in runs:
                length = train_len * factor
                for variant in variants:
                    apply_variant(model, variant, train_len, length + args.decode_tokens)
                    model(ids[:, :8], logits_to_keep=1)
                    synchronize(args.device)
                    resettable = reset_peak(args.device)
                    before = peak_mib(args.device)
                    start = time.perf_counter()
                    cache = make_cache(model, args.cache)
                    try:
                        model(ids[:, :length], **with_cache(model, cache), use_cache=True, logits_to_keep=1)
                    except torch.OutOfMemoryError:  # the anchor at long lengths: reported, the others go on
                        del cache
                        print(f"{variant} at {factor}x train_len {train_len}: out of memory", file=sys.stderr)
                        continue
                    synchronize(args.device)
                    prefill_s = time.perf_counter() - start
                    peak = peak_mib(args.device) if resettable else float("nan")
                    decode = []
                    for step in range(args.decode_tokens):
                        start = time.perf_counter()
                        model(ids[:, length + step : length + step + 1], **with_cache(model, cache), use_cache=True,
                              logits_to_keep=1)
                        synchronize(args.device)
                        decode.append(time.perf_counter() - start)
                    del cache
                    measured = {"prefill_s": prefill_s, "peak_mib": peak, "prefill_mib": peak - before,
                                "decode_ms": 1000 * statistics.median(decode) if decode else None}
                    print(f"{variant} at {factor}x train_len {train_len}: {measured}", file=sys.stderr, flush=True)
                    results[(variant, train_len, factor)].append(measured)
    return results


def worker(args: argparse.Namespace) -> dict:
    """One variant: prefill `factor` x train_len tokens, then decode; returns times (s) and peak memory (MiB)."""
    from transformers import DynamicCache

    from gali_cli.engine.seam.cache_argument import with_cache
    from gali_cli.patching import forward_ends

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model = build_model(args)
    train_len = int(args.train_len)  # a worker gets one train_len and one factor
    length = int(args.factors) * train_len
    apply_variant(model, args.variant, train_len, length + args.decode_tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, length + args.decode_tokens), device=args.device)
    prompt = ids[:, :length]
    ends = forward_ends(model, "gali", 0, length) if args.variant.endswith("pieces") else None  # one forward a chunk
    pieces = list(zip([0, *ends[:-1]], ends)) if ends else None

    def prefill() -> DynamicCache:
        cache = make_cache(model, args.cache)
        for first, last in pieces or [(0, length)]:
            model(prompt[:, first:last], **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        return cache

    with torch.no_grad():
        model(ids[:, :8], logits_to_keep=1)  # warm-up: kernels, thread pools
        synchronize(args.device)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = peak_memory_mib(args.device)
        times = []
        for _ in range(args.repeats):  # the first prefill also pays for first-touch page faults: keep the best
            start = time.perf_counter()
            cache = prefill()
            synchronize(args.device)
            times.append(time.perf_counter() - start)
        prefill_s = min(times)
        peak = peak_memory_mib(args.device)
        decode = []
        for step in range(args.decode_tokens):  # each step as generation runs it: the next token's logits only
            token = ids[:, length + step : length + step + 1]
            synchronize(args.device)
            start = time.perf_counter()
            model(token, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
            synchronize(args.device)
            decode.append(time.perf_counter() - start)
    return {
        "prefill_s": prefill_s,
        "decode_ms": 1000 * statistics.median(decode) if decode else None,
        "peak_mib": peak,
        "prefill_mib": peak - before,
    }


def run_worker(args: argparse.Namespace, variant: str, train_len: int, factor: int, decode_tokens: int,
               repeats: int) -> dict | None:
    """One worker process; None (and its error on stderr) when it fails, e.g. out of memory."""
    command = [sys.executable, __file__, "--worker", variant, "--factors", str(factor), "--decode-tokens",
               str(decode_tokens), "--device", args.device, "--dtype", args.dtype, "--shape", args.shape,
               "--train-len", str(train_len), "--repeats", str(repeats), "--threads", str(args.threads),
               "--cache", args.cache]
    if args.model:
        command += ["--model", args.model] + (["--layers", str(args.layers)] if args.layers else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        error = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        print(f"worker {variant} at {factor}x failed: {error}", file=sys.stderr)
        return None
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"{variant} at {factor}x train_len {train_len}: {measured}", file=sys.stderr, flush=True)  # progress
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", choices=SHAPES, default="small", help="random weights of this shape")
    parser.add_argument("--model", help="a real checkpoint instead: a folder, a .gguf file or smollm2 (as gali's -m)")
    parser.add_argument("--train-len", default="256", help="the window GALI and the methods stay within; several, "
                        "comma-separated, are measured in turn")
    parser.add_argument("--factors", default="16", help="prefill lengths as multiples of train_len, e.g. 1,4,16,32")
    parser.add_argument("--layers", type=int, help="with --model: keep its first N layers (ratios per layer, sooner; "
                        "tables built once per forward then weigh more than in the whole model)")
    parser.add_argument("--tokens", type=int, help="one prefill length for every train_len instead of --factors")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: torch's)")
    parser.add_argument("--variants", help="comma-separated, from: " + ", ".join(VARIANTS) + " (default: all; "
                        "gali-noise-torch only on CUDA, elsewhere it is gali-noise)")
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per variant, interleaved")
    parser.add_argument("--repeats", type=int, default=2, help="prefills per worker; the fastest counts")
    parser.add_argument("--decode-factors", default="1,2,4,8,16", help="context lengths (x train_len) for decode")
    parser.add_argument("--decode-tokens", type=int, default=16, help="decoded after each prefill worker's prefill "
                        "too, for the prefill table's decode column (0: none)")
    parser.add_argument("--one-process", action="store_true", help="every variant in this process, interleaved "
                        "forward by forward (one model load; peak RSS per forward via Linux's VmHWM): the ratios to "
                        "trust on a shared, loaded machine")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--cache", choices=("growing", "dynamic"), default="growing",
                        help="the KV cache: gali's, which appends in place (default), or transformers' DynamicCache")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return

    variants = args.variants.split(",") if args.variants else [
        variant for variant in VARIANTS if args.device == "cuda" or variant != "gali-noise-torch"]
    train_lens = [int(train_len) for train_len in args.train_len.split(",")]
    if args.tokens:
        runs = [(train_len, args.tokens // train_len) for train_len in train_lens]
    else:
        runs = [(train_len, int(factor)) for train_len in train_lens for factor in args.factors.split(",")]
    prefill: dict[tuple[str, int, int], list[dict]] = {(v, *run): [] for v in variants for run in runs}
    if args.one_process:
        prefill = side_by_side(args, variants, runs)
    for _ in range(0 if args.one_process else args.rounds):  # variants interleaved: the load shifts alike for all
        for run in runs:
            for variant in variants:
                prefill[(variant, *run)].append(run_worker(args, variant, *run, args.decode_tokens, args.repeats))
    decode_variants = [v for v in ("sdpa", "gali", *METHOD_VARIANTS) if v in variants]
    decode_factors = [int(factor) for factor in args.decode_factors.split(",") if factor]
    decode = {(variant, factor): run_worker(args, variant, train_lens[0], factor, args.decode_tokens, 1)
              for factor in decode_factors for variant in decode_variants}

    if args.json:  # first: a failure below loses nothing
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args),
                       "prefill": {f"{v}@{t}x{f}": results for (v, t, f), results in prefill.items()},
                       "decode": {f"{v}@{f}": run and run["decode_ms"] for (v, f), run in decode.items()}},
                      handle, indent=1)
    model = (f"{args.model}" + (f" (first {args.layers} layers)" if args.layers else "") if args.model
             else f"{args.shape} Llama (random weights)")
    print(f"# {date.today()} - {platform.node()} - {platform.processor() or platform.machine()} - "
          f"torch {torch.__version__} - {args.threads or torch.get_num_threads()} threads - load average "
          f"{os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} cores")
    print(f"# python {' '.join(sys.argv)}")
    for train_len, factor in runs:
        tokens = factor * train_len
        print(f"\nPrefill of {tokens} tokens ({factor}x train_len {train_len}), {model}, {args.dtype} on "
              f"{args.device}; " + (f"one process, variants interleaved, median of {args.rounds} forwards"
                                    if args.one_process else
                                    f"best of {args.repeats} per worker, median of {args.rounds} workers") +
              f"; decode: median ms per token of {args.decode_tokens} after that prefill\n")
        # "prefill MiB" is the peak during prefill minus the peak before it (weights, warm-up): the activations.
        print("| variant | prefill s | x sdpa | tokens/s | peak MiB | x sdpa | prefill MiB | x sdpa | decode ms | "
              "decode x sdpa tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        keys = ("prefill_s", "peak_mib", "prefill_mib") + (("decode_ms",) if args.decode_tokens else ())
        median = {v: {k: statistics.median(r[k] for r in results) for k in keys}
                  for v in variants if (results := [r for r in prefill[(v, train_len, factor)] if r])}
        base = median.get("sdpa")
        for variant in variants:
            if variant not in median:
                print(f"| {variant}: {VARIANTS[variant]} | failed (see stderr) | | | | | | | | |")
                continue
            m = median[variant]
            ratio = {key: f"{m[key] / base[key]:.2f}" if base and base[key] else "-"
                     for key in ("prefill_s", "peak_mib", "prefill_mib")}
            decoded = (f"{m['decode_ms']:.1f} | {base['decode_ms'] / m['decode_ms']:.2f}" if base and args.decode_tokens
                       else "- | -")
            print(f"| {variant}: {VARIANTS[variant]} | {m['prefill_s']:.2f} | {ratio['prefill_s']} | "
                  f"{tokens / m['prefill_s']:.0f} | {m['peak_mib']:.0f} | {ratio['peak_mib']} | "
                  f"{m['prefill_mib']:.0f} | {ratio['prefill_mib']} | {decoded} |")
    if decode:
        print(f"\nDecode, ms per token (median of {args.decode_tokens}) after a prompt of factor x train_len "
              f"{train_lens[0]}\n")
        print("| prompt tokens | x train_len | " + " | ".join(decode_variants) + " |")
        print("|---|---|" + "---|" * len(decode_variants))
        for factor in decode_factors:
            cells = " | ".join(f"{decode[(v, factor)]['decode_ms']:.1f}" if decode[(v, factor)] else "failed"
                               for v in decode_variants)
            print(f"| {factor * train_lens[0]} | {factor} | {cells} |")



if __name__ == "__main__":
    main()
