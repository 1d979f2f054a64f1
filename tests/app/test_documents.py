import io
import zlib
from pathlib import Path

import pytest
from helpers.documents import make_pdf

from gali_cli.config import parse_size
from gali_cli.documents import read_document
from gali_cli.errors import InputError


def test_utf8_text(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("# Title\r\n\r\nCafé, naïve, 東京.\r\n", encoding="utf-8")
    document = read_document(str(path))
    assert document.text == "# Title\n\nCafé, naïve, 東京.\n"
    assert (document.kind, document.pages, document.warnings) == ("text", 0, ())


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig"])
def test_text_with_a_byte_order_mark(tmp_path, encoding):
    path = tmp_path / "bom.txt"
    path.write_text("Grüße aus Köln", encoding=encoding)
    assert read_document(str(path)).text == "Grüße aus Köln"


def test_other_encodings_are_detected_with_a_warning(tmp_path):
    path = tmp_path / "latin.txt"
    text = "Le château de la forêt était très ancien; les élèves y passèrent l'été à étudier. " * 20
    path.write_bytes(text.encode("cp1252"))
    document = read_document(str(path))
    assert "château" in document.text and "élèves" in document.text
    assert any("not UTF-8" in warning for warning in document.warnings)


def test_undecodable_bytes_are_replaced_with_a_warning(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"plain ascii text and " * 30 + b"\xff\xfe\xfa broken" + b" more text" * 30)
    document = read_document(str(path))
    assert "plain ascii text" in document.text and document.warnings


def test_standard_input(tmp_path):
    document = read_document("-", stdin=io.BytesIO(b"from stdin\n"))
    assert document.text == "from stdin\n" and document.name == "<stdin>"
    pdf = make_pdf(tmp_path / "in.pdf", ["A PDF arriving on stdin."])
    assert "arriving on stdin" in read_document("-", stdin=io.BytesIO(pdf.read_bytes())).text


def test_pdf_page_by_page_with_progress(tmp_path):
    path = make_pdf(tmp_path / "report.pdf", ["First page about leases.", "Second page about rent."])
    seen = []
    document = read_document(str(path), progress=lambda done, total: seen.append((done, total)))
    assert document.kind == "pdf" and document.pages == 2
    assert "First page about leases." in document.text and "Second page about rent." in document.text
    assert seen == [(1, 2), (2, 2)]


def test_pdf_pages_without_text_are_reported(tmp_path):
    path = make_pdf(tmp_path / "mixed.pdf", ["Some text.", None, "More text."])
    document = read_document(str(path))
    assert document.warnings == (f"{path}: read text from 2 of 3 pages; none on page 2 (scanned images)",)


def _without_text_on(path: Path, pages: list[int]) -> Path:
    """The PDF at `path` with `pages` (0-based) drawing text that gives no characters, in their own font, as a PDF
    whose fonts have no text map reads."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, NameObject

    writer = PdfWriter(clone_from=str(path))
    for index in pages:
        page = writer.pages[index]
        font = next(iter(page["/Resources"]["/Font"]))
        drawing = DecodedStreamObject()
        drawing.set_data(f"BT {font} 12 Tf 72 700 Td () Tj ET".encode())
        page[NameObject("/Contents")] = writer._add_object(drawing)
    with open(path, "wb") as file:
        writer.write(file)
    return path


def test_a_pdf_mostly_without_text_is_refused_unless_partial_reading_is_allowed(tmp_path):
    """42 of 64 pages without text once gave a confident summary of the rest: fewer than half the pages with text
    is refused (exit 3 on the command line), saying how many were read and why the others were not."""
    scanned = make_pdf(tmp_path / "scanned.pdf", ["A lease.", None, None, None])
    with pytest.raises(InputError, match=r"text on only 1 of 4 pages \(scanned images on the others\).*"
                                         r"ocrmypdf, or give --allow-partial to read the page with text$"):
        read_document(str(scanned))
    with pytest.raises(InputError, match=r"give --allow-partial to read the 2 pages with text$"):
        read_document(str(make_pdf(tmp_path / "two.pdf", ["One.", "Two.", None, None, None])))
    partial = read_document(str(scanned), allow_partial=True)
    assert partial.text.strip() == "A lease." and partial.warnings == (
        f"{scanned}: read text from 1 of 4 pages; none on pages 2, 3, 4 (scanned images)",)
    unmapped = _without_text_on(make_pdf(tmp_path / "fonts.pdf", ["One.", "Two.", "Three.", None]), [1, 2])
    with pytest.raises(InputError, match=r"text on only 1 of 4 pages \(fonts without a text map and scanned images"):
        read_document(str(unmapped))
    half = make_pdf(tmp_path / "half.pdf", ["One.", None, "Three.", None])
    assert read_document(str(half)).warnings == (f"{half}: read text from 2 of 4 pages; none on pages 2, 4 "
                                                 "(scanned images)",)
    with pytest.raises(InputError, match=r"no extractable text \(scanned images\): run OCR"):
        read_document(str(make_pdf(tmp_path / "images.pdf", [None, None])), allow_partial=True)


def raw_pdf(pages: list[bytes]) -> bytes:
    """A PDF written by hand: one page per content stream given, each compressed with zlib (FlateDecode)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % (4 + 2 * i) for i in
                                                                     range(len(pages))), len(pages)),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for index, content in enumerate(pages):
        stream = zlib.compress(content, 9)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R /Resources << /Font "
                       b"<< /F1 3 0 R >> >> >>" % (5 + 2 * index))
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(stream), stream))
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    table = b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + (b"xref\n0 %d\n0000000000 65535 f \n%strailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n"
                  % (len(objects) + 1, table, len(objects) + 1, len(out)))


