"""Reading the documents gali is asked about: text in any encoding, PDF (page by page, with pypdf), or stdin.

Problems come back as `InputError` with a message naming the file; recoverable oddities (a guessed encoding,
replaced bytes, PDF pages without text) come back as warnings on the `Document`. Inputs are read up to a size limit
(256 MiB unless the caller says otherwise), so that `gali summarize /dev/zero` stops there instead of filling memory.
"""

import errno
import io
import math
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import charset_normalizer
from charset_normalizer.md import mess_ratio
from pypdf import PdfReader
from pypdf.errors import DependencyError, PyPdfError

from .config import MAX_INPUT_BYTES, format_size
from .errors import InputError

STDIN = "-"
_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))
_SNIFF = 8192  # bytes looked at to tell binary from text
# A legacy encoding other than cp1252 needs evidence: this many non-ASCII bytes, and cp1252 reading as a mess.
_EVIDENCE_BYTES, _WESTERN_MESS = 16, 0.1
_MESS_SAMPLE = 65536  # characters whose mess ratio is measured (it is computed in Python, character by character)


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
    max_bytes: int = MAX_INPUT_BYTES,
    allow_partial: bool = False,
) -> Document:
    """Read a file path, or standard input for "-"; PDFs are recognised by their first bytes, not their name.

    Args:
        password: for encrypted PDFs.
        progress: called with (pages read, pages in all) while a PDF is read.
        max_bytes: a larger input is refused (InputError) once this much has been read.
        allow_partial: read a PDF with text on fewer than MIN_TEXT_SHARE of its pages (else an InputError).
    """
    name = "<stdin>" if source == STDIN else source
    if source == STDIN:
        data = _read_limited(stdin or sys.stdin.buffer, name, max_bytes)
    else:
        data = _read_bytes(Path(source), name, max_bytes)
    if not data.strip():
        raise InputError(f"{name} is empty")
    if data.lstrip()[:5] == b"%PDF-":
        return _read_pdf(data, name, password, progress, allow_partial)
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
    try:
        exists, directory = path.exists(), path.is_dir()
    except OSError as error:  # e.g. a folder on the way that gali may not enter
        raise InputError(f"{name}: {error.strerror or error}") from None
    if not exists:
        raise InputError(f"{name}: {link_problem(path) or 'no such file'}")
    if directory:
        raise InputError(f"{name} is a directory, not a document")


def _read_bytes(path: Path, name: str, max_bytes: int) -> bytes:
    _check_path(path, name)
    try:
        if path.stat().st_size > max_bytes:  # a regular file says its size; /dev/zero and pipes say 0
            raise _too_large(name, max_bytes, endless=False, size=path.stat().st_size)
        with open(path, "rb") as file:
            return _read_limited(file, name, max_bytes)
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


_PIECE = 64 * 2**20  # read at most this much at a time: read(n) sets aside n bytes before it reads any


