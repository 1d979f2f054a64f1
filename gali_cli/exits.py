"""How a command ends: gali's errors as one line on stderr with their documented exit code (docs/cli.md), usage
errors named with the help to read, and a reader of stdout that went away (`gali ... | head`) taken as done."""

import functools
import os
import select
import stat
import sys
from collections.abc import Callable

import typer

from .display import fail, say
from .errors import ConfigError, GaliError, InputError, ModelLoadError, UnsupportedModelError

EXIT_CODES = {ConfigError: 2, InputError: 3, ModelLoadError: 4, UnsupportedModelError: 4}


def guarded(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with gali's errors as one line on stderr and an exit code (GALI_DEBUG=1: tracebacks)."""

    @functools.wraps(command)
    def run(*args, **kwargs) -> None:
        try:
            command(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt as interrupt:  # a run may say what was kept (batch mode: what is safe in --out)
            say(f"interrupted: {interrupt}" if str(interrupt) else "interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:  # the reader of stdout went away (e.g. | head): it has what it wanted
            silence_stdout()
            raise typer.Exit(0) from None
        except GaliError as error:
            fail(str(error))
            raise typer.Exit(next((code for kind, code in EXIT_CODES.items() if isinstance(error, kind)), 1)) from None
        except Exception as error:
            if os.environ.get("GALI_DEBUG"):
                raise
            fail(f"unexpected {type(error).__name__}: {error} (GALI_DEBUG=1 shows the traceback)")
            raise typer.Exit(1) from None

    return run


def usage_message(error: typer.TyperException) -> str:
    """Click's message, but for `gali ask FILE` with no question: Click fills QUESTION first (from the end) and
    then says DOCS is missing, blaming the argument that was given."""
    parameter, context = getattr(error, "param", None), getattr(error, "ctx", None)
    names = [param.name for param in context.command.params] if context else []
    missing = type(error).__name__ == "MissingParameter"  # Click's, or the copy of it newer Typers carry
    if missing and parameter is not None and parameter.name == "files" and "question" in names:
        return "missing DOCS or QUESTION: the documents come first, then the question, e.g. gali ask notes.txt " \
               '"What is due on Friday?"'
    return error.format_message()


def help_command(error: typer.TyperException) -> str:
    """`gali ask --help` for an error in `gali ask`'s arguments; `gali --help` where no command was found."""
    context, words = getattr(error, "ctx", None), []
    while context is not None and context.parent is not None:  # the root's name is the program's, whatever ran it
        words.insert(0, context.info_name)
        context = context.parent
    return " ".join(["gali", *words, "--help"])


def stdout_file() -> os.stat_result | None:
    """What stdout is (None: no real file, as under tests' captured output)."""
    try:
        return os.fstat(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def reader_gone(before: os.stat_result | None) -> bool:
    """Whether stdout, `before` the command ran, was a pipe whose reader has since closed it (`gali ... | head` once
    head has its lines): Linux's poll reports an error on such a pipe's writing end, and Rich, meeting the closed
    pipe first, points stdout at /dev/null."""
    if before is None or not stat.S_ISFIFO(before.st_mode):
        return False
    now = stdout_file()
    if now is not None and stat.S_ISCHR(now.st_mode) and now.st_rdev == os.stat(os.devnull).st_rdev:
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not report the closed pipe again (as
    Python's docs on SIGPIPE advise)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
