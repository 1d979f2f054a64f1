"""The `gali` executable. It imports the CLI (and with it torch) lazily, so that Ctrl-C during start-up exits
quietly too."""

import sys


def main() -> None:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(run())
