"""How long `gali` takes to answer when it loads no model: --help, --version, gali info, usage errors.

    python benchmarks/bench_startup.py                # 15 rounds
    python benchmarks/bench_startup.py --rounds 30

Each round runs every command once, in turn (so that a busy machine slows them alike), as a real process through
the `gali` executable; a round also runs `python -c pass` (the interpreter alone) and `import torch, transformers`
(what each of these commands cost when it imported them). Wall time and CPU time (user + system, the process and its
children) per command: median and range over the rounds. Then, from `python -X importtime`, how many modules each
imports, whether torch or transformers is among them, and the slowest imports.
"""

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

GALI = str(Path(sys.executable).with_name("gali"))
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "gali --help": [GALI, "--help"],
    "gali --version": [GALI, "--version"],
    "gali info -m demo": [GALI, "info", "-m", "demo"],
    "gali info (default model)": [GALI, "info"],
    "gali summarize x --method bogus": [GALI, "summarize", "x", "--method", "bogus"],
    "gali summarize missing.txt": [GALI, "summarize", "missing.txt", "-m", "demo"],
    "import torch, transformers": [sys.executable, "-c", "import torch, transformers"],
}
HEAVY = ("torch", "transformers")


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ,
                                                                                          "COLUMNS": "100"})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports(command: list[str]) -> tuple[int, list[str], list[tuple[float, str]]]:
    """Modules `command` imports (as `python -X importtime` lists them), the heavy ones among them, and the five
    slowest top-level imports with their cumulative seconds."""
    python = [sys.executable, "-X", "importtime", "-m", "gali_cli", *command[1:]] if command[0] == GALI else \
        [sys.executable, "-X", "importtime", *command[1:]]
    lines = subprocess.run(python, capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"}
                           ).stderr.splitlines()
    rows = [line.split("|") for line in lines if line.startswith("import time:") and "self [us]" not in line]
    names = [row[2].strip() for row in rows]
    top = sorted(((int(row[1]) / 1e6, row[2].strip()) for row in rows if not row[2].startswith("  ")),
                 reverse=True)[:5]
    return len(names), sorted({name.split(".")[0] for name in names} & set(HEAVY)), top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for command in COMMANDS.values():  # warm the file cache
        timed(command)
    load_before = os.getloadavg()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            results[name].append(timed(command))
    load_after = os.getloadavg()
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    print(f"{date.today()}, {platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python "
          f"{platform.python_version()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{args.rounds} rounds\n")
    print("| command | wall, median (min-max) | CPU, median (min-max) | modules | torch / transformers |")
    print("|---|---|---|---|---|")
    details = []
    for name, command in COMMANDS.items():
        walls, cpus = zip(*results[name])
        count, heavy, top = imports(command)
        print(f"| `{name}` | {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}) | "
              f"{statistics.median(cpus):.2f} s ({min(cpus):.2f}-{max(cpus):.2f}) | {count} | "
              f"{', '.join(heavy) or 'neither'} |")
        details.append(f"- `{name}`: " + ", ".join(f"{module} {seconds:.3f} s" for seconds, module in top))
    print("\nSlowest top-level imports (cumulative, one `python -X importtime` run):\n")
    print("\n".join(details))


if __name__ == "__main__":
    main()
