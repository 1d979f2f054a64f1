"""Thread settings side by side, on the machine as it is and with busy loops added: which count (and OpenMP wait
policy) keeps a loaded CPU from collapsing. Each variant runs `gali summarize` in a fresh process (OpenMP reads its
environment once), in turns, and the load average is printed beside each figure.

    python benchmarks/bench_threads.py examples/declaration-of-independence.txt --busy 2 \
        --variant before=PYTHONPATH=/tmp/gali-before --variant default= --variant 1-thread=--threads=1

A variant is NAME=ITEMS, ITEMS a comma list of command-line words (starting with -) and VAR=VALUE environment
settings; gali's own default is the empty list.
"""

import argparse
import os
import re
import subprocess
import sys
import time

STATS = re.compile(r"read in ([\d.]+) s \(([\d.]+) tokens/s\); generated \d+ tokens \(([\d.]+) tokens/s")


def run(document: str, words: list[str], environment: dict[str, str]) -> str:
    """One summary's stats: prefill and decode tokens/s, wall seconds, the threads -v reported, the load."""
    load = os.getloadavg()[0]
    command = [sys.executable, "-m", "gali_cli", "summarize", document, "-m", "smollm2", "--train-len", "1024",
               "--no-cache", "--max-new-tokens", "30", "-v", *words]
    started = time.perf_counter()
    # PYTHONPATH=<another checkout> runs that checkout's gali: from its directory, where `-m` looks first
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **environment},
                            cwd=environment.get("PYTHONPATH"))
    wall = time.perf_counter() - started
    stats = STATS.search(result.stderr)
    threads = re.search(r"threads: ([^\n]*)", result.stderr)
    if not stats:
        return f"failed: {result.stderr.strip()[-200:]}"
    return (f"prefill {float(stats[2]):6.1f} tok/s  decode {float(stats[3]):5.1f} tok/s  wall {wall:5.1f} s  "
            f"load {load:4.1f}  ({threads[1] if threads else '?'})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("document")
    parser.add_argument("--variant", action="append", required=True, help="NAME=ITEMS (see the module's doc)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops for the loaded half")
    parser.add_argument("--rounds", type=int, default=1)
    arguments = parser.parse_args()
    arguments.document = os.path.abspath(arguments.document)
    variants = []
    for text in arguments.variant:
        name, _, items = text.partition("=")
        parts = [item for item in items.split(",") if item]
        words = [item for item in parts if item.startswith("-")]
        environment = dict(item.split("=", 1) for item in parts if not item.startswith("-"))
        variants.append((name, words, environment))
    for busy in (0, arguments.busy):
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(2 if busy else 0)
            for _ in range(arguments.rounds):
                for name, words, environment in variants:
                    print(f"+{busy} busy  {name:14} {run(arguments.document, words, environment)}", flush=True)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()


if __name__ == "__main__":
    main()
