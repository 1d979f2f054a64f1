"""One SIGINT stops a test run, however it was started.

A shell without job control (a script, `bash -c`, a tool that runs commands) starts a background job
(`python -m pytest ... &`) with SIGINT ignored, and Python leaves an ignored SIGINT ignored: `kill -INT` then does
nothing to the run, however often it is sent. The conftest imports this hook, so the run takes SIGINT back as
Python's KeyboardInterrupt, which pytest ends the run on, as Ctrl-C at a terminal does.
tests/project/test_interrupts.py runs pytest with only this plugin, SIGINT ignored, and interrupts it.
"""

import signal


def pytest_configure(config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