def test_a_page_that_cannot_be_decoded_is_not_called_blank(tmp_path):
    """A PDF whose only page is a deflate bomb past pypdf's limit (75 MB) was blamed on "blank pages" and sent to
    OCR, which cannot read it either."""
    text = b"BT /F1 12 Tf 72 720 Td (Hello) Tj ET\n"
    bomb = text + b" " * 80_000_000
    (tmp_path / "bomb.pdf").write_bytes(raw_pdf([bomb]))
    with pytest.raises(InputError) as error:
        read_document(str(tmp_path / "bomb.pdf"))
    said = str(error.value)
    assert said.startswith(f"{tmp_path / 'bomb.pdf'} has no text gali can read: page 1 could not be decoded (Limit "
                           "reached while decompressing")
    assert said.endswith("a damaged PDF, or one past pypdf's limits") and "blank" not in said
    (tmp_path / "two.pdf").write_bytes(raw_pdf([bomb, b"q Q\n"]))  # the other page blank: OCR may read it
    with pytest.raises(InputError, match=r"page 1 could not be decoded \(.*\), and blank pages on the others: .* "
                                         r"\(OCR may read the others, e\.g\. ocrmypdf\)$"):
        read_document(str(tmp_path / "two.pdf"))
    (tmp_path / "fine.pdf").write_bytes(raw_pdf([text]))
    assert read_document(str(tmp_path / "fine.pdf")).text.strip() == "Hello"


def test_encrypted_pdf(tmp_path):
    path = make_pdf(tmp_path / "secret.pdf", ["Classified lease terms."], password="s3cret")
    with pytest.raises(InputError, match="--password"):
        read_document(str(path))
    with pytest.raises(InputError, match="wrong password"):
        read_document(str(path), password="guess")
    assert "Classified lease terms." in read_document(str(path), password="s3cret").text


def write(directory: Path, name: str, data: bytes) -> Path:
    (directory / name).write_bytes(data)
    return directory / name