def _read_limited(stream: BinaryIO, name: str, max_bytes: int) -> bytes:
    """All of `stream`, or InputError once more than `max_bytes` have come (memory never holds more). Read in
    pieces, so that a limit of tens of GB (or past 64 bits: no practical limit) costs only what the input holds."""
    pieces, size = [], 0
    while size <= max_bytes:
        piece = stream.read(min(_PIECE, max_bytes + 1 - size))
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    if size > max_bytes:
        raise _too_large(name, max_bytes, _is_device(stream))
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _is_device(stream: BinaryIO) -> bool:
    """Whether `stream` reads from a character device (/dev/zero, /dev/urandom; a terminal too, which no one types
    256 MB into): past the limit, such a stream is taken to be endless."""
    try:
        return stat.S_ISCHR(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # an in-memory stream
        return False


def _too_large(name: str, max_bytes: int, endless: bool, size: int | None = None) -> InputError:
    """The input limit reached: raising it is the advice for a file or a pipe, never for a device such as
    /dev/zero, which would fill any limit (and the memory) without end. The value suggested is the file's `size`,
    rounded up, where it is known (4 times the limit said nothing of what the file needs, and 0 for a limit of 0); a
    pipe's is not known until it is read whole."""
    limit = f"{name} is larger than the input limit of {format_size(max_bytes)}"
    if endless:
        return InputError(f"{limit}: it is a device, which may never end; save the document to a file and give "
                          "that")
    if size is None:
        return InputError(f"{limit}: raise --max-input-size past its size (more than {format_size(max_bytes)}), or "
                          "save it to a file and give that, whose size gali reads first")
    return InputError(f"{limit}: it has {format_size(size)}; raise the limit with --max-input-size {_enough(size)}")


def _enough(size: int) -> str:
    """The shortest --max-input-size value, a tenth of a unit at most past `size`, that parse_size reads as at
    least `size` bytes."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale:
            return f"{math.ceil(size * 10 / scale) / 10:g}{unit}"
    return str(size)


def _decode(data: bytes, name: str) -> tuple[str, list[str]]:
    """UTF-8 when it is, or mostly is (bad bytes replaced); else a legacy encoding, cp1252 unless the text is clearly
    in another one."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data.decode(encoding, errors="replace"), []
    head = data[:_SNIFF]
    if b"\x00" in head:  # ASCII-range text in UTF-16 without a byte order mark: zeros on one side of each pair
        for encoding, high, low in (("utf-16-le", head[1::2], head[0::2]), ("utf-16-be", head[0::2], head[1::2])):
            if high.count(0) > 0.9 * len(high) and low.count(0) < 0.1 * len(low):
                warning = f"{name} has no byte order mark; read it as {encoding}"
                return data.decode(encoding, errors="replace"), [warning]
    control = sum(byte < 32 and byte not in b"\t\n\r\f\v\x1b" for byte in head)
    if b"\x00" in head or control > len(head) // 10:
        raise InputError(f"{name} looks like a binary file, not text or PDF")
    try:
        return data.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())  # the replacements, not U+FFFDs of the text
    characters = len(text) - len(text.encode("ascii", errors="ignore")) - bad  # well-formed multi-byte ones
    replaced = f"{bad} invalid UTF-8 byte sequence{'s' if bad != 1 else ''} replaced with U+FFFD"
    if characters > bad:  # UTF-8 with a few damaged bytes: a legacy reading would garble every good character
        return text, [f"{name} is UTF-8 but for {replaced}"]
    legacy = _legacy_decode(data)
    if legacy is None:
        return text, [f"{name} is not UTF-8 nor a known legacy encoding: read it as UTF-8, {replaced}"]
    text, encoding = legacy
    return text, [f"{name} is not UTF-8; read it as {encoding} (if that is wrong, convert it to UTF-8 first, e.g. "
                  "with iconv)"]


def _legacy_decode(data: bytes) -> tuple[str, str] | None:
    """The text of non-UTF-8 `data` and its encoding: cp1252 (Windows Western, a superset of printable Latin-1) unless
    there are enough non-ASCII bytes to judge, cp1252 reads as a mess, and charset-normalizer finds a reading with
    less of one (Cyrillic, Greek, Central European, CJK...). A short text fits many code pages equally well, so
    detection alone would pick one at random (cp775 for a Latin-1 "café")."""
    try:
        western = data.decode("cp1252")
    except UnicodeDecodeError:
        western = None  # bytes that cp1252 leaves undefined
    non_ascii = len(data.translate(None, bytes(range(128))))  # ASCII bytes deleted
    western_mess = mess_ratio(western[:_MESS_SAMPLE], maximum_threshold=1.0) if western is not None else 1.0
    if western is not None and (non_ascii < _EVIDENCE_BYTES or western_mess <= _WESTERN_MESS):
        return western, "cp1252"
    for threshold in (0.2, 0.5):  # charset-normalizer keeps readings below a mess threshold; a short text needs 0.5
        guess = charset_normalizer.from_bytes(data, threshold=threshold).best()
        if guess is not None:
            break
    if guess is not None and guess.encoding not in ("utf_8", "ascii") and guess.percent_chaos / 100 < western_mess:
        return str(guess), guess.encoding
    return (western, "cp1252") if western is not None else None


