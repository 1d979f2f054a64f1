"""Run the engine's equivalence tests against each transformers release, one environment per release, and write the
table of docs/compatibility.md.

    python scripts/compat.py                      # the releases below; updates docs/compatibility.md
    python scripts/compat.py --releases 5.24.0    # just these (the table keeps the other rows)

The releases, by default: the lowest the range in gali_cli/compat.py admits, the newest patch of every minor from
there on, and the newest release on the index (also past the range: that is how the range is raised). Each
environment is this interpreter's packages (torch, gali, the test dependencies) with one transformers release, and
the dependencies a fresh install of it resolves, installed by pip into a directory of its own that goes first on
PYTHONPATH. The tests are the seam's, the hooks', every method's against its float64 restatement, the authors'
GALI outputs, generation, the server's streams, GGUF files read by transformers (and gali's reading of their blocks,
held to it) and every model family (`TESTS`).
A release's row says passed only when all of them did.
To admit a new release: raise the range's upper bound in gali_cli/compat.py and pyproject.toml past it (a test holds
the installed release to the range), run this, and keep the new bound only if the release passed.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gali_cli.compat import TESTED_TRANSFORMERS  # the checkout's own range, not an installed copy's

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/engine/seam/test_compat.py", "tests/engine/seam/test_hooks.py", "tests/engine/seam/test_kv_cache.py",
         "tests/methods",  # every method against its restatement, and the authors' GALI outputs
         "tests/app/test_generate.py", "tests/server/test_server.py", "tests/model/test_gguf.py",
         "tests/app/test_gguf_weights.py", "tests/model/test_families.py"]
TABLE = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"


def index_releases() -> list[Version]:
    """Every final transformers release on the package index, newest first."""
    listing = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                             text=True, check=True).stdout
    found = re.search(r"Available versions: (.*)", listing)
    if not found:
        raise SystemExit(f"compat: cannot read the index's transformers releases from pip:\n{listing}")
    return sorted((Version(item.strip()) for item in found.group(1).split(",")), reverse=True)


def default_releases(available: list[Version]) -> list[Version]:
    """The lowest release the range admits, the newest patch of every minor from there, and the newest of all."""
    lowest = min(v for v in available if v in SpecifierSet(_lower_bound()) and not v.is_prerelease)
    chosen = {lowest, max(v for v in available if not v.is_prerelease)}
    for version in available:
        if version >= lowest and not version.is_prerelease:
            newest_of_minor = max(v for v in available if v.release[:2] == version.release[:2] and not v.is_prerelease)
            chosen.add(newest_of_minor)
    return sorted(chosen)


def _lower_bound() -> str:
    return ",".join(str(spec) for spec in SpecifierSet(TESTED_TRANSFORMERS) if spec.operator.startswith(">"))


def install(release: Version, work: Path) -> Path:
    """transformers `release` and the dependencies it resolves, in a directory of their own (kept between runs)."""
    target = work / f"transformers-{release}"
    if not (target / ".complete").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--target", str(target), "--upgrade", f"transformers=={release}"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        (target / ".complete").touch()
    return target


def run_tests(release: Version, target: Path) -> dict:
    """The equivalence tests with `target` first on the path; the row of the table."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    finished = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                              env=environment, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    closing = re.findall(r"^=* ?(\d+ (?:passed|failed).*) in [\d.]+s", finished.stdout, flags=re.MULTILINE)
    summary = closing[-1] if closing else " ".join((finished.stdout or finished.stderr).split()[-30:])
    imported = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                              env=environment, capture_output=True, text=True, check=False).stdout.strip()
    if imported != str(release):
        return _row(release, "not run", f"the environment imported transformers {imported or 'nothing'}", seconds)
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)}
    result = "passed" if finished.returncode == 0 else "failed"
    detail = ", ".join(f"{number} {kind}" for kind, number in counts.items()) or summary
    if finished.returncode != 0:
        failures = re.findall(r"^FAILED (\S+)", finished.stdout, flags=re.MULTILINE)
        detail += f" ({', '.join(failures[:3])}{', ...' if len(failures) > 3 else ''})" if failures else ""
    return _row(release, result, detail, seconds)


def _row(release: Version, result: str, detail: str, seconds: float) -> dict:
    return {"release": str(release), "result": result, "tests": detail, "seconds": round(seconds),
            "date": datetime.date.today().isoformat(), "in_range": release in SpecifierSet(TESTED_TRANSFORMERS)}


def write_table(rows: list[dict]) -> None:
    """docs/compatibility.md's table between its markers: the rows of this run over those of earlier ones."""
    text = TABLE.read_text()
    before, rest = text.split(BEGIN)
    old, after = rest.split(END)
    kept = {row["release"]: row for row in _parse(old)}
    kept.update({row["release"]: row for row in rows})
    lines = ["| transformers | result | tests | date | in gali's range |", "|---|---|---|---|---|"]
    for row in sorted(kept.values(), key=lambda row: Version(row["release"]), reverse=True):
        lines.append(f"| {row['release']} | {row['result']} | {row['tests']} | {row['date']} | "
                     f"{'yes' if row['in_range'] else 'no'} |")
    TABLE.write_text(f"{before}{BEGIN}\n" + "\n".join(lines) + f"\n{END}{after}")


def _parse(table: str) -> list[dict]:
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5:
            rows.append({"release": cells[0], "result": cells[1], "tests": cells[2], "date": cells[3],
                         "in_range": cells[4] == "yes"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", help="comma-separated transformers releases (default: see above)")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "gali-compat",
                        help="where the environments are kept (default: ~/.cache/gali-compat)")
    parser.add_argument("--json", type=Path, help="also write the rows of this run to this file")
    args = parser.parse_args()
    releases = ([Version(item) for item in args.releases.split(",")] if args.releases
                else default_releases(index_releases()))
    print(f"compat: {len(releases)} releases: {', '.join(map(str, releases))}", file=sys.stderr, flush=True)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as installs:  # the next installs while tests run
        pending = {release: installs.submit(install, release, args.work) for release in releases}
        for release in releases:
            try:
                target = pending[release].result()
            except subprocess.CalledProcessError as error:
                row = _row(release, "not installed", " ".join((error.stderr or "").split())[-200:], 0)
            else:
                row = run_tests(release, target)
            rows.append(row)
            print(f"compat: transformers {row['release']}: {row['result']} ({row['tests']}, {row['seconds']} s)",
                  file=sys.stderr, flush=True)
    write_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if any(row["result"] != "passed" and row["in_range"] for row in rows):
        raise SystemExit("compat: a release inside gali's range failed: narrow the range or fix the seam")


if __name__ == "__main__":
    main()
