"""What gali writes into a cache directory, and the proof that it wrote it.

Users point gali's caches at folders of their own (`--cache-dir`, GALI_CACHE_DIR, GALI_MODEL_CACHE,
GALI_GGUF_CACHE), so a cache may delete only what it can prove it wrote: a name is no proof (a user's folder may be
called `.partial-anything`). Each cache directory holds a token file (TOKEN_FILE) with a random 128-bit token,
created once with an exclusive open. Every write happens in a `workspace`: a fresh folder made with `mkdtemp`,
locked by the writing process (file_locks.py), holding a marker file (MARKER) created with an exclusive open and
carrying the directory's token and the cache's kind. A folder is gali's when its marker carries that token, which
a user's files cannot hold by accident; what it holds is then gali's too, whatever its names (safetensors' own
`.tmpXXXX` files among them). A marked folder whose lock nobody holds was left by a killed writer (`leftovers`),
and is deleted whole. An empty folder named like a workspace (a writer killed before it wrote the marker) is only
ever removed with `rmdir`, which cannot delete data (`remove_empty_partials`: listing never deletes).

A token file that is not gali's (a user's file of that name) makes the cache refuse to write there: it says so, and
deletes nothing. A lost token file makes everything written before it foreign: left alone and named in a warning,
never deleted.
"""

import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import platformdirs

from .config import expand_home
from .file_locks import hold, left_behind

TOKEN_FILE = ".gali-cache-token"
MARKER = ".gali-writer"
PARTIAL = ".partial-"  # a workspace's name (a convenience for listing; the proof is its marker)
_HEADER = "gali cache token"
_TOKEN = re.compile(r"[0-9a-f]{32}")
# a link is not followed, a FIFO does not block the open (then it fails the regular-file check)
_OPEN_PLAIN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_READ_TRIES = 20  # a token file another gali has just created may be empty for an instant


def user_cache_directory(folder: str, variable: str | None = None) -> Path:
    """$`variable` (with ~ expanded) where it is set, else `folder` in the platform's user cache directory (e.g.
    ~/.cache/gali/`folder` on Linux): where each of gali's caches lives."""
    if variable and os.environ.get(variable):
        return expand_home(os.environ[variable], variable)
    return Path(platformdirs.user_cache_dir("gali")) / folder


def known_token(directory: Path) -> str | None:
    """The token of the cache in `directory` where it has one gali wrote (None: none yet, or a file of its name
    that is not gali's): what proves a folder or entry there gali's, for listing and deleting."""
    try:
        return cache_token(directory, create=False)
    except OSError:
        return None


class NotOwnable(OSError):
    """The directory's token file is not one gali wrote, so nothing gali writes there could be told from a user's."""


def cache_token(directory: Path, create: bool = True) -> str | None:
    """The token of the cache in `directory`: read from its TOKEN_FILE, or (with `create`) made now. None without
    `create` when there is none; NotOwnable when the file is not gali's; OSError when it cannot be made."""
    path = directory / TOKEN_FILE
    for _ in range(_READ_TRIES):
        try:
            token = _read_token(path)
        except FileNotFoundError:
            if not create:
                return None
            token = _make_token(path)
            if token is None:
                continue  # another gali made it this instant: read theirs
        if token:
            return token
        time.sleep(0.05)  # empty: its writer is between creating and writing it
    raise NotOwnable(f"{path} is not a token file gali wrote")


def _read_token(path: Path) -> str:
    """The token in `path` ("" while it is empty); NotOwnable for anything but a regular file in gali's format."""
    descriptor = os.open(path, _OPEN_PLAIN)
    try:
        if not _is_regular(descriptor):
            raise NotOwnable(f"{path} is not a regular file")
        text = os.read(descriptor, 256).decode("ascii", errors="replace")
    finally:
        os.close(descriptor)
    if not text:
        return ""
    header, _, token = text.partition("\n")
    if header != _HEADER or not _TOKEN.fullmatch(token.strip()):
        raise NotOwnable(f"{path} is not a token file gali wrote")
    return token.strip()


def _make_token(path: Path) -> str | None:
    """Create `path` with a new token (exclusively); None when another process created it first."""
    token = secrets.token_hex(16)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    try:
        os.write(descriptor, f"{_HEADER}\n{token}\n".encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return token


def _is_regular(descriptor: int) -> bool:
    return stat.S_ISREG(os.fstat(descriptor).st_mode)


@contextmanager
def workspace(directory: Path, kind: str) -> Iterator[Path]:
    """A new folder in `directory` for one write of the `kind` cache, locked by this process and marked as gali's;
    deleted with what is left in it on the way out, whatever happens (the caller renames out what it keeps).
    OSError (NotOwnable among them) when the directory cannot hold one."""
    token = cache_token(directory)
    folder = Path(tempfile.mkdtemp(dir=directory, prefix=PARTIAL))
    lock = hold(folder)  # while held, no other gali takes the folder for a killed writer's
    try:
        descriptor = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(descriptor, _marking(token, kind))
        finally:
            os.close(descriptor)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _marking(token: str, kind: str) -> bytes:
    return f"{token} {kind}\n".encode()


def is_marked(folder: Path, token: str | None, kind: str) -> bool:
    """Whether `folder` (not a link) holds gali's marker for `kind` with `token`: the proof that gali made it."""
    if token is None or folder.is_symlink() or not folder.is_dir():
        return False
    try:
        descriptor = os.open(folder / MARKER, _OPEN_PLAIN)
    except OSError:
        return False
    try:
        return _is_regular(descriptor) and os.read(descriptor, 256) == _marking(token, kind)
    except OSError:
        return False
    finally:
        os.close(descriptor)


def workspaces(directory: Path, kind: str) -> list[Path]:
    """The `kind` cache's workspaces in `directory`, running or left by a killed writer (each proven by its
    marker)."""
    try:
        token = cache_token(directory, create=False)
    except OSError:
        return []
    return [folder for folder in _named_like_workspaces(directory) if is_marked(folder, token, kind)]


def remove_empty_partials(directory: Path) -> None:
    """Remove, with rmdir, the empty folders in `directory` named like a workspace that no writer holds: what a
    writer killed before it wrote its marker left (rmdir cannot delete data). Nothing where the token file is not
    gali's: such a cache deletes nothing."""
    try:
        cache_token(directory, create=False)
    except OSError:
        return
    for folder in _named_like_workspaces(directory):
        if _empty(folder) and left_behind(folder):  # a marked folder is never empty: it holds its marker
            with suppress(OSError):
                folder.rmdir()


def _named_like_workspaces(directory: Path) -> list[Path]:
    """The folders (not links) in `directory` named like a workspace, whoever made them; none where it cannot be
    read."""
    try:
        with os.scandir(directory) as found:
            return [Path(entry.path) for entry in found
                    if entry.name.startswith(PARTIAL) and entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def leftovers(directory: Path, kind: str) -> list[Path]:
    """The `kind` cache's workspaces in `directory` that a killed writer left (no process holds their lock)."""
    return [folder for folder in workspaces(directory, kind) if left_behind(folder)]


def _empty(folder: Path) -> bool:
    try:
        return not any(folder.iterdir())
    except OSError:
        return False
