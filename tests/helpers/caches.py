"""Cache directories as the tests look at them: their contents, a write that kill -9 stopped, a temporary backdated."""

import os
import subprocess
import sys
import time
from pathlib import Path


def cache_contents(directory: Path) -> list[Path]:
    """What a cache directory holds besides its token file (cache_ownership.py), in name order."""
    from gali_cli.cache_ownership import TOKEN_FILE

    return sorted(path for path in directory.iterdir() if path.name != TOKEN_FILE)


_KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
from gali_cli.cache_ownership import workspace

with workspace(Path(sys.argv[1]), sys.argv[2]) as folder:
    (folder / ".tmpKILLED").write_bytes(bytes(int(sys.argv[3])))  # as safetensors names the file it writes
    os.kill(os.getpid(), signal.SIGKILL)
"""


def backdate(*paths: Path) -> None:
    """As a minute later: a temporary is never judged in its first seconds (its writer may not hold its lock yet)."""
    for path in paths:
        os.utime(path, (time.time() - 60, time.time() - 60))


def killed_workspace(directory: Path, kind: str, size: int) -> Path:
    """The workspace of a `kind` cache's write in `directory` that kill -9 stopped with `size` bytes written."""
    from gali_cli.cache_ownership import TOKEN_FILE

    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(directory), kind, str(size)],
                            capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (folder,) = set(directory.iterdir()) - before - {directory / TOKEN_FILE}
    backdate(folder)
    return folder