def link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: link(d / "loop.txt", d / "loop.txt"), "loop.txt: a symbolic link loop"),
        (lambda d: link(d / "dangling.txt", d / "gone.txt"), "dangling.txt: a broken symbolic link \\(to .*gone.txt"),
        (lambda d: d, "is a directory"),
        (lambda d: write(d, "empty.txt", b""), "is empty"),
        (lambda d: write(d, "blank.txt", b" \n\t\n"), "is empty"),
        (lambda d: write(d, "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200)), "binary"),
        (lambda d: write(d, "broken.pdf", b"%PDF-1.7\n%broken\n1 0 obj << /Type /Catalog"), "not a readable PDF"),
        (lambda d: make_pdf(d / "scan.pdf", [None, None]), "OCR"),
    ],
    ids=["missing", "symlink-loop", "broken-symlink", "directory", "empty", "blank", "binary", "corrupt-pdf",
         "image-only-pdf"],
)
def test_unreadable_inputs(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(InputError, match=message):
        read_document(str(path))


def test_encoding_corner_cases(tmp_path):
    short = read_document("-", stdin=io.BytesIO("La forêt est très belle en été.\n".encode("cp1252")))
    assert short.text == "La forêt est très belle en été.\n"  # cp1250 fits too, but cp1252 wins the tie
    utf16 = read_document("-", stdin=io.BytesIO("Plain text in UTF-16, no BOM.\n".encode("utf-16-le")))
    assert utf16.text == "Plain text in UTF-16, no BOM.\n" and "byte order mark" in utf16.warnings[0]
    mentions = read_document("-", stdin=io.BytesIO(b"# Notes\n\nA PDF starts with %PDF-1.7, then objects.\n"))
    assert mentions.kind == "text"
    from pypdf import PdfWriter

    empty = tmp_path / "empty.pdf"
    PdfWriter().write(empty)
    with pytest.raises(InputError, match="without pages"):
        read_document(str(empty))


@pytest.mark.parametrize("text, encoding", [
    ("café\n", "latin-1"),  # too few non-ASCII bytes to tell code pages apart: cp1252, the common one
    ("£10\n", "latin-1"),  # charset-normalizer alone: cp1006 (Urdu)
    ("© 2024\n", "latin-1"),  # cp932
    ("Hyvää päivää, mitä kuuluu? Kiitos hyvää.\n", "latin-1"),  # hp_roman8
    ("Müller, Jürgen\nHauptstraße 5\n", "cp1252"),
    ("Привет, как дела? Это тест кодировки. " * 10, "cp1251"),  # enough text, and cp1252 would read as a mess
    ("Привет, как дела? " * 3, "koi8-r"),
    ("Zażółć gęślą jaźń. " * 5, "cp1250"),
    ("中文文本测试。" * 10, "gb2312"),
])
def test_a_legacy_encoding_is_chosen_on_evidence_only(text, encoding):
    document = read_document("-", stdin=io.BytesIO(text.encode(encoding)))
    assert document.text == text
    assert len(document.warnings) == 1 and "is not UTF-8; read it as" in document.warnings[0]


@pytest.mark.parametrize("bad", [b"\x92", b"\xe9", b"\xff\xfe"])
def test_mostly_utf8_stays_utf8_with_the_bad_bytes_replaced(bad):
    text = "The naïve café serves crème brûlée — and Grüße from Köln. "
    document = read_document("-", stdin=io.BytesIO(text.encode() * 3 + bad + b" tail"))
    assert document.text.startswith(text * 3) and document.text.endswith("\ufffd tail")
    assert document.warnings == (f"<stdin> is UTF-8 but for {document.text.count(chr(0xFFFD))} invalid UTF-8 byte "
                                 f"sequence{'s' if document.text.count(chr(0xFFFD)) > 1 else ''} replaced with "
                                 "U+FFFD",)


def test_inputs_past_the_size_limit_are_refused_while_reading(tmp_path):
    # a pipe's size is not known: the hint says so; a file's is, and the hint is what it needs (it was 4 times the
    # limit, 0 for a limit of 0)
    with pytest.raises(InputError, match=r"^<stdin> is larger than the input limit of 1K: raise --max-input-size "
                                         r"past its size \(more than 1K\), or save it to a file and give that"):
        read_document("-", stdin=io.BytesIO(b"x" * 1025), max_bytes=1024)
    assert read_document("-", stdin=io.BytesIO(b"x" * 1024), max_bytes=1024).text == "x" * 1024
    big = write(tmp_path, "big.txt", b"words " * 1000)
    for limit, hint in ((5 * 1024, "5K"), (0, "0")):
        with pytest.raises(InputError, match=rf"big.txt is larger than the input limit of {hint}: it has 5.859K; "
                                             r"raise the limit with --max-input-size 5.9K$"):
            read_document(str(big), max_bytes=limit)
    assert read_document(str(big), max_bytes=parse_size("5.9K", "--max-input-size")).text.startswith("words")

    class Endless(io.RawIOBase):  # /dev/zero or `yes |`: never ends, so only the limit stops it
        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            buffer[:] = b"y" * len(buffer)
            return len(buffer)

    with pytest.raises(InputError, match="larger than the input limit of 2M"):
        read_document("-", stdin=io.BufferedReader(Endless()), max_bytes=2 * 2**20)
    if Path("/dev/zero").exists():  # an endless device: raising the limit would only fill more memory (issue 50)
        with pytest.raises(InputError, match=r"^/dev/zero is larger than the input limit of 1M: it is a device, "
                                             r"which may never end; save the document to a file and give that$"):
            read_document("/dev/zero", max_bytes=2**20)
        with open("/dev/zero", "rb") as zeros, pytest.raises(InputError, match=r"<stdin> .* it is a device"):
            read_document("-", stdin=zeros, max_bytes=2**20)
