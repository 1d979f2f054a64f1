"""Docs that are generated or quoted must match the code."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text() == module.render(), "run: python docs/cli_reference.py > docs/cli.md"


def test_ci_runs_the_readme_blocks():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- ci:begin -->\n```bash\n(.*?)```\n<!-- ci:end -->", readme, flags=re.S)
    assert len(blocks) == 2  # set-up with the demo model, then the tests
    assert "ci:begin" in (ROOT / ".ci" / "run").read_text()