MIN_TEXT_SHARE = 0.5  # of a PDF's pages: with text on fewer, most of the document would be missing from the answer


def _read_pdf(
    data: bytes, name: str, password: str | None, progress: Callable[[int, int], None] | None,
    allow_partial: bool = False,
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
    texts, empty, broken, causes, failure = [], [], [], set(), ""
    for number in range(1, total + 1):
        try:
            text = pages[number - 1].extract_text() or ""
        except Exception as error:  # pypdf raises many kinds on a damaged page; skip it, say so below
            text = ""
            broken.append(number)
            failure = failure or " ".join(str(error).split())[:80] or type(error).__name__
        if text.strip():
            texts.append(text)
        elif number not in broken:
            empty.append(number)
            causes.add(_why_no_text(pages[number - 1]))
        if progress:
            progress(number, total)
    cause = _causes_words(causes)
    if not texts and broken:  # not blank: pages whose streams pypdf could not decode (damaged, or past its limits)
        undecodable = (f"page{'s' if len(broken) > 1 else ''} {_page_list(broken)} could not be decoded ({failure})"
                       f"{f', and {cause} on the others' if empty else ''}")
        raise InputError(f"{name} has no text gali can read: {undecodable}: a damaged PDF, or one past pypdf's "
                         "limits" + (" (OCR may read the others, e.g. ocrmypdf)" if empty else ""))
    if not texts:
        raise InputError(f"{name} has no extractable text ({cause}): run OCR on it first, e.g. ocrmypdf")
    if len(texts) < MIN_TEXT_SHARE * total and not allow_partial:
        with_text = "the page" if len(texts) == 1 else f"the {len(texts)} pages"
        raise InputError(f"{name}: text on only {len(texts)} of {total} pages ({cause} on the others): run OCR on it "
                         f"first, e.g. ocrmypdf, or give --allow-partial to read {with_text} with text")
    warnings = []
    if empty:
        warnings.append(f"{name}: read text from {len(texts)} of {total} pages; none on page"
                        f"{'s' if len(empty) > 1 else ''} {_page_list(empty)} ({cause})")
    if broken:
        warnings.append(f"{name}: could not read page{'s' if len(broken) > 1 else ''} {_page_list(broken)}")
    return Document(text="\n\n".join(texts), name=name, kind="pdf", pages=total, warnings=tuple(warnings))


def _why_no_text(page) -> str:
    """Why a page gave no text: "fonts" (it draws text, with fonts whose glyphs map to no characters: no ToUnicode
    map), "images" (it draws images and no text: a scan), or "" (neither: a blank page, or not known). Resources are
    often shared between pages, so what the page's drawing does decides, not what its resources hold."""
    try:
        resources = page.get("/Resources")
        resources = resources.get_object() if resources is not None else {}
        contents = page.get_contents()
        drawing = contents.get_data() if contents is not None else b""
        fonts = resources.get("/Font")
        if fonts is not None and len(fonts.get_object()) and re.search(rb"(^|\s)BT(\s|$)", drawing):
            return "fonts"
        objects = resources.get("/XObject")
        objects = objects.get_object() if objects is not None else {}
        if any(item.get_object().get("/Subtype") == "/Image" for item in objects.values()):
            return "images"
    except Exception:  # a damaged page: the cause is not known
        pass
    return ""


def _causes_words(causes: set[str]) -> str:
    """The reasons pages gave no text, in words."""
    words = {"fonts": "fonts without a text map", "images": "scanned images", "": "blank pages"}
    if causes <= {""}:
        return "blank pages"
    return " and ".join(words[cause] for cause in ("fonts", "images") if cause in causes)


def _page_list(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")
