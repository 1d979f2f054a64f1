"""Where the repository and the tests' data are, whichever folder of tests/ a test module lives in."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: README.md, docs/, gali_cli/, tests/
DATA = ROOT / "tests" / "data"  # files written for the tests (LongBench records, token streams, the authors' outputs)
