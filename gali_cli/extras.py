"""How to install one of gali's extras (plot, serve, eval), said the same way in every help text, error and doc.

gali is installed from its clone, not from a package index (no `gali-cli` is published there), so the command that
works is pip's install of the clone with the extra; an error also names the clone's folder where gali runs from one
(an editable install), since `.` means the folder the command is typed in.
"""

from pathlib import Path


def install_command(extra: str) -> str:
    """The one form every help text and doc gives: `pip install -e ".[plot]"`, typed in gali's clone."""
    return f'pip install -e ".[{extra}]"'


def install_hint(extra: str) -> str:
    """`install_command`, with the folder to type it in when gali runs from its clone."""
    folder = Path(__file__).resolve().parent.parent
    return install_command(extra) + (f" in {folder}" if (folder / "pyproject.toml").is_file() else " in gali's clone")
