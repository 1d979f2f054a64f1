"""The documents a batch names: files, directories, glob patterns and @manifests, expanded to one sorted list of
paths, each once; what cannot be a document (a named pipe, a device, a socket) is refused with why.
"""

import glob
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..documents import link_problem
from ..errors import ConfigError, InputError

# Files a directory contributes; anything else in it (images, binaries, code) is left alone.
DOCUMENT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".html", ".htm", ".pdf")
_GLOB_CHARACTERS = set("*?[")
MANIFEST_DEPTH = 16  # @manifests within @manifests, at most (a deeper chain is a mistake; Python's stack is finite)
_MANIFEST_BYTES = 64 * 2**20  # a manifest larger than this is not a list of paths (@/dev/zero)


def expand_documents(specs: list[str]) -> list[Path]:
    """The documents named by `specs`, in order, each once: files, directories (searched recursively for
    DOCUMENT_SUFFIXES, hidden entries skipped), glob patterns (`**` recurses), and `@list.txt` manifests with one
    path, directory or pattern per line (relative to the manifest's folder; blank lines and # comments skipped)."""
    found: dict[Path, None] = {}
    for spec in specs:
        for path in _expand(spec, Path.cwd(), manifests_seen=set()):
            found.setdefault(path, None)
    if not found:
        raise InputError(f"no documents in {' '.join(specs)}")
    return list(found)


def _expand(spec: str, base: Path, manifests_seen: set[Path]) -> Iterator[Path]:
    if spec == "-":
        raise ConfigError("several documents are read from files, not from standard input ('-')")
    if "\0" in spec:
        raise InputError(f"{spec}: a path cannot hold a NUL byte (is this a list of paths?)")
    if spec.startswith("@"):
        manifest = (base / Path(spec[1:]).expanduser()).resolve()
        if manifest in manifests_seen:
            raise InputError(f"manifest {manifest} includes itself")
        if len(manifests_seen) >= MANIFEST_DEPTH:
            raise InputError(f"manifest {spec[1:]}: @manifests nested more than {MANIFEST_DEPTH} deep")
        lines = _manifest_lines(manifest, spec[1:])
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                try:
                    yield from _expand(line, manifest.parent, manifests_seen | {manifest})
                except InputError as error:
                    raise InputError(f"{spec[1:]}, line {number}: {error}") from None
        return
    path = base / Path(spec).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as error:  # e.g. a folder on the way that gali may not enter
        raise InputError(f"{spec}: {error.strerror or error}") from None
    if is_file:
        yield path.resolve()
    elif is_dir:
        files = [found for found in path.rglob("*") if found.is_file() and found.suffix.lower() in DOCUMENT_SUFFIXES
                 and not any(part.startswith(".") for part in found.relative_to(path).parts)]
        if not files:
            raise InputError(f"{spec}: no documents ({', '.join(DOCUMENT_SUFFIXES)}) in this directory")
        yield from sorted(found.resolve() for found in files)
    elif _GLOB_CHARACTERS & set(spec):
        matches = sorted((base / match).resolve() for match in glob.glob(os.path.expanduser(spec), root_dir=base,
                                                                          recursive=True)
                         if (base / match).is_file())
        if not matches:
            raise InputError(f"{spec}: no file matches")
        yield from matches
    else:
        raise InputError(f"{spec}: {_special_kind(path) or link_problem(path) or 'no such file or directory'}")


def _manifest_lines(manifest: Path, name: str) -> list[str]:
    """The lines of a manifest: a file, or a named pipe or process substitution (@<(ls *.txt)), read once."""
    try:
        with open(manifest, "rb") as file:
            data = file.read(_MANIFEST_BYTES + 1)
        if len(data) > _MANIFEST_BYTES:
            raise InputError(f"manifest {name} is larger than {_MANIFEST_BYTES // 2**20}M: not a list of paths")
        return data.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read manifest {name}: {error}") from error


def _special_kind(path: Path) -> str | None:
    """What a path that is there but neither a file nor a directory is, and why batch mode cannot take it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return ("a named pipe or process substitution, which can be read only once: batch mode reads each document "
                "twice (its hash, then its text); save it to a file, or give it alone (gali reads it once)")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a document (it may never end): save what it gives to a file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a document"
    return None
