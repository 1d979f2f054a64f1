"""Documents written at test time."""

import io
from pathlib import Path

from fpdf import FPDF
from PIL import Image


def make_pdf(path: Path, pages: list[str | None], password: str | None = None) -> Path:
    """A PDF with one page per entry: text, or None for a page holding only an image."""
    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for text in pages:
        pdf.add_page()
        if text is None:
            image = io.BytesIO()
            Image.new("RGB", (40, 20), (200, 30, 30)).save(image, format="PNG")
            pdf.image(image, x=10, y=10, w=80)
        else:
            pdf.multi_cell(0, 8, text)
    if password is not None:
        pdf.set_encryption(owner_password="owner", user_password=password)
    pdf.output(str(path))
    return path
