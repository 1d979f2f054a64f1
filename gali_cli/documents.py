"""Reading the documents gali is asked about: text in any encoding, PDF (page by page, with pypdf), or stdin.

Problems come back as `InputError` with a message naming the file; recoverable oddities (a guessed encoding,
replaced bytes, PDF pages without text) come back as warnings on the `Document`.
"""

import errno
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import charset_normalizer
from pypdf import PdfReader
from pypdf.errors import DependencyError, PyPdfError

from .errors import InputError

STDIN = "-"
_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))
_SNIFF = 8192  # bytes looked at to tell binary from text


@dataclass(frozen=True)
class Document:
    """A document's text, where it came from, and what was odd about reading it."""

    text: str
    name: str  # the path as given, or "<stdin>"
    kind: str  # "text" or "pdf"
    pages: int = 0  # PDF pages, 0 for text
    warnings: tuple[str, ...] = ()


def read_document(
    source: str,
    password: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    stdin: BinaryIO | None = None,
) -> Document:
    """Read a file path, or standard input for "-"; PDFs are recognised by their first bytes, not their name.

    Args:
        password: for encrypted PDFs.
        progress: called with (pages read, pages in all) while a PDF is read.
    """
    name = "<stdin>" if source == STDIN else source
    data = (stdin or sys.stdin.buffer).read() if source == STDIN else _read_bytes(Path(source), name)
    if not data.strip():
        raise InputError(f"{name} is empty")
    if data.lstrip()[:5] == b"%PDF-":
        return _read_pdf(data, name, password, progress)
    text, warnings = _decode(data, name)
    if not text.strip():
        raise InputError(f"{name} has no text")
    return Document(text=text.replace("\r\n", "\n"), name=name, kind="text", warnings=tuple(warnings))


def check_source(source: str) -> None:
    """Refuse at once a document path that names no file (nothing there, a broken link or a loop, a directory):
    the command line calls it before anything heavy is imported, so a typo costs no wait."""
    if source != STDIN:
        _check_path(Path(source), source)


def _check_path(path: Path, name: str) -> None:
    if not path.exists():
        raise InputError(f"{name}: {link_problem(path) or 'no such file'}")
    if path.is_dir():
        raise InputError(f"{name} is a directory, not a document")


def _read_bytes(path: Path, name: str) -> bytes:
    _check_path(path, name)
    try:
        return path.read_bytes()
    except OSError as error:
        raise InputError(f"cannot read {name}: {error.strerror or error}") from error


def link_problem(path: Path) -> str | None:
    """Why a path that does not exist to Path.exists() is there all the same: a loop of symbolic links, or a
    symbolic link to nothing; None when there is simply nothing there."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "a symbolic link loop (following it leads back to itself)"
        if path.is_symlink():
            return f"a broken symbolic link (to {os.readlink(path)}, which does not exist)"
    return None


def _decode(data: bytes, name: str) -> tuple[str, list[str]]:
    """UTF-8 if it is; otherwise the encoding charset-normalizer finds; otherwise UTF-8 with replacements."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data.decode(encoding, errors="replace"), []
    head = data[:_SNIFF]
    if b"\x00" in head:  # ASCII-range text in UTF-16 without a byte order mark: zeros on one side of each pair
        for encoding, high, low in (("utf-16-le", head[1::2], head[0::2]), ("utf-16-be", head[0::2], head[1::2])):
            if high.count(0) > 0.9 * len(high) and low.count(0) < 0.1 * len(low):
                return data.decode(encoding, errors="replace"), [f"{name} has no byte order mark; read it as {encoding}"]
    control = sum(byte < 32 and byte not in b"\t\n\r\f\v\x1b" for byte in head)
    if b"\x00" in head or control > len(head) // 10:
        raise InputError(f"{name} looks like a binary file, not text or PDF")
    try:
        return data.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    guess = charset_normalizer.from_bytes(data).best()
    western = charset_normalizer.from_bytes(data, cp_isolation=["cp1252"]).best()
    if western is not None and (guess is None or western.percent_chaos <= guess.percent_chaos):
        guess = western  # short texts fit several code pages equally well: take the most common one
    if guess is not None and guess.encoding not in ("utf_8", "ascii"):
        return str(guess), [f"{name} is not UTF-8; read it as {guess.encoding}"]
    text = data.decode("utf-8", errors="replace")
    return text, [f"{name}: {text.count(chr(0xFFFD))} undecodable bytes replaced with U+FFFD"]


def _read_pdf(
    data: bytes, name: str, password: str | None, progress: Callable[[int, int], None] | None
) -> Document:
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(password or ""):
            if password is None:
                raise InputError(f"{name} is encrypted: give its password with --password")
            raise InputError(f"{name}: wrong password")
        pages = reader.pages
        total = len(pages)
        if not total:
            raise InputError(f"{name} is a PDF without pages")
    except DependencyError as error:
        raise InputError(f"{name} needs a decryption library: pip install 'pypdf[crypto]' ({error})") from error
    except (PyPdfError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"{name} is not a readable PDF ({error})") from error
    texts, empty, broken = [], [], []
    for number in range(1, total + 1):
        try:
            text = pages[number - 1].extract_text() or ""
        except Exception:  # noqa: BLE001 - pypdf raises many kinds on a damaged page; skip it, say so below
            text = ""
            broken.append(number)
        if text.strip():
            texts.append(text)
        elif number not in broken:
            empty.append(number)
        if progress:
            progress(number, total)
    if not texts:
        raise InputError(
            f"{name} has no extractable text (is it scanned images?): run OCR on it first, e.g. ocrmypdf"
        )
    warnings = []
    if empty:
        warnings.append(f"{name}: no text on page{'s' if len(empty) > 1 else ''} {_page_list(empty)} (images?)")
    if broken:
        warnings.append(f"{name}: could not read page{'s' if len(broken) > 1 else ''} {_page_list(broken)}")
    return Document(text="\n\n".join(texts), name=name, kind="pdf", pages=total, warnings=tuple(warnings))


def _page_list(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")
