"""The `gali` executable. It imports the CLI (and with it torch) lazily, so that Ctrl-C during start-up exits
quietly too, and so that OpenMP's settings are in place before torch loads it."""

import sys


def main() -> None:
    try:
        from .threads import prepare_openmp

        prepare_openmp()
        from .cli import main as run
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(run())
